"""Real services for integration tests, owned by the test session.

``kafka_bootstrap`` and ``nats_url`` use ROLLOUT_KAFKA_BOOTSTRAP / ROLLOUT_NATS_URL when set (e.g. a
stack from ``rollout infra up``); otherwise the session starts a private broker / nats-server on free
ports in a temporary state dir and stops them, by pid, at the end. ``docker_engine`` uses the engine
answering on DOCKER_HOST (or the configured socket) or starts one; it fails, never skips, when it cannot.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ops.infra import DockerEngine, InfraConfig, InfraError, KafkaBroker, NatsServer, free_port
from ops.infra.service import Service

HERE = Path(__file__).parent


def pytest_sessionstart(session: pytest.Session) -> None:
    # `timeout`, CI cancellation and `kill` send SIGTERM, which would end pytest without running
    # session finalizers and leave the servers it started behind. As KeyboardInterrupt, pytest unwinds
    # and the fixtures below stop them.
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def infra_config(tmp_path_factory: pytest.TempPathFactory) -> InfraConfig:
    """Private state dir and free ports for what this session starts (never the default ports)."""
    overrides: dict[str, object] = {}
    if os.environ.get("DOCKER_HOST", "").startswith("unix://"):
        overrides["docker_socket"] = os.environ["DOCKER_HOST"].removeprefix("unix://")
    return InfraConfig.from_env(
        state_dir=tmp_path_factory.mktemp("infra"),
        kafka_port=free_port(),
        kafka_controller_port=free_port(),
        nats_port=free_port(),
        **overrides,
    )


@contextmanager
def _running(service: Service) -> Iterator[Service]:
    """Start ``service``, wait until it answers, stop it (by pid) on exit; fail the tests if it cannot."""
    try:
        try:
            service.start()
            service.wait_ready()
        except InfraError as exc:
            pytest.fail(f"could not start {service.name} for the tests: {exc}\n{exc.log_tail}", pytrace=False)
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(infra_config: InfraConfig) -> Iterator[str]:
    """``host:port`` of a real Kafka broker."""
    if external := os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"):
        yield external
        return
    with _running(KafkaBroker(infra_config)):
        yield infra_config.kafka_bootstrap


@pytest.fixture(scope="session")
def nats_url(infra_config: InfraConfig) -> Iterator[str]:
    """``nats://host:port`` of a real nats-server with JetStream."""
    if external := os.environ.get("ROLLOUT_NATS_URL"):
        yield external
        return
    with _running(NatsServer(infra_config)):
        yield infra_config.nats_url


@pytest.fixture(scope="session")
def docker_engine(infra_config: InfraConfig) -> Iterator[DockerEngine]:
    """A Docker engine that answers; ``DOCKER_HOST`` points at it for the session.

    Use ``engine.docker_host`` as a client's ``base_url``, or ``docker.from_env()``.
    """
    engine = DockerEngine(infra_config)
    previous = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = engine.docker_host
    try:
        if engine.is_healthy():
            yield engine
        else:
            with _running(engine):
                yield engine
    finally:
        if previous is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = previous


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A name unique to this test run, legal for Kafka topics and NATS buckets: ``t-<test>-<hex8>``."""
    test = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")[:40]
    return f"t-{test}-{uuid.uuid4().hex[:8]}"
