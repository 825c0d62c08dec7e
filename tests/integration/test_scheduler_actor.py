"""The scheduler against the real broker and nats-server: admission follows the learner's version."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from actors.reward import REWARD_STATS_KEY
from actors.runtime import Runtime
from actors.scheduler import SCHEDULER_STATUS_KEY, SchedulerActor
from engine.config import EngineConfig, InferenceConfig, KafkaConfig, LearnerConfig, NatsConfig, SchedulerConfig
from engine.schemas import Task
from engine.topics import Names
from streams.kafka import Consumer

pytestmark = pytest.mark.anyio


async def _until(cond: Callable[[], Any], timeout_s: float, what: str) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.05)


async def test_admission_stops_at_the_bound_and_resumes_with_the_version(
        kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    # capacity = (max_staleness + version + 1) * batch_size = (1 + v + 1) * 4 samples = (2 + v) * 2 tasks
    cfg = EngineConfig(
        namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
        nats=NatsConfig(url=nats_url), learner=LearnerConfig(batch_size=4),
        inference=InferenceConfig(max_new_tokens=16, temperature=0.7),
        scheduler=SchedulerConfig(domains={"arith": 1.0, "code": 1.0}, group_size=2, max_staleness=1, max_tasks=8))
    tasks: list[Task] = []
    keys: list[str | None] = []
    async with Runtime(cfg) as rt:
        bucket = rt.names.bucket(cfg.nats.kv_bucket)
        nats = rt.require_control()

        async def learner_at(version: int) -> None:
            status = {"version": version, "step": version, "consumed": version * 4}
            await nats.kv_put(bucket, Names.LEARNER_VERSION_KEY, json.dumps(status).encode())

        actor = SchedulerActor(rt)
        finished = anyio.Event()

        async def run() -> None:
            await actor.run()
            finished.set()

        async def collect(n: int) -> None:
            with anyio.fail_after(30):
                while len(tasks) < n:
                    for record in await out.getmany(timeout_s=0.2):
                        assert isinstance(record.message, Task)
                        tasks.append(record.message)
                        keys.append(record.key)

        out = Consumer(cfg.kafka, assign=[(rt.names.tasks, 0)], expect=(Task.SCHEMA,))
        async with out, anyio.create_task_group() as tg:
            tg.start_soon(run)
            await collect(4)
            blocked = actor.blocked_waits
            await _until(lambda: actor.blocked_waits >= blocked + 2, 10, "scheduler blocked at the bound")
            assert actor.tasks_admitted == 4 and actor.admitted_samples == 8
            assert all(t.admitted_version == 0 for t in tasks)

            # observed statistics rebalance the domains
            stats = {"domains": {"code": {"count": 40, "groups": 20, "zero_variance_rate": 1.0, "success": 0.0}}}
            await nats.kv_put(bucket, REWARD_STATS_KEY, json.dumps(stats).encode())
            await _until(lambda: actor.mixer.weights["arith"] > 0.9, 10, "rebalanced weights")

            await learner_at(1)
            await collect(6)
            blocked = actor.blocked_waits
            await _until(lambda: actor.blocked_waits >= blocked + 2, 10, "blocked again")
            assert actor.tasks_admitted == 6
            assert [t.admitted_version for t in tasks[4:]] == [1, 1]

            await learner_at(2)
            await collect(8)
            with anyio.fail_after(10):
                await finished.wait()  # max_tasks reached: serve returned
            tg.cancel_scope.cancel()
        assert actor.done and actor.tasks_admitted == 8
        assert len({t.task_id for t in tasks}) == 8 and keys == [t.task_id for t in tasks]
        for t in tasks:
            assert t.group_size == 2 and t.domain in ("arith", "code")
            assert t.sampling == {"max_new_tokens": 16, "temperature": 0.7, "stop": ["\n"]}
        saved = json.loads(await nats.kv_get(bucket, SCHEDULER_STATUS_KEY) or b"{}")
        assert saved["tasks_admitted"] == 8 and saved["admitted_samples"] == 16

        # a restarted scheduler resumes from its saved counters instead of admitting again
        again = SchedulerActor(rt)
        with anyio.fail_after(10):
            await again.run()
        assert again.tasks_admitted == 8 and again.done
