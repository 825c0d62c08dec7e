"""An asyncio-friendly Kafka adapter on kafka-python 3.x.

kafka-python is synchronous; this module keeps it off the event loop:

- ``Producer``: records go onto a bounded hand-off queue drained by one sender thread that calls
  ``KafkaProducer.send``; acknowledgements come back through ``loop.call_soon_threadsafe`` in
  batches (one wake-up for many acks). The event loop never blocks on a full producer buffer or a
  metadata fetch; ``send`` awaits room in the hand-off queue instead (backpressure).
- ``Consumer``: ``poll`` and ``commit`` run in a worker thread, never concurrently (one lock).
  Records are decoded in that thread; a record that fails to decode or validate is produced to the
  dead-letter topic, acknowledged and never handed to the caller. Offsets are committed only for
  records the caller acknowledged (``OffsetTracker``), so a crash re-delivers unfinished work:
  at-least-once, with de-duplication by message id left to the effects that need it.

The producer is idempotent with ``acks=all``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.errors import KafkaError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata, TopicPartition

from engine.config import KafkaConfig, check_files
from engine.schemas import DeadLetter, Message
from streams.codec import HEADER_MESSAGE_ID, HEADER_TRACEPARENT, DecodedRecord, DecodeError, Envelope, decode, encode
from streams.kafka_admin import ensure_topics
from streams.kafka_client import StreamError, _connect_error, _construct, client_security, kafka_reason
from streams.offsets import OffsetTracker
from streams.protocols import EventProducer

log = logging.getLogger("rollout.streams.kafka")



@dataclasses.dataclass(frozen=True, slots=True)
class RecordMetadata:
    topic: str
    partition: int
    offset: int


# -- admin ------------------------------------------------------------------------------------------

class Producer:
    """Idempotent producer (acks=all) whose ``send`` never blocks the event loop."""

    def __init__(self, cfg: KafkaConfig, *, producer_id: str, queue_limit: int = 20000,
                 linger_ms: int = 5, **overrides: Any) -> None:
        self.cfg = cfg
        self.producer_id = producer_id
        self._kwargs = dict(
            bootstrap_servers=cfg.bootstrap,
            client_id=producer_id.replace("/", "-")[:200],
            acks="all",
            enable_idempotence=True,
            compression_type=None if cfg.compression == "none" else cfg.compression,
            linger_ms=linger_ms,
            batch_size=256 * 1024,
            max_request_size=cfg.max_record_bytes + 64 * 1024,
            max_block_ms=120000,
            **client_security(cfg),
        )
        self._kwargs.update(overrides)
        self._queue_limit = queue_limit
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake_sender = threading.Event()
        self._room = asyncio.Event()
        self._acks: collections.deque[tuple[asyncio.Future[Any], Any, BaseException | None]] = collections.deque()
        self._acks_lock = threading.Lock()
        self._ack_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._producer: KafkaProducer | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unacked = 0
        self._all_acked = asyncio.Event()
        self.sent = 0
        self.errors = 0

    async def start(self) -> "Producer":
        check_files(self.cfg)
        self._loop = asyncio.get_running_loop()
        self._room.set()
        self._all_acked.set()
        try:
            self._producer = await anyio.to_thread.run_sync(lambda: _construct(KafkaProducer, **self._kwargs))
        except KafkaError as exc:
            raise _connect_error("cannot connect a producer to", self.cfg, exc) from exc
        self._thread = threading.Thread(target=self._sender, name=f"kafka-send-{self.producer_id}", daemon=True)
        self._thread.start()
        return self

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def send_raw_nowait(self, topic: str, value: bytes, *, key: bytes | None = None,
                        headers: list[tuple[str, bytes]] | None = None,
                        partition: int | None = None) -> asyncio.Future[Any]:
        """Queue one record; the future resolves to RecordMetadata when the broker acknowledged it."""
        if self._closed or self._loop is None:
            raise StreamError("producer is closed" if self._closed else "producer not started")
        fut = self._loop.create_future()
        self._pending.append((topic, value, key, headers, partition, fut))
        self._unacked += 1
        self._all_acked.clear()
        if len(self._pending) >= self._queue_limit:
            self._room.clear()
        self._wake_sender.set()
        return fut

    def send_nowait(self, topic: str, message: Message, *, key: str | None = None,
                    headers: dict[str, str] | None = None, partition: int | None = None,
                    message_id: str | None = None) -> tuple[asyncio.Future[Any], str]:
        """Encode and queue a message; returns (ack future, message id)."""
        value, mid = encode(message, producer=self.producer_id, message_id=message_id)
        if len(value) > self.cfg.max_record_bytes:
            raise StreamError(f"{message.SCHEMA} record of {len(value)} bytes exceeds "
                              f"kafka.max_record_bytes={self.cfg.max_record_bytes}")
        hdrs = [(HEADER_MESSAGE_ID, mid.encode())]
        if headers:
            hdrs.extend((k, v.encode()) for k, v in headers.items())
        fut = self.send_raw_nowait(topic, value, key=key.encode() if key is not None else None,
                                   headers=hdrs, partition=partition)
        return fut, mid

    async def wait_room(self) -> None:
        """Wait until the hand-off queue has room (backpressure for bulk senders)."""
        await self._room.wait()

    async def send(self, topic: str, message: Message, *, key: str | None = None,
                   headers: dict[str, str] | None = None, partition: int | None = None,
                   message_id: str | None = None) -> RecordMetadata:
        """Produce one message and wait for the broker's acknowledgement."""
        await self._room.wait()
        fut, _ = self.send_nowait(topic, message, key=key, headers=headers, partition=partition,
                                  message_id=message_id)
        return await fut

    async def flush(self, timeout_s: float = 120.0) -> None:
        """Wait until every queued record is acknowledged (or failed)."""
        with anyio.fail_after(timeout_s):
            await self._all_acked.wait()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is queued, then close. Idempotent."""
        if self._closed:
            return
        try:
            if self._producer is not None:
                with anyio.move_on_after(timeout_s):
                    await self._all_acked.wait()
        finally:
            self._closed = True
            self._wake_sender.set()
            if self._thread is not None:
                await anyio.to_thread.run_sync(self._thread.join, timeout_s)
            if self._producer is not None:
                producer = self._producer
                self._producer = None
                await anyio.to_thread.run_sync(lambda: producer.close(timeout=timeout_s))

    # -- threads -----------------------------------------------------------------------------------
    def _sender(self) -> None:
        assert self._producer is not None and self._loop is not None
        producer = self._producer
        while True:
            self._wake_sender.wait()
            self._wake_sender.clear()
            while self._pending:
                topic, value, key, headers, partition, fut = self._pending.popleft()
                try:
                    kfut = producer.send(topic, value=value, key=key, headers=headers, partition=partition)
                except Exception as exc:  # delivered to the awaiting coroutine, not swallowed
                    self._complete(fut, None, exc)
                    continue
                kfut.add_callback(self._on_ack, fut)
                kfut.add_errback(self._on_error, fut)
                if len(self._pending) < self._queue_limit // 2 and not self._room.is_set():
                    self._loop.call_soon_threadsafe(self._room.set)
            if not self._room.is_set():
                self._loop.call_soon_threadsafe(self._room.set)
            if self._closed and not self._pending:
                return

    # kafka-python calls callbacks as f(*args, value): the bound future comes first.
    def _on_ack(self, fut: asyncio.Future[Any], md: Any) -> None:
        self._complete(fut, RecordMetadata(md.topic, md.partition, md.offset), None)

    def _on_error(self, fut: asyncio.Future[Any], exc: BaseException) -> None:
        self._complete(fut, None, exc)

    def _complete(self, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        with self._acks_lock:
            self._acks.append((fut, result, exc))
            if self._ack_scheduled:
                return
            self._ack_scheduled = True
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver_acks)
        except RuntimeError:
            pass  # loop closed: nobody is waiting any more

    def _deliver_acks(self) -> None:
        with self._acks_lock:
            acks, self._acks = self._acks, collections.deque()
            self._ack_scheduled = False
        for fut, result, exc in acks:
            self._unacked -= 1
            if fut.done():
                continue
            if exc is not None:
                self.errors += 1
                fut.set_exception(exc if isinstance(exc, StreamError) else
                                  StreamError(f"produce failed: {kafka_reason(exc, 'the produce request')}"))
                # Nobody may await a send_nowait future; retrieve it so asyncio does not warn.
                fut.exception()
            else:
                self.sent += 1
                fut.set_result(result)
        if self._unacked == 0:
            self._all_acked.set()


# -- consumer ---------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False, slots=True)
class Record(DecodedRecord):
    """A decoded record handed to a consumer's caller; ``ack()`` once its effects are durable."""

    _consumer: "Consumer"
    _acked: bool = False

    @property
    def owned_since_ms(self) -> int:
        return self._consumer.owned_since.get((self.topic, self.partition), 0)

    def ack(self) -> None:
        """Mark the record processed: its offset may now be committed. Idempotent."""
        if not self._acked:
            self._acked = True
            self._consumer._finish(self.topic, self.partition, self.offset)

    async def dead_letter(self, reason: str, error: str) -> None:
        """Send this record to the dead-letter topic (a semantic failure) and ack it."""
        await self._consumer.dead_letter_raw(self.topic, self.partition, self.offset,
                                             self.key, b"", reason, error, envelope=self.envelope)
        self.ack()


DeadLetterSink = Callable[[str, bytes | None, DeadLetter], Awaitable[None]]


class _Listener(ConsumerRebalanceListener):
    def __init__(self, consumer: "Consumer") -> None:
        self.consumer = consumer

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.consumer._on_revoked(list(revoked))

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        # Evicted from the group: a commit would be refused; the next owner re-delivers.
        self.consumer._on_revoked(list(lost), commit=False)

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.consumer._on_assigned(list(assigned))


class Consumer:
    """A consumer-group member (or a manual assignment) with commit-after-ack and dead-lettering.

    ``expect`` restricts which schemas are valid on these topics; anything else is dead-lettered.
    At most ``max_in_flight`` records are handed out and not yet acknowledged; beyond that, fetching
    pauses (backpressure) while the group membership stays alive.
    """

    def __init__(self, cfg: KafkaConfig, *, topics: list[str] | None = None, group: str | None = None,
                 assign: list[tuple[str, int]] | None = None, assign_topics: list[str] | None = None,
                 start_offsets: dict[tuple[str, int], int] | None = None, expect: tuple[str, ...] | None = None,
                 dead_letters: EventProducer | None = None, dlq_topic: str | None = None,
                 max_in_flight: int = 10000, max_poll_records: int = 500, from_end: bool = False,
                 client_id: str = "rollout", **overrides: Any) -> None:
        if sum(x is not None for x in (topics, assign, assign_topics)) != 1:
            raise ValueError("give exactly one of topics (group subscription), assign (manual partitions) "
                             "or assign_topics (every partition of these topics)")
        if start_offsets is not None and topics is not None:
            raise ValueError("start_offsets needs a manual assignment (assign or assign_topics)")
        if topics is not None and group is None:
            raise ValueError("a subscription needs a consumer group")
        if dead_letters is not None and dlq_topic is None:
            raise ValueError("dead_letters needs dlq_topic")
        self.cfg = cfg
        self.topics = topics
        self.group = group
        self.assignment = assign
        self.assign_topics = assign_topics
        self.start_offsets = start_offsets
        self.expect = expect
        self._dlq = dead_letters
        self._dlq_topic = dlq_topic
        self.max_in_flight = max_in_flight
        self._from_end = from_end
        self._kwargs = dict(
            bootstrap_servers=cfg.bootstrap,
            group_id=group,
            client_id=client_id.replace("/", "-")[:200],
            enable_auto_commit=False,
            auto_offset_reset="latest" if from_end else "earliest",
            max_poll_records=max_poll_records,
            fetch_max_bytes=max(52428800, cfg.max_record_bytes * 2),
            max_partition_fetch_bytes=max(1048576, cfg.max_record_bytes + 65536),
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=max(500, cfg.session_timeout_ms // 10),
            max_poll_interval_ms=300000,
            # Incremental (KIP-429) rebalancing: a member keeps the partitions it is not asked to give
            # up, with their positions and in-flight records; eager rebalancing would revoke them all
            # on any membership or metadata change and re-deliver work still being processed.
            partition_assignment_strategy=(CooperativeStickyAssignor,),
            **client_security(cfg),
        )
        self._kwargs.update(overrides)
        self._consumer: KafkaConsumer | None = None
        self._lock = anyio.Lock()
        self._tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
        self._tracker_lock = threading.Lock()
        self._paused = False
        self._closed = False
        self._buffer: collections.deque[Record] = collections.deque()
        self.dead_lettered = 0
        self.delivered = 0
        self.commits = 0
        self.commits_deferred = 0
        self.assigned: set[tuple[str, int]] = set()
        self.owned_since: dict[tuple[str, int], int] = {}
        """(topic, partition) -> when this member got it (ms since the epoch), the start or a rebalance."""

    async def start(self) -> "Consumer":
        check_files(self.cfg)
        try:
            self._consumer = await anyio.to_thread.run_sync(self._make)
        except KafkaError as exc:
            raise _connect_error("cannot start a consumer on", self.cfg, exc) from exc
        return self

    def _make(self) -> KafkaConsumer:
        c = _construct(KafkaConsumer, **self._kwargs)
        if self.topics is not None:
            # Know every topic's partitions before joining: a leader that assigns before its metadata
            # has them leaves them unowned until the next metadata refresh.
            deadline = time.monotonic() + 30
            for topic in self.topics:
                while not c.partitions_for_topic(topic):
                    if time.monotonic() > deadline:
                        c.close(autocommit=False)
                        raise StreamError(f"topic {topic} has no partitions on {self.cfg.bootstrap} (not created?)")
                    time.sleep(0.05)
            c.subscribe(self.topics, listener=_Listener(self))
            return c
        if self.assign_topics is not None:
            # Partitions come from the broker, not from configuration: a topic grown by another
            # deployment's config is still read whole.
            self.assignment = []
            for topic in self.assign_topics:
                parts = c.partitions_for_topic(topic)
                if not parts:
                    c.close(autocommit=False)
                    raise StreamError(f"topic {topic} has no partitions (not created?)")
                self.assignment += [(topic, p) for p in sorted(parts)]
        tps = [TopicPartition(t, p) for t, p in self.assignment or []]
        c.assign(tps)
        self.assigned = set(self.assignment or [])
        self.owned_since = dict.fromkeys(self.assigned, time.time_ns() // 1_000_000)
        if self.start_offsets is not None:
            for tp in tps:  # an explicit start: the caller's offsets, else the end (from_end) or the beginning
                offset = self.start_offsets.get((tp.topic, tp.partition))
                if offset is not None:
                    c.seek(tp, offset)
                elif self._from_end:
                    c.seek_to_end(tp)
                    c.position(tp)
                else:
                    c.seek_to_beginning(tp)
        elif self._from_end:
            c.seek_to_end(*tps)
            for tp in tps:  # resolve the position now so records produced after start() are seen
                c.position(tp)
        return c

    async def __aenter__(self) -> "Consumer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the caller's side -------------------------------------------------------------------------
    async def getmany(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Record]:
        """Poll once; return decoded, valid records (poison ones are dead-lettered here)."""
        if self._buffer:
            buffered: list[Record] = []
            while self._buffer and (max_records is None or len(buffered) < max_records):
                buffered.append(self._buffer.popleft())
            return buffered
        async with self._lock:
            if self._consumer is None:
                raise StreamError("consumer is closed or not started")
            self._apply_backpressure()
            polled = await anyio.to_thread.run_sync(self._poll_and_decode, timeout_s)
        out: list[Record] = []
        for item in polled:
            if isinstance(item, Record):
                out.append(item)
            else:
                await self._dead_letter_poison(*item)
        self.delivered += len(out)
        if max_records is not None and len(out) > max_records:
            self._buffer.extend(out[max_records:])
            out = out[:max_records]
        return out

    def __aiter__(self) -> "Consumer":
        return self

    async def __anext__(self) -> Record:
        while True:
            if self._closed:
                raise StopAsyncIteration
            records = await self.getmany(timeout_s=0.5, max_records=1)
            if records:
                return records[0]

    async def commit(self) -> dict[tuple[str, int], int]:
        """Commit offsets of acknowledged records; returns what was committed."""
        if self.group is None:
            return {}
        async with self._lock:
            if self._consumer is None:
                return {}
            return await anyio.to_thread.run_sync(self._commit_sync)

    async def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``partition`` of ``topic`` from ``offset`` on; its records handed out and not acknowledged are
        forgotten (their acks no longer move a committable offset). Manual assignments only."""
        key = (topic, partition)
        async with self._lock:
            if self._consumer is None:
                raise StreamError("consumer is closed or not started")
            if self.topics is not None or key not in self.assigned:
                raise StreamError(f"cannot seek {topic}[{partition}]: not a partition of this consumer's "
                                  f"manual assignment {sorted(self.assigned)}")
            if offset < 0:
                raise StreamError(f"cannot seek {topic}[{partition}] to offset {offset}: offsets are >= 0")
            consumer = self._consumer
            await anyio.to_thread.run_sync(lambda: consumer.seek(TopicPartition(topic, partition), offset))
            with self._tracker_lock:
                self._tracker.revoke([key])
            self._buffer = collections.deque(r for r in self._buffer if (r.topic, r.partition) != key)

    async def dead_letter_raw(self, topic: str, partition: int, offset: int, key: str | None, value: bytes,
                              reason: str, error: str, envelope: Envelope | None = None) -> None:
        if self._dlq is None or self._dlq_topic is None:
            log.error("dropping poison record %s[%d]@%d (%s: %s): no dead-letter producer configured",
                      topic, partition, offset, reason, error)
            return
        if envelope is not None and not value:
            value, _ = encode(envelope.message, producer=envelope.producer or "unknown",
                              message_id=envelope.id, created_at=envelope.created_at, validate=False)
        # Keep the record under the size limit: a dead letter must never be poison itself.
        keep = max(0, self.cfg.max_record_bytes - 64 * 1024)
        letter = DeadLetter(topic=topic, partition=partition, offset=offset, reason=reason,
                            error=error[:4000], value=bytes(value[:keep]), consumer_group=self.group or "")
        await self._dlq.send(self._dlq_topic, letter, key=key)
        self.dead_lettered += 1

    async def close(self) -> None:
        """Commit what is acknowledged and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            consumer, self._consumer = self._consumer, None
            if consumer is None:
                return

            def _close() -> None:
                try:
                    if self.group is not None:
                        self._commit_with(consumer)
                finally:
                    consumer.close(autocommit=False)

            await anyio.to_thread.run_sync(_close)

    def statistics(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "dead_lettered": self.dead_lettered, "commits": self.commits,
                "commits_deferred": self.commits_deferred, "in_flight": self._tracker.in_flight(),
                "assigned": len(self.assigned), "paused": self._paused}

    async def lag(self) -> dict[tuple[str, int], int]:
        """Per-partition lag (end offset minus committed) of this member's assignment."""
        async with self._lock:
            if self._consumer is None:
                return {}
            c = self._consumer

            def _lag() -> dict[tuple[str, int], int]:
                tps = list(c.assignment())
                if not tps:
                    return {}
                ends = c.end_offsets(tps)
                out = {}
                for tp in tps:
                    committed = c.committed(tp) if self.group else None
                    pos = committed if committed is not None else c.position(tp)
                    out[(tp.topic, tp.partition)] = max(0, ends[tp] - (pos or 0))
                return out

            return await anyio.to_thread.run_sync(_lag)

    # -- worker-thread side ------------------------------------------------------------------------
    def _poll_and_decode(self, timeout_s: float) -> list[Record | tuple[Any, ...]]:
        assert self._consumer is not None
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        out: list[Record | tuple[Any, ...]] = []
        for tp, records in batches.items():
            for r in records:
                with self._tracker_lock:
                    self._tracker.start((tp.topic, tp.partition), r.offset)
                key = r.key.decode("utf-8", "replace") if r.key is not None else None
                try:
                    env = decode(r.value, max_bytes=self.cfg.max_record_bytes, expect=self.expect)
                except DecodeError as exc:
                    out.append((tp.topic, tp.partition, r.offset, key, r.value or b"", exc.reason, exc.detail))
                    continue
                headers = {k: v for k, v in (r.headers or []) if isinstance(v, (bytes, bytearray))}
                out.append(Record(env, tp.topic, tp.partition, r.offset, key, headers, r.timestamp, self))
        return out

    async def _dead_letter_poison(self, topic: str, partition: int, offset: int, key: str | None,
                                  value: bytes, reason: str, detail: str) -> None:
        log.warning("dead-lettering %s[%d]@%d: %s: %s", topic, partition, offset, reason, detail[:200])
        await self.dead_letter_raw(topic, partition, offset, key, value, reason, detail)
        self._finish(topic, partition, offset)

    def _finish(self, topic: str, partition: int, offset: int) -> None:
        with self._tracker_lock:
            self._tracker.finish((topic, partition), offset)

    def _apply_backpressure(self) -> None:
        assert self._consumer is not None
        over = self._tracker.in_flight() >= self.max_in_flight
        if over and not self._paused:
            self._consumer.pause(*self._consumer.assignment())
            self._paused = True
        elif not over and self._paused:
            self._consumer.resume(*self._consumer.paused())
            self._paused = False

    def _commit_sync(self) -> dict[tuple[str, int], int]:
        assert self._consumer is not None
        return self._commit_with(self._consumer)

    def _commit_with(self, consumer: KafkaConsumer) -> dict[tuple[str, int], int]:
        with self._tracker_lock:
            offsets = {p: o for p, o in self._tracker.committable().items() if p in self.assigned}
        if not offsets:
            return {}
        try:
            consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()})
        except RebalanceInProgressError:
            # The group is rebalancing: nothing was committed. The offsets stay pending and go with the
            # next commit (or, for partitions this member loses, with the commit on revoke).
            self.commits_deferred += 1
            log.info("%s: commit deferred, the group is rebalancing", self.group)
            return {}
        with self._tracker_lock:
            self._tracker.mark_committed(offsets)
        self.commits += 1
        return offsets

    def _on_revoked(self, revoked: list[TopicPartition], *, commit: bool = True) -> None:
        # Called by kafka-python's IO thread during a rebalance: commit what is done on the partitions
        # we lose. It must not block there (kafka-python 3 refuses a synchronous commit from that
        # thread), so the commit is sent asynchronously; if it is lost, the next owner re-delivers
        # those records, which at-least-once allows.
        keys = [(tp.topic, tp.partition) for tp in revoked]
        with self._tracker_lock:
            offsets = {p: o for p, o in self._tracker.committable().items() if p in keys}
        if offsets and commit and self._consumer is not None:
            try:
                self._consumer.commit_async({TopicPartition(t, p): OffsetAndMetadata(o, "", -1)
                                             for (t, p), o in offsets.items()})
            except KafkaError as exc:
                log.warning("commit on revoke failed: %s", kafka_reason(exc, "the commit"))
        with self._tracker_lock:
            self._tracker.revoke(keys)
        self.assigned -= set(keys)
        for key in keys:
            self.owned_since.pop(key, None)
        # Records of revoked partitions still buffered here belong to the new owner now.
        self._buffer = collections.deque(r for r in self._buffer if (r.topic, r.partition) not in keys)

    def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        keys = {(tp.topic, tp.partition) for tp in assigned}
        now_ms = time.time_ns() // 1_000_000
        for key in keys - self.assigned:  # cooperative rebalancing: kept partitions are not assigned again
            self.owned_since[key] = now_ms
        self.assigned |= keys


# ensure_topics, StreamError, client_security and kafka_reason live in kafka_admin / kafka_client; they are
# re-exported here, where callers have always imported them from.
__all__ = ["HEADER_MESSAGE_ID", "HEADER_TRACEPARENT", "Consumer", "DeadLetterSink", "Producer", "Record", "RecordMetadata",
           "StreamError", "client_security", "ensure_topics", "kafka_reason"]


def read_range(cfg: KafkaConfig, topic: str, start_offsets: dict[int, int] | None = None, *,
               since_ms: int | None = None, timeout_s: float = 60.0,
               client_id: str = "rollout-reader") -> Iterable[tuple[int, int, Envelope | DecodeError]]:
    """Every record of ``topic`` from ``start_offsets`` (partition -> offset; 0 where absent) up to the end
    offsets at call time, as ``(partition, offset, envelope or DecodeError)``. With ``since_ms`` (ms since
    the epoch) each partition starts no earlier than its first record timestamped at or after it (the
    broker's time index: ``offsets_for_times``). Blocking: call it in a thread.

    No consumer group: reading commits nothing and disturbs no one. TimeoutError when a partition is not
    read to its end within ``timeout_s``.
    """
    check_files(cfg)
    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap, group_id=None, enable_auto_commit=False,
                             client_id=client_id, auto_offset_reset="earliest",
                             fetch_max_bytes=max(52428800, cfg.max_record_bytes * 2),
                             max_partition_fetch_bytes=max(1048576, cfg.max_record_bytes + 65536),
                             **client_security(cfg))
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        starts = dict(start_offsets or {})
        if since_ms is not None:
            for tp, found in consumer.offsets_for_times({tp: max(0, since_ms) for tp in tps}).items():
                at = found.offset if found is not None else ends[tp]  # None: no record that recent
                starts[tp.partition] = max(starts.get(tp.partition, 0), at)
        for tp in tps:
            consumer.seek(tp, min(max(0, starts.get(tp.partition, 0)), ends[tp]))
        todo = {tp for tp in tps if ends[tp] > consumer.position(tp)}
        deadline = time.monotonic() + timeout_s
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(tp.partition for tp in todo)} "
                                   f"not read to their end within {timeout_s}s")
            for tp, records in consumer.poll(timeout_ms=500).items():
                for r in records:
                    if r.offset >= ends[tp]:
                        continue
                    try:
                        yield tp.partition, r.offset, decode(r.value, max_bytes=cfg.max_record_bytes)
                    except DecodeError as exc:
                        yield tp.partition, r.offset, exc
            for tp in list(todo):
                if consumer.position(tp) >= ends[tp]:
                    todo.discard(tp)
    finally:
        consumer.close(autocommit=False)
