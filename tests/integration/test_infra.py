"""The local stack for real: the broker, nats-server, the Docker engine, bubblewrap and the CLI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ops.infra import (
    DockerEngine,
    InfraConfig,
    KafkaBroker,
    NatsServer,
    PidRecord,
    bwrap_works,
    free_port,
    kafka_answers_metadata,
    nats_jetstream_answers,
)
from ops.infra.kafka_broker import MAX_MESSAGE_BYTES


def rollout(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_") or k == "ROLLOUT_CACHE_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def test_broker_answers_metadata(kafka_bootstrap: str) -> None:
    from kafka import KafkaAdminClient

    assert kafka_answers_metadata(kafka_bootstrap)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=10_000)
    try:
        assert len(admin.describe_cluster()["brokers"]) == 1
    finally:
        admin.close()


def test_large_record_round_trips_through_the_broker(kafka_bootstrap: str, unique_name: str) -> None:
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=10_000)
    try:
        admin.create_topics([NewTopic(unique_name, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    value = os.urandom(1_500_000)  # over the 1 MB default: the broker's message.max.bytes must allow it
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=MAX_MESSAGE_BYTES)
    try:
        producer.send(unique_name, key=b"k", value=value, headers=[("traceparent", b"00-x")]).get(timeout=30)
    finally:
        producer.close()
    consumer = KafkaConsumer(
        unique_name,
        bootstrap_servers=kafka_bootstrap,
        group_id=unique_name,
        auto_offset_reset="earliest",
        consumer_timeout_ms=30_000,
    )
    try:
        record = next(iter(consumer))
    finally:
        consumer.close()
    assert (record.key, record.value, record.headers) == (b"k", value, [("traceparent", b"00-x")])


@pytest.mark.anyio
async def test_nats_jetstream_kv_put_get(nats_url: str, unique_name: str) -> None:
    import nats

    nc = await nats.connect(nats_url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream(timeout=10)
        kv = await js.create_key_value(bucket=unique_name)
        revision = await kv.put("manifest", b"v1")
        entry = await kv.get("manifest")
        assert (entry.value, entry.revision) == (b"v1", revision)
        await js.delete_key_value(unique_name)
    finally:
        await nc.close()


def test_docker_engine_answers(docker_engine: DockerEngine) -> None:
    import docker

    client = docker.DockerClient(base_url=docker_engine.docker_host, timeout=10)
    try:
        assert client.ping()
    finally:
        client.close()
    assert os.environ["DOCKER_HOST"] == docker_engine.docker_host


def test_bwrap_runs_an_isolated_process() -> None:
    assert bwrap_works() is None


def test_cli_up_is_idempotent_and_down_stops_only_what_it_started(
    tmp_path: Path, kafka_bootstrap: str, nats_url: str
) -> None:
    state = tmp_path / "state"
    ports = {"--kafka-port": free_port(), "--kafka-controller-port": free_port(), "--nats-port": free_port()}
    up = ["infra", "up", "--state-dir", str(state), *(f"{k}={v}" for k, v in ports.items())]
    config = InfraConfig.from_env(
        state_dir=state,
        kafka_port=ports["--kafka-port"],
        kafka_controller_port=ports["--kafka-controller-port"],
        nats_port=ports["--nats-port"],
    )
    kafka, nats_server = KafkaBroker(config), NatsServer(config)
    try:
        first = rollout(*up)
        assert first.returncode == 0, first.stderr
        pids = (kafka.pid(), nats_server.pid())
        assert None not in pids

        second = rollout(*up)
        assert second.returncode == 0, second.stderr
        assert second.stdout.count("already running") == 2
        assert (kafka.pid(), nats_server.pid()) == pids

        status = rollout("infra", "status", "--state-dir", str(state))
        assert status.returncode == 0, status.stdout + status.stderr
        assert str(pids[0]) in status.stdout and f"127.0.0.1:{ports['--kafka-port']}" in status.stdout

        down = rollout("infra", "down", "--state-dir", str(state))
        assert down.returncode == 0, down.stderr
        assert not kafka.is_running() and not nats_server.is_running()
        # The session's own services, in another state dir, were not touched.
        assert kafka_answers_metadata(kafka_bootstrap)
        assert nats_jetstream_answers(nats_url)

        status = rollout("infra", "status", "--state-dir", str(state))
        assert status.returncode == 1
    finally:
        kafka.stop()
        nats_server.stop()


def test_down_never_signals_a_process_it_did_not_start(tmp_path: Path) -> None:
    config = InfraConfig.from_env(state_dir=tmp_path)
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        real = PidRecord.of_process(stranger.pid)
        assert real is not None
        # A pid file whose pid now belongs to another program (pid reuse), and one with a wrong start time.
        PidRecord(stranger.pid, real.start_ticks, ["/usr/bin/java", "kafka.Kafka"]).write(KafkaBroker(config).pid_file)
        PidRecord(stranger.pid, real.start_ticks + 1, real.argv).write(NatsServer(config).pid_file)
        result = rollout("infra", "down", "--state-dir", str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert stranger.poll() is None
        assert not KafkaBroker(config).pid_file.exists() and not NatsServer(config).pid_file.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_busy_port_gives_a_one_line_error_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = rollout(
            "infra", "up", "--state-dir", str(tmp_path), f"--kafka-port={port}",
            f"--kafka-controller-port={free_port()}", f"--nats-port={free_port()}",
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == f"rollout infra: port {port} is in use by another process; pass --kafka-port or stop it"
    assert not list(tmp_path.rglob("*.pid"))


def test_cli_up_jaeger_prints_the_otlp_endpoint_and_down_stops_it(tmp_path: Path) -> None:
    from ops.infra.jaeger import JaegerServer

    state = tmp_path / "state"
    ports = {"--kafka-port": free_port(), "--kafka-controller-port": free_port(), "--nats-port": free_port(),
             "--jaeger-otlp-port": free_port(), "--jaeger-port": free_port()}
    config = InfraConfig.from_env(state_dir=state, kafka_port=ports["--kafka-port"],
                                  kafka_controller_port=ports["--kafka-controller-port"], nats_port=ports["--nats-port"])
    jaeger = JaegerServer(config, otlp_port=ports["--jaeger-otlp-port"], query_port=ports["--jaeger-port"])
    services = (KafkaBroker(config), NatsServer(config), jaeger)
    try:
        up = rollout("infra", "up", "--jaeger", "--state-dir", str(state), *(f"{k}={v}" for k, v in ports.items()))
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{ports['--jaeger-otlp-port']}" in up.stdout
        assert jaeger.pid() is not None and jaeger.is_healthy()
        status = rollout("infra", "status", "--state-dir", str(state))  # remembers that jaeger was asked for
        assert status.returncode == 0 and "jaeger" in status.stdout, status.stdout + status.stderr
        down = rollout("infra", "down", "--state-dir", str(state))
        assert down.returncode == 0 and "jaeger: stopped" in down.stdout, down.stdout + down.stderr
        assert not jaeger.is_running()
    finally:
        for service in services:
            service.stop()
