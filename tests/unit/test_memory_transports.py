"""The transport protocols (streams/protocols.py): Kafka and NATS have their shape, and the actor runtime's
contract (handle, emit, ack after effects, commit, dead-letter) holds over the in-memory transports."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from actors.runtime import Runtime, StreamActor
from engine.config import EngineConfig, KafkaConfig, NatsConfig
from engine.schemas import DeadLetter, Task
from engine.topics import Names
from streams.kafka import Consumer, Producer
from streams.memory import MemoryEventLog, MemoryProducer, MemoryStore, StoredRecord
from streams.nats import Nats
from streams.protocols import AssignedConsumer, ControlStore, EventConsumer, EventLog, EventProducer, EventRecord, TransportError
from streams.transports import KafkaEventLog
from streams.weights import WeightPublisher, WeightSubscriber
from tests.transport_conformance import CHECKS

pytestmark = pytest.mark.anyio


def test_kafka_nats_and_memory_have_the_protocols_shape() -> None:
    kafka = KafkaConfig()
    assert isinstance(KafkaEventLog(kafka), EventLog)
    assert isinstance(Producer(kafka, producer_id="p"), EventProducer)
    assert isinstance(Consumer(kafka, topics=["t"], group="g"), EventConsumer)
    assert isinstance(KafkaEventLog(kafka).assigned_consumer(topics=["t"], expect=("task",)), AssignedConsumer)
    assert isinstance(Nats(NatsConfig()), ControlStore)
    log = MemoryEventLog()
    assert isinstance(log, EventLog)
    assert isinstance(log.producer(producer_id="p"), EventProducer)
    assert isinstance(MemoryStore(), ControlStore)
    # the negative case: a protocol check is not vacuous
    assert not isinstance(object(), EventLog) and not isinstance(MemoryStore(), EventLog)


class Upcase(StreamActor):
    """Reads tasks, emits each with its prompt upper-cased on the completions topic; a task whose prompt is
    "fail" makes the handler raise (a semantic failure: the record is dead-lettered, the actor goes on)."""

    role = "upcase"
    topics = ["tasks"]
    expect = ("task",)
    commit_interval_s = 0.0

    async def handle(self, record: EventRecord) -> None:
        task = record.message
        assert isinstance(task, Task)
        if task.prompt == "fail":
            raise ValueError("cannot upcase 'fail'")
        self.emit(record, self.rt.names.topic("completions"), Task(task_id=task.task_id, domain=task.domain,
                                                                    prompt=task.prompt.upper(), spec={}))


async def run_until(actor: StreamActor, done, timeout_s: float = 10.0) -> None:
    """Run ``actor`` until ``done()`` holds (polled), then drain it; fails after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            while not done():
                await anyio.sleep(0.01)
            actor.request_drain()


async def test_stream_actor_handles_commits_and_dead_letters_over_memory() -> None:
    cfg = EngineConfig(namespace="memtest")
    log, store = MemoryEventLog(), MemoryStore()
    names = Names(cfg.namespace)
    async with Runtime(cfg, event_log=log, store=store, instance="t") as rt:
        tasks = names.topic("tasks")
        for i, prompt in enumerate(["a", "fail", "b"]):
            await rt.producer.send(tasks, Task(task_id=f"t{i}", domain="arith", prompt=prompt, spec={}), key=f"t{i}")
        log.append(tasks, StoredRecord("poison", b"\xc1 not msgpack", {}, 0))  # poison: dead-lettered by the consumer

        actor = Upcase(rt)
        await run_until(actor, lambda: actor.handled + actor.handler_errors == 3)

    outputs = sorted(m.prompt for m in log.messages(names.topic("completions")))
    assert outputs == ["A", "B"]
    letters = log.messages(names.dlq)
    assert all(isinstance(m, DeadLetter) for m in letters)
    assert sorted(m.reason for m in letters) == ["handler_error", "undecodable"]
    failed = next(m for m in letters if m.reason == "handler_error")
    assert "cannot upcase 'fail'" in failed.error and failed.consumer_group == names.group("upcase")
    # every record (good, failed, poison) is committed: the group's offsets reach the end of each partition
    for p, part in enumerate(log.topics[tasks]):
        assert log.committed.get((names.group("upcase"), tasks, p), 0) == len(part)

    # a new member of the same group resumes after the committed offsets: nothing is handled twice
    async with Runtime(cfg, event_log=log, store=store, instance="t2") as rt:
        await rt.producer.send(tasks, Task(task_id="t9", domain="arith", prompt="c", spec={}), key="t9")
        again = Upcase(rt)
        await run_until(again, lambda: again.handled == 1)
        assert again.handler_errors == 0
    assert sorted(m.prompt for m in log.messages(names.topic("completions"))) == ["A", "B", "C"]


async def test_an_unacknowledged_record_is_not_committed() -> None:
    log = MemoryEventLog()
    await log.ensure_topics({"in": 1, "dlq": 1})
    producer = log.producer(producer_id="p")
    for i in range(3):
        await producer.send("in", Task(task_id=f"t{i}", domain="arith", prompt="x", spec={}))
    consumer = await log.consumer(topics=["in"], group="g", expect=("task",), dead_letters=producer,
                                  dlq_topic="dlq", client_id="c").start()
    first, second, third = await consumer.getmany(timeout_s=0.1)
    first.ack()
    third.ack()
    assert await consumer.commit() == {("in", 0): 1}  # the second is still in flight: stop before it
    second.ack()
    assert await consumer.commit() == {("in", 0): 3}


async def test_memory_producer_refuses_bad_destinations_by_name() -> None:
    log = MemoryEventLog()
    await log.ensure_topics({"in": 2})
    producer = MemoryProducer(log, producer_id="p")
    task = Task(task_id="t", domain="arith", prompt="x", spec={})
    with pytest.raises(TransportError, match="topic nowhere does not exist"):
        await producer.send("nowhere", task)
    with pytest.raises(TransportError, match="has 2 partitions, no partition 5"):
        await producer.send("in", task, partition=5)


async def test_weight_publication_over_the_memory_store(tmp_path: Path) -> None:
    store, names = MemoryStore(), Names("w")
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\x01\x02" * 100)
    manifest = await WeightPublisher(store, names).publish(3, [weights], step=7)
    got = await anext(WeightSubscriber(store, names, tmp_path / "dest").manifests())
    assert (got.version, got.step, got.objects) == (3, 7, manifest.objects)
    obj = manifest.objects[0]
    out = tmp_path / "copy.bin"
    assert await store.get_file(names.bucket(store.cfg.weights_bucket), obj["name"], out, sha256=obj["sha256"]) == 200
    assert out.read_bytes() == weights.read_bytes()
    with pytest.raises(TransportError, match="does not match the manifest"):
        await store.get_file(names.bucket(store.cfg.weights_bucket), obj["name"], out, sha256="0" * 64)


async def test_kv_watch_yields_the_current_value_then_updates() -> None:
    store = MemoryStore()
    await store.kv_put("b", "k", b"one")
    seen: list[bytes] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                async for value in store.kv_watch("b", "k"):
                    seen.append(value)
                    if len(seen) == 2:
                        return
            tg.start_soon(watch)
            while not seen:
                await anyio.sleep(0.01)
            await store.kv_put("b", "other", b"ignored")
            await store.kv_put("b", "k", b"two")
    assert seen == [b"one", b"two"]


class TracedUpcase(Upcase):
    span_name = "upcase"

    async def handle(self, record: EventRecord) -> None:
        from opentelemetry import trace
        trace.get_current_span().set_attribute("rollout.task_id", record.message.task_id)
        await super().handle(record)


async def test_the_runtime_opens_one_span_per_handled_record() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import ops.telemetry as telemetry
    from actors import tracing
    from engine.config import TelemetryConfig

    cfg = EngineConfig(namespace="traced")
    log, names = MemoryEventLog(), Names("traced")
    exporter = InMemorySpanExporter()
    shutdown = telemetry.setup_tracing(TelemetryConfig(tracing=True), "test", exporter=exporter)
    try:
        async with Runtime(cfg, event_log=log, store=MemoryStore(), instance="t") as rt:
            with tracing.tracer().start_as_current_span("schedule") as root:
                headers = tracing.trace_headers(root)
            await rt.producer.send(names.topic("tasks"), Task(task_id="t1", domain="arith", prompt="a", spec={}),
                                   headers=headers)
            await rt.producer.send(names.topic("tasks"), Task(task_id="t2", domain="arith", prompt="fail", spec={}),
                                   headers=headers)
            actor = TracedUpcase(rt)
            await run_until(actor, lambda: actor.handled + actor.handler_errors == 2)
        assert telemetry.force_flush(5000)
    finally:
        shutdown()
    spans = [s for s in exporter.get_finished_spans() if s.name == "upcase"]
    assert len(spans) == 2
    ok = next(s for s in spans if s.attributes["rollout.task_id"] == "t1")
    failed = next(s for s in spans if s.attributes["rollout.task_id"] == "t2")
    assert ok.parent.span_id == root.get_span_context().span_id and ok.context.trace_id == root.get_span_context().trace_id
    assert ok.attributes["rollout.role"] == "upcase"
    assert ok.attributes["messaging.destination.name"] == names.topic("tasks")
    assert not failed.status.is_ok and failed.events[0].name == "exception"  # the handler's error is on its span
    # the output carries the handling span's context: the next consumer's span nests under it
    (out,) = [r for part in log.topics[names.topic("completions")] for r in part]
    ctx = ok.context
    assert out.headers["traceparent"].decode() == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


async def test_read_since_reads_from_offsets_to_the_end_skipping_the_unexpected() -> None:
    log = MemoryEventLog()
    await log.ensure_topics({"t": 2})
    producer = log.producer(producer_id="p")
    for i in range(4):
        fut, _ = producer.send_nowait("t", Task(task_id=f"t{i}", domain="math", prompt="x", spec={}), partition=i % 2)
        await fut
    log.append("t", StoredRecord(None, b"\xc1 not msgpack", {}, 0), partition=0)
    got = await log.read_since("t", {0: 1}, expect=(Task.SCHEMA,))
    assert [(p, o, m.task_id) for p, o, m in got] == [(0, 1, "t2"), (1, 0, "t1"), (1, 1, "t3")]
    assert await log.read_since("t", {0: 9, 1: 2}, expect=(Task.SCHEMA,)) == []
    assert await log.read_since("t", {}, expect=("outcome",)) == []


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
async def test_the_memory_event_log_passes_the_transport_conformance_checks(check) -> None:  # type: ignore[no-untyped-def]
    await check(MemoryEventLog(), "conformance")


async def test_an_assigned_consumer_without_a_dead_letter_producer_skips_poison(caplog) -> None:  # type: ignore[no-untyped-def]
    log = MemoryEventLog()
    await log.ensure_topics({"in": 1})
    log.append("in", StoredRecord(None, b"\xc1 not msgpack", {}, 0))
    await log.producer(producer_id="p").send("in", Task(task_id="t", domain="arith", prompt="x", spec={}))
    consumer = await log.assigned_consumer(topics=["in"], expect=("task",)).start()
    (record,) = await consumer.getmany(timeout_s=0.1)
    assert record.offset == 1 and consumer.statistics()["dead_lettered"] == 0
    assert "dropping poison record in[0]@0" in caplog.text
