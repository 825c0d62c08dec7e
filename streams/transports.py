"""The production transports behind :mod:`streams.protocols`: Kafka as the event log, NATS as the control store.

``Runtime`` builds these unless it is handed other implementations (``streams/memory.py`` in tests).
The Kafka classes already have the protocol's shape; this module only binds a :class:`KafkaConfig` to
the factory functions, so the actor runtime never names Kafka or NATS itself.
"""

from __future__ import annotations

from typing import Any

import anyio

from engine.config import KafkaConfig, NatsConfig
from engine.schemas import Message
from streams.codec import DecodeError
from streams.kafka import Consumer, Producer, ensure_topics, read_range
from streams.nats import Nats
from streams.protocols import ControlStore, EventProducer


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
        if not isinstance(dead_letters, Producer):
            raise TypeError(f"a Kafka consumer dead-letters through a Kafka producer, got {type(dead_letters).__name__}")
        return Consumer(self.cfg, topics=topics, group=group, expect=expect, dead_letters=dead_letters,
                        dlq_topic=dlq_topic, client_id=client_id, **kw)

    async def read_since(self, topic: str, start_offsets: dict[int, int], *,
                         expect: tuple[str, ...]) -> list[tuple[int, int, Message]]:
        def read() -> list[tuple[int, int, Message]]:
            return [(p, o, env.message) for p, o, env in read_range(self.cfg, topic, start_offsets)
                    if not isinstance(env, DecodeError) and env.message.SCHEMA in expect]

        return await anyio.to_thread.run_sync(read)


def nats_store(cfg: NatsConfig) -> ControlStore:
    """The control store on NATS JetStream (``nats`` section of the config); not connected yet."""
    return Nats(cfg)


__all__ = ["KafkaEventLog", "nats_store"]
