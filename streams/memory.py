"""In-process implementations of the event log and the control store (:mod:`streams.protocols`).

Why: the actor runtime's contract (handle, emit, ack after the effects are acknowledged, commit only
acknowledged offsets, dead-letter poison and failing records) is logic above the transport. These let a
unit test run that logic over real records in the real wire format (``streams/codec.py``) without a
broker; the integration suite keeps testing Kafka and NATS themselves.

Simplifications, on purpose: one process, no replication; a consumer group has one member, which
owns every partition of its topics (no rebalancing); acknowledgements are immediate. Offsets and
committed positions behave as Kafka's (the committed offset is the next record to read), so a consumer
started again in the same group resumes after what was committed. Assigned consumers (no group) start
each partition where the caller says, as Kafka's manual assignment does.

The config's ``transport.type = "memory"`` makes a process use these (``streams/transports.py``): every role
of a one-process deployment then talks through them, with nothing to install.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import time
import zlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anyio

from engine.config import NatsConfig
from engine.schemas import DeadLetter, Message
from streams.codec import HEADER_MESSAGE_ID, DecodedRecord, DecodeError, decode, encode
from streams.offsets import OffsetTracker
from streams.protocols import EventProducer, TransportError

logger = logging.getLogger("rollout.streams.memory")



@dataclasses.dataclass(frozen=True, slots=True)
class StoredRecord:
    """One record as the log keeps it: raw bytes, as a broker would."""

    key: str | None
    value: bytes
    headers: dict[str, bytes]
    timestamp_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Acked:
    """Where an acknowledged record landed (the broker's metadata)."""

    topic: str
    partition: int
    offset: int


class MemoryEventLog:
    """Topics of partitions (lists of :class:`StoredRecord`) and each group's committed offsets."""

    def __init__(self, max_record_bytes: int = 8 * 1024 * 1024) -> None:
        self.max_record_bytes = max_record_bytes
        self.topics: dict[str, list[list[StoredRecord]]] = {}
        self.committed: dict[tuple[str, str, int], int] = {}
        self._appended = asyncio.Event()
        self._round_robin = itertools.count()

    async def ensure_topics(self, topics: dict[str, int]) -> None:
        for name, partitions in topics.items():
            if partitions < 1:
                raise TransportError(f"topic {name}: partitions must be >= 1, got {partitions}")
            have = self.topics.setdefault(name, [])
            have.extend([] for _ in range(partitions - len(have)))

    def producer(self, *, producer_id: str) -> "MemoryProducer":
        return MemoryProducer(self, producer_id=producer_id)

    def consumer(self, *, topics: list[str], group: str, expect: tuple[str, ...], dead_letters: EventProducer,
                 dlq_topic: str, client_id: str = "", **_ignored: Any) -> "MemoryConsumer":
        return MemoryConsumer(self, topics=topics, group=group, expect=expect, dead_letters=dead_letters,
                              dlq_topic=dlq_topic)

    def assigned_consumer(self, *, topics: list[str] | None = None, partitions: list[tuple[str, int]] | None = None,
                          start_offsets: dict[tuple[str, int], int] | None = None, from_end: bool = False,
                          expect: tuple[str, ...], dead_letters: EventProducer | None = None,
                          dlq_topic: str | None = None, client_id: str = "") -> "MemoryConsumer":
        if (topics is None) == (partitions is None):
            raise ValueError("give exactly one of topics (every partition of these topics) or partitions")
        if dead_letters is not None and dlq_topic is None:
            raise ValueError("dead_letters needs dlq_topic")
        return MemoryConsumer(self, topics=topics, partitions=partitions, group=None, expect=expect,
                              dead_letters=dead_letters, dlq_topic=dlq_topic, start_offsets=start_offsets,
                              from_end=from_end)

    def append(self, topic: str, record: StoredRecord, *, partition: int | None = None) -> Acked:
        """Append to a partition (the given one, else by key hash, else round robin); wakes consumers."""
        parts = self.topics.get(topic)
        if parts is None:
            raise TransportError(f"topic {topic} does not exist (ensure_topics first)")
        if partition is None:
            partition = (zlib.crc32(record.key.encode()) if record.key is not None else next(self._round_robin)) % len(parts)
        elif not 0 <= partition < len(parts):
            raise TransportError(f"topic {topic} has {len(parts)} partitions, no partition {partition}")
        parts[partition].append(record)
        self._appended.set()
        self._appended = asyncio.Event()
        return Acked(topic, partition, len(parts[partition]) - 1)

    async def wait_appended(self, timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            await self._appended.wait()

    async def read_since(self, topic: str, start_offsets: dict[int, int], *, expect: tuple[str, ...],
                         since_ms: int | None = None) -> list[tuple[int, int, Message]]:
        out = []
        for partition, records in enumerate(self.topics.get(topic, [])):
            start = max(0, start_offsets.get(partition, 0))
            if since_ms is not None:  # as Kafka's offsets_for_times: the first record at or after since_ms
                start = max(start, next((o for o, r in enumerate(records) if r.timestamp_ms >= since_ms), len(records)))
            for offset in range(start, len(records)):
                try:
                    env = decode(records[offset].value, max_bytes=self.max_record_bytes, expect=expect)
                except DecodeError:
                    continue
                out.append((partition, offset, env.message))
        return out

    def messages(self, topic: str) -> list[Message]:
        """Every decodable message of ``topic`` in partition order (for assertions)."""
        return [decode(r.value, max_bytes=self.max_record_bytes).message
                for part in self.topics.get(topic, []) for r in part]


class MemoryProducer:
    """Encodes like the Kafka producer; every send is acknowledged at once."""

    def __init__(self, log: MemoryEventLog, *, producer_id: str) -> None:
        self.log = log
        self.producer_id = producer_id
        self.sent = 0
        self._closed = False

    async def start(self) -> "MemoryProducer":
        return self

    def send_nowait(self, topic: str, message: Message, *, key: str | None = None,
                    headers: dict[str, str] | None = None, partition: int | None = None,
                    message_id: str | None = None) -> tuple[asyncio.Future[Acked], str]:
        if self._closed:
            raise TransportError("producer is closed")
        value, mid = encode(message, producer=self.producer_id, message_id=message_id)
        if len(value) > self.log.max_record_bytes:
            raise TransportError(f"{message.SCHEMA} record of {len(value)} bytes exceeds "
                                 f"max_record_bytes={self.log.max_record_bytes}")
        hdrs = {HEADER_MESSAGE_ID: mid.encode(), **{k: v.encode() for k, v in (headers or {}).items()}}
        acked = self.log.append(topic, StoredRecord(key, value, hdrs, int(time.time() * 1000)), partition=partition)
        fut: asyncio.Future[Acked] = asyncio.get_running_loop().create_future()
        fut.set_result(acked)
        self.sent += 1
        return fut, mid

    async def send(self, topic: str, message: Message, *, key: str | None = None,
                   headers: dict[str, str] | None = None, partition: int | None = None,
                   message_id: str | None = None) -> Acked:
        fut, _ = self.send_nowait(topic, message, key=key, headers=headers, partition=partition,
                                  message_id=message_id)
        return await fut

    async def wait_room(self) -> None:
        """Never full: acknowledgements are immediate."""

    async def flush(self, timeout_s: float = 120.0) -> None:
        """Nothing is ever queued."""

    async def close(self) -> None:
        self._closed = True


@dataclasses.dataclass(eq=False, slots=True)
class MemoryRecord(DecodedRecord):
    """A consumed record; the same surface as ``streams.kafka.Record``."""

    _consumer: "MemoryConsumer"
    _acked: bool = False

    @property
    def owned_since_ms(self) -> int:
        return self._consumer.owned_since_ms

    def ack(self) -> None:
        if not self._acked:
            self._acked = True
            self._consumer._tracker.finish((self.topic, self.partition), self.offset)

    async def dead_letter(self, reason: str, error: str) -> None:
        value, _ = encode(self.message, producer=self.envelope.producer or "unknown", message_id=self.message_id,
                          created_at=self.envelope.created_at, validate=False)
        await self._consumer._dead_letter(self.topic, self.partition, self.offset, self.key, value, reason, error)
        self.ack()


class MemoryConsumer:
    """The only member of ``group`` (reads every partition of ``topics`` from the group's committed offset), or,
    with no group, a consumer of ``topics``' partitions or of exactly ``partitions`` from ``start_offsets``."""

    def __init__(self, log: MemoryEventLog, *, topics: list[str] | None = None,
                 partitions: list[tuple[str, int]] | None = None, group: str | None, expect: tuple[str, ...],
                 dead_letters: EventProducer | None, dlq_topic: str | None,
                 start_offsets: dict[tuple[str, int], int] | None = None, from_end: bool = False) -> None:
        if group is not None and (partitions is not None or start_offsets is not None or topics is None):
            raise ValueError("a group member subscribes to topics; partitions and start_offsets need no group")
        self.log = log
        self.topics = topics
        self.partitions = partitions
        self.group = group
        self.expect = expect
        self.start_offsets = dict(start_offsets or {})
        self.from_end = from_end
        self._dlq = dead_letters
        self._dlq_topic = dlq_topic
        self._tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
        self._positions: dict[tuple[str, int], int] = {}
        self.assigned: set[tuple[str, int]] = set()
        self.owned_since_ms = 0
        self._started = False
        self.delivered = 0
        self.dead_lettered = 0
        self.commits = 0

    async def start(self) -> "MemoryConsumer":
        for topic in self.topics or sorted({t for t, _ in self.partitions or []}):
            if topic not in self.log.topics:
                raise TransportError(f"topic {topic} does not exist (not created?)")
        keys = self.partitions if self.partitions is not None else [
            (t, p) for t in self.topics or [] for p in range(len(self.log.topics[t]))]
        for topic, p in keys:
            if not 0 <= p < len(self.log.topics[topic]):
                raise TransportError(f"topic {topic} has {len(self.log.topics[topic])} partitions, no partition {p}")
            self._positions[(topic, p)] = self._start_at(topic, p)
        self.assigned = set(self._positions)
        self.owned_since_ms = time.time_ns() // 1_000_000  # the only member: it owns every partition from its start
        self._started = True
        return self

    def _start_at(self, topic: str, p: int) -> int:
        if self.group is not None:
            return self.log.committed.get((self.group, topic, p), 0)
        if (topic, p) in self.start_offsets:
            return max(0, self.start_offsets[(topic, p)])
        return len(self.log.topics[topic][p]) if self.from_end else 0

    async def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``partition`` of ``topic`` from ``offset`` on; its records not acknowledged are forgotten."""
        key = (topic, partition)
        if not self._started:
            raise TransportError("consumer is closed or not started")
        if self.group is not None or key not in self._positions:
            raise TransportError(f"cannot seek {topic}[{partition}]: not a partition of this consumer's "
                                 f"manual assignment {sorted(self.assigned)}")
        if offset < 0:
            raise TransportError(f"cannot seek {topic}[{partition}] to offset {offset}: offsets are >= 0")
        self._tracker.revoke([key])
        self._positions[key] = offset

    async def getmany(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[MemoryRecord]:
        """Decoded records from the positions on; poison ones are dead-lettered here, never returned."""
        if not self._started:
            raise TransportError("consumer is closed or not started")
        if not self._has_unread():
            await self.log.wait_appended(timeout_s)
        limit = max_records or 500
        out: list[MemoryRecord] = []
        for (topic, p), pos in list(self._positions.items()):
            part = self.log.topics[topic][p]
            while pos < len(part) and len(out) < limit:
                stored, offset = part[pos], pos
                pos += 1
                self._tracker.start((topic, p), offset)
                try:
                    env = decode(stored.value, max_bytes=self.log.max_record_bytes, expect=self.expect)
                except DecodeError as exc:
                    await self._dead_letter(topic, p, offset, stored.key, stored.value, exc.reason, exc.detail)
                    self._tracker.finish((topic, p), offset)
                    continue
                out.append(MemoryRecord(env, topic, p, offset, stored.key, dict(stored.headers),
                                        stored.timestamp_ms, self))
            self._positions[(topic, p)] = pos
        self.delivered += len(out)
        return out

    def _has_unread(self) -> bool:
        return any(pos < len(self.log.topics[t][p]) for (t, p), pos in self._positions.items())

    async def commit(self) -> dict[tuple[str, int], int]:
        """Commit the offsets of acknowledged records (never past an unacknowledged one); without a group, nothing."""
        if self.group is None:
            return {}
        offsets = self._tracker.committable()
        for (topic, p), offset in offsets.items():
            self.log.committed[(self.group, topic, p)] = offset
        self._tracker.mark_committed(offsets)
        if offsets:
            self.commits += 1
        return offsets

    async def _dead_letter(self, topic: str, partition: int, offset: int, key: str | None, value: bytes,
                           reason: str, error: str) -> None:
        if self._dlq is None or self._dlq_topic is None:
            logger.error("dropping poison record %s[%d]@%d (%s: %s): no dead-letter producer configured",
                         topic, partition, offset, reason, error)
            return
        keep = max(0, self.log.max_record_bytes - 64 * 1024)
        letter = DeadLetter(topic=topic, partition=partition, offset=offset, reason=reason, error=error[:4000],
                            value=bytes(value[:keep]), consumer_group=self.group or "")
        await self._dlq.send(self._dlq_topic, letter, key=key)
        self.dead_lettered += 1

    async def close(self) -> None:
        if self._started:
            await self.commit()
            self._started = False

    def statistics(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "dead_lettered": self.dead_lettered, "commits": self.commits,
                "in_flight": self._tracker.in_flight(), "assigned": len(self._positions), "paused": False}


class MemoryStore:
    """Key-value buckets with watches and an object store, in process (the NATS control store's surface)."""

    def __init__(self, cfg: NatsConfig | None = None) -> None:
        self.cfg = cfg or NatsConfig()
        self.kv: dict[str, dict[str, tuple[int, bytes]]] = {}
        self.objects: dict[str, dict[str, bytes]] = {}
        self._changed = asyncio.Event()

    async def connect(self) -> "MemoryStore":
        return self

    async def close(self) -> None:
        """Nothing to release."""

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int:
        entries = self.kv.setdefault(bucket, {})
        revision = max((rev for rev, _ in entries.values()), default=0) + 1
        entries[key] = (revision, bytes(value))
        self._changed.set()
        self._changed = asyncio.Event()
        return revision

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        entry = self.kv.get(bucket, {}).get(key)
        return None if entry is None else entry[1]

    async def kv_watch(self, bucket: str, key: str) -> AsyncGenerator[bytes, None]:
        """The current value (if any), then every later put of ``key``."""
        seen = 0
        while True:
            changed = self._changed
            entry = self.kv.get(bucket, {}).get(key)
            if entry is not None and entry[0] > seen:
                seen = entry[0]
                yield entry[1]
                continue
            await changed.wait()

    async def put_bytes(self, bucket: str, name: str, data: bytes) -> dict[str, Any]:
        self.objects.setdefault(bucket, {})[name] = bytes(data)
        return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    async def put_file(self, bucket: str, name: str, path: str | Path, timeout_s: float | None = None) -> dict[str, Any]:
        return await self.put_bytes(bucket, name, Path(path).read_bytes())

    async def get_file(self, bucket: str, name: str, path: str | Path, *, sha256: str | None = None,
                       timeout_s: float | None = None) -> int:
        data = self.objects.get(bucket, {}).get(name)
        if data is None:
            raise TransportError(f"object {name} not found in bucket {bucket}")
        got = hashlib.sha256(data).hexdigest()
        if sha256 is not None and got != sha256:
            raise TransportError(f"object {name}: sha256 {got} does not match the manifest's {sha256}")
        Path(path).write_bytes(data)
        return len(data)

    async def delete_object(self, bucket: str, name: str) -> None:
        self.objects.get(bucket, {}).pop(name, None)


__all__ = ["Acked", "MemoryConsumer", "MemoryEventLog", "MemoryProducer", "MemoryRecord", "MemoryStore",
           "StoredRecord"]
