"""A real single-node Apache Kafka broker (KRaft, broker+controller in one JVM) on 127.0.0.1.

The jars come from Maven Central through ops/infra/kafka/pom.xml and are cached outside git in
``<cache_dir>/kafka-<version>/libs``; the broker runs as ``java -cp 'libs/*' kafka.Kafka server.properties``.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

from ops.infra.config import HOST, LOG4J2_CONFIG, POM_PATH, InfraConfig
from ops.infra.errors import InfraError
from ops.infra.process import find_executable, log_tail, tcp_accepts
from ops.infra.service import Service

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest record batch the broker accepts: room for 1 MB+ records (token streams, outcomes)."""

JAVA_MIN_MAJOR = 17


def render_server_properties(config: InfraConfig, data_dir: Path, extra: Mapping[str, str] | None = None) -> str:
    """The broker's server.properties; ``extra`` adds or replaces properties (e.g. SASL/TLS listeners)."""
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{HOST}:{config.kafka_controller_port}",
        "listeners": f"PLAINTEXT://{HOST}:{config.kafka_port},CONTROLLER://{HOST}:{config.kafka_controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{config.kafka_port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        # One broker: every internal topic has one replica.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # The default 50 partitions of each internal topic only slow down the first group join here.
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.num.partitions": "8",
        "group.initial.rebalance.delay.ms": "0",
        # The engine creates its topics with explicit partition counts; a typo must not create one.
        "auto.create.topics.enable": "false",
        "message.max.bytes": str(MAX_MESSAGE_BYTES),
        "replica.fetch.max.bytes": str(MAX_MESSAGE_BYTES),
    }
    props.update(extra or {})
    return "".join(f"{k}={v}\n" for k, v in props.items())


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (Kafka's Uuid format).

    Never one starting with ``-`` (one in 64 would): the storage tool's argument parser reads it as an
    option (Kafka's own ``Uuid.randomUuid`` avoids them for the same reason)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def find_java() -> str:
    """Path of a Java 17+ runtime, or a one-line error saying how to get one."""
    java = find_executable("java")
    if java is None:
        raise InfraError("java not found: install a JDK 17+ (apt-get install openjdk-17-jre-headless)")
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):  # "1.8.0" style
        major = int(match.group(2))
    if major < JAVA_MIN_MAJOR:
        raise InfraError(f"{java} is Java {major or '?'}: install a JDK 17+ (apt-get install openjdk-17-jre-headless)")
    return java


def kafka_libs_dir(config: InfraConfig) -> Path:
    return config.cache_dir / f"kafka-{config.kafka_version}" / "libs"


def ensure_kafka_jars(config: InfraConfig) -> Path:
    """The folder of the broker's jars, resolved from Maven Central on first use and cached."""
    libs = kafka_libs_dir(config)
    if (libs / f"kafka_2.13-{config.kafka_version}.jar").is_file():
        return libs
    mvn = find_executable("mvn")
    if mvn is None:
        raise InfraError("could not resolve Kafka jars from Maven Central: mvn not found (apt-get install maven)")
    libs.parent.mkdir(parents=True, exist_ok=True)
    print(f"infra: resolving Kafka {config.kafka_version} jars from Maven Central into {libs}", flush=True)
    # Resolve into a temporary sibling and rename, so an interrupted download never looks complete.
    with tempfile.TemporaryDirectory(dir=libs.parent, prefix=".libs-") as tmp:
        argv = [
            mvn, "-q", "-B", "-f", str(POM_PATH), "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp}", f"-Dkafka.version={config.kafka_version}",
        ]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0 or not (Path(tmp) / f"kafka_2.13-{config.kafka_version}.jar").is_file():
            lines = [ln for ln in (result.stdout + result.stderr).splitlines() if "ERROR" in ln] or [
                f"mvn exited {result.returncode}"
            ]
            raise InfraError(f"could not resolve Kafka jars from Maven Central: {lines[0].strip()}")
        shutil.rmtree(libs, ignore_errors=True)
        Path(tmp).rename(libs)
    return libs


class KafkaBroker(Service):
    """One KRaft broker+controller process; its data, config and logs live in ``<state>/kafka``."""

    name = "kafka"

    @property
    def address(self) -> str:
        return self.config.kafka_bootstrap

    @property
    def bootstrap_servers(self) -> str:
        return self.config.kafka_bootstrap

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def properties_file(self) -> Path:
        return self.dir / "server.properties"

    def ports(self) -> list[tuple[int, str]]:
        return [(self.config.kafka_port, "--kafka-port"), (self.config.kafka_controller_port, "--kafka-controller-port")]

    def extra_properties(self) -> dict[str, str]:
        """Properties added to (or replacing) the rendered server.properties; subclasses set listeners here."""
        return {}

    def _java_cmd(self, heap: list[str]) -> list[str]:
        return [
            find_java(), *heap, "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}", f"-Dkafka.logs.dir={self.logs_dir}",
            "-cp", f"{kafka_libs_dir(self.config)}/*",
        ]  # fmt: skip

    def argv(self) -> list[str]:
        return [*self._java_cmd(self.config.kafka_heap.split()), "kafka.Kafka", str(self.properties_file)]

    def prepare(self) -> None:
        find_java()
        ensure_kafka_jars(self.config)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        # Rewritten on every start: ports may differ from the last run. Static voters keep the formatted
        # storage valid across port changes.
        props = render_server_properties(self.config, self.data_dir, self.extra_properties())
        self.properties_file.write_text(props)
        if not (self.data_dir / "meta.properties").is_file():
            self._format_storage()

    def _format_storage(self) -> None:
        argv = [
            *self._java_cmd(["-Xmx256m"]), "kafka.tools.StorageTool", "format",
            "-t", new_cluster_id(), "-c", str(self.properties_file), "--ignore-formatted",
        ]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=self.dir)
        if result.returncode != 0:
            lines = (result.stdout + result.stderr).strip().splitlines()
            raise InfraError(
                f"kafka storage format failed (exit {result.returncode}) in {self.data_dir}: "
                f"{lines[-1] if lines else 'no output'}",
                log_tail="\n".join(lines[-20:]),
            )

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        return kafka_answers_metadata(self.bootstrap_servers, timeout_s)

    def startup_log(self) -> str:
        return "\n".join(t for t in (log_tail(self.logs_dir / "server.log", 20), log_tail(self.log_file, 10)) if t)


def kafka_answers_metadata(bootstrap: str, timeout_s: float = 3.0) -> bool:
    """True if a broker at ``bootstrap`` answers a metadata request listing at least one broker."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaConfigurationError, KafkaError

    host, _, port = bootstrap.rpartition(":")
    # A refused TCP connect is the common case while the JVM starts; kafka-python would log it as an error.
    if not tcp_accepts(int(port), host or HOST, timeout_s=min(timeout_s, 1.0)):
        return False
    ms = max(500, int(timeout_s * 1000))
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap,
            client_id="rollout-infra-probe",
            request_timeout_ms=ms,
            bootstrap_timeout_ms=ms,
            connections_max_idle_ms=max(ms + 1000, 10_000),
        )
        try:
            return bool(admin.describe_cluster().get("brokers"))
        finally:
            admin.close()
    except KafkaConfigurationError:
        raise
    except (KafkaError, OSError):
        return False
