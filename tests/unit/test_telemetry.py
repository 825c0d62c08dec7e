"""Trace context through Kafka-style headers, and the process's tracing setup (no exporter when off)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ops.telemetry as telemetry
from actors import tracing
from engine.config import TelemetryConfig
from engine.schemas import Task
from streams.codec import Envelope
from streams.kafka import HEADER_TRACEPARENT, Record

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def kafka_record(headers: dict[str, str]) -> Record:
    """A consumed record whose headers went through the producer's encoding (str -> bytes)."""
    raw = [(k, v.encode()) for k, v in headers.items()]  # what Producer.send_nowait hands to Kafka
    envelope = Envelope(message=Task(task_id="t1", domain="arith", prompt="1+1=", spec={}), id="m1",
                        created_at=0.0, producer="test")
    return Record(envelope=envelope, topic="ns.rollout.tasks", partition=0, offset=7, key="t1",
                  headers=dict(raw), timestamp_ms=0, _consumer=None)  # type: ignore[arg-type]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test (the SDK's recorder), exporting to memory; removed afterwards."""
    exporter = InMemorySpanExporter()
    shutdown = telemetry.setup_tracing(TelemetryConfig(tracing=True), "test", exporter=exporter)
    try:
        yield exporter
    finally:
        shutdown()


def finished(exporter: InMemorySpanExporter) -> dict[str, Any]:
    assert telemetry.force_flush(5000)
    return {s.name: s for s in exporter.get_finished_spans()}


# -- propagation -----------------------------------------------------------------------------------

def test_traceparent_crosses_kafka_headers_and_parents_the_consumer_span(spans: InMemorySpanExporter) -> None:
    with tracing.tracer().start_as_current_span("schedule") as root:
        headers = tracing.trace_headers()
    assert set(headers) == {HEADER_TRACEPARENT}
    assert TRACEPARENT.match(headers[HEADER_TRACEPARENT])

    record = kafka_record(headers)
    assert record.traceparent == headers[HEADER_TRACEPARENT]
    with tracing.tracer().start_as_current_span("generate", context=tracing.record_context(record)) as child:
        downstream = tracing.trace_headers(child)

    got = finished(spans)
    root_ctx, child_ctx = root.get_span_context(), got["generate"].context
    assert child_ctx.trace_id == root_ctx.trace_id
    assert got["generate"].parent.span_id == root_ctx.span_id
    assert got["generate"].parent.is_remote
    assert got["schedule"].parent is None
    # the consumer's own headers name its span, so the next hop nests under it
    assert downstream[HEADER_TRACEPARENT].startswith(f"00-{root_ctx.trace_id:032x}-{child_ctx.span_id:016x}-")


@pytest.mark.parametrize("header", [None, "", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_missing_or_malformed_traceparent_starts_a_new_root(spans: InMemorySpanExporter, header: str | None) -> None:
    assert tracing.span_context_of(header) is None
    with tracing.tracer().start_as_current_span("verify", context=tracing.context_of(header)):
        pass
    assert finished(spans)["verify"].parent is None


_VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("header", [
    _VALID, _VALID[:-2] + "00", _VALID.upper(), _VALID.replace("-", "_"), _VALID + "-extra", " " + _VALID,
    "01" + _VALID[2:], "ff" + _VALID[2:], _VALID[:3] + "0" * 32 + _VALID[35:], _VALID[:36] + "0" * 16 + _VALID[52:],
    _VALID[:3] + "4bf92f3577b34da6a3ce929d0e0e473_" + _VALID[35:], _VALID[:53] + "+1", _VALID[:53] + "zz",
])
def test_the_fast_traceparent_path_reads_what_the_w3c_propagator_reads(header: str) -> None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    expected = trace.get_current_span(TraceContextTextMapPropagator().extract({HEADER_TRACEPARENT: header}))
    got = trace.get_current_span(tracing.context_of(header))
    assert got.get_span_context() == expected.get_span_context()


def test_traceparent_of_is_what_the_w3c_propagator_writes(spans: InMemorySpanExporter) -> None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with tracing.tracer().start_as_current_span("schedule") as span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        assert tracing.traceparent_of(span) == carrier[HEADER_TRACEPARENT]
        assert TRACEPARENT.match(carrier[HEADER_TRACEPARENT])


def test_span_context_of_gives_a_linkable_remote_context(spans: InMemorySpanExporter) -> None:
    with tracing.tracer().start_as_current_span("reward") as span:
        tp = tracing.traceparent_of()
    ctx = tracing.span_context_of(tp)
    assert ctx is not None and ctx.is_remote
    assert (ctx.trace_id, ctx.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
    with tracing.tracer().start_as_current_span("learner.step", links=[trace.Link(ctx)]):
        pass
    (link,) = finished(spans)["learner.step"].links
    assert link.context.span_id == ctx.span_id


def test_record_attributes_name_the_record() -> None:
    attrs = tracing.record_attributes(kafka_record({}))
    assert attrs["messaging.system"] == "kafka"
    assert attrs["messaging.destination.name"] == "ns.rollout.tasks"
    assert attrs["messaging.kafka.offset"] == 7
    assert attrs["messaging.message.id"] == "m1"


def test_with_tracing_off_the_incoming_context_is_forwarded_unchanged() -> None:
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.trace_headers() == {}  # no span at all: nothing to propagate
    with tracing.tracer().start_as_current_span("sandbox.step", context=tracing.context_of(incoming)) as span:
        assert not span.is_recording()
        assert tracing.trace_headers() == {HEADER_TRACEPARENT: incoming}


# -- setup -----------------------------------------------------------------------------------------

def test_tracing_off_creates_no_exporter_and_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []
    monkeypatch.setattr(telemetry, "otlp_exporter", lambda cfg: created.append("exporter"))
    monkeypatch.setattr(telemetry, "BatchSpanProcessor", lambda exp: created.append("processor"))
    shutdown = telemetry.setup_tracing(TelemetryConfig(tracing=False), "rollout")
    with tracing.tracer().start_as_current_span("schedule") as span:
        assert not span.is_recording()
    shutdown()
    assert created == []


def test_otel_sdk_disabled_wins_over_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setattr(telemetry, "otlp_exporter", lambda cfg: pytest.fail("exporter created"))
    telemetry.setup_tracing(TelemetryConfig(tracing=True), "rollout")()
    assert not tracing.tracer().start_span("x").is_recording()


def test_shutdown_flushes_and_a_later_setup_takes_over() -> None:
    recorder = "sdk"
    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    shutdown = telemetry.setup_tracing(TelemetryConfig(tracing=True, tracer=recorder), "one", exporter=first)
    tracing.tracer().start_span("a").end()
    shutdown()
    shutdown()  # idempotent
    assert [s.name for s in first.get_finished_spans()] == ["a"]
    assert not tracing.tracer().start_span("dropped").is_recording()

    shutdown = telemetry.setup_tracing(TelemetryConfig(tracing=True, tracer=recorder), "two", exporter=second,
                                       resource_attributes={"service.namespace": "ns"})
    try:
        tracing.tracer().start_span("b").end()
    finally:
        shutdown()
    (span,) = second.get_finished_spans()
    assert span.resource.attributes["service.name"] == "two"
    assert span.resource.attributes["service.namespace"] == "ns"


def test_otel_service_name_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    exporter = InMemorySpanExporter()
    shutdown = telemetry.setup_tracing(TelemetryConfig(tracing=True), "rollout", exporter=exporter)
    tracing.tracer().start_span("a").end()
    shutdown()
    assert exporter.get_finished_spans()[0].resource.attributes["service.name"] == "from-env"


@pytest.mark.parametrize(("given", "expected"), [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
    ("https://otel.example:443/custom/path", "https://otel.example:443/custom/path"),
])
def test_otlp_endpoint_from_config(given: str, expected: str) -> None:
    assert telemetry.traces_endpoint(given) == expected
    exporter = telemetry.otlp_exporter(TelemetryConfig(tracing=True, otlp_endpoint=given))
    try:
        assert exporter._endpoint == expected
    finally:
        exporter.shutdown()


def test_otlp_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    exporter = telemetry.otlp_exporter(TelemetryConfig(tracing=True))
    try:
        assert exporter._endpoint == "http://collector:4318/v1/traces"
    finally:
        exporter.shutdown()


def test_a_bad_endpoint_is_named() -> None:
    with pytest.raises(ValueError, match="otlp_endpoint"):
        telemetry.traces_endpoint("localhost:4318")


def test_the_removed_lean_recorder_means_sdk_with_a_deprecation_warning() -> None:
    with pytest.warns(FutureWarning, match='telemetry.tracer = "lean" is deprecated'):
        cfg = TelemetryConfig(tracing=True, tracer="lean")
    assert cfg.tracer == "sdk"
    exporter = InMemorySpanExporter()
    shutdown = telemetry.setup_tracing(cfg, "old-config", exporter=exporter)
    try:
        tracing.tracer().start_span("kept").end()
    finally:
        shutdown()
    from opentelemetry.sdk.trace import ReadableSpan
    (span,) = exporter.get_finished_spans()
    assert isinstance(span, ReadableSpan) and span.name == "kept"


def test_an_unknown_recorder_is_refused_by_name() -> None:
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="tracer"):
        TelemetryConfig(tracer="fast")
