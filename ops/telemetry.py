"""OpenTelemetry SDK setup of a process: where the actors' spans go (they use only the API).

    shutdown = setup_tracing(cfg.telemetry, service_name="rollout")
    ...
    shutdown()  # flush what is buffered, stop exporting

With ``telemetry.tracing = false`` (or ``OTEL_SDK_DISABLED=true``) nothing is installed: the API's
no-op tracer stays, no exporter exists and a span costs one small object. With tracing on, spans are
recorded by the SDK's ``TracerProvider`` (public API only) and go
through a ``BatchSpanProcessor`` (``OTEL_BSP_*`` tune it) to an OTLP/HTTP exporter whose endpoint is
``telemetry.otlp_endpoint`` if set, else the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` variables, else ``http://localhost:4318/v1/traces``; headers, timeout
and compression come from the other ``OTEL_EXPORTER_OTLP_*`` variables, sampling from
``OTEL_TRACES_SAMPLER`` (default: parent-based, always on), extra resource attributes from
``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_SERVICE_NAME`` overrides ``service_name``.

The API lets a process install its global tracer provider only once. So the global provider is a
:class:`SwitchableTracerProvider`, installed on the first setup, and each setup points it at a fresh
SDK provider; its shutdown points it back at the no-op provider. Several setups in one process (tests,
a load test comparing tracing on and off) therefore work, one at a time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.util.types import Attributes

from engine.config import TelemetryConfig

log = logging.getLogger("rollout.telemetry")

OTLP_TRACES_PATH = "/v1/traces"

Shutdown = Callable[[], None]


class SwitchableTracerProvider(trace.TracerProvider):
    """The process's global provider: hands out tracers of whichever provider is current.

    Tracers are cached per name until the next switch: the actors look theirs up for every span, and
    the SDK builds a new tracer object on each lookup (a fifth of a span's cost).
    """

    def __init__(self) -> None:
        self._current: trace.TracerProvider = trace.NoOpTracerProvider()
        self._tracers: dict[tuple[str, str | None, str | None], trace.Tracer] = {}

    @property
    def current(self) -> trace.TracerProvider:
        return self._current

    @current.setter
    def current(self, provider: trace.TracerProvider) -> None:
        self._current = provider
        self._tracers = {}

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Attributes = None) -> trace.Tracer:
        if attributes:
            return self._current.get_tracer(instrumenting_module_name, instrumenting_library_version, schema_url,
                                            attributes)
        key = (instrumenting_module_name, instrumenting_library_version, schema_url)
        tracer = self._tracers.get(key)
        if tracer is None:
            tracer = self._tracers[key] = self._current.get_tracer(*key)
        return tracer


_switch: SwitchableTracerProvider | None = None
_lock = threading.Lock()


def _global_switch() -> SwitchableTracerProvider:
    global _switch
    with _lock:
        if _switch is None:
            existing = trace.get_tracer_provider()
            if not isinstance(existing, trace.ProxyTracerProvider):
                raise RuntimeError(f"a global tracer provider ({type(existing).__name__}) was installed outside "
                                   "ops.telemetry; set up tracing only through setup_tracing")
            _switch = SwitchableTracerProvider()
            trace.set_tracer_provider(_switch)
        return _switch


def traces_endpoint(endpoint: str) -> str:
    """``endpoint`` as an OTLP/HTTP traces URL: a bare ``http://host:port`` gets ``/v1/traces``."""
    parts = urlsplit(endpoint)
    if not parts.scheme or not parts.netloc:
        raise ValueError(f"telemetry.otlp_endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def tracing_enabled(cfg: TelemetryConfig) -> bool:
    """Tracing is on in the config and the SDK is not disabled by ``OTEL_SDK_DISABLED``."""
    return cfg.tracing and os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def otlp_exporter(cfg: TelemetryConfig) -> SpanExporter:
    """The OTLP/HTTP span exporter the configuration and ``OTEL_EXPORTER_OTLP_*`` describe."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_endpoint(cfg.otlp_endpoint) if cfg.otlp_endpoint else None)


def setup_tracing(cfg: TelemetryConfig, service_name: str, *, exporter: SpanExporter | None = None,
                  resource_attributes: dict[str, str] | None = None) -> Shutdown:
    """Install the process's span pipeline; returns the callable that flushes and removes it (idempotent).

    ``exporter`` replaces the OTLP exporter (tests and load tests pass an in-memory one). With tracing
    off, nothing is created and the returned callable does nothing.
    """
    if not tracing_enabled(cfg):
        return lambda: None
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name, **(resource_attributes or {})}
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter or otlp_exporter(cfg)))
    switch = _global_switch()
    if not isinstance(switch.current, trace.NoOpTracerProvider):
        log.warning("setup_tracing: replacing the tracer provider of an earlier setup that was not shut down")
    switch.current = provider
    done = threading.Event()

    def shutdown() -> None:
        if done.is_set():
            return
        done.set()
        if switch.current is provider:
            switch.current = trace.NoOpTracerProvider()
        provider.shutdown()  # flushes the batch processor, then shuts the exporter down

    return shutdown


def force_flush(timeout_ms: int = 30000) -> bool:
    """Export every span ended so far in this process; False if the exporter did not finish in time."""
    current = _switch.current if _switch is not None else None
    if isinstance(current, TracerProvider):
        return current.force_flush(timeout_ms)
    return True


__all__ = ["SwitchableTracerProvider", "force_flush", "otlp_exporter", "setup_tracing", "traces_endpoint",
           "tracing_enabled"]
