"""The two transports the actors depend on, as structural protocols.

Actors talk to two kinds of infrastructure, and only through these shapes:

- an **event log** (:class:`EventLog`): named, partitioned topics; a producer whose sends are acknowledged
  asynchronously (:class:`EventProducer`); group consumers that hand out decoded records
  (:class:`EventRecord`), commit only what was acknowledged and send poison records to the dead-letter
  topic (:class:`EventConsumer`); and consumers of a fixed set of partitions with no group, each partition
  read from a start offset the caller chose (:class:`AssignedConsumer`: the learner resumes from its
  checkpoint's offsets, the exporter from its position file, the inference actor reads its reply
  partition from the end). Kafka implements it in production (``streams/kafka.py`` through
  :class:`streams.transports.KafkaEventLog`).
- a **control store** (:class:`ControlStore`): a key-value bucket with watches (learner version,
  scheduler and reward statistics, the weights manifest) and an object store for weight files
  (``streams/weights.py`` publishes and fetches versions through it). NATS JetStream implements it
  (``streams/nats.py``).

``streams/memory.py`` implements both in one process, so the actor logic (consume, handle, emit, commit,
dead-letter), and the whole pipeline, can be exercised without a broker. Which implementation a process
uses is the config's ``transport.type`` (``streams/transports.py`` holds the registry). Protocols are ``runtime_checkable`` so a test can check
that each implementation has the whole surface (``isinstance`` checks names, not signatures).

Failures of either transport are :class:`TransportError`: an actor treats them as "the infrastructure
failed" (crash, restart, re-delivery), never as "this record is bad" (dead letter). A transport raises
its own subclass (Kafka's ``StreamError``, ``NatsError``) or this class itself; roles name only this one,
and so do other failures of infrastructure a role depends on (a sandbox pool that cannot start).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine.config import NatsConfig
from engine.schemas import Message


class TransportError(RuntimeError):
    """An event-log or control-store operation failed; the message says which."""


@runtime_checkable
class EventRecord(Protocol):
    """A consumed, decoded record. ``ack()`` once its effects are durable; its offset may then be committed."""

    topic: str
    partition: int
    offset: int
    key: str | None
    headers: dict[str, bytes]
    timestamp_ms: int

    @property
    def message(self) -> Message: ...

    @property
    def message_id(self) -> str: ...

    @property
    def traceparent(self) -> str | None: ...

    @property
    def owned_since_ms(self) -> int:
        """When this consumer got the record's partition (ms since the epoch; 0 if unknown): a record
        timestamped earlier may have been handed to the partition's previous owner first."""
        ...

    def ack(self) -> None: ...

    async def dead_letter(self, reason: str, error: str) -> None: ...


@runtime_checkable
class EventProducer(Protocol):
    """Sends encoded messages; ``send_nowait`` returns (future of the broker's acknowledgement, message id)."""

    producer_id: str

    async def start(self) -> Any: ...

    def send_nowait(self, topic: str, message: Message, *, key: str | None = None,
                    headers: dict[str, str] | None = None, partition: int | None = None,
                    message_id: str | None = None) -> tuple[asyncio.Future[Any], str]: ...

    async def send(self, topic: str, message: Message, *, key: str | None = None,
                   headers: dict[str, str] | None = None, partition: int | None = None,
                   message_id: str | None = None) -> Any: ...

    async def wait_room(self) -> None: ...

    async def flush(self, timeout_s: float = 120.0) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class EventConsumer(Protocol):
    """A consumer-group member: decoded records out, poison records to the dead-letter topic, commit-after-ack."""

    async def start(self) -> Any: ...

    async def getmany(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Any]: ...

    async def commit(self) -> dict[tuple[str, int], int]: ...

    async def close(self) -> None: ...

    def statistics(self) -> dict[str, Any]: ...


@runtime_checkable
class AssignedConsumer(EventConsumer, Protocol):
    """A consumer of a fixed set of partitions, outside any consumer group.

    Each partition starts at the offset the caller gave (``start_offsets``), else at the end of the log
    (``from_end``), else at its beginning; ``seek`` moves one partition later. ``commit`` commits nothing
    (there is no group to commit to): whoever needs to resume keeps the offsets itself (the learner in its
    checkpoint, the exporter in its position file). Records are still acknowledged, poison ones still
    dead-lettered when a dead-letter producer is given (else logged and skipped).
    """

    assigned: set[tuple[str, int]]
    """The ``(topic, partition)`` pairs read (known once ``start`` returned)."""

    async def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``partition`` of ``topic`` from ``offset`` on (the next ``getmany``); records of it handed out
        earlier and not acknowledged are forgotten. TransportError for a partition not assigned."""
        ...


@runtime_checkable
class EventLog(Protocol):
    """Makes topics, producers and consumers of one event log (one broker or cluster)."""

    async def ensure_topics(self, topics: dict[str, int]) -> None: ...

    def producer(self, *, producer_id: str) -> EventProducer: ...

    def consumer(self, *, topics: list[str], group: str, expect: tuple[str, ...], dead_letters: EventProducer,
                 dlq_topic: str, client_id: str, **kw: Any) -> EventConsumer: ...

    def assigned_consumer(self, *, topics: list[str] | None = None, partitions: list[tuple[str, int]] | None = None,
                          start_offsets: dict[tuple[str, int], int] | None = None, from_end: bool = False,
                          expect: tuple[str, ...], dead_letters: EventProducer | None = None,
                          dlq_topic: str | None = None, client_id: str = "rollout") -> AssignedConsumer:
        """A consumer of every partition of ``topics`` (as the log has them when it starts) or of exactly
        ``partitions``: give one of the two. See :class:`AssignedConsumer` for where each partition starts."""
        ...

    async def read_since(self, topic: str, start_offsets: dict[int, int], *, expect: tuple[str, ...],
                         since_ms: int | None = None) -> list[tuple[int, int, Message]]:
        """``(partition, offset, message)`` of every record of ``topic`` from ``start_offsets`` (partition ->
        offset, 0 where absent) to the end at call time; records that do not decode as ``expect`` are skipped.
        With ``since_ms``, each partition starts no earlier than its first record timestamped at or after it
        (milliseconds since the epoch; the log's index, not a scan). No consumer group: reading commits nothing."""
        ...


@runtime_checkable
class ControlStore(Protocol):
    """Control keys (put/get/watch) and the object store weight versions are published to."""

    cfg: NatsConfig

    async def connect(self) -> Any: ...

    async def close(self) -> None: ...

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int: ...

    async def kv_get(self, bucket: str, key: str) -> bytes | None: ...

    # a generator, not just an iterator: callers close it (``aclose``) to stop the watch deterministically
    def kv_watch(self, bucket: str, key: str) -> AsyncGenerator[bytes, None]: ...

    async def put_file(self, bucket: str, name: str, path: str | Path,
                       timeout_s: float | None = None) -> dict[str, Any]: ...

    async def put_bytes(self, bucket: str, name: str, data: bytes) -> dict[str, Any]: ...

    async def get_file(self, bucket: str, name: str, path: str | Path, *, sha256: str | None = None,
                       timeout_s: float | None = None) -> int: ...

    async def delete_object(self, bucket: str, name: str) -> None: ...


__all__ = ["AssignedConsumer", "ControlStore", "EventConsumer", "EventLog", "EventProducer", "EventRecord", "TransportError"]
