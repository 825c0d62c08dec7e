"""Local infrastructure for development and tests: Kafka broker, nats-server, Docker engine, bubblewrap.

Used by ``rollout infra up|down|status`` (ops/cli_infra.py) and by the integration-test fixtures.
Every pid file, log and data folder lives under one state dir (``InfraConfig.state_dir``).
"""

from ops.infra.bwrap import bwrap_works, ensure_bwrap
from ops.infra.config import HOST, InfraConfig
from ops.infra.docker_engine import DockerEngine, docker_host, docker_pings
from ops.infra.errors import InfraError, PortInUseError
from ops.infra.kafka_broker import KafkaBroker, ensure_kafka_jars, kafka_answers_metadata
from ops.infra.nats_server import NatsServer, nats_jetstream_answers
from ops.infra.process import PidRecord, free_port, port_in_use
from ops.infra.stack import ServiceStatus, Stack, format_table

__all__ = [
    "HOST",
    "DockerEngine",
    "InfraConfig",
    "InfraError",
    "KafkaBroker",
    "NatsServer",
    "PidRecord",
    "PortInUseError",
    "ServiceStatus",
    "Stack",
    "bwrap_works",
    "docker_host",
    "docker_pings",
    "ensure_bwrap",
    "ensure_kafka_jars",
    "format_table",
    "free_port",
    "kafka_answers_metadata",
    "nats_jetstream_answers",
    "port_in_use",
]
