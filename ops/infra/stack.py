"""The local stack as a whole: ``up`` (idempotent), ``down`` (only what we started), ``status``.

``<state>/stack.json`` remembers which optional parts (Docker, bubblewrap) ``up`` was asked for, so
``status`` knows what is expected to be running, and the addresses it used: while anything it started
still runs, ``status``, ``down`` and a repeated ``up`` talk to those addresses whatever the flags say.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.infra.bwrap import bwrap_works, ensure_bwrap, find_bwrap
from ops.infra.config import InfraConfig
from ops.infra.docker_engine import DockerEngine, ensure_dockerd_installed
from ops.infra.errors import InfraError
from ops.infra.jaeger import JaegerServer
from ops.infra.kafka_broker import KafkaBroker
from ops.infra.nats_server import NatsServer
from ops.infra.service import Service

Log = Callable[[str], None]

MANIFEST = "stack.json"
SAVED_ADDRESSES = ("kafka_port", "kafka_controller_port", "nats_port", "docker_socket", "jaeger_otlp_port", "jaeger_port")


def _jaeger(config: InfraConfig) -> JaegerServer:
    """The local Jaeger v2 on the configured ports (OTLP/HTTP, query API and UI, query gRPC one below)."""
    return JaegerServer(config, otlp_port=config.jaeger_otlp_port, query_port=config.jaeger_port,
                        query_grpc_port=config.jaeger_port - 1)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class ServiceStatus:
    """One row of ``rollout infra status``."""

    service: str
    pid: int | None
    address: str
    healthy: bool
    note: str = ""


class Stack:
    """Kafka and NATS always; the Docker engine, bubblewrap and Jaeger when asked for (or asked for before)."""

    def __init__(self, config: InfraConfig, *, docker: bool = False, bwrap: bool = False, jaeger: bool = False) -> None:
        saved = _read_manifest(config.state_dir / MANIFEST)
        running = any(s(config).is_running() for s in (KafkaBroker, NatsServer, DockerEngine, _jaeger))
        if running and saved.get("addresses"):
            config = InfraConfig.model_validate({**config.model_dump(), **saved["addresses"]})
        self.config = config
        self.docker = docker or bool(saved.get("docker", False))
        self.bwrap = bwrap or bool(saved.get("bwrap", False))
        self.jaeger = jaeger or bool(saved.get("jaeger", False))
        self.kafka = KafkaBroker(config)
        self.nats = NatsServer(config)
        self.docker_engine = DockerEngine(config)
        self.jaeger_server = _jaeger(config)

    def _write_manifest(self) -> None:
        addresses = self.config.model_dump(mode="json", include=set(SAVED_ADDRESSES))
        data = {"docker": self.docker, "bwrap": self.bwrap, "jaeger": self.jaeger, "addresses": addresses}
        (self.config.state_dir / MANIFEST).write_text(json.dumps(data, indent=1))

    def services(self) -> list[Service]:
        return [self.kafka, self.nats, *([self.docker_engine] if self.docker else []),
                *([self.jaeger_server] if self.jaeger else [])]

    def up(self, log: Log = print) -> list[ServiceStatus]:
        """Start whatever is not running yet and wait until every part answers."""
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        if self.bwrap:
            log(f"bwrap: ok ({ensure_bwrap()})")
        if self.docker:
            ensure_dockerd_installed()
        to_start: list[Service] = []
        for service in self.services():
            if service.is_running():
                log(f"{service.name}: already running (pid {service.pid()}) at {service.address}")
            elif isinstance(service, DockerEngine) and service.is_external():
                log(f"docker: an engine not started by us answers at {service.address}; using it")
            else:
                to_start.append(service)
        # Check every port before starting anything, so a conflict leaves nothing half started.
        for service in to_start:
            service.check_ports()
        for service in to_start:
            pid = service.start()
            log(f"{service.name}: started (pid {pid}), waiting for {service.address}")
        self._write_manifest()
        for service in self.services():
            try:
                service.wait_ready()
            except InfraError:
                if service in to_start:
                    service.stop()
                raise
        return self.status()

    def down(self, log: Log = print) -> None:
        """Stop, by pid file, every process this state dir started; leave everything else alone."""
        for service in [self.kafka, self.nats, self.docker_engine, self.jaeger_server]:
            pid = service.stop()
            if pid is not None:
                log(f"{service.name}: stopped (pid {pid})")
            elif isinstance(service, DockerEngine) and service.is_healthy(timeout_s=1.0):
                log(f"docker: not started by us, left running at {service.address}")
            else:
                log(f"{service.name}: not running")
        (self.config.state_dir / MANIFEST).unlink(missing_ok=True)

    def status(self) -> list[ServiceStatus]:
        rows = []
        for service in self.services():
            pid = service.pid()
            healthy = service.is_healthy(timeout_s=2.0)
            note = "external" if pid is None and healthy else ""
            rows.append(ServiceStatus(service.name, pid, service.address, healthy, note))
        if self.bwrap:
            problem = bwrap_works()
            rows.append(ServiceStatus("bwrap", None, find_bwrap() or "-", problem is None, problem or ""))
        return rows


def format_table(rows: list[ServiceStatus]) -> str:
    table = [("service", "pid", "address", "healthy")]
    for row in rows:
        healthy = ("yes" if row.healthy else "NO") + (f" ({row.note})" if row.note else "")
        table.append((row.service, str(row.pid) if row.pid else "-", row.address, healthy))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)
