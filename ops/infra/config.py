"""Configuration of the local stack: defaults, environment variables and CLI flags in one model.

Precedence: explicit value (a CLI flag) > environment variable > default. Each field's environment
variable is listed in ``ENV_VARS``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.cache import CACHE_DIR_ENV, default_cache_dir  # one cache root for every package
from ops.infra.errors import InfraError

HOST = "127.0.0.1"
"""Every local service listens on loopback only."""

POM_PATH = Path(__file__).parent / "kafka" / "pom.xml"
LOG4J2_CONFIG = Path(__file__).parent / "kafka" / "log4j2.yaml"


def repo_root() -> Path:
    """The checkout this package runs from (editable install), else the working directory."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def pom_kafka_version(pom: Path = POM_PATH) -> str:
    """The Kafka version pinned in the pom, so the pom stays the single place to change it."""
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", pom.read_text())
    if match is None:
        raise InfraError(f"{pom}: no <kafka.version> property")
    return match.group(1).strip()


class InfraConfig(BaseModel):
    """Where and how the local Kafka broker, nats-server and Docker engine run."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="forbid")

    state_dir: Path = Field(default_factory=lambda: repo_root() / ".state" / "infra")
    """One folder for every pid file, log and data directory of the stack."""
    cache_dir: Path = Field(default_factory=default_cache_dir)
    """Cache for the resolved Kafka jars (``<cache_dir>/kafka-<version>/libs``), outside git."""
    kafka_port: int = Field(default=9092, ge=1, le=65535)
    """Kafka client (PLAINTEXT) listener port on 127.0.0.1."""
    kafka_controller_port: int = Field(default=9093, ge=1, le=65535)
    """KRaft controller listener port on 127.0.0.1."""
    kafka_heap: str = "-Xmx1G -Xms512m"
    """JVM heap options of the broker."""
    kafka_version: str = Field(default_factory=pom_kafka_version)
    """Apache Kafka version; defaults to the one pinned in ops/infra/kafka/pom.xml."""
    nats_port: int = Field(default=4222, ge=1, le=65535)
    """nats-server client port on 127.0.0.1."""
    jaeger_otlp_port: int = Field(default=4318, ge=1, le=65535)
    """OTLP/HTTP receiver of the local Jaeger (``rollout infra up --jaeger``) on 127.0.0.1."""
    jaeger_port: int = Field(default=16686, ge=1, le=65535)
    """Jaeger's query API and UI on 127.0.0.1 (its query gRPC port is this minus one)."""
    docker_socket: Path = Path("/var/run/docker.sock")
    """Unix socket of the Docker engine; the default lets ``docker.from_env()`` work unconfigured."""
    docker_data_root: Path = Path("/var/lib/docker")
    """Images and containers of the Docker engine; kept outside the state dir because images can
    only be built locally (no registry) and are slow to rebuild."""
    ready_timeout_s: float = Field(default=120.0, gt=0)
    """How long ``up`` waits for each service to answer before failing."""

    @property
    def kafka_bootstrap(self) -> str:
        return f"{HOST}:{self.kafka_port}"

    @property
    def nats_url(self) -> str:
        return f"nats://{HOST}:{self.nats_port}"

    @property
    def docker_host(self) -> str:
        """The value for ``DOCKER_HOST`` that reaches this engine."""
        return f"unix://{self.docker_socket}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> InfraConfig:
        """Build from environment variables, then apply ``overrides`` (``None`` means 'not given')."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        source: dict[str, str] = {}  # field -> where its value came from, for error messages
        for field, names in ENV_VARS.items():
            name = next((n for n in names if env.get(n, "").strip()), None)
            if name is not None:
                values[field], source[field] = env[name].strip(), name
        for field, value in overrides.items():
            if value is not None:
                values[field], source[field] = value, field
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "?"
            raise InfraError(f"invalid {source.get(field, field)}={values.get(field)!r}: {err['msg']}") from None


# field -> environment variables, first match wins.
ENV_VARS: dict[str, tuple[str, ...]] = {
    "state_dir": ("ROLLOUT_STATE_DIR",),
    "cache_dir": (CACHE_DIR_ENV,),
    "kafka_port": ("ROLLOUT_KAFKA_PORT",),
    "jaeger_otlp_port": ("ROLLOUT_JAEGER_OTLP_PORT",),
    "jaeger_port": ("ROLLOUT_JAEGER_PORT",),
    "kafka_controller_port": ("ROLLOUT_KAFKA_CONTROLLER_PORT",),
    "kafka_heap": ("ROLLOUT_KAFKA_HEAP", "KAFKA_HEAP_OPTS"),
    "kafka_version": ("ROLLOUT_KAFKA_VERSION",),
    "nats_port": ("ROLLOUT_NATS_PORT",),
    "docker_socket": ("ROLLOUT_DOCKER_SOCKET",),
    "docker_data_root": ("ROLLOUT_DOCKER_DATA_ROOT",),
    "ready_timeout_s": ("ROLLOUT_INFRA_TIMEOUT",),
}
