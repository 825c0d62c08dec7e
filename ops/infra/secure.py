"""A Kafka broker and a nats-server that require credentials, for tests and local trials of the
engine's security settings (``kafka.security_protocol``/``sasl_*``/``ssl_cafile``, ``nats.user``/
``password``/``token``).

- :class:`SecureKafkaBroker`: the local KRaft broker (:class:`~ops.infra.KafkaBroker`'s machinery) with
  a ``SASL_PLAINTEXT`` client listener on ``kafka_port`` and, optionally, a ``SASL_SSL`` one on
  ``ssl_port`` whose certificate is signed by a throw-away CA (:func:`make_test_ca`, ``openssl``
  only: the keystore is PKCS#12, which Java reads without ``keytool``). SASL mechanism PLAIN, users
  in the listener's JAAS config (``listener.name.<listener>.plain.sasl.jaas.config``). The broker talks
  to itself over the SASL_PLAINTEXT listener as ``admin``; the KRaft controller listener stays
  PLAINTEXT on loopback (only the broker's own process uses it). No authorizer: every authenticated
  user may do everything (see docs/security.md).
- :class:`SecureNatsServer`: nats-server with JetStream from a config file whose ``authorization``
  block requires a user/password or a token.

Both are :class:`~ops.infra.service.Service` s: ``start()`` spawns detached, ``wait_ready()`` probes
with the credentials, ``stop()`` ends the process by its recorded pid.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Literal

from ops.infra.config import HOST, InfraConfig
from ops.infra.errors import InfraError
from ops.infra.kafka_broker import KafkaBroker
from ops.infra.nats_server import NatsServer, find_nats_server, nats_jetstream_answers
from ops.infra.process import find_executable, tcp_accepts

ADMIN_USER = "admin"
"""The broker's own SASL identity (inter-broker traffic on the SASL_PLAINTEXT listener)."""


@dataclasses.dataclass(frozen=True)
class SelfSignedCA:
    """Files of a throw-away CA and one server certificate for 127.0.0.1 / localhost."""

    ca_cert: Path
    """PEM CA certificate: give it to clients as ``kafka.ssl_cafile``."""
    keystore: Path
    """PKCS#12 keystore holding the server's key and certificate chain."""
    keystore_password: str


def make_test_ca(directory: Path, password: str = "rollout-test") -> SelfSignedCA:
    """A CA and a server certificate (SAN IP:127.0.0.1, DNS:localhost) made with ``openssl``; idempotent."""
    openssl = find_executable("openssl")
    if openssl is None:
        raise InfraError("openssl not found: apt-get install openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext, keystore = directory / "server.ext", directory / "server.p12"
    ca = SelfSignedCA(ca_cert=ca_cert, keystore=keystore, keystore_password=password)
    if keystore.is_file() and ca_cert.is_file():
        return ca
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_cert, "-days", "2",
         "-subj", "/CN=rollout-engine test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={HOST}"],
        ["x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", ext],
        ["pkcs12", "-export", "-in", cert, "-inkey", key, "-certfile", ca_cert, "-name", "kafka",
         "-out", keystore, "-passout", f"pass:{password}"],
    ]  # fmt: skip
    for step in steps:
        result = subprocess.run([openssl, *map(str, step)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise InfraError(f"openssl {step[0]} failed (exit {result.returncode})", log_tail=result.stderr[-2000:])
    return ca


def _jaas(users: dict[str, str]) -> str:
    # PlainLoginModule: username/password are the broker's own (client side of inter-broker traffic);
    # user_<name>="<password>" entries are the accounts clients may log in as.
    entries = " ".join(f"user_{u}={json.dumps(p)}" for u, p in users.items())
    return (f"org.apache.kafka.common.security.plain.PlainLoginModule required "
            f"username={json.dumps(ADMIN_USER)} password={json.dumps(users[ADMIN_USER])} {entries};")


class SecureKafkaBroker(KafkaBroker):
    """A KRaft broker whose client listeners require SASL/PLAIN (and TLS on ``ssl_port`` if given)."""

    name = "kafka-secure"

    def __init__(self, config: InfraConfig, *, users: dict[str, str], ssl_port: int | None = None,
                 ca: SelfSignedCA | None = None) -> None:
        super().__init__(config)
        if (ssl_port is None) != (ca is None):
            raise ValueError("a SASL_SSL listener needs both ssl_port and ca (make_test_ca)")
        self.users = {ADMIN_USER: "admin-secret", **users}
        self.ssl_port = ssl_port
        self.ca = ca

    @property
    def ssl_bootstrap(self) -> str:
        if self.ssl_port is None:
            raise InfraError("this broker has no SASL_SSL listener")
        return f"{HOST}:{self.ssl_port}"

    def ports(self) -> list[tuple[int, str]]:
        extra = [(self.ssl_port, "ssl_port")] if self.ssl_port is not None else []
        return [*super().ports(), *extra]

    def extra_properties(self) -> dict[str, str]:
        listeners = {"SASL_PLAINTEXT": self.config.kafka_port}
        if self.ssl_port is not None:
            listeners["SASL_SSL"] = self.ssl_port
        client = ",".join(f"{name}://{HOST}:{port}" for name, port in listeners.items())
        props = {
            "listeners": f"{client},CONTROLLER://{HOST}:{self.config.kafka_controller_port}",
            "advertised.listeners": client,
            "listener.security.protocol.map": ",".join(["CONTROLLER:PLAINTEXT", *(f"{n}:{n}" for n in listeners)]),
            "inter.broker.listener.name": "SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
        }
        for name in listeners:
            props[f"listener.name.{name.lower()}.plain.sasl.jaas.config"] = _jaas(self.users)
        if self.ca is not None:
            props.update({
                "listener.name.sasl_ssl.ssl.keystore.type": "PKCS12",
                "listener.name.sasl_ssl.ssl.keystore.location": str(self.ca.keystore),
                "listener.name.sasl_ssl.ssl.keystore.password": self.ca.keystore_password,
                "listener.name.sasl_ssl.ssl.key.password": self.ca.keystore_password,
            })
        return props

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        return sasl_kafka_answers(self.bootstrap_servers, ADMIN_USER, self.users[ADMIN_USER], timeout_s)


def sasl_kafka_answers(bootstrap: str, user: str, password: str, timeout_s: float = 3.0) -> bool:
    """True if a broker at ``bootstrap`` answers a metadata request over SASL_PLAINTEXT/PLAIN."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    host, _, port = bootstrap.rpartition(":")
    if not tcp_accepts(int(port), host or HOST, timeout_s=min(timeout_s, 1.0)):
        return False
    ms = max(500, int(timeout_s * 1000))
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="rollout-infra-probe", request_timeout_ms=ms,
                                 bootstrap_timeout_ms=ms, connections_max_idle_ms=max(ms + 1000, 10_000),
                                 security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                                 sasl_plain_username=user, sasl_plain_password=password)
        try:
            return bool(admin.describe_cluster().get("brokers"))
        finally:
            admin.close()
    except (KafkaError, OSError):
        return False


class SecureNatsServer(NatsServer):
    """nats-server with JetStream whose clients must present a user/password (``auth="password"``) or a
    token (``auth="token"``)."""

    name = "nats-secure"

    def __init__(self, config: InfraConfig, *, auth: Literal["password", "token"] = "password",
                 user: str = "rollout", password: str = "nats-secret", token: str = "nats-token") -> None:
        super().__init__(config)
        self.auth = auth
        self.user, self.password, self.token = user, password, token
        self.name = f"nats-secure-{auth}"

    @property
    def config_file(self) -> Path:
        return self.dir / "nats.conf"

    @property
    def authed_url(self) -> str:
        """The URL with the credentials in it (``nats://user:pass@host:port`` or ``nats://token@host:port``)."""
        cred = f"{self.user}:{self.password}" if self.auth == "password" else self.token
        return f"nats://{cred}@{HOST}:{self.config.nats_port}"

    def render_config(self) -> str:
        if self.auth == "password":
            authorization = f"authorization {{ users = [ {{ user: {json.dumps(self.user)}, " \
                            f"password: {json.dumps(self.password)} }} ] }}"
        else:
            authorization = f"authorization {{ token: {json.dumps(self.token)} }}"
        return "\n".join([
            f"listen: {json.dumps(f'{HOST}:{self.config.nats_port}')}",
            f"server_name: {json.dumps(self.name)}",
            f"jetstream {{ store_dir: {json.dumps(str(self.dir / 'jetstream'))} }}",
            authorization, "",
        ])

    def argv(self) -> list[str]:
        return [find_nats_server(), "-c", str(self.config_file)]

    def prepare(self) -> None:
        super().prepare()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(self.render_config())
        self.config_file.chmod(0o600)

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        return nats_jetstream_answers(self.authed_url, timeout_s)
