"""A private Kafka broker and/or nats-server on free ports for a load test, stopped by pid at the end."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ops.infra import InfraConfig, KafkaBroker, NatsServer, free_port


@contextlib.contextmanager
def private_stack() -> Iterator[tuple[str, str]]:
    """Yields ``(kafka_bootstrap, nats_url)``."""
    with tempfile.TemporaryDirectory(prefix="rollout-loadtest-") as tmp:
        cfg = InfraConfig.from_env(state_dir=Path(tmp), kafka_port=free_port(), kafka_controller_port=free_port(),
                                   nats_port=free_port())
        services = [KafkaBroker(cfg), NatsServer(cfg)]
        try:
            for s in services:
                s.start()
            for s in services:
                s.wait_ready()
            yield cfg.kafka_bootstrap, cfg.nats_url
        finally:
            for s in services:
                s.stop()


@contextlib.contextmanager
def private_nats() -> Iterator[str]:
    """A nats-server alone (JetStream on a temporary directory); yields its URL."""
    with tempfile.TemporaryDirectory(prefix="rollout-loadtest-") as tmp:
        cfg = InfraConfig.from_env(state_dir=Path(tmp), nats_port=free_port())
        server = NatsServer(cfg)
        try:
            server.start()
            server.wait_ready()
            yield cfg.nats_url
        finally:
            server.stop()
