"""What every event log (``streams.protocols.EventLog``) must do, as checks any transport's tests can run.

Each check takes a fresh :class:`EventLog` and a name prefix unique to the test (topics are made under
it), and raises AssertionError on the first difference. ``tests/unit/test_memory_transports.py`` runs them
on the in-memory transport, ``tests/integration/test_transport_conformance.py`` on Kafka; a new
transport's tests call them too (docs/extending.md, "Writing a transport").

Reads wait for what they expect (bounded by ``TIMEOUT_S``) and rely on the one ordering every event log
keeps, within a partition: a consumer that started at the wrong offset gets a wrong record first.
"""

from __future__ import annotations

import time

import anyio
import pytest

from engine.schemas import DeadLetter, Task
from streams.protocols import AssignedConsumer, EventConsumer, EventLog, EventProducer, EventRecord, TransportError

TIMEOUT_S = 60.0


def _task(i: int) -> Task:
    return Task(task_id=f"t{i}", domain="arith", prompt=f"{i}+{i}=", spec={"answer": str(2 * i)})


async def _read(consumer: EventConsumer, n: int) -> list[EventRecord]:
    """The next ``n`` records (fails after ``TIMEOUT_S``)."""
    out: list[EventRecord] = []
    with anyio.fail_after(TIMEOUT_S):
        while len(out) < n:
            out.extend(await consumer.getmany(timeout_s=0.5, max_records=n - len(out)))
    return out


async def _fill(log: EventLog, topic: str, partitions: int, per_partition: int) -> EventProducer:
    """Make ``topic`` and put ``per_partition`` tasks into each partition (t0.. in partition 0, then 1, ...)."""
    await log.ensure_topics({topic: partitions})
    producer = log.producer(producer_id="conformance")
    await producer.start()
    for p in range(partitions):
        for i in range(per_partition):
            await producer.send(topic, _task(p * per_partition + i), partition=p)
    return producer


async def check_the_shapes(log: EventLog, prefix: str) -> None:
    """The log, its producer and both kinds of consumer have the protocols' whole surface."""
    await log.ensure_topics({f"{prefix}.in": 1, f"{prefix}.dlq": 1})
    producer = log.producer(producer_id="p")
    assert isinstance(log, EventLog) and isinstance(producer, EventProducer)
    group = log.consumer(topics=[f"{prefix}.in"], group=f"{prefix}.g", expect=("task",), dead_letters=producer,
                         dlq_topic=f"{prefix}.dlq", client_id="c")
    assert isinstance(group, EventConsumer)
    assigned = log.assigned_consumer(topics=[f"{prefix}.in"], expect=("task",))
    assert isinstance(assigned, AssignedConsumer)
    with pytest.raises(ValueError, match="exactly one of topics"):
        log.assigned_consumer(topics=[f"{prefix}.in"], partitions=[(f"{prefix}.in", 0)], expect=("task",))


async def check_a_group_commits_only_what_was_acknowledged(log: EventLog, prefix: str) -> None:
    topic, dlq = f"{prefix}.in", f"{prefix}.dlq"
    await log.ensure_topics({dlq: 1})
    producer = await _fill(log, topic, 1, 3)
    joined_ms = time.time_ns() // 1_000_000
    consumer = await log.consumer(topics=[topic], group=f"{prefix}.g", expect=("task",), dead_letters=producer,
                                  dlq_topic=dlq, client_id="c").start()
    try:
        first, second, third = await _read(consumer, 3)
        assert [r.message.task_id for r in (first, second, third)] == ["t0", "t1", "t2"]  # type: ignore[attr-defined]
        # the member owns the partition since it joined: the records were produced before, by nobody it knows
        assert joined_ms <= first.owned_since_ms <= time.time_ns() // 1_000_000
        assert first.timestamp_ms <= first.owned_since_ms
        first.ack()
        third.ack()
        assert await consumer.commit() == {(topic, 0): 1}  # the second is still in flight: stop before it
        await second.dead_letter("handler_error", "a semantic failure")  # to the dead-letter topic, and acked
        assert await consumer.commit() == {(topic, 0): 3}
    finally:
        await consumer.close()
        await producer.close()
    reader = await log.assigned_consumer(topics=[dlq], expect=("dead_letter",)).start()
    try:
        (letter,) = await _read(reader, 1)
        assert isinstance(letter.message, DeadLetter)
        assert (letter.message.topic, letter.message.offset, letter.message.reason) == (topic, 1, "handler_error")
    finally:
        await reader.close()


async def check_an_assigned_consumer_starts_where_told_and_commits_nothing(log: EventLog, prefix: str) -> None:
    topic = f"{prefix}.in"
    producer = await _fill(log, topic, 2, 3)  # partition 0: t0 t1 t2; partition 1: t3 t4 t5
    consumer = await log.assigned_consumer(topics=[topic], start_offsets={(topic, 0): 2}, expect=("task",)).start()
    try:
        assert consumer.assigned == {(topic, 0), (topic, 1)}
        got = await _read(consumer, 4)
        # partition 0 from offset 2 (its start offset), partition 1 from its beginning (none given)
        assert sorted((r.partition, r.offset, r.message.task_id) for r in got) == [  # type: ignore[attr-defined]
            (0, 2, "t2"), (1, 0, "t3"), (1, 1, "t4"), (1, 2, "t5")]
        for r in got:
            r.ack()
        assert await consumer.commit() == {}  # no group: whoever resumes keeps the offsets itself
    finally:
        await consumer.close()
        await producer.close()


async def check_seek_moves_one_partition(log: EventLog, prefix: str) -> None:
    topic = f"{prefix}.in"
    producer = await _fill(log, topic, 2, 3)
    consumer = await log.assigned_consumer(partitions=[(topic, 1)], start_offsets={(topic, 1): 3},
                                           expect=("task",)).start()
    try:
        await consumer.seek(topic, 1, 1)
        got = await _read(consumer, 2)
        assert [(r.partition, r.offset, r.message.task_id) for r in got] == [  # type: ignore[attr-defined]
            (1, 1, "t4"), (1, 2, "t5")]
        with pytest.raises(TransportError, match=rf"cannot seek {topic}\[0\]: not a partition"):
            await consumer.seek(topic, 0, 0)
    finally:
        await consumer.close()
        await producer.close()


async def check_from_end_reads_only_what_comes_after_start(log: EventLog, prefix: str) -> None:
    topic = f"{prefix}.in"
    producer = await _fill(log, topic, 2, 3)
    consumer = await log.assigned_consumer(partitions=[(topic, 1)], from_end=True, expect=("task",)).start()
    try:
        await producer.send(topic, _task(9), partition=1)
        (record,) = await _read(consumer, 1)
        assert (record.partition, record.offset, record.message.task_id) == (1, 3, "t9")  # type: ignore[attr-defined]
    finally:
        await consumer.close()
        await producer.close()


async def check_read_since_a_time_starts_at_the_first_record_that_recent(log: EventLog, prefix: str) -> None:
    """``read_since(..., since_ms=T)``: per partition, from its first record timestamped at or after T (what an
    inference actor taking over a dead one's task reads ``rollout.tokens`` from)."""
    topic = f"{prefix}.in"
    producer = await _fill(log, topic, 2, 3)
    try:
        await producer.flush()
        mark = time.time_ns() // 1_000_000 + 1
        while time.time_ns() // 1_000_000 < mark:  # the clock, not a readiness wait: later records, later stamps
            await anyio.sleep(0.002)
        await producer.send(topic, _task(9), partition=1)
        await producer.send(topic, _task(10), partition=0)
        await producer.flush()
        since = await log.read_since(topic, {}, expect=("task",), since_ms=mark)
        assert sorted((p, o, m.task_id) for p, o, m in since) == [(0, 3, "t10"), (1, 3, "t9")]  # type: ignore[attr-defined]
        assert await log.read_since(topic, {0: 4}, expect=("task",), since_ms=mark) == [
            (p, o, m) for p, o, m in since if p == 1]  # the later of the two starts wins
        assert await log.read_since(topic, {}, expect=("task",), since_ms=mark + 3_600_000) == []
        everything = await log.read_since(topic, {}, expect=("task",))
        assert len(everything) == 8
    finally:
        await producer.close()


CHECKS = (check_the_shapes, check_a_group_commits_only_what_was_acknowledged,
          check_an_assigned_consumer_starts_where_told_and_commits_nothing, check_seek_moves_one_partition,
          check_from_end_reads_only_what_comes_after_start, check_read_since_a_time_starts_at_the_first_record_that_recent)
"""Every check, for ``pytest.mark.parametrize``."""
