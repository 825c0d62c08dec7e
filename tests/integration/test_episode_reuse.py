"""A regenerated multi-turn episode never sees another attempt's sandbox or observations.

When the inference role dies mid-episode, the task's whole group is generated again elsewhere, and the
sample (so its episode) keeps its id ``task_id/index``. The sandbox actor still holds the first attempt's
sandbox (until it idles out) and remembers its replies by (episode, step, action). Here the requests of
two attempts of one episode are sent as the inference actor sends them (real broker, real bwrap sandbox,
the sandbox role's actors under the supervisor): the first attempt writes a file and is abandoned after
one step (its actor "died"), the second opens the episode again and runs different commands.

Checked: the second attempt's steps run its own commands in a pristine sandbox (no cached reply of the
first attempt's step, none of its files), its final-state checks judge its own sandbox, the first
attempt's sandbox went back to the pool when the second opened (not after the idle timeout), and a late
request of the first attempt is answered ``episode_unknown`` without touching the second's sandbox.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from actors.runtime import Runtime
from actors.sandbox import EPISODE_UNKNOWN, SandboxResources, SandboxSettings, build_sandbox_actors
from engine.actor import RestartPolicy, Supervisor
from engine.config import EngineConfig, KafkaConfig, NatsConfig, SandboxConfig
from engine.schemas import SandboxRequest, SandboxResult
from streams.kafka import Consumer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), pytest.mark.anyio]

REPLY_PARTITION = 0
EPISODE = "task-7/0"  # what the inference actor names the episode of sample 0 of task-7, on every attempt
SPEC = {"setup_files": {"in.txt": "hello\n"}, "checks": [{"cmd": "test -f /work/state"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_regenerated_episode_gets_a_fresh_sandbox_and_its_own_observations(
        kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    cfg = EngineConfig(
        namespace=unique_name,
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
        nats=NatsConfig(url=nats_url),
        sandbox=SandboxConfig(backend="bwrap", pool_size=1, max_sandboxes=4, memory_mb=128, pids=32, timeout_s=5),
    )
    # the idle timeout is far beyond the test: the first attempt's sandbox must be released by the second's open
    resources = SandboxResources(cfg.sandbox, SandboxSettings(idle_timeout_s=600.0))
    async with Runtime(cfg) as rt, resources:
        names = rt.names
        supervisor = Supervisor(RestartPolicy(max_restarts=0), drain_timeout_s=30)
        for spec in build_sandbox_actors(rt, resources):
            supervisor.add_spec(spec)
        results = Consumer(cfg.kafka, assign=[(names.sandbox_results, REPLY_PARTITION)], expect=("sandbox_result",))
        seen: list[SandboxResult] = []
        async with results, anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run)

            async def request(attempt: str, step: int, action: str, **kw: Any) -> SandboxResult:
                def mine(r: SandboxResult) -> bool:
                    return r.episode_id == EPISODE and r.step == step and r.attempt == attempt

                before = sum(map(mine, seen))
                await rt.producer.send(names.sandbox_requests, SandboxRequest(
                    episode_id=EPISODE, step=step, action=action, reply_partition=REPLY_PARTITION,
                    attempt=attempt, **kw), key=EPISODE)
                await _until(results, seen, lambda: sum(map(mine, seen)) > before, f"reply to {attempt} step {step}")
                return [r for r in seen if mine(r)][-1]

            def in_use() -> int:  # the shared pool's sandboxes out of it (the actors start with the supervisor)
                return int(supervisor.actors["sandbox.episodes"].statistics()["pool"]["in_use"])

            # -- attempt 1: opens, changes its sandbox, then its inference actor dies ---------------
            assert (await request("a1", 0, "open", domain="terminal", spec=SPEC)).error == ""
            first = await request("a1", 1, "step", command="echo from-a1 > /work/state; cat /work/state")
            assert first.observation.strip() == "from-a1" and first.exit_code == 0
            assert in_use() == 1

            # -- attempt 2: the group generated again, same episode id ------------------------------
            assert (await request("a2", 0, "open", domain="terminal", spec=SPEC)).error == ""
            assert in_use() == 1  # attempt 1's sandbox went back to the pool when attempt 2 opened
            step1 = await request("a2", 1, "step", command="cat /work/state 2>/dev/null || echo no-state")
            assert step1.observation.strip() == "no-state", step1  # its own command, run, not a1's cached reply
            step2 = await request("a2", 2, "step", command="ls /work; cat /work/in.txt")
            assert step2.observation.split() == ["in.txt", "hello"], step2  # a pristine sandbox with its own setup

            # -- a late request of attempt 1 neither runs nor touches attempt 2's sandbox -----------
            late = await request("a1", 2, "step", command="echo from-a1 > /work/state")
            assert late.error == EPISODE_UNKNOWN
            closed = await request("a2", 3, "close")
            assert closed.error == "" and closed.facts == {"checks_passed": 0, "checks_total": 1, "turns": 2}
            assert in_use() == 0
            stats = supervisor.actors["sandbox.episodes"].statistics()
            assert stats["episodes"] == 0 and stats["superseded"] == 1, stats
            supervisor.drain()


async def _until(consumer: Consumer, seen: list[SandboxResult], cond: Callable[[], bool], what: str) -> None:
    with anyio.fail_after(60):
        while not cond():
            for record in await consumer.getmany(timeout_s=0.2):
                record.ack()
                assert isinstance(record.message, SandboxResult)
                seen.append(record.message)
    assert cond(), what

