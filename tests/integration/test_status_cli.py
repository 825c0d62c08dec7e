"""`rollout status --once` against a real Deployment publishing heartbeats over the real nats-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import pytest

from engine.config import EngineConfig, KafkaConfig, NatsConfig, TelemetryConfig
from ops.deployment import Deployment
from tests.integration.test_metrics import GROUP, produce_groups

pytestmark = pytest.mark.anyio


def rollout_status(namespace: str, nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLOUT__NAMESPACE": namespace, "ROLLOUT__NATS__URL": nats_url,
           "ROLLOUT__TELEMETRY__HEARTBEAT_S": "0.5"}
    return subprocess.run([sys.executable, "-m", "ops.cli", "status", "--once", *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(180)
async def test_status_once_sees_a_running_deployment(kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=nats_url), telemetry=TelemetryConfig(heartbeat_s=0.5))
    async with Deployment(cfg, roles=["reward"], instance="host-a") as d:
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.run)
            await produce_groups(d, "s", 2)
            with anyio.fail_after(60):
                while d.supervisor.actors["reward"].statistics()["handled"] < 2 * GROUP:
                    await anyio.sleep(0.1)
            as_json = await anyio.to_thread.run_sync(rollout_status, unique_name, nats_url, "--json")
            as_text = await anyio.to_thread.run_sync(rollout_status, unique_name, nats_url)
            d.drain()
            tg.cancel_scope.cancel()

    assert as_json.returncode == 0, as_json.stderr
    snap = json.loads(as_json.stdout)
    [reward] = snap["instances"]
    assert (reward["role"], reward["instance"], reward["name"]) == ("reward", "host-a", "reward")
    assert reward["alive"] is True and reward["stats"]["handled"] == 2 * GROUP
    assert "handled" in reward["rates"]  # two heartbeats or more were heard
    assert snap["rewards"]["arith"]["count"] == 2 * GROUP

    assert as_text.returncode == 0, as_text.stderr
    assert "host-a/reward" in as_text.stdout and "REWARD BY DOMAIN" in as_text.stdout
    assert "\x1b[" not in as_text.stdout


async def test_status_once_with_nothing_running_exits_1(nats_url: str, unique_name: str) -> None:
    result = await anyio.to_thread.run_sync(rollout_status, unique_name, nats_url)
    assert result.returncode == 1
    assert "no heartbeats" in result.stderr and unique_name in result.stderr and nats_url in result.stderr
    assert result.stdout == ""


async def test_status_names_an_unreachable_nats(unique_name: str, free_tcp_port) -> None:
    url = f"nats://127.0.0.1:{free_tcp_port()}"
    env = {**os.environ, "ROLLOUT__NATS__TIMEOUT_S": "3"}
    result = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "ops.cli", "status", "--once"], capture_output=True, text=True, timeout=60,
        env={**env, "ROLLOUT__NAMESPACE": unique_name, "ROLLOUT__NATS__URL": url}))
    assert result.returncode == 1 and url in result.stderr
