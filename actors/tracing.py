"""Trace context of a rollout across Kafka records: the OpenTelemetry *API* only, no SDK.

Every rollout is one trace. The scheduler starts it (span ``schedule``) and puts the W3C
``traceparent`` of that span into the task record's headers; every actor that handles a record of the
rollout opens its span as a child of the record's context (:func:`context_of`) and gives each record
it produces the traceparent of its own span (:func:`trace_headers`), so downstream spans nest under it.

Whether anything is recorded is decided by whoever configures the process (``ops/telemetry.py``). Until
then the API's no-op tracer hands out non-recording spans that carry the parent's context, so a
process with tracing off still forwards the traceparent it received and records nothing. Build span
attributes only when ``span.is_recording()``.

Tracers are looked up per use (:func:`tracer`), never cached at import time: a cached tracer would
keep pointing at whatever provider was installed when it was created.
"""

from __future__ import annotations

import re
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from streams.codec import HEADER_TRACEPARENT
from streams.protocols import EventRecord

TRACER_NAME = "rollout-engine"

_PROPAGATOR = TraceContextTextMapPropagator()


def tracer() -> trace.Tracer:
    """The tracer of the engine's spans (the process's current provider)."""
    return trace.get_tracer(TRACER_NAME)


def context_of(traceparent: str | None) -> Context:
    """The context whose current span is the remote parent named by ``traceparent``.

    An absent or malformed header gives an empty context: a span started in it is a new root.
    """
    if not traceparent:
        return Context()
    remote = _parse_traceparent(traceparent)
    if remote is None:  # another version or a malformed header: the propagator decides
        return _PROPAGATOR.extract({HEADER_TRACEPARENT: traceparent})
    return trace.set_span_in_context(trace.NonRecordingSpan(remote), Context())


def _parse_traceparent(value: str) -> trace.SpanContext | None:
    """A version-00 ``traceparent`` parsed with one anchored pattern (it is read on every record of a
    rollout; the propagator's pattern also handles other versions and surrounding whitespace), or None
    for anything else."""
    if _TRACEPARENT_00.fullmatch(value) is None:
        return None
    trace_id, span_id = int(value[3:35], 16), int(value[36:52], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(value[53:], 16)))


_TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def record_context(record: EventRecord) -> Context:
    """The parent context carried by a consumed record's ``traceparent`` header."""
    return context_of(record.traceparent)


def traceparent_of(span: trace.Span | None = None) -> str | None:
    """The W3C ``traceparent`` of ``span`` (default: the current span), or None when it has no valid context."""
    span = trace.get_current_span() if span is None else span
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"  # W3C trace context, version 00


def trace_headers(span: trace.Span | None = None) -> dict[str, str]:
    """Kafka headers that make ``span`` (default: the current span) the parent of a record's consumer.

    Empty when there is no valid span; ``StreamActor.emit`` then forwards the incoming record's header.
    """
    tp = traceparent_of(span)
    return {HEADER_TRACEPARENT: tp} if tp else {}


def span_context_of(traceparent: str | None) -> trace.SpanContext | None:
    """The remote span context named by ``traceparent`` (for span links), or None if absent or malformed."""
    ctx = trace.get_current_span(context_of(traceparent)).get_span_context()
    return ctx if ctx.is_valid else None


def record_attributes(record: EventRecord) -> dict[str, Any]:
    """Messaging attributes of a consumed record (OpenTelemetry semantic conventions)."""
    return {
        "messaging.system": "kafka",
        "messaging.destination.name": record.topic,
        "messaging.destination.partition.id": str(record.partition),
        "messaging.kafka.offset": record.offset,
        "messaging.message.id": record.message_id,
    }


__all__ = ["TRACER_NAME", "context_of", "record_attributes", "record_context", "span_context_of", "trace_headers",
           "traceparent_of", "tracer"]
