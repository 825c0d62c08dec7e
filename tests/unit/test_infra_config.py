"""Local-infrastructure logic that needs nothing running: config, pid files, ports, rendering."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.cli import build_parser
from ops.infra import InfraConfig, InfraError, PidRecord, PortInUseError, ServiceStatus, format_table, port_in_use
from ops.infra import kafka_broker
from ops.infra.config import pom_kafka_version
from ops.infra.kafka_broker import MAX_MESSAGE_BYTES, new_cluster_id, render_server_properties
from ops.infra.process import ensure_port_free, spawn, stop_process
from ops.infra.service import Service
from ops.infra.stack import Stack


def test_defaults() -> None:
    config = InfraConfig.from_env(env={})
    assert (config.kafka_port, config.kafka_controller_port, config.nats_port) == (9092, 9093, 4222)
    assert config.kafka_bootstrap == "127.0.0.1:9092"
    assert config.nats_url == "nats://127.0.0.1:4222"
    assert config.docker_host == "unix:///var/run/docker.sock"
    assert config.state_dir.parts[-2:] == (".state", "infra")
    assert config.kafka_version == pom_kafka_version() == "4.3.1"


def test_env_vars_then_explicit_values_win() -> None:
    env = {"ROLLOUT_KAFKA_PORT": "19092", "ROLLOUT_NATS_PORT": "14222", "ROLLOUT_STATE_DIR": "/tmp/s", "KAFKA_HEAP_OPTS": "-Xmx2G"}
    config = InfraConfig.from_env(env=env)
    assert (config.kafka_port, config.nats_port, config.state_dir, config.kafka_heap) == (19092, 14222, Path("/tmp/s"), "-Xmx2G")
    assert InfraConfig.from_env(env={**env, "ROLLOUT_KAFKA_HEAP": "-Xmx3G"}).kafka_heap == "-Xmx3G"
    assert InfraConfig.from_env(env=env, kafka_port=29092, nats_port=None).kafka_port == 29092
    assert InfraConfig.from_env(env=env, nats_port=None).nats_port == 14222


def test_bad_values_name_their_source() -> None:
    with pytest.raises(InfraError, match=r"^invalid ROLLOUT_KAFKA_PORT='nine': .*integer"):
        InfraConfig.from_env(env={"ROLLOUT_KAFKA_PORT": "nine"})
    with pytest.raises(InfraError, match=r"^invalid nats_port=70000: "):
        InfraConfig.from_env(env={}, nats_port=70000)


def test_server_properties() -> None:
    config = InfraConfig.from_env(env={}, kafka_port=19092, kafka_controller_port=19093)
    props = dict(line.split("=", 1) for line in render_server_properties(config, Path("/d")).splitlines())
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["log.dirs"] == "/d"
    assert props["auto.create.topics.enable"] == "false"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert int(props["message.max.bytes"]) == MAX_MESSAGE_BYTES <= int(props["replica.fetch.max.bytes"])
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor", "transaction.state.log.min.isr"):
        assert props[key] == "1"


def test_cluster_id_is_a_kafka_uuid() -> None:
    cid = new_cluster_id()
    assert len(cid) == 22 and len(base64.urlsafe_b64decode(cid + "==")) == 16
    assert cid != new_cluster_id()
    # never an id the storage tool would parse as an option (one in 64 random ids starts with "-")
    assert not any(new_cluster_id().startswith("-") for _ in range(2000))


def test_pid_record_round_trip_and_ownership(tmp_path: Path) -> None:
    me = PidRecord.of_process(os.getpid())
    assert me is not None and me.is_alive()
    path = tmp_path / "x.pid"
    me.write(path)
    assert PidRecord.read(path) == me
    # Same pid, different process (reused pid) or different start time: not ours.
    assert not PidRecord(me.pid, me.start_ticks, ["/usr/bin/java"]).is_alive()
    assert not PidRecord(me.pid, me.start_ticks + 1, me.argv).is_alive()
    path.write_text("garbage")
    assert PidRecord.read(path) is None
    assert PidRecord.read(tmp_path / "missing.pid") is None


def test_stop_process_stops_its_own_and_ignores_stale_records(tmp_path: Path) -> None:
    pid_file = tmp_path / "sleep.pid"
    pid = spawn(["sleep", "300"], pid_file=pid_file, log_file=tmp_path / "sleep.out")
    record = PidRecord.read(pid_file)
    assert record is not None and record.pid == pid and record.is_alive()
    assert record.argv == ["sleep", "300"]
    assert stop_process(pid_file) == pid
    assert not record.is_alive() and not pid_file.exists()
    # A record of a pid that now runs something else is dropped without a signal.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        PidRecord(stranger.pid, -1, ["sleep", "300"]).write(pid_file)
        assert stop_process(pid_file) is None
        assert stranger.poll() is None and not pid_file.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_stop_process_escalates_to_sigkill(tmp_path: Path) -> None:
    pid_file = tmp_path / "stubborn.pid"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
    spawn([sys.executable, "-c", code], pid_file=pid_file, log_file=tmp_path / "out")
    while "up" not in (tmp_path / "out").read_text():
        time.sleep(0.01)
    record = PidRecord.read(pid_file)
    assert record is not None
    assert stop_process(pid_file, term_timeout_s=0.3) == record.pid
    assert not record.is_alive() and not pid_file.exists()


def test_busy_port_check() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(PortInUseError) as info:
            ensure_port_free(port, "--nats-port")
        assert str(info.value) == f"port {port} is in use by another process; pass --nats-port or stop it"
    assert not port_in_use(port)


def test_saved_addresses_apply_only_while_something_runs(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text('{"docker": true, "addresses": {"kafka_port": 19092}}')
    stack = Stack(InfraConfig.from_env(env={}, state_dir=tmp_path))
    assert stack.docker and stack.config.kafka_port == 9092


def test_status_table() -> None:
    rows = [ServiceStatus("kafka", 12, "127.0.0.1:9092", True), ServiceStatus("docker", None, "unix:///s", False, "x")]
    assert format_table(rows).splitlines() == [
        "service  pid  address         healthy",
        "kafka    12   127.0.0.1:9092  yes",
        "docker   -    unix:///s       NO (x)",
    ]


def test_cli_arguments() -> None:
    args = build_parser("infra").parse_args(["infra", "up", "--docker", "--kafka-port", "1234", "--state-dir", "/s"])
    assert (args.docker, args.bwrap, args.kafka_port, args.nats_port, args.state_dir) == (True, False, 1234, None, Path("/s"))
    assert callable(args.func)
    for action in ("down", "status"):
        assert callable(build_parser("infra").parse_args(["infra", action]).func)


def test_missing_java_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_broker, "find_executable", lambda name: None)
    with pytest.raises(InfraError) as info:
        kafka_broker.find_java()
    assert str(info.value) == "java not found: install a JDK 17+ (apt-get install openjdk-17-jre-headless)"


def test_maven_failure_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "mvn"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '[INFO] Scanning'\necho '[ERROR] Failed to execute goal: Could not resolve dependencies'\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    config = InfraConfig.from_env(env={}, cache_dir=tmp_path / "cache")
    with pytest.raises(InfraError) as info:
        kafka_broker.ensure_kafka_jars(config)
    assert str(info.value) == (
        "could not resolve Kafka jars from Maven Central: [ERROR] Failed to execute goal: Could not resolve dependencies"
    )
    assert not kafka_broker.kafka_libs_dir(config).exists()


class _Crasher(Service):
    name = "crasher"
    address = "nowhere"

    def ports(self) -> list[tuple[int, str]]:
        return []

    def argv(self) -> list[str]:
        return ["sh", "-c", "echo 'fatal: bad config' >&2; exit 3"]

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        return False


def test_a_process_that_dies_at_startup_reports_its_log(tmp_path: Path) -> None:
    crasher = _Crasher(InfraConfig.from_env(env={}, state_dir=tmp_path))
    pid = crasher.start()
    with pytest.raises(InfraError, match="crasher exited during start-up") as info:
        crasher.wait_ready(timeout_s=10)
    assert "fatal: bad config" in info.value.log_tail
    assert crasher.stop() is None
    assert not Path(f"/proc/{pid}").exists()  # reaped, not left as a zombie
