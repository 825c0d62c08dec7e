"""Transports by name: the config's ``transport.type`` picks which event log and control store a process uses.

A :class:`Transport` makes both halves of :mod:`streams.protocols` from an :class:`EngineConfig`. Two are
built in, registered at the bottom of this module:

- ``kafka`` (the default): Kafka as the event log (``kafka`` section; :class:`KafkaEventLog` binds the
  config to ``streams/kafka.py``'s producer and consumers) and NATS JetStream as the control store
  (``nats`` section, ``streams/nats.py``);
- ``memory``: both in this process (``streams/memory.py``): a deployment whose roles all run in one
  process (one ``Runtime``), with no broker; what it logs is gone when the process ends.

Other transports register with :func:`register_transport` (or, from an installed package, the
``rollout_engine.transports`` entry-point group); docs/extending.md, "Writing a transport", says what to
implement and which conformance tests to run. ``Runtime`` asks :func:`transport_named` for the config's
type, so the roles never name Kafka or NATS themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from engine.config import ConfigError, EngineConfig, KafkaConfig, NatsConfig
from engine.registry import Registry, UnknownName
from engine.schemas import Message
from streams.codec import DecodeError
from streams.kafka import Consumer, Producer, ensure_topics, read_range
from streams.memory import MemoryEventLog, MemoryStore
from streams.nats import Nats
from streams.protocols import ControlStore, EventLog, EventProducer


class KafkaEventLog:
    """The event log on a Kafka cluster (``kafka`` section of the config)."""

    def __init__(self, cfg: KafkaConfig) -> None:
        self.cfg = cfg

    async def ensure_topics(self, topics: dict[str, int]) -> None:
        await ensure_topics(self.cfg, topics)

    def producer(self, *, producer_id: str) -> Producer:
        return Producer(self.cfg, producer_id=producer_id)

    def consumer(self, *, topics: list[str], group: str, expect: tuple[str, ...], dead_letters: EventProducer,
                 dlq_topic: str, client_id: str, **kw: Any) -> Consumer:
        return Consumer(self.cfg, topics=topics, group=group, expect=expect, dead_letters=_kafka_producer(dead_letters),
                        dlq_topic=dlq_topic, client_id=client_id, **kw)

    def assigned_consumer(self, *, topics: list[str] | None = None, partitions: list[tuple[str, int]] | None = None,
                          start_offsets: dict[tuple[str, int], int] | None = None, from_end: bool = False,
                          expect: tuple[str, ...], dead_letters: EventProducer | None = None,
                          dlq_topic: str | None = None, client_id: str = "rollout") -> Consumer:
        if (topics is None) == (partitions is None):
            raise ValueError("give exactly one of topics (every partition of these topics) or partitions")
        return Consumer(self.cfg, assign=partitions, assign_topics=topics, start_offsets=start_offsets,
                        from_end=from_end, expect=expect,
                        dead_letters=None if dead_letters is None else _kafka_producer(dead_letters),
                        dlq_topic=dlq_topic, client_id=client_id)

    async def read_since(self, topic: str, start_offsets: dict[int, int], *, expect: tuple[str, ...],
                         since_ms: int | None = None) -> list[tuple[int, int, Message]]:
        def read() -> list[tuple[int, int, Message]]:
            return [(p, o, env.message) for p, o, env in read_range(self.cfg, topic, start_offsets, since_ms=since_ms)
                    if not isinstance(env, DecodeError) and env.message.SCHEMA in expect]

        return await anyio.to_thread.run_sync(read)


def _kafka_producer(dead_letters: EventProducer) -> Producer:
    if not isinstance(dead_letters, Producer):
        raise TypeError(f"a Kafka consumer dead-letters through a Kafka producer, got {type(dead_letters).__name__}")
    return dead_letters


def nats_store(cfg: NatsConfig) -> ControlStore:
    """The control store on NATS JetStream (``nats`` section of the config); not connected yet."""
    return Nats(cfg)


@dataclass(frozen=True)
class Transport:
    """How a process gets its event log and its control store (neither connected yet)."""

    name: str
    event_log: Callable[[EngineConfig], EventLog]
    control_store: Callable[[EngineConfig], ControlStore]
    description: str = ""


def _adopt(registry: Registry[Transport], obj: object, origin: str) -> None:
    if not isinstance(obj, Transport):
        raise TypeError(f"expected a Transport (or a module that registers one), got {type(obj).__name__}")
    registry.register(obj.name, obj, origin=origin, replace=registry.origin(obj.name) == origin)


TRANSPORTS: Registry[Transport] = Registry("transport", entry_point_group="rollout_engine.transports", adopt=_adopt)


def register_transport(transport: Transport, *, replace: bool = False) -> Transport:
    """Make ``transport.name`` a value of ``transport.type``; ValueError if the name is taken (unless ``replace``)."""
    return TRANSPORTS.register(transport.name, transport, replace=replace)


def transport_named(name: str) -> Transport:
    """The transport registered as ``name``; ConfigError naming ``transport.type`` and the known ones otherwise."""
    try:
        return TRANSPORTS[name]
    except UnknownName as exc:
        raise ConfigError(f"transport.type: {exc}") from None


register_transport(Transport("kafka", lambda cfg: KafkaEventLog(cfg.kafka), lambda cfg: nats_store(cfg.nats),
                             "Kafka (section kafka) as the event log, NATS JetStream (section nats) as the control store"))
register_transport(Transport("memory", lambda cfg: MemoryEventLog(max_record_bytes=cfg.kafka.max_record_bytes),
                             lambda cfg: MemoryStore(cfg.nats),
                             "both in this process (streams/memory.py): one-process deployments and tests"))

__all__ = ["KafkaEventLog", "TRANSPORTS", "Transport", "nats_store", "register_transport", "transport_named"]
