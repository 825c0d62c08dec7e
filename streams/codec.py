"""MessagePack codec with the envelope every record carries.

Wire format of one record value (a MessagePack map, documented in docs/wire-schemas.md)::

    {"schema": "task", "version": 1, "id": "<32 hex>", "created_at": 1733130000.123,
     "producer": "inference/host-1/4711", "body": {...}}

Arrays inside ``body`` are MessagePack ``bin`` values holding little-endian int32 / float32 / uint8.
Decoding never raises anything but ``DecodeError``, whose ``reason`` is one of ``REASONS``; consumers
route such records to the dead-letter topic.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import msgpack

from engine.schemas import SCHEMAS, Message, SchemaError

REASONS = ("oversized", "undecodable", "not_an_envelope", "unknown_schema", "unsupported_version", "invalid")
DEFAULT_MAX_BYTES = 8 * 1024 * 1024


class DecodeError(ValueError):
    """A record that cannot become a message; ``reason`` is a stable code from ``REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded record: the message and its envelope fields."""

    message: Message
    id: str
    created_at: float
    producer: str


HEADER_MESSAGE_ID = "message_id"
HEADER_TRACEPARENT = "traceparent"
"""The record headers every transport writes: the envelope's id, and the W3C trace context when traced."""


@dataclasses.dataclass(eq=False, slots=True)
class DecodedRecord:
    """What every transport's consumed record holds: where it came from and its decoded envelope.

    Each transport subclasses it with its own ``ack()`` and ``dead_letter()`` (``streams.protocols.EventRecord``).
    """

    envelope: Envelope
    topic: str
    partition: int
    offset: int
    key: str | None
    headers: dict[str, bytes]
    timestamp_ms: int

    @property
    def message(self) -> Message:
        return self.envelope.message

    @property
    def message_id(self) -> str:
        return self.envelope.id

    @property
    def traceparent(self) -> str | None:
        raw = self.headers.get(HEADER_TRACEPARENT)
        return raw.decode("ascii", "replace") if raw else None


def new_message_id() -> str:
    return uuid.uuid4().hex


def encode(message: Message, *, producer: str, message_id: str | None = None,
           created_at: float | None = None, validate: bool = True) -> tuple[bytes, str]:
    """Encode ``message`` in an envelope; returns ``(value_bytes, message_id)``."""
    if validate:
        message.validate()
    mid = message_id or new_message_id()
    env = {
        "schema": message.SCHEMA,
        "version": message.VERSION,
        "id": mid,
        "created_at": time.time() if created_at is None else created_at,
        "producer": producer,
        "body": message.to_body(),
    }
    return msgpack.packb(env, use_bin_type=True), mid


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, expect: tuple[str, ...] | None = None) -> Envelope:
    """Decode and validate one record value; raises ``DecodeError`` only."""
    if data is None:
        raise DecodeError("undecodable", "record has no value (tombstone)")
    if len(data) > max_bytes:
        raise DecodeError("oversized", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        env = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DecodeError("undecodable", f"not MessagePack: {exc}") from None
    if not isinstance(env, dict) or not {"schema", "version", "id", "body"} <= env.keys():
        raise DecodeError("not_an_envelope", "expected a map with schema, version, id and body")
    schema, version, mid = env["schema"], env["version"], env["id"]
    if not isinstance(mid, str) or not mid or len(mid) > 128:
        raise DecodeError("not_an_envelope", f"bad message id {mid!r:.80}")
    cls = SCHEMAS.get(schema) if isinstance(schema, str) else None
    if cls is None:
        raise DecodeError("unknown_schema", f"schema {schema!r:.80} is not one of {sorted(SCHEMAS)}")
    if expect is not None and schema not in expect:
        raise DecodeError("unknown_schema", f"schema {schema!r} not expected on this topic (expects {expect})")
    if version != cls.VERSION:
        raise DecodeError("unsupported_version", f"{schema} version {version!r:.40}, this build reads {cls.VERSION}")
    try:
        message = cls.from_body(env["body"])
    except SchemaError as exc:
        raise DecodeError("invalid", str(exc)) from None
    except (TypeError, ValueError) as exc:  # e.g. a dataclass rejecting a field it cannot hold
        raise DecodeError("invalid", f"{schema}: {exc}") from None
    created = env.get("created_at", 0.0)
    producer = env.get("producer", "")
    return Envelope(
        message=message,
        id=mid,
        created_at=float(created) if isinstance(created, (int, float)) else 0.0,
        producer=producer if isinstance(producer, str) else "",
    )
