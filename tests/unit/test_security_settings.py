"""Security settings reach the clients; the secure infra helpers render what the servers need; the
drain endpoint's token check (in-process HTTP server on loopback, nothing external running)."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client

from engine.actor import Supervisor
from engine.config import KafkaConfig, NatsConfig, TelemetryConfig
from ops.http import HttpServer
from ops.infra import InfraConfig
from ops.infra.kafka_broker import render_server_properties
from ops.infra.secure import SecureKafkaBroker, SecureNatsServer, SelfSignedCA
from streams.kafka import client_security
from streams.nats import Nats, NatsError, connect_options


def infra(tmp_path: Path) -> InfraConfig:
    return InfraConfig(state_dir=tmp_path, kafka_port=19092, kafka_controller_port=19093, nats_port=14222,
                       kafka_version="4.3.1")


def props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def test_client_security_passes_sasl_and_tls_settings() -> None:
    assert client_security(KafkaConfig()) == {"security_protocol": "PLAINTEXT"}
    cfg = KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                      sasl_password="p", ssl_cafile="/ca.pem")
    assert client_security(cfg) == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                                    "sasl_plain_username": "u", "sasl_plain_password": "p", "ssl_cafile": "/ca.pem"}
    mtls = KafkaConfig(security_protocol="SSL", ssl_cafile="/ca.pem", ssl_certfile="/c.pem", ssl_keyfile="/c.key")
    assert client_security(mtls) == {"security_protocol": "SSL", "ssl_cafile": "/ca.pem", "ssl_certfile": "/c.pem",
                                     "ssl_keyfile": "/c.key"}


def test_nats_connect_options_carry_credentials() -> None:
    opts = connect_options(NatsConfig(url="nats://a:1,nats://b:2", user="u", password="p"))
    assert opts["servers"] == ["nats://a:1", "nats://b:2"] and (opts["user"], opts["password"]) == ("u", "p")
    assert connect_options(NatsConfig(token="t"))["token"] == "t"
    assert connect_options(NatsConfig(credentials="/x.creds"))["user_credentials"] == "/x.creds"
    assert not {"user", "password", "token", "user_credentials"} & connect_options(NatsConfig()).keys()


def test_nats_credentials_without_nkeys_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nkeys", None)  # import nkeys now raises ImportError
    with pytest.raises(NatsError, match=r"nats.credentials=/x.creds needs the nkeys package"):
        connect_options(NatsConfig(credentials="/x.creds"))


@pytest.mark.anyio
async def test_nats_connect_failing_before_setup_reports_its_own_error(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """nats-py reads the credentials before it sets up its queues; a failure there must surface as itself,
    not as the ``Client.connect must be called first`` of closing a client that never started."""
    def unreadable(self: Client) -> None:
        raise PermissionError("credentials unreadable")

    monkeypatch.setattr(Client, "_setup_nkeys_connect", unreadable)
    creds = write_creds(tmp_path / "u.creds")
    with pytest.raises(NatsError, match=r"could not connect to NATS at nats://127.0.0.1:1: PermissionError: "
                                        r"credentials unreadable"):
        await Nats(NatsConfig(url="nats://127.0.0.1:1", credentials=str(creds), timeout_s=5)).connect()


def write_creds(path: Path) -> Path:
    """A well-formed .creds file of a made-up user (nothing verifies its JWT here)."""
    from ops.infra.secure import NKey, encode_jwt, format_creds

    account, user = NKey.generate("account"), NKey.generate("user")
    path.write_text(format_creds(encode_jwt(account, user.public, "u", {"type": "user"}), user))
    return path


def test_secure_broker_properties(tmp_path: Path) -> None:
    ca = SelfSignedCA(ca_cert=tmp_path / "ca.pem", keystore=tmp_path / "s.p12", keystore_password="pw")
    broker = SecureKafkaBroker(infra(tmp_path), users={"alice": 'se"cret'}, ssl_port=19094, mtls_port=19095, ca=ca)
    p = props(render_server_properties(broker.config, tmp_path / "data", broker.extra_properties()))
    assert p["listeners"] == ("SASL_PLAINTEXT://127.0.0.1:19092,SASL_SSL://127.0.0.1:19094,SSL://127.0.0.1:19095,"
                              "CONTROLLER://127.0.0.1:19093")
    assert p["advertised.listeners"] == ("SASL_PLAINTEXT://127.0.0.1:19092,SASL_SSL://127.0.0.1:19094,"
                                         "SSL://127.0.0.1:19095")
    assert p["listener.name.ssl.ssl.client.auth"] == "required"  # the SSL listener is mutual TLS
    assert p["listener.name.ssl.ssl.truststore.location"] == str(ca.ca_cert)
    assert "listener.name.ssl.plain.sasl.jaas.config" not in p
    assert p["inter.broker.listener.name"] == "SASL_PLAINTEXT" and p["sasl.enabled.mechanisms"] == "PLAIN"
    jaas = p["listener.name.sasl_plaintext.plain.sasl.jaas.config"]
    assert 'user_alice="se\\"cret"' in jaas and jaas.endswith(";")
    assert p["listener.name.sasl_ssl.ssl.keystore.location"] == str(ca.keystore)
    assert "PLAINTEXT://" not in p["listeners"].replace("SASL_PLAINTEXT://", "")  # no unauthenticated listener
    assert ("CONTROLLER:PLAINTEXT" in p["listener.security.protocol.map"])
    with pytest.raises(ValueError):
        SecureKafkaBroker(infra(tmp_path), users={}, ssl_port=19094)


def test_secure_nats_config(tmp_path: Path) -> None:
    pw = SecureNatsServer(infra(tmp_path), auth="password", user="u", password="p")
    assert 'users = [ { user: "u", password: "p" } ]' in pw.render_config()
    assert pw.authed_url == "nats://u:p@127.0.0.1:14222" and pw.name == "nats-secure-password"
    tok = SecureNatsServer(infra(tmp_path), auth="token", token="t")
    assert 'authorization { token: "t" }' in tok.render_config() and tok.authed_url == "nats://t@127.0.0.1:14222"
    assert '"127.0.0.1:14222"' in tok.render_config()


def test_http_binds_loopback_by_default() -> None:
    assert TelemetryConfig().http_host == "127.0.0.1" and TelemetryConfig().control_token is None


@pytest.mark.anyio
@pytest.mark.parametrize(("token", "header", "status"), [
    (None, "Bearer x", 403),
    ("s3cret", None, 401),
    ("s3cret", "Bearer wrong", 401),
    ("s3cret", "s3cret", 401),          # the scheme is required
    ("s3cret", "Basic s3cret", 401),
    ("s3cret", "Bearer t\u00f6ken", 401),  # non-ASCII: a refusal, not a 500
    ("s3cret", "Bearer s3cret", 200),
    ("s3cret", "bearer  s3cret ", 200),
])
async def test_drain_needs_the_bearer_token(token: str | None, header: str | None, status: int) -> None:
    supervisor = Supervisor()
    async with HttpServer("127.0.0.1", 0, supervisor, control_token=token) as srv, aiohttp.ClientSession() as http:
        headers = {"Authorization": header} if header is not None else {}
        async with http.post(f"{srv.url}/drain", headers=headers) as r:
            assert r.status == status


def test_kafka_refusals_are_told_apart_from_outages() -> None:
    from kafka.errors import KafkaConnectionError, KafkaTimeoutError, SaslAuthenticationFailedError

    from streams.kafka_client import _connect_error
    from streams.kafka_refusals import is_refusal

    wrong = SaslAuthenticationFailedError("SaslAuthenticationFailedError: Authentication failed: Invalid username or password")
    untrusted = KafkaConnectionError("Handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    no_cert = KafkaConnectionError("[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required")
    assert is_refusal(wrong) and is_refusal(untrusted) and is_refusal(no_cert)
    assert not is_refusal(KafkaConnectionError("socket disconnected")) and not is_refusal(KafkaTimeoutError())
    cfg = KafkaConfig(bootstrap="b:9092", security_protocol="SASL_SSL", sasl_username="u", sasl_password="secret")
    err = str(_connect_error("cannot connect a producer to", cfg, wrong))
    assert err == ("cannot connect a producer to b:9092: SaslAuthenticationFailedError: Authentication failed: Invalid "
                   "username or password (the broker refused this client's security settings: kafka.security_protocol="
                   "SASL_SSL, sasl_mechanism=None, sasl_username=u, ssl_cafile=None, ssl_certfile=None)")
    assert "secret" not in err
    timeout = str(_connect_error("cannot connect a producer to", cfg, KafkaTimeoutError("Unable to bootstrap from b:9092")))
    assert timeout.startswith("cannot connect a producer to b:9092: KafkaTimeoutError: Unable to bootstrap from b:9092 "
                              "(unreachable, or it refused")
