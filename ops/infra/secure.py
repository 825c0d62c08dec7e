"""A Kafka broker and a nats-server that require credentials, for tests and local trials of the
engine's security settings (``kafka.security_protocol``/``sasl_*``/``ssl_cafile``, ``nats.user``/
``password``/``token``).

- :class:`SecureKafkaBroker`: the local KRaft broker (:class:`~ops.infra.KafkaBroker`'s machinery) with
  a ``SASL_PLAINTEXT`` client listener on ``kafka_port`` and, optionally, a ``SASL_SSL`` one on
  ``ssl_port`` and a mutual-TLS ``SSL`` one on ``mtls_port`` (no SASL: clients must present a
  certificate the CA signed, :func:`make_client_cert`), both with a server certificate signed by a
  throw-away CA (:func:`make_test_ca`, ``openssl`` only: the keystore is PKCS#12, which Java reads
  without ``keytool``; the truststore is the CA's PEM file). SASL mechanism PLAIN, users
  in the listener's JAAS config (``listener.name.<listener>.plain.sasl.jaas.config``). The broker talks
  to itself over the SASL_PLAINTEXT listener as ``admin``; the KRaft controller listener stays
  PLAINTEXT on loopback (only the broker's own process uses it). No authorizer: every authenticated
  user may do everything (see docs/security.md).
- :class:`SecureNatsServer`: nats-server with JetStream from a config file whose ``authorization``
  block requires a user/password or a token, or (``auth="operator"``) in operator mode: accounts and
  users are JWTs signed by an operator (:func:`make_nats_operator`), clients log in with a ``.creds``
  file (a user JWT and the user's nkey seed, which signs the server's nonce).

Both are :class:`~ops.infra.service.Service` s: ``start()`` spawns detached, ``wait_ready()`` probes
with the credentials, ``stop()`` ends the process by its recorded pid.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from ops.infra.config import HOST, InfraConfig
from ops.infra.errors import InfraError
from ops.infra.kafka_broker import KafkaBroker
from ops.infra.nats_server import NatsServer, find_nats_server, nats_jetstream_answers
from ops.infra.process import find_executable, tcp_accepts

ADMIN_USER = "admin"
"""The broker's own SASL identity (inter-broker traffic on the SASL_PLAINTEXT listener)."""


def _openssl() -> str:
    """The ``openssl`` executable; InfraError if it is not installed."""
    openssl = find_executable("openssl")
    if openssl is None:
        raise InfraError("openssl not found: apt-get install openssl")
    return openssl


def _run_openssl(openssl: str, steps: Sequence[Sequence[object]]) -> None:
    """Run ``openssl STEP...`` for each step in turn; InfraError naming the first that fails, with its stderr."""
    for step in steps:
        result = subprocess.run([openssl, *map(str, step)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise InfraError(f"openssl {step[0]} failed (exit {result.returncode})", log_tail=result.stderr[-2000:])


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
    openssl = _openssl()
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
    _run_openssl(openssl, steps)
    return ca


@dataclasses.dataclass(frozen=True)
class ClientCertificate:
    """A client's PEM certificate and unencrypted key: ``kafka.ssl_certfile`` / ``kafka.ssl_keyfile``."""

    cert: Path
    key: Path


def make_client_cert(ca_dir: Path, name: str) -> ClientCertificate:
    """A client certificate (CN=``name``, extendedKeyUsage clientAuth) signed by the CA that
    :func:`make_test_ca` made in ``ca_dir``; idempotent."""
    openssl = _openssl()
    ca_key, ca_cert = ca_dir / "ca.key", ca_dir / "ca.pem"
    key, csr, cert = ca_dir / f"{name}.key", ca_dir / f"{name}.csr", ca_dir / f"{name}.pem"
    ext = ca_dir / f"{name}.ext"
    made = ClientCertificate(cert=cert, key=key)
    if cert.is_file() and key.is_file():
        return made
    ext.write_text("extendedKeyUsage=clientAuth\n")
    steps = [
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}"],
        ["x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", ext],
    ]  # fmt: skip
    _run_openssl(openssl, steps)
    return made


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
                 mtls_port: int | None = None, ca: SelfSignedCA | None = None) -> None:
        super().__init__(config)
        if (ssl_port is None and mtls_port is None) != (ca is None):
            raise ValueError("a SASL_SSL or mutual-TLS listener needs ca (make_test_ca), and only they do")
        self.users = {ADMIN_USER: "admin-secret", **users}
        self.ssl_port = ssl_port
        self.mtls_port = mtls_port
        self.ca = ca

    @property
    def ssl_bootstrap(self) -> str:
        if self.ssl_port is None:
            raise InfraError("this broker has no SASL_SSL listener")
        return f"{HOST}:{self.ssl_port}"

    @property
    def mtls_bootstrap(self) -> str:
        if self.mtls_port is None:
            raise InfraError("this broker has no mutual-TLS listener")
        return f"{HOST}:{self.mtls_port}"

    def ports(self) -> list[tuple[int, str]]:
        extra = [(port, name) for port, name in ((self.ssl_port, "ssl_port"), (self.mtls_port, "mtls_port"))
                 if port is not None]
        return [*super().ports(), *extra]

    def extra_properties(self) -> dict[str, str]:
        listeners = {"SASL_PLAINTEXT": self.config.kafka_port}
        if self.ssl_port is not None:
            listeners["SASL_SSL"] = self.ssl_port
        if self.mtls_port is not None:
            listeners["SSL"] = self.mtls_port
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
            if name.startswith("SASL"):
                props[f"listener.name.{name.lower()}.plain.sasl.jaas.config"] = _jaas(self.users)
        if self.ca is not None:
            for name in ("SASL_SSL", "SSL"):
                if name in listeners:
                    prefix = f"listener.name.{name.lower()}.ssl"
                    props.update({
                        f"{prefix}.keystore.type": "PKCS12",
                        f"{prefix}.keystore.location": str(self.ca.keystore),
                        f"{prefix}.keystore.password": self.ca.keystore_password,
                        f"{prefix}.key.password": self.ca.keystore_password,
                    })
        if "SSL" in listeners:
            assert self.ca is not None
            props.update({  # mutual TLS: a client without a certificate the CA signed is refused in the handshake
                "listener.name.ssl.ssl.client.auth": "required",
                "listener.name.ssl.ssl.truststore.type": "PEM",
                "listener.name.ssl.ssl.truststore.location": str(self.ca.ca_cert),
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


# -- NATS operator mode (decentralised JWT auth) -------------------------------------------------------

def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclasses.dataclass(frozen=True)
class NKey:
    """An ed25519 nkey: ``seed`` (S...) and ``public`` (O... operator, A... account, U... user)."""

    seed: bytes
    public: str

    @classmethod
    def generate(cls, role: Literal["operator", "account", "user"]) -> "NKey":
        import nkeys

        prefix = {"operator": nkeys.PREFIX_BYTE_OPERATOR, "account": nkeys.PREFIX_BYTE_ACCOUNT,
                  "user": nkeys.PREFIX_BYTE_USER}[role]
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return cls(seed=seed, public=nkeys.from_seed(seed).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        import nkeys

        return nkeys.from_seed(self.seed).sign(data)


def encode_jwt(issuer: NKey, subject: str, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT (v2): header ``{"typ": "JWT", "alg": "ed25519-nkey"}``, claims with ``jti`` (base32 of
    the SHA-512/256 of the claims without it, as the Go library computes it), ``iat``, ``iss``, ``name``,
    ``sub`` and the role's ``nats`` object (with ``type`` and ``version: 2``), signed by ``issuer`` over
    ``header.claims`` (base64url, no padding)."""
    claims: dict[str, object] = {"jti": "", "iat": int(time.time()), "iss": issuer.public, "name": name,
                                 "sub": subject, "nats": {**nats, "version": 2}}
    digest = hashlib.new("sha512_256", json.dumps(claims, separators=(",", ":")).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64url(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}." \
                    f"{_b64url(json.dumps(claims, separators=(',', ':')).encode())}"
    return f"{signing_input}.{_b64url(issuer.sign(signing_input.encode()))}"


def format_creds(user_jwt: str, user: NKey) -> str:
    """A ``.creds`` file's text, as ``nsc generate creds`` writes it."""
    return (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


ACCOUNT_LIMITS = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                  "conn": -1, "leaf": -1}
JETSTREAM_LIMITS = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
"""Unlimited; an account JWT without storage limits has JetStream disabled."""


@dataclasses.dataclass(frozen=True)
class NatsOperator:
    """An operator, its system account and one JetStream-enabled account whose user logs in with ``creds``."""

    operator_jwt: str
    system_account: str
    """Public key of the system account."""
    account: str
    """Public key of the account the user belongs to."""
    account_jwts: dict[str, str]
    """Public key -> JWT of every account the server knows (its ``resolver_preload``)."""
    creds: Path
    """The user's ``.creds`` file: give it to clients as ``nats.credentials``."""
    operator: NKey
    account_key: NKey


def make_account(operator: NKey, name: str, *, jetstream: bool = True) -> tuple[NKey, str]:
    account = NKey.generate("account")
    limits = {**ACCOUNT_LIMITS, **(JETSTREAM_LIMITS if jetstream else {})}
    return account, encode_jwt(operator, account.public, name, {"type": "account", "limits": limits,
                                                                "default_permissions": {"pub": {}, "sub": {}}})


def make_user_creds(account: NKey, name: str, path: Path) -> Path:
    """A user of ``account`` (no permission limits) written as a ``.creds`` file at ``path`` (mode 0600)."""
    user = NKey.generate("user")
    jwt = encode_jwt(account, user.public, name, {"type": "user", "pub": {}, "sub": {}, "subs": -1,
                                                  "data": -1, "payload": -1})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_creds(jwt, user))
    path.chmod(0o600)
    return path


def make_nats_operator(directory: Path, name: str = "rollout-test") -> NatsOperator:
    """Keys and JWTs of a throw-away operator, a system account, an account ``ROLLOUT`` with JetStream,
    and a user of it (``directory/rollout.creds``)."""
    operator = NKey.generate("operator")
    system, system_jwt = make_account(operator, "SYS", jetstream=False)
    account, account_jwt = make_account(operator, "ROLLOUT")
    operator_jwt = encode_jwt(operator, operator.public, name, {"type": "operator",
                                                                "system_account": system.public})
    creds = make_user_creds(account, "rollout", directory / "rollout.creds")
    return NatsOperator(operator_jwt=operator_jwt, system_account=system.public, account=account.public,
                        account_jwts={system.public: system_jwt, account.public: account_jwt}, creds=creds,
                        operator=operator, account_key=account)


class SecureNatsServer(NatsServer):
    """nats-server with JetStream whose clients must present a user/password (``auth="password"``), a
    token (``auth="token"``) or a ``.creds`` file of the operator's account (``auth="operator"``)."""

    name = "nats-secure"

    def __init__(self, config: InfraConfig, *, auth: Literal["password", "token", "operator"] = "password",
                 user: str = "rollout", password: str = "nats-secret", token: str = "nats-token",
                 operator: NatsOperator | None = None) -> None:
        super().__init__(config)
        if (auth == "operator") != (operator is not None):
            raise ValueError('auth="operator" needs operator= (make_nats_operator), and only it does')
        self.auth = auth
        self.user, self.password, self.token = user, password, token
        self.operator = operator
        self.name = f"nats-secure-{auth}"

    @property
    def config_file(self) -> Path:
        return self.dir / "nats.conf"

    @property
    def authed_url(self) -> str:
        """The URL with the credentials in it (``nats://user:pass@host:port`` or ``nats://token@host:port``)."""
        if self.auth == "operator":
            raise InfraError("an operator-mode server takes a .creds file, not credentials in the URL")
        cred = f"{self.user}:{self.password}" if self.auth == "password" else self.token
        return f"nats://{cred}@{HOST}:{self.config.nats_port}"

    def render_config(self) -> str:
        if self.auth == "password":
            authorization = f"authorization {{ users = [ {{ user: {json.dumps(self.user)}, " \
                            f"password: {json.dumps(self.password)} }} ] }}"
        elif self.auth == "token":
            authorization = f"authorization {{ token: {json.dumps(self.token)} }}"
        else:
            assert self.operator is not None
            preload = ", ".join(f"{key}: {json.dumps(jwt)}" for key, jwt in self.operator.account_jwts.items())
            authorization = "\n".join([
                f"operator: {json.dumps(self.operator.operator_jwt)}",
                f"system_account: {json.dumps(self.operator.system_account)}",
                "resolver: MEMORY",
                f"resolver_preload: {{ {preload} }}",
            ])
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
        if self.operator is not None:
            return nats_jetstream_answers(self.url, timeout_s, user_credentials=str(self.operator.creds))
        return nats_jetstream_answers(self.authed_url, timeout_s)
