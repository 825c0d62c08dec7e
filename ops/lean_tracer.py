"""A lean span recorder behind the OpenTelemetry API, exporting through the SDK's span processors.

The engine records a few spans for every sample of every rollout (``generate``, ``verify``, ``reward``,
``learner.consume``, one ``sandbox.step`` per turn), each with 5-17 attributes. The SDK's tracer spends
about 30 µs of CPU starting and ending a span and 1.7 µs per attribute (each value is cleaned through
an ABC-checked recursive walk under a per-span lock, and every span is copied into a second object when
it ends); on two cores that alone took 2.3% of the pipeline's CPU (docs/tracing.md).

:class:`LeanTracerProvider` records the same spans with less work and hands them to the same
processors and exporters (``BatchSpanProcessor``, the OTLP exporter), which see ordinary
``ReadableSpan`` objects:

- A :class:`LeanSpan` *is* the ``ReadableSpan`` the processors receive (no copy at the end); its
  attributes are a plain dict. Values of the plain types (str, int, float, bool, bytes, None) are
  checked with one ``type()`` lookup each; anything else (sequences, mappings, other types) goes
  through the SDK's own cleaning, so what is stored is what the SDK would store. The span limits
  (``OTEL_SPAN_*_LIMIT``, ``OTEL_ATTRIBUTE_*_LIMIT``) apply as in the SDK.
- The sampler is the SDK's, from ``OTEL_TRACES_SAMPLER`` / ``_ARG`` as the SDK reads them. A parent-based
  sampler whose delegate for the parent at hand is always-on or always-off is decided without a call
  (that is what it would answer: the decision and the parent's trace state); any other sampler is called.
- A span is changed by the code that holds it, without a lock (the engine's spans live on one event
  loop); ``end`` is the point after which it is read by the exporting thread and no longer changes.

``telemetry.tracer = "sdk"`` installs the SDK's ``TracerProvider`` instead; the tests run both.
"""

from __future__ import annotations

import functools
import inspect
import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from types import TracebackType
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes, _clean_attribute_value
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor, sampling
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.util import types

log = logging.getLogger("rollout.telemetry")

_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})
"""Attribute value types stored as given (the SDK's cleaning returns them unchanged, strings up to the length limit)."""

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RANDOM_TRACE_ID = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C trace context level 2 (API >= 1.39)
_UNSET = Status(StatusCode.UNSET)


class LeanTracerProvider(trace_api.TracerProvider):
    """Hands out :class:`LeanTracer`s whose spans go to the span processors added here."""

    def __init__(self, resource: Resource | None = None, sampler: sampling.Sampler | None = None,
                 span_limits: SpanLimits | None = None, id_generator: IdGenerator | None = None) -> None:
        self.resource = resource if resource is not None else Resource.create({})
        self.sampler = sampler if sampler is not None else sampling._get_from_env_or_default()
        self.limits = span_limits if span_limits is not None else SpanLimits()
        self.ids = id_generator if id_generator is not None else RandomIdGenerator()
        self.processors: tuple[SpanProcessor, ...] = ()
        self._static = _static_decisions(self.sampler)
        self._random_ids = bool(getattr(self.ids, "is_trace_id_random", lambda: False)())
        self._shut = False

    def add_span_processor(self, processor: SpanProcessor) -> None:
        self.processors = (*self.processors, processor)

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: types.Attributes = None) -> trace_api.Tracer:
        if self._shut:
            return trace_api.NoOpTracer()
        # a new tracer per call, as the SDK's; ops/telemetry's SwitchableTracerProvider caches them per name
        return LeanTracer(self, InstrumentationScope(instrumenting_module_name, instrumenting_library_version,
                                                     schema_url, attributes))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time_ns() + timeout_millis * 1_000_000
        for processor in self.processors:
            left_ms = max(0, (deadline - time_ns()) // 1_000_000)
            if not processor.force_flush(left_ms):
                return False
        return True

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        for processor in self.processors:
            processor.shutdown()

    def sample(self, context: context_api.Context | None, parent: SpanContext | None, trace_id: int, name: str,
               kind: SpanKind, attributes: types.Attributes, links: Sequence[Link],
               ) -> tuple[sampling.Decision, types.Attributes, TraceState | None]:
        """The sampler's decision, attributes and trace state for a new span (see :func:`_static_decisions`
        for the calls it saves)."""
        if parent is not None:
            static = self._static.get((parent.is_remote, parent.trace_flags.sampled))
            if static is not None:
                return static, attributes, parent.trace_state
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        return result.decision, result.attributes, result.trace_state


def _static_decisions(sampler: sampling.Sampler) -> dict[tuple[bool, bool], sampling.Decision]:
    """For a parent-based sampler: the fixed decision for each kind of parent whose delegate is
    always-on or always-off, keyed by (parent is remote, parent is sampled). Empty for any other sampler,
    and for subclasses that decide otherwise (their own ``should_sample``)."""
    if type(sampler).should_sample is not sampling.ParentBased.should_sample:
        return {}
    delegates = {(True, True): "_remote_parent_sampled", (True, False): "_remote_parent_not_sampled",
                 (False, True): "_local_parent_sampled", (False, False): "_local_parent_not_sampled"}
    fixed = {}
    for key, attribute in delegates.items():
        delegate = getattr(sampler, attribute, None)  # absent in another SDK version: the sampler is called
        decision = getattr(delegate, "_decision", None)
        static = getattr(type(delegate), "should_sample", None) is sampling.StaticSampler.should_sample
        if static and isinstance(decision, sampling.Decision):
            fixed[key] = decision
    return fixed


def _append_bounded(items: list[Any], item: Any, limit: int | None) -> int:
    """Append ``item``; at ``limit`` the oldest gives way (the SDK's ``BoundedList``). Returns how many were dropped."""
    if limit is None or len(items) < limit:
        items.append(item)
        return 0
    if limit > 0:
        del items[0]
        items.append(item)
    return 1


class LeanTracer(trace_api.Tracer):
    """Starts :class:`LeanSpan`s (see the module's docstring)."""

    def __init__(self, provider: LeanTracerProvider, scope: InstrumentationScope) -> None:
        self.provider = provider
        self.scope = scope

    def start_span(self, name: str, context: context_api.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: types.Attributes = None, links: Sequence[Link] | None = (),
                   start_time: int | None = None, record_exception: bool = True,
                   set_status_on_exception: bool = True) -> trace_api.Span:
        provider = self.provider
        parent: SpanContext | None = trace_api.get_current_span(context).get_span_context()
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            random_id = parent.trace_flags & _RANDOM_TRACE_ID
        else:
            parent = None
            trace_id = provider.ids.generate_trace_id()
            random_id = _RANDOM_TRACE_ID if provider._random_ids else 0
        links = links or ()
        decision, attributes, trace_state = provider.sample(context, parent, trace_id, name, kind, attributes, links)
        flags = _SAMPLED if decision.is_sampled() else _NOT_SAMPLED
        if random_id:
            flags = TraceFlags(flags | random_id)
        span_context = SpanContext(trace_id, provider.ids.generate_span_id(), is_remote=False, trace_flags=flags,
                                   trace_state=trace_state)
        if not decision.is_recording():
            return trace_api.NonRecordingSpan(span_context)
        span = LeanSpan(name, span_context, parent, kind, self, record_exception, set_status_on_exception)
        if attributes:
            span.set_attributes(attributes)  # the sampler's, which include the caller's
        if links:
            for link in links:
                if link:
                    span.add_link(link.context, link.attributes)
        span._start_time = start_time if start_time is not None else time_ns()
        for processor in provider.processors:
            # the SDK types on_start for its own Span; processors only read the ReadableSpan API LeanSpan has
            processor.on_start(span, parent_context=context)  # type: ignore[arg-type]
        return span

    # _Current is used exactly as the API's context manager (and decorator), without the SDK's generator
    def start_as_current_span(self, name: str, context: context_api.Context | None = None,  # type: ignore[override]
                              kind: SpanKind = SpanKind.INTERNAL, attributes: types.Attributes = None,
                              links: Sequence[Link] | None = (), start_time: int | None = None,
                              record_exception: bool = True, set_status_on_exception: bool = True,
                              end_on_exit: bool = True) -> _Current:
        return _Current(self, (name, context, kind, attributes, links, start_time, record_exception,
                               set_status_on_exception), end_on_exit)


class _Current:
    """``start_as_current_span``'s result: a context manager that starts the span on entry and makes it
    current; on exit records an escaping ``Exception`` (as ``trace.use_span`` does), restores the
    context and ends the span. Used as a decorator, it starts a span per call (sync or async)."""

    __slots__ = ("_tracer", "_args", "_end_on_exit", "_span", "_token")

    def __init__(self, tracer: LeanTracer, args: tuple[Any, ...], end_on_exit: bool) -> None:
        self._tracer, self._args, self._end_on_exit = tracer, args, end_on_exit

    def __enter__(self) -> trace_api.Span:
        self._span = span = self._tracer.start_span(*self._args)
        self._token = context_api.attach(trace_api.set_span_in_context(span))
        return span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span = self._span
        try:
            if isinstance(exc, Exception) and isinstance(span, LeanSpan):
                span._escaped(exc, escaped=False)  # as trace.use_span records it
        finally:
            context_api.detach(self._token)
            if self._end_on_exit:
                span.end()

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        tracer, args, end_on_exit = self._tracer, self._args, self._end_on_exit
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def traced_async(*a: Any, **kw: Any) -> Any:
                with _Current(tracer, args, end_on_exit):
                    return await func(*a, **kw)
            return traced_async

        @functools.wraps(func)
        def traced(*a: Any, **kw: Any) -> Any:
            with _Current(tracer, args, end_on_exit):
                return func(*a, **kw)
        return traced


class LeanSpan(trace_api.Span, ReadableSpan):
    """A recording span; once ended, the ``ReadableSpan`` its processors receive."""

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
                 tracer: LeanTracer, record_exception: bool = True, set_status_on_exception: bool = True) -> None:
        # ReadableSpan's fields, set directly (its __init__ would build a Resource when given none)
        self._name = name
        self._context: SpanContext = context
        self._parent = parent
        self._kind = kind
        self._resource = tracer.provider.resource
        self._instrumentation_scope = tracer.scope
        self._instrumentation_info = None
        self._attributes: dict[str, types.AnyValue] = {}
        self._events: list[Event] = []
        self._links: list[Link] = []
        self._status = _UNSET
        self._start_time: int | None = None
        self._end_time: int | None = None
        # the rest
        self._limits = tracer.provider.limits
        self._provider = tracer.provider
        self._record_exception = record_exception
        self._set_status_on_exception = set_status_on_exception
        self._dropped_attributes = self._dropped_events = self._dropped_links = 0

    def __repr__(self) -> str:
        return f'{type(self).__name__}(name="{self._name}", context={self._context})'

    # -- what processors and exporters read ---------------------------------------------------------
    @property
    def dropped_attributes(self) -> int:
        return self._dropped_attributes

    @property
    def dropped_events(self) -> int:
        return self._dropped_events

    @property
    def dropped_links(self) -> int:
        return self._dropped_links

    # -- the API's Span -----------------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        self.set_attributes({key: value})

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        if self._end_time is not None:
            log.warning("Setting attribute on ended span.")
            return
        mine, max_len = self._attributes, self._limits.max_span_attribute_length
        limit = self._limits.max_span_attributes
        for key, value in attributes.items():
            if type(value) not in _PLAIN or (max_len is not None and type(value) is str and len(value) > max_len):
                value = _clean_attribute_value(value, max_len)  # the SDK's cleaning, warnings included
            if type(key) is not str or not key:
                log.warning("invalid key `%s`. must be non-empty string. Dropping key from attributes.", key)
                self._dropped_attributes += 1
                continue
            if key in mine:
                del mine[key]  # a key set again moves to the end, as in the SDK's BoundedAttributes
            elif limit is not None and len(mine) >= limit:
                if limit == 0:
                    self._dropped_attributes += 1
                    continue
                del mine[next(iter(mine))]  # full: the oldest gives way
                self._dropped_attributes += 1
            mine[key] = value

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        if self._end_time is not None:
            log.warning("Calling add_event on an ended span.")
            return
        event = Event(name, BoundedAttributes(self._limits.max_event_attributes, attributes,
                                              max_value_len=self._limits.max_attribute_length), timestamp)
        self._dropped_events += _append_bounded(self._events, event, self._limits.max_events)

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self._end_time is not None:
            log.warning("Calling add_link on an ended span.")
            return
        if not context or not (context.is_valid or attributes or context.trace_state):
            return  # a link to nothing (the SDK's rule)
        link = Link(context, BoundedAttributes(self._limits.max_link_attributes, attributes,
                                               max_value_len=self._limits.max_attribute_length))
        self._dropped_links += _append_bounded(self._links, link, self._limits.max_links)

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._end_time is not None:
            log.warning("Calling set_status on an ended span.")
            return
        # as the SDK: OK is final, UNSET is never set
        if self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(self, exception: BaseException, attributes: types.Attributes = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        recorded: dict[str, types.AnyValue] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            recorded.update(attributes)
        self.add_event("exception", recorded, timestamp)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """``with tracer.start_span(...) as span:`` records what escapes the block, then ends the span (the SDK's rule)."""
        if exc is not None:
            self._escaped(exc, escaped=True)
        self.end()

    def _escaped(self, exc: BaseException, escaped: bool) -> None:
        """An exception left the span's block: record it and set the ERROR status, as the span was told to."""
        if self._end_time is not None:
            return
        if self._record_exception:
            self.record_exception(exc, escaped=escaped)
        if self._set_status_on_exception:
            self.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            log.warning("Calling end() on an ended span.")
            return
        self._end_time = end_time if end_time is not None else time_ns()
        for processor in self._provider.processors:
            processor.on_end(self)


__all__ = ["LeanSpan", "LeanTracer", "LeanTracerProvider"]
