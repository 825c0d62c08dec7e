"""The reward actor against the real broker and nats-server: groups, zero variance, stragglers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from actors.reward import REWARD_STATS_KEY, RewardActor, experience_message_id
from actors.runtime import Runtime
from engine.config import EngineConfig, KafkaConfig, NatsConfig, RewardConfig
from engine.schemas import Experience
from helpers.fixtures import answer_outcome
from streams.kafka import Consumer

pytestmark = pytest.mark.anyio

GROUP = 4


async def _until(cond: Callable[[], Any], timeout_s: float, what: str) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.05)


async def test_groups_zero_variance_and_stragglers(kafka_bootstrap: str, nats_url: str, unique_name: str) -> None:
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=nats_url),
                       reward=RewardConfig(group_timeout_s=1.5, normalize="group_std", drop_zero_variance=True))
    got: list[Experience] = []
    async with Runtime(cfg) as rt:
        actor = RewardActor(rt)
        actor.stats_interval_s = 0.2
        out = Consumer(cfg.kafka, assign=[(rt.names.experience, 0)], expect=(Experience.SCHEMA,))
        async with out, anyio.create_task_group() as tg:
            tg.start_soon(actor.run)

            async def collect(n: int, timeout_s: float = 30) -> None:
                with anyio.fail_after(timeout_s):
                    while len(got) < n:
                        for record in await out.getmany(timeout_s=0.2):
                            assert isinstance(record.message, Experience)
                            assert record.message_id == experience_message_id(record.message.sample_id)
                            got.append(record.message)

            def of(task_id: str) -> list[Experience]:
                return sorted((e for e in got if e.task_id == task_id), key=lambda e: e.sample_id)

            # a group with signal, and a group where every sample is right
            mixed = [answer_outcome("mixed", i, c, GROUP) for i, c in enumerate((True, False, False, True))]
            for i, o in enumerate(mixed):
                await rt.producer.send(rt.names.outcomes, o, key="mixed", message_id=f"mixed-{i}")
            for i in range(GROUP):
                await rt.producer.send(rt.names.outcomes, answer_outcome("flat", i, True, GROUP), key="flat")
            await collect(8)
            assert [e.reward for e in of("mixed")] == [1.0, 0.0, 0.0, 1.0]
            assert sum(e.advantage for e in of("mixed")) == pytest.approx(0.0, abs=1e-6)
            assert [round(e.advantage, 3) for e in of("mixed")] == [1.0, -1.0, -1.0, 1.0]
            assert all(e.filtered == "" for e in of("mixed"))
            assert all(e.filtered == "zero_variance" and e.advantage == 0.0 for e in of("flat"))

            # a group missing one sample: held (not acknowledged) until the timeout flushes it
            late_outcomes = [answer_outcome("late", i, c, GROUP) for i, c in enumerate((True, False, True))]
            for i, o in enumerate(late_outcomes):
                await rt.producer.send(rt.names.outcomes, o, key="late", message_id=f"late-{i}")
            await _until(lambda: actor.assembler.pending_samples == 3, 10, "late group pending")
            consumer = actor.consumer
            assert consumer is not None and consumer.statistics()["in_flight"] == 3
            # a re-delivery of a held outcome is held with it: acknowledging it now would let the
            # committed offset pass the group before the group is emitted
            await rt.producer.send(rt.names.outcomes, late_outcomes[0], key="late", message_id="late-0")
            await _until(lambda: actor.duplicates == 1, 10, "re-delivery seen")
            assert consumer.statistics()["in_flight"] == 4 and actor.assembler.pending_samples == 3
            await collect(11)
            late = of("late")
            assert len(late) == 3 and all(e.filtered == "" for e in late)
            assert sum(e.advantage for e in late) == pytest.approx(0.0, abs=1e-6)
            await _until(lambda: actor.consumer is not None and actor.consumer.statistics()["in_flight"] == 0, 10,
                         "late group acknowledged")

            # re-deliveries: the same message id, then the same sample under a new message id
            await rt.producer.send(rt.names.outcomes, mixed[0], key="mixed", message_id="mixed-0")
            await rt.producer.send(rt.names.outcomes, mixed[1], key="mixed")
            await _until(lambda: actor.duplicates == 3, 10, "duplicates dropped")

            # the straggler arrives after its group was emitted
            await rt.producer.send(rt.names.outcomes, answer_outcome("late", 3, False, GROUP), key="late")
            await collect(12)
            straggler = [e for e in of("late") if e.sample_id == "late/3"]
            assert len(straggler) == 1 and straggler[0].filtered == "straggler" and straggler[0].advantage == 0.0
            assert len({e.sample_id for e in got}) == len(got) == 12  # every sample exactly once

            bucket = rt.names.bucket(cfg.nats.kv_bucket)
            stats: dict[str, Any] = {}

            async def stats_written() -> None:
                with anyio.fail_after(10):
                    while True:
                        raw = await rt.require_control().kv_get(bucket, REWARD_STATS_KEY)
                        if raw and json.loads(raw)["domains"].get("arith", {}).get("stragglers") == 1:
                            stats.update(json.loads(raw)["domains"]["arith"])
                            return
                        await anyio.sleep(0.1)

            await stats_written()
            assert stats["count"] == 12 and stats["groups"] == 3 and stats["zero_variance_groups"] == 1
            assert stats["timed_out_groups"] == 1 and stats["mean"] == pytest.approx(8 / 12)
            actor.request_drain()
