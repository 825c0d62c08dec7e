"""The scheduler's context-length curriculum against the real broker and nats-server: after reported
successes at one length, the next tasks it publishes carry longer documents."""

from __future__ import annotations

import json

import anyio
import pytest

from actors.reward import REWARD_STATS_KEY
from actors.runtime import Runtime
from actors.scheduler import SCHEDULER_STATUS_KEY, SchedulerActor
from engine.config import (EngineConfig, KafkaConfig, LearnerConfig, LengthCurriculumConfig, NatsConfig,
                           SchedulerConfig)
from engine.schemas import Task
from engine.topics import Names
from streams.kafka import Consumer

pytestmark = pytest.mark.anyio


async def test_scheduler_issues_longer_documents_after_successes(
        kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    # capacity = (max_staleness + version + 1) * batch_size = (v + 1) * 2 samples = one task per version
    cfg = EngineConfig(
        namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
        nats=NatsConfig(url=nats_url), learner=LearnerConfig(batch_size=2),
        scheduler=SchedulerConfig(domains={"longdoc": 1.0}, group_size=2, max_staleness=0, max_tasks=4,
                                  length_curriculum=LengthCurriculumConfig(lengths=[1000, 2000, 4000],
                                                                           threshold=0.5, window=4)))
    tasks: list[Task] = []
    async with Runtime(cfg) as rt:
        bucket = rt.names.bucket(cfg.nats.kv_bucket)
        nats = rt.require_control()
        actor = SchedulerActor(rt)

        async def step(version: int, count: int, success: float) -> None:
            """Report reward statistics, wait until the scheduler saw them, then free room for one task."""
            stats = {"domains": {"longdoc": {"count": count, "groups": count // 2, "success": success}}}
            await nats.kv_put(bucket, REWARD_STATS_KEY, json.dumps(stats).encode())
            with anyio.fail_after(10):
                while actor.length_curriculum.state()["longdoc"]["success"] != success:
                    await anyio.sleep(0.05)
            status = {"version": version, "step": version, "consumed": version * 2}
            await nats.kv_put(bucket, Names.LEARNER_VERSION_KEY, json.dumps(status).encode())

        async def collect(n: int) -> None:
            with anyio.fail_after(30):
                while len(tasks) < n:
                    tasks.extend(r.message for r in await out.getmany(timeout_s=0.2))

        out = Consumer(cfg.kafka, assign=[(rt.names.tasks, 0)], expect=(Task.SCHEMA,))
        async with out, anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            await collect(1)
            await step(1, 0, 0.0)       # marks where the 1000-token samples start
            await collect(2)
            await step(2, 8, 0.25)      # a window of samples, under the threshold: stays at 1000
            await collect(3)
            await step(3, 12, 0.75)     # threshold reached: 2000
            await collect(4)
            tg.cancel_scope.cancel()
        assert [t.spec["tokens"] for t in tasks] == [1000, 1000, 1000, 2000]
        assert tasks[-1].difficulty > tasks[0].difficulty == 0.0
        assert len(tasks[-1].prompt) > 1.5 * len(tasks[0].prompt)
        assert all(t.sampling["max_new_tokens"] == 12 for t in tasks)
        await actor.put_status()
        saved = json.loads(await nats.kv_get(bucket, SCHEDULER_STATUS_KEY) or b"{}")
        assert saved["length_curriculum"]["longdoc"]["length"] == 2000
        assert actor.statistics()["length_curriculum"]["longdoc"]["level"] == 1
