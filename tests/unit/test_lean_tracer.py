"""ops/lean_tracer.py records what the OpenTelemetry SDK's tracer records.

Each scenario runs once against the SDK's ``TracerProvider`` and once against ``LeanTracerProvider``,
both exporting to memory; the exported spans must match field by field (ids mapped to their order of
appearance, clocks left out where the scenario does not set them) and must encode to OTLP alike.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from ops.lean_tracer import LeanSpan, LeanTracerProvider

REMOTE = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True,
                     trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("vendor", "v1")]))
OTHER = SpanContext(0x1111, 0x2222, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))

Scenario = Callable[[trace.Tracer], None]


def run(kind: str, scenario: Scenario, *, limits: SpanLimits | None = None,
        sampler: sampling.Sampler | None = None) -> list[ReadableSpan]:
    resource = Resource.create({"service.name": "test"})
    if kind == "sdk":
        provider: Any = TracerProvider(resource=resource, span_limits=limits, sampler=sampler)
    else:
        provider = LeanTracerProvider(resource, span_limits=limits, sampler=sampler)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    scenario(provider.get_tracer("rollout-engine", "1.0"))
    provider.shutdown()
    return list(exporter.get_finished_spans())


def normalized(spans: list[ReadableSpan], *, clocks: bool) -> list[dict[str, Any]]:
    """The spans as JSON (``ReadableSpan.to_json``), new ids replaced by their order of appearance."""
    ids: dict[str, str] = {f"0x{REMOTE.span_id:016x}": "remote", f"0x{OTHER.span_id:016x}": "other",
                           f"0x{REMOTE.trace_id:032x}": "remote-trace", f"0x{OTHER.trace_id:032x}": "other-trace"}

    def name_id(value: Any) -> Any:
        if isinstance(value, str) and value.startswith("0x"):
            return ids.setdefault(value, f"id{len(ids)}")
        return value

    out = []
    for span in spans:
        doc = json.loads(span.to_json())
        doc["context"] = {k: name_id(v) for k, v in doc["context"].items()}
        doc["parent_id"] = name_id(doc["parent_id"])
        doc["trace_flags"] = int(span.context.trace_flags)
        doc["parent_is_remote"] = span.parent.is_remote if span.parent else None
        doc["dropped"] = (span.dropped_attributes, span.dropped_events, span.dropped_links)
        doc["scope"] = (span.instrumentation_scope.name, span.instrumentation_scope.version)
        for link in doc["links"]:
            link["context"] = {k: name_id(v) for k, v in link["context"].items()}
        for event in doc["events"]:
            stack = event["attributes"].pop("exception.stacktrace", None)
            if stack is not None:  # frames differ with the recorder's own code; the exception's line does not
                event["attributes"]["exception.stacktrace.last"] = stack.strip().splitlines()[-1]
            if not clocks:
                event.pop("timestamp")
        if not clocks:
            doc.pop("start_time")
            doc.pop("end_time")
        out.append(doc)
    return out


def rollout_like(tracer: trace.Tracer) -> None:
    """What the engine's actors do: a consumer span under a remote parent, attributes set after the work,
    headers read from the current span, a child, links, an exception recorded by the context manager."""
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE))
    with tracer.start_as_current_span("generate", context=parent, kind=SpanKind.CONSUMER,
                                      attributes={"messaging.system": "kafka"}) as span:
        assert trace.get_current_span() is span
        span.set_attributes({"rollout.task_id": "t1", "rollout.group_index": 0, "rollout.reward": 0.5,
                             "rollout.solved": True, "rollout.weight_versions": [0, 1], "pair": ("a", "b"),
                             "nested": {"k": [1, 2]}})
        span.set_attributes({"rollout.group_index": 1})
        span.set_attribute("messaging.system", "kafka")  # set again: moves to the end
        span.set_attribute("", "dropped")  # an empty key is dropped
        span.add_event("token.first", {"seq": [0]})
        span.add_link(OTHER, {"rollout.sample_id": "t1/0"})
        with tracer.start_as_current_span("sandbox.step") as step:
            step.set_status(StatusCode.OK)
            step.set_status(StatusCode.ERROR, "after OK: ignored")
        with pytest.raises(ValueError):
            with tracer.start_as_current_span("verify", attributes={"rollout.domain": "code"}):
                raise ValueError("boom")
        with pytest.raises(KeyError):
            with tracer.start_span("direct") as direct:  # a span as its own context manager
                raise KeyError("missing")
        assert not direct.is_recording()
    assert trace.get_current_span() is not span

    root = tracer.start_span("learner.step", links=[Link(REMOTE, {"rollout.verdict": "train"}), Link(OTHER)],
                             start_time=123, kind=SpanKind.INTERNAL)
    root.update_name("learner.step.renamed")
    root.set_status(StatusCode.ERROR, "failed")
    root.end(end_time=456)
    root.end()  # ended twice: a warning, no second export
    root.set_attribute("late", 1)  # ignored after the end
    quiet = tracer.start_span("no-exception-record", record_exception=False, set_status_on_exception=False)
    with pytest.raises(RuntimeError):
        with trace.use_span(quiet, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            raise RuntimeError("not recorded")


def test_the_lean_recorder_exports_what_the_sdk_exports() -> None:
    sdk, lean = run("sdk", rollout_like), run("lean", rollout_like)
    assert [s.name for s in lean] == ["sandbox.step", "verify", "direct", "generate", "learner.step.renamed",
                                      "no-exception-record"]
    assert all(isinstance(s, LeanSpan) for s in lean)
    assert normalized(lean, clocks=False) == normalized(sdk, clocks=False)
    explicit = [s for s in lean if s.name == "learner.step.renamed"][0]
    assert (explicit.start_time, explicit.end_time) == (123, 456)
    generate = [s for s in lean if s.name == "generate"][0]
    assert generate.parent == REMOTE and generate.context.trace_id == REMOTE.trace_id
    assert generate.context.trace_state == REMOTE.trace_state
    assert list(generate.attributes)[-1] == "messaging.system"
    assert generate.attributes["rollout.weight_versions"] == (0, 1)


def test_span_limits_drop_and_truncate_as_the_sdk_does() -> None:
    limits = SpanLimits(max_span_attributes=3, max_attribute_length=4, max_events=1, max_links=1,
                        max_event_attributes=1, max_link_attributes=1)

    def crowded(tracer: trace.Tracer) -> None:
        with tracer.start_as_current_span("crowded", links=[Link(REMOTE, {"a": 1, "b": 2}), Link(OTHER)]) as span:
            span.set_attributes({f"k{i}": "value-long" for i in range(5)})
            span.set_attribute("list", ["abcdefgh", "ab"])
            span.add_event("one", {"x": 1, "y": 2})
            span.add_event("two")
            span.add_link(OTHER)

    sdk, lean = run("sdk", crowded, limits=limits), run("lean", crowded, limits=limits)
    assert normalized(lean, clocks=False) == normalized(sdk, clocks=False)
    (span,) = lean
    assert dict(span.attributes) == {"k3": "valu", "k4": "valu", "list": ("abcd", "ab")}
    assert (span.dropped_attributes, span.dropped_events, span.dropped_links) == (3, 1, 2)


def test_both_encode_to_the_same_otlp() -> None:
    sdk, lean = run("sdk", rollout_like), run("lean", rollout_like)

    def request(spans: list[ReadableSpan]) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        doc = MessageToDict(encode_spans(spans))
        for scope_spans in doc["resourceSpans"][0]["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId", "startTimeUnixNano", "endTimeUnixNano"):
                    span.pop(key, None)
                for event in span.get("events", []):
                    event.pop("timeUnixNano", None)
                    event["attributes"] = [a for a in event["attributes"] if a["key"] != "exception.stacktrace"]
                for link in span.get("links", []):
                    link.pop("spanId", None)
                    link.pop("traceId", None)
        return doc

    assert request(lean) == request(sdk)


@pytest.mark.parametrize(("sampler", "parent_flags", "recorded"), [
    (sampling.ParentBased(sampling.ALWAYS_ON), TraceFlags.SAMPLED, True),
    (sampling.ParentBased(sampling.ALWAYS_ON), TraceFlags.DEFAULT, False),
    (sampling.ParentBased(sampling.TraceIdRatioBased(0.0)), TraceFlags.SAMPLED, True),
    (sampling.ParentBased(sampling.ALWAYS_OFF, remote_parent_sampled=sampling.ALWAYS_OFF), TraceFlags.SAMPLED, False),
    (sampling.ParentBased(sampling.ALWAYS_ON, remote_parent_sampled=sampling.TraceIdRatioBased(0.0)),
     TraceFlags.SAMPLED, False),
    (sampling.TraceIdRatioBased(1.0), TraceFlags.DEFAULT, True),
    (sampling.ALWAYS_OFF, TraceFlags.SAMPLED, False),
])
@pytest.mark.parametrize("kind", ["sdk", "lean"])
def test_children_of_a_remote_parent_follow_the_sampler(kind: str, sampler: sampling.Sampler, parent_flags: int,
                                                         recorded: bool) -> None:
    parent = SpanContext(REMOTE.trace_id, REMOTE.span_id, is_remote=True, trace_flags=TraceFlags(parent_flags))
    seen: list[trace.Span] = []

    def child(tracer: trace.Tracer) -> None:
        seen.append(tracer.start_span("child", context=trace.set_span_in_context(NonRecordingSpan(parent))))
        seen[0].end()

    exported = run(kind, child, sampler=sampler)
    (span,) = seen
    assert span.is_recording() is False  # ended (recorded) or never recording
    assert [s.name for s in exported] == (["child"] if recorded else [])
    assert span.get_span_context().trace_id == REMOTE.trace_id
    assert span.get_span_context().trace_flags.sampled is recorded


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_root_spans_follow_otel_traces_sampler_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                      ratio: float) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", str(ratio))
    provider = LeanTracerProvider()
    assert isinstance(provider.sampler, sampling.ParentBased)
    span = provider.get_tracer("t").start_span("schedule")
    assert span.is_recording() is (ratio == 1.0)
    assert span.get_span_context().is_valid


def test_decorated_functions_get_a_span_per_call() -> None:
    def decorated(tracer: trace.Tracer) -> None:
        @tracer.start_as_current_span("sync")
        def work(x: int) -> int:
            trace.get_current_span().set_attribute("x", x)
            return x * 2

        @tracer.start_as_current_span("async")
        async def awork(x: int) -> int:
            trace.get_current_span().set_attribute("x", x)
            await asyncio.sleep(0)
            return x + 1

        assert [work(1), work(2)] == [2, 4]
        assert asyncio.run(awork(5)) == 6

    sdk, lean = run("sdk", decorated), run("lean", decorated)
    assert [(s.name, dict(s.attributes)) for s in lean] == [("sync", {"x": 1}), ("sync", {"x": 2}),
                                                            ("async", {"x": 5})]
    assert normalized(lean, clocks=False) == normalized(sdk, clocks=False)


def test_a_shut_down_provider_records_nothing() -> None:
    exporter = InMemorySpanExporter()
    provider = LeanTracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.shutdown()
    provider.shutdown()  # idempotent
    assert not provider.get_tracer("t").start_span("late").is_recording()
    assert exporter.get_finished_spans() == ()


def test_parent_based_static_delegates_are_decided_without_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    assert len(LeanTracerProvider()._static) == 4  # the ratio applies to roots only

    class Deciding(sampling.ParentBased):  # a subclass with its own rule is always asked
        calls = 0

        def should_sample(self, *args: Any, **kwargs: Any) -> sampling.SamplingResult:
            Deciding.calls += 1
            return sampling.SamplingResult(sampling.Decision.DROP)

    provider = LeanTracerProvider(sampler=Deciding(sampling.ALWAYS_ON))
    assert provider._static == {}
    span = provider.get_tracer("t").start_span("child", context=trace.set_span_in_context(NonRecordingSpan(REMOTE)))
    assert not span.is_recording() and Deciding.calls == 1
