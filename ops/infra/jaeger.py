"""Jaeger v2 on 127.0.0.1 with in-memory storage: a real OTLP trace backend for development and tests.

The binary is built from source with the Go toolchain and cached outside git in
``<cache_dir>/jaeger-<module version>/jaeger``. ``go install github.com/jaegertracing/jaeger/cmd/jaeger@v…``
cannot build it: Jaeger's go.mod has a ``replace`` directive, which ``go install pkg@version`` refuses.
So :func:`ensure_jaeger` fetches the module through the Go module proxy (``go mod download``) and runs
``go build ./cmd/jaeger`` in a writable copy, where the replace directive applies.

Jaeger v2 releases are tagged twice; the Go module only knows the v1 tag of a release (its module
path has no ``/v2``): module version v1.76.0 is Jaeger v2.13.0.

:class:`JaegerServer` writes a collector-style config (OTLP/HTTP receiver, in-memory store, query
extension, all on loopback ports of the caller's choosing), starts the binary detached and stops it by
its recorded pid; it is ready when the query API answers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ops.infra.config import HOST, InfraConfig
from ops.infra.errors import InfraError
from ops.infra.process import free_port, tcp_accepts
from ops.infra.service import Service

JAEGER_RELEASE = "v2.13.0"
JAEGER_MODULE = "github.com/jaegertracing/jaeger"
JAEGER_MODULE_VERSION = "v1.76.0"
"""The Go module tag of ``JAEGER_RELEASE``."""
BUILD_TIMEOUT_S = 3600.0


def find_go() -> str:
    """The ``go`` command (PATH, then the usual install location)."""
    found = shutil.which("go") or next((p for p in ("/usr/local/go/bin/go",) if os.access(p, os.X_OK)), None)
    if found is None:
        raise InfraError("go not found: building Jaeger needs the Go toolchain (https://go.dev/dl/)")
    return found


def jaeger_binary(config: InfraConfig, version: str = JAEGER_MODULE_VERSION) -> Path:
    """Where the Jaeger binary of ``version`` is cached."""
    return config.cache_dir / f"jaeger-{version}" / "jaeger"


def _go(go: str, args: list[str], cwd: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> str:
    try:
        done = subprocess.run([go, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InfraError(f"go {' '.join(args)} did not finish within {timeout_s:.0f}s") from exc
    if done.returncode != 0:
        raise InfraError(f"go {' '.join(args)} failed (exit {done.returncode})", log_tail=done.stderr[-4000:])
    return done.stdout


def ensure_jaeger(config: InfraConfig, version: str = JAEGER_MODULE_VERSION) -> Path:
    """The cached Jaeger binary of ``version``, built first if missing (minutes; needs the module proxy)."""
    binary = jaeger_binary(config, version)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    go = find_go()
    info = json.loads(_go(go, ["mod", "download", "-json", f"{JAEGER_MODULE}@{version}"]))
    if info.get("Error") or not info.get("Dir"):
        raise InfraError(f"go mod download {JAEGER_MODULE}@{version}: {info.get('Error', 'no source directory')}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaeger-src-", dir=binary.parent) as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(info["Dir"], src)  # the module cache is read-only; go build may write go.sum
        for path in [src, *src.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
        staged = Path(tmp) / "jaeger"
        _go(go, ["build", "-trimpath", "-o", str(staged), "./cmd/jaeger"], cwd=src)
        staged.replace(binary)  # atomic: a concurrent reader sees no binary or a whole one
    return binary


def render_config(*, otlp_port: int, query_port: int, query_grpc_port: int, max_traces: int = 100_000) -> dict[str, Any]:
    """The Jaeger v2 config: OTLP/HTTP in, in-memory storage, query API; loopback only, no other ports.

    Written as JSON, which is YAML too.
    """
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                     "exporters": ["jaeger_storage_exporter"]}},
            # level none: no Prometheus endpoint for Jaeger's own metrics (it would bind :8888)
            "telemetry": {"resource": {"service.name": "jaeger"}, "metrics": {"level": "none"},
                          "logs": {"level": "info"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": max_traces}}}},
            "jaeger_query": {"storage": {"traces": "memstore"}, "enable_tracing": False,
                             "http": {"endpoint": f"{HOST}:{query_port}"},
                             "grpc": {"endpoint": f"{HOST}:{query_grpc_port}"}},
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"{HOST}:{otlp_port}"}}}},
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
    }


class JaegerServer(Service):
    """One Jaeger v2 process: OTLP/HTTP on ``otlp_port``, the query API (and UI) on ``query_port``.

    Ports default to free ones. ``otlp_endpoint`` is what an OTLP/HTTP exporter (or
    ``telemetry.otlp_endpoint``) takes.
    """

    name = "jaeger"

    def __init__(self, config: InfraConfig, *, otlp_port: int | None = None, query_port: int | None = None,
                 query_grpc_port: int | None = None, version: str = JAEGER_MODULE_VERSION) -> None:
        super().__init__(config)
        self.otlp_port = otlp_port or free_port()
        self.query_port = query_port or free_port()
        self.query_grpc_port = query_grpc_port or free_port()
        self.version = version

    @property
    def config_file(self) -> Path:
        return self.dir / "jaeger.yaml"

    @property
    def otlp_endpoint(self) -> str:
        """Base URL of the OTLP/HTTP receiver (traces go to ``/v1/traces``)."""
        return f"http://{HOST}:{self.otlp_port}"

    @property
    def query_url(self) -> str:
        """Base URL of the query API (``/api/services``, ``/api/traces``) and the UI."""
        return f"http://{HOST}:{self.query_port}"

    @property
    def address(self) -> str:
        return self.query_url

    def ports(self) -> list[tuple[int, str]]:
        return [(self.otlp_port, "otlp_port"), (self.query_port, "query_port"), (self.query_grpc_port, "query_grpc_port")]

    def argv(self) -> list[str]:
        return [str(jaeger_binary(self.config, self.version)), "--config", str(self.config_file)]

    def prepare(self) -> None:
        ensure_jaeger(self.config, self.version)
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = render_config(otlp_port=self.otlp_port, query_port=self.query_port, query_grpc_port=self.query_grpc_port)
        self.config_file.write_text(json.dumps(cfg, indent=2) + "\n")

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        if not tcp_accepts(self.otlp_port, timeout_s=min(timeout_s, 0.5)):
            return False
        try:
            self.services(timeout_s=timeout_s)
        except InfraError:
            return False
        return True

    # -- query API ---------------------------------------------------------------------------------
    def _get(self, path: str, params: dict[str, Any] | None = None, timeout_s: float = 5.0) -> Any:
        url = f"{self.query_url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise InfraError(f"jaeger query {url}: {exc}") from exc

    def services(self, timeout_s: float = 5.0) -> list[str]:
        """Service names Jaeger has spans of."""
        return list(self._get("/api/services", timeout_s=timeout_s).get("data") or [])

    def traces(self, service: str, *, limit: int = 100, lookback: str = "1h", **tags: str) -> list[dict[str, Any]]:
        """Traces with spans of ``service`` (Jaeger's JSON model: ``traceID``, ``spans``, ``processes``)."""
        params: dict[str, Any] = {"service": service, "limit": limit, "lookback": lookback}
        if tags:
            params["tags"] = json.dumps(tags)
        return list(self._get("/api/traces", params).get("data") or [])

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One trace by its 32-hex id, or None if Jaeger does not have it."""
        try:
            data = self._get(f"/api/traces/{trace_id}").get("data") or []
        except InfraError:
            return None
        return data[0] if data else None


__all__ = ["JAEGER_MODULE_VERSION", "JAEGER_RELEASE", "JaegerServer", "ensure_jaeger", "find_go", "jaeger_binary",
           "render_config"]
