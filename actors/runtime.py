"""What every role gets from the process that runs it, and the loop shared by the roles that consume a topic.

``Runtime`` holds the process's connections (one producer on the event log, one control store) and the
names of the deployment; roles receive it and never know who built it (``ops/cli_run.py`` does), nor which
transport carries it (the config's ``transport.type``, ``streams/transports.py``).

``StreamActor`` is the consume -> handle -> produce -> ack loop of the design:

- records are handled concurrently, at most ``concurrency`` at a time;
- a handler emits its outputs with ``emit``; the record is acknowledged only after every output is
  acknowledged by the broker, and offsets are committed only for acknowledged records;
- a handler that raises on a record dead-letters that record (reason ``handler_error``) and the
  actor goes on; infrastructure failures (``TransportError``, which each transport's errors subclass) propagate, crash the actor
  and let the supervisor restart it, which re-delivers whatever was not committed;
- a handler may ``defer_ack(record)``: the record then stays unacknowledged when ``handle`` returns, and
  the actor acks it itself (``record.ack()``) once the effects it waited for are acknowledged (the
  reward actor holds a group's outcomes until the group's experiences are out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
from opentelemetry.trace import Span, SpanKind

from actors import tracing
from engine.actor import Actor, describe_error
from engine.config import EngineConfig, check_files
from engine.schemas import Message
from engine.topics import TOPIC_SUFFIXES, Names
from streams.protocols import (AssignedConsumer, ControlStore, EventConsumer, EventLog, EventProducer, EventRecord,
                               TransportError)
from streams.transports import transport_named

log = logging.getLogger("rollout.actors")

# Every transport's failures are TransportErrors (Kafka's StreamError, NATS's NatsError, the in-memory ones).
INFRA_ERRORS: tuple[type[BaseException], ...] = (TransportError,)


class Runtime:
    """Shared connections of one process. ``async with Runtime(cfg) as rt``.

    The event log and the control store are the config's transport's (``transport.type``: Kafka and NATS
    by default) unless ``event_log`` / ``store`` are given (tests share one in-memory pair between
    runtimes): roles only see the protocols of ``streams/protocols.py``. ``use_nats=False`` builds no
    control store (the name predates the control store's; roles that need one then fail at once).
    """

    def __init__(self, cfg: EngineConfig, *, instance: str | None = None, use_nats: bool = True,
                 event_log: EventLog | None = None, store: ControlStore | None = None) -> None:
        self.cfg = cfg
        self.names = Names(cfg.namespace)
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}"
        transport = transport_named(cfg.transport.type)  # ConfigError naming transport.type when unknown
        self.event_log: EventLog = event_log if event_log is not None else transport.event_log(cfg)
        # The producer id names the process that produced a record, not only its instance: an instance named
        # by the operator (``--instance``) keeps its name across restarts, so its pid tells one life from the next.
        life = self.instance if instance is None else f"{self.instance}:{os.getpid()}"
        self.producer: EventProducer = self.event_log.producer(producer_id=f"{cfg.namespace}/{life}")
        if not use_nats:
            store = None
        elif store is None:
            store = transport.control_store(cfg)
        self.control: ControlStore | None = store
        """The control store (weights, learner version, statistics); None when built with ``use_nats=False``."""
        self._started = False

    @property
    def nats(self) -> ControlStore | None:
        """The control store under its old name (it is NATS only under the ``kafka`` transport): use ``control``."""
        return self.control

    @property
    def kv_bucket(self) -> str:
        """The deployment's control KV bucket (``nats.kv_bucket`` under the namespace): weights manifest,
        learner status, scheduler and reward statistics all live there."""
        return self.names.bucket(self.cfg.nats.kv_bucket)

    def partitions(self, suffix: str) -> int:
        """Partitions of the topic ``suffix`` (the ``kafka`` section sizes the topics of every transport)."""
        return self.cfg.kafka.partitions.get(suffix, self.cfg.kafka.default_partitions)

    async def start(self) -> "Runtime":
        check_files(self.cfg)  # every file the config names, before any connection
        await self.event_log.ensure_topics({self.names.topic(s): self.partitions(s) for s in TOPIC_SUFFIXES})
        await self.producer.start()
        if self.control is not None:
            await self.control.connect()
        self._started = True
        return self

    async def __aenter__(self) -> "Runtime":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.producer.close()
            if self.control is not None:
                await self.control.close()

    def consumer(self, role: str, suffixes: list[str], expect: tuple[str, ...], **kw: Any) -> EventConsumer:
        """A member of the role's consumer group on the given topics, dead-lettering poison records."""
        return self.event_log.consumer(topics=[self.names.topic(s) for s in suffixes], group=self.names.group(role),
                                       expect=expect, dead_letters=self.producer, dlq_topic=self.names.dlq,
                                       client_id=f"{role}-{self.instance}", **kw)

    def assigned_consumer(self, role: str, *, topics: list[str] | None = None,
                          partitions: list[tuple[str, int]] | None = None,
                          start_offsets: dict[tuple[str, int], int] | None = None, from_end: bool = False,
                          expect: tuple[str, ...]) -> AssignedConsumer:
        """A consumer of every partition of ``topics`` (full names) or of exactly ``partitions``, outside any
        group, from ``start_offsets`` (see ``streams.protocols.AssignedConsumer``); poison records go to the
        dead-letter topic."""
        return self.event_log.assigned_consumer(topics=topics, partitions=partitions, start_offsets=start_offsets,
                                                from_end=from_end, expect=expect, dead_letters=self.producer,
                                                dlq_topic=self.names.dlq, client_id=f"{role}-{self.instance}")

    def require_control(self) -> ControlStore:
        """The control store; TransportError if the runtime was built without one."""
        if self.control is None:
            raise TransportError("this role needs the control store but the runtime was built without it")
        return self.control


class Released(Exception):
    """Raised by a handler to give its record back unhandled: it is neither acknowledged nor dead-lettered,
    so the committed offset stays before it and the next owner of the partition gets it again (a
    draining actor's handler that has not started real work raises this instead of holding the drain)."""


class StreamActor(Actor):
    """Base of the roles that consume event-log topics. Subclasses set ``topics``/``expect`` and ``handle``."""

    topics: ClassVar[list[str]] = []
    expect: ClassVar[tuple[str, ...]] = ()
    # Exceptions that mean "the infrastructure failed", not "this record is bad": they crash the
    # actor (the supervisor restarts it and the record is re-delivered) instead of dead-lettering.
    infra_errors: ClassVar[tuple[type[BaseException], ...]] = INFRA_ERRORS
    concurrency: int = 64
    commit_interval_s: float = 1.0
    # The tracing hook: when set, ``handle`` runs inside a CONSUMER span of this name, child of the
    # record's ``traceparent``, with the record's messaging attributes and ``rollout.role``; the handler
    # adds its own attributes to ``trace.get_current_span()``, and ``emit`` gives outputs this span's
    # traceparent. One place for what every consuming role used to repeat (docs/tracing.md).
    span_name: ClassVar[str | None] = None

    def __init__(self, rt: Runtime, name: str | None = None) -> None:
        super().__init__(name)
        self.rt = rt
        self.consumer: EventConsumer | None = None
        self._pending_emits: dict[int, list[asyncio.Future]] = {}
        self._deferred: set[int] = set()
        self._span_parents: dict[int, str | None] = {}
        self.handled = 0
        self.handler_errors = 0
        self.released = 0

    def make_consumer(self) -> EventConsumer:
        return self.rt.consumer(self.role, self.topics, self.expect, max_in_flight=self.concurrency * 4)

    async def setup(self) -> None:
        self.consumer = await self.make_consumer().start()

    async def teardown(self) -> None:
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            await consumer.close()

    async def handle(self, record: EventRecord) -> None:
        """Process one record; produce outputs with ``emit``. Subclasses implement."""
        raise NotImplementedError

    def emit(self, record: EventRecord, topic: str, message: Message, *, key: str | None = None,
             partition: int | None = None, headers: dict[str, str] | None = None, trace: bool = True) -> str:
        """Produce ``message`` as an effect of ``record``; the record is acked after it is. Returns its id.

        The record's ``traceparent`` goes with it unless ``headers`` name another one, or ``trace`` is
        false (no trace context at all: records a consumer can tie to a traced one by a key).
        """
        hdrs = dict(headers or {})
        if not trace:
            hdrs.pop("traceparent", None)
        elif "traceparent" not in hdrs:
            parent = self._span_parents.get(id(record), record.traceparent)
            if parent:
                hdrs["traceparent"] = parent
        fut, mid = self.rt.producer.send_nowait(topic, message, key=key, partition=partition, headers=hdrs)
        self._pending_emits.setdefault(id(record), []).append(fut)
        return mid

    def defer_ack(self, record: EventRecord) -> None:
        """Keep ``record`` unacknowledged after ``handle`` returns; the caller must ``record.ack()`` it later."""
        self._deferred.add(id(record))

    async def serve(self) -> None:
        assert self.consumer is not None
        limiter = anyio.Semaphore(self.concurrency)
        last_commit = time.monotonic()
        crash: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            while not self.draining and not crash:
                await self.rt.producer.wait_room()
                records = await self.consumer.getmany(timeout_s=0.2, max_records=self.concurrency)
                for record in records:
                    await limiter.acquire()
                    tg.start_soon(self._process, record, limiter, crash)
                if time.monotonic() - last_commit >= self.commit_interval_s:
                    await self.consumer.commit()
                    last_commit = time.monotonic()
                await self.tick()
        # the task group waited for in-flight handlers: commit what they finished
        if crash:
            raise crash[0]
        await self.consumer.commit()

    async def tick(self) -> None:
        """Called once per poll loop (timers, straggler checks). Default: nothing."""

    async def _process(self, record: EventRecord, limiter: anyio.Semaphore, crash: list[BaseException]) -> None:
        try:
            try:
                with self._handling_span(record):
                    await self.handle(record)
                for fut in self._pending_emits.pop(id(record), []):
                    await fut
            except self.infra_errors as exc:
                crash.append(exc)
                return
            except Released as exc:
                self._pending_emits.pop(id(record), None)
                self._deferred.discard(id(record))
                self.released += 1
                log.info("%s: record %s[%d]@%d given back unhandled: %s", self.name, record.topic,
                         record.partition, record.offset, exc)
                return
            except Exception as exc:
                self._pending_emits.pop(id(record), None)
                self._deferred.discard(id(record))
                self.handler_errors += 1
                log.warning("%s: record %s[%d]@%d failed: %s", self.name, record.topic, record.partition,
                            record.offset, describe_error(exc))
                log.debug("%s: the handler's traceback", self.name, exc_info=exc)
                try:
                    await record.dead_letter("handler_error", describe_error(exc))
                except self.infra_errors as dlq_exc:
                    crash.append(dlq_exc)
                return
            if id(record) in self._deferred:
                self._deferred.discard(id(record))
            else:
                record.ack()
            self.handled += 1
        finally:
            self._span_parents.pop(id(record), None)
            limiter.release()

    @contextlib.contextmanager
    def record_span(self, record: EventRecord, name: str) -> Iterator[Span]:
        """A CONSUMER span ``name``, child of ``record``'s traceparent, with its messaging attributes and
        ``rollout.role``. The hook opens one around ``handle``; a handler that fans one record out into
        several units of work, each traced on its own (the inference actor's samples), opens one per unit."""
        with tracing.tracer().start_as_current_span(name, context=tracing.record_context(record),
                                                    kind=SpanKind.CONSUMER) as span:
            if span.is_recording():
                span.set_attributes({**tracing.record_attributes(record), "rollout.role": self.role})
            yield span

    @contextlib.contextmanager
    def _handling_span(self, record: EventRecord) -> Iterator[None]:
        """The span of one handled record (``span_name``), or nothing when the role traces by itself."""
        if self.span_name is None:
            yield
            return
        with self.record_span(record, self.span_name) as span:
            self._span_parents[id(record)] = tracing.traceparent_of(span) or record.traceparent
            yield

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(handled=self.handled, handler_errors=self.handler_errors, released=self.released)
        if self.consumer is not None:
            stats.update(self.consumer.statistics())
        return stats
