"""/metrics and /healthz of a real Deployment (the reward role) against the real broker and nats-server."""

from __future__ import annotations

import re

import aiohttp
import anyio
import pytest

from engine.config import EngineConfig, KafkaConfig, NatsConfig, RewardConfig, TelemetryConfig
from helpers.fixtures import answer_outcome
from ops.deployment import Deployment

pytestmark = pytest.mark.anyio

GROUP = 2


def series(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition, or None if absent."""
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


async def produce_groups(d: Deployment, prefix: str, groups: int) -> None:
    for g in range(groups):
        task_id = f"{prefix}-{g}"
        for i in range(GROUP):
            await d.rt.producer.send(d.rt.names.outcomes, answer_outcome(task_id, i, i == 0, GROUP), key=task_id)


@pytest.mark.timeout(180)
async def test_metrics_move_while_a_deployment_runs(kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=nats_url), reward=RewardConfig(group_timeout_s=30),
                       telemetry=TelemetryConfig(heartbeat_s=0.3))
    async with Deployment(cfg, roles=["reward"]) as d, aiohttp.ClientSession() as http:
        heartbeater = d.heartbeater  # the deployment runs it and exports its lag

        async def scrape() -> str:
            async with http.get(f"{d.http.url}/metrics") as r:
                assert r.status == 200
                return await r.text()

        async def handled_at_least(n: float) -> tuple[float, str]:
            with anyio.fail_after(60):
                while True:
                    text = await scrape()
                    v = series(text, "rollout_handled", role="reward", actor="reward")
                    if v is not None and v >= n:
                        return v, text
                    await anyio.sleep(0.2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(d.run)

            await produce_groups(d, "a", 3)
            first, text1 = await handled_at_least(3 * GROUP)
            async with http.get(f"{d.http.url}/healthz") as r:
                assert r.status == 200
                assert (await r.json())["ok"] is True

            await produce_groups(d, "b", 2)
            second, text2 = await handled_at_least(first + 2 * GROUP)
            with anyio.fail_after(30):
                while heartbeater.published == 0 or "reward" not in heartbeater.lag:
                    await anyio.sleep(0.1)
            text3 = await scrape()

            d.drain()
            tg.cancel_scope.cancel()

    assert second > first
    emitted1 = series(text1, "rollout_emitted", role="reward")
    emitted2 = series(text2, "rollout_emitted", role="reward")
    assert emitted1 is not None and emitted2 is not None and emitted2 > emitted1
    assert series(text2, "rollout_domains_arith_count", role="reward") == second
    assert series(text2, "rollout_uptime_s", role="reward") > series(text1, "rollout_uptime_s", role="reward")
    assert series(text2, "rollout_actor_restarts", role="reward") == 0
    assert series(text3, "rollout_consumer_lag", role="reward", actor="reward") is not None
