"""Security of the daemons against real services that require it.

- Kafka: a broker whose client listeners require SASL/PLAIN (SASL_PLAINTEXT, and SASL_SSL with a
  throw-away CA) or a client certificate (mutual TLS, SSL), started by ``ops.infra.secure``. The
  engine's admin, producer and consumer work with the right credentials; no credentials, a wrong
  password, TLS without the CA, and mutual TLS without a client certificate or with one of another CA
  are refused with a ``StreamError`` naming the broker.
- NATS: nats-server requiring a user/password, one requiring a token, and one in operator mode (JWTs
  and nkeys made in the test) requiring a ``.creds`` file. ``Nats`` works with them and is refused with
  a ``NatsError`` (naming the authorization violation) without, or with a ``.creds`` file of an account
  the server does not know. The whole runtime (topics, producer, consumer group, weights published
  and fetched through the object store and KV) runs on a ``.creds`` login.
- HTTP: a real Deployment binds loopback by default; ``POST /drain`` is 403 without a configured token,
  401 with a missing or wrong one, 200 with the right one (and the deployment then drains).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anyio
import numpy as np
import pytest

from actors.runtime import Runtime
from engine.config import EngineConfig, KafkaConfig, NatsConfig, TelemetryConfig
from engine.schemas import DeadLetter
from ops.deployment import Deployment
from ops.infra import InfraConfig, InfraError, free_port
from ops.infra.secure import (SecureKafkaBroker, SecureNatsServer, make_account, make_client_cert,
                              make_nats_operator, make_test_ca, make_user_creds)
from streams.kafka import Consumer, Producer, StreamError, ensure_topics
from streams.nats import Nats, NatsError

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

USER, PASSWORD = "alice", "alice-secret"
FAST_FAIL = {"bootstrap_timeout_ms": 4000}
"""A client the broker drops without a reason (no SASL handshake at all) retries until its bootstrap
timeout (30 s by default): keep that case short. Refusals with a reason fail at once, without it."""


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafkaBroker]:
    state = tmp_path_factory.mktemp("secure-infra")
    config = InfraConfig.from_env(state_dir=state, kafka_port=free_port(), kafka_controller_port=free_port(),
                                  kafka_heap="-Xmx384m -Xms128m")
    broker = SecureKafkaBroker(config, users={USER: PASSWORD}, ssl_port=free_port(), mtls_port=free_port(),
                               ca=make_test_ca(state / "ca"))
    try:
        try:
            broker.start()
            broker.wait_ready(120)
        except InfraError as exc:
            pytest.fail(f"could not start the SASL broker: {exc}\n{exc.log_tail}", pytrace=False)
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module", params=["password", "token"])
def secure_nats(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNatsServer]:
    config = InfraConfig.from_env(state_dir=tmp_path_factory.mktemp("secure-nats"), nats_port=free_port())
    server = SecureNatsServer(config, auth=request.param)
    try:
        server.start()
        server.wait_ready(30)
        yield server
    finally:
        server.stop()


def sasl(bootstrap: str, password: str = PASSWORD, **kw: object) -> KafkaConfig:
    return KafkaConfig(bootstrap=bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                       sasl_username=USER, sasl_password=password, default_partitions=1, **kw)


def nats_credentials(server: SecureNatsServer, **kw: object) -> NatsConfig:
    if server.auth == "password":
        return NatsConfig(url=server.url, user=server.user, password=server.password, **kw)
    return NatsConfig(url=server.url, token=server.token, **kw)


def letter(i: int) -> DeadLetter:
    return DeadLetter(topic="t", partition=0, offset=i, reason="probe", error="", value=b"x" * i)


async def roundtrip(cfg: KafkaConfig, topic: str, n: int = 5) -> list[int]:
    """Create ``topic``, produce ``n`` records, read them back in a consumer group; their offsets."""
    await ensure_topics(cfg, {topic: 1})
    async with Producer(cfg, producer_id="security-test") as producer:
        for i in range(n):
            await producer.send(topic, letter(i), key=str(i))
    got: list[int] = []
    async with Consumer(cfg, topics=[topic], group=f"{topic}-g", expect=("dead_letter",)) as consumer:
        with anyio.fail_after(60):
            while len(got) < n:
                for record in await consumer.getmany(timeout_s=0.5):
                    got.append(record.message.offset)  # type: ignore[attr-defined]
                    record.ack()
        await consumer.commit()
    return sorted(got)


# -- Kafka ------------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
async def test_kafka_sasl_plaintext_and_sasl_ssl_work_with_credentials(secure_kafka: SecureKafkaBroker,
                                                                       unique_name: str) -> None:
    assert await roundtrip(sasl(secure_kafka.bootstrap_servers), f"{unique_name}-plain") == list(range(5))
    assert secure_kafka.ca is not None
    tls = KafkaConfig(bootstrap=secure_kafka.ssl_bootstrap, security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                      sasl_username=USER, sasl_password=PASSWORD, ssl_cafile=str(secure_kafka.ca.ca_cert))
    assert await roundtrip(tls, f"{unique_name}-tls") == list(range(5))


@pytest.mark.timeout(240)
async def test_kafka_refuses_clients_without_credentials(secure_kafka: SecureKafkaBroker) -> None:
    cfg = KafkaConfig(bootstrap=secure_kafka.bootstrap_servers)
    with pytest.raises(StreamError, match=rf"cannot connect a producer to {cfg.bootstrap}.*security_protocol"):
        await Producer(cfg, producer_id="intruder", **FAST_FAIL).start()
    with pytest.raises(StreamError, match=rf"cannot start a consumer on {cfg.bootstrap}"):
        await Consumer(cfg, assign_topics=["anything"], **FAST_FAIL).start()


@pytest.mark.timeout(240)
async def test_kafka_wrong_password_is_reported_with_the_brokers_reason(secure_kafka: SecureKafkaBroker) -> None:
    """With the default bootstrap timeout: the error is the broker's refusal, not kafka-python's
    ``Unable to bootstrap`` at the end of the timeout (streams/kafka_refusals.py)."""
    cfg = sasl(secure_kafka.bootstrap_servers, password="not-the-password")
    refused = (r": SaslAuthenticationFailedError: .*Invalid username or password.* \(the broker refused this "
               r"client's security settings: kafka.security_protocol=SASL_PLAINTEXT, sasl_mechanism=PLAIN, "
               rf"sasl_username={USER}, ")
    with pytest.raises(StreamError, match=rf"^cannot connect a producer to {cfg.bootstrap}{refused}") as caught:
        await Producer(cfg, producer_id="intruder").start()
    assert "not-the-password" not in str(caught.value)
    with pytest.raises(StreamError, match=rf"^cannot start a consumer on {cfg.bootstrap}{refused}"):
        await Consumer(cfg, assign_topics=["anything"]).start()
    with pytest.raises(StreamError, match=rf"^could not create topics \(t\) on {cfg.bootstrap}{refused}"):
        await ensure_topics(cfg, {"t": 1})


REFUSED_TLS = """
import asyncio, sys
from engine.config import KafkaConfig
from streams.kafka import Producer, StreamError
cfg = KafkaConfig(bootstrap=sys.argv[1], security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                  sasl_username=sys.argv[2], sasl_password=sys.argv[3])
try:
    asyncio.run(Producer(cfg, producer_id="intruder").start())
except StreamError as exc:
    print("refused:", exc)
"""


@pytest.mark.timeout(120)
def test_kafka_tls_refused_without_the_ca(secure_kafka: SecureKafkaBroker) -> None:
    """The right password, but a broker certificate the client cannot verify. Run in a child process:
    kafka-python drops the sockets of failed TLS handshakes unclosed (the GC closes them later with a
    ResourceWarning that would land in whichever test runs then)."""
    out = subprocess.run([sys.executable, "-c", REFUSED_TLS, secure_kafka.ssl_bootstrap, USER, PASSWORD],
                         capture_output=True, text=True, timeout=90)
    assert f"refused: cannot connect a producer to {secure_kafka.ssl_bootstrap}" in out.stdout, out.stderr[-2000:]
    assert "CERTIFICATE_VERIFY_FAILED" in out.stdout  # the reason, at once, not a bootstrap timeout
    assert "the broker refused this client's security settings: kafka.security_protocol=SASL_SSL" in out.stdout


@pytest.mark.timeout(240)
async def test_kafka_mutual_tls_works_with_a_client_certificate(secure_kafka: SecureKafkaBroker, unique_name: str) -> None:
    assert secure_kafka.ca is not None
    client = make_client_cert(secure_kafka.ca.ca_cert.parent, "rollout-client")
    mtls = KafkaConfig(bootstrap=secure_kafka.mtls_bootstrap, security_protocol="SSL", default_partitions=1,
                       ssl_cafile=str(secure_kafka.ca.ca_cert), ssl_certfile=str(client.cert), ssl_keyfile=str(client.key))
    assert await roundtrip(mtls, f"{unique_name}-mtls") == list(range(5))


REFUSED_MTLS = """
import asyncio, sys
from engine.config import KafkaConfig
from streams.kafka import Producer, StreamError
cfg = KafkaConfig(bootstrap=sys.argv[1], security_protocol="SSL", ssl_cafile=sys.argv[2],
                  ssl_certfile=sys.argv[3] or None, ssl_keyfile=sys.argv[4] or None)
try:
    asyncio.run(Producer(cfg, producer_id="intruder").start())
except StreamError as exc:
    print("refused:", exc)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["no-certificate", "another-ca"])
def test_kafka_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(secure_kafka: SecureKafkaBroker, case: str,
                                                                          tmp_path: Path) -> None:
    """In a child process, as for ``test_kafka_tls_refused_without_the_ca``."""
    assert secure_kafka.ca is not None
    cert = key = ""
    if case == "another-ca":
        make_test_ca(tmp_path / "other-ca")
        other = make_client_cert(tmp_path / "other-ca", "intruder")
        cert, key = str(other.cert), str(other.key)
    out = subprocess.run([sys.executable, "-c", REFUSED_MTLS, secure_kafka.mtls_bootstrap, str(secure_kafka.ca.ca_cert),
                          cert, key], capture_output=True, text=True, timeout=90)
    assert f"refused: cannot connect a producer to {secure_kafka.mtls_bootstrap}" in out.stdout, out.stderr[-2000:]
    assert "the broker refused this client's security settings: kafka.security_protocol=SSL" in out.stdout
    assert "KafkaTimeoutError" not in out.stdout, out.stdout  # refused with the handshake's reason
    print(out.stdout)


# -- NATS -------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
async def test_nats_requires_credentials(secure_nats: SecureNatsServer, unique_name: str) -> None:
    async with Nats(nats_credentials(secure_nats)) as nats:
        await nats.kv_put(unique_name, "k", b"v")
        assert await nats.kv_get(unique_name, "k") == b"v"
        info = await nats.put_bytes(f"{unique_name}-obj", "blob", b"\x00" * 1000)
        assert info["size"] == 1000
    wrong = (NatsConfig(url=secure_nats.url, user=secure_nats.user, password="wrong", timeout_s=3)
             if secure_nats.auth == "password" else NatsConfig(url=secure_nats.url, token="wrong", timeout_s=3))
    for cfg in (NatsConfig(url=secure_nats.url, timeout_s=3), wrong):
        with pytest.raises(NatsError, match=rf"{secure_nats.url}.*Authorization Violation"):
            await Nats(cfg).connect()


@pytest.mark.timeout(240)
async def test_runtime_on_secured_kafka_and_nats(secure_kafka: SecureKafkaBroker, tmp_path_factory: pytest.TempPathFactory,
                                                 unique_name: str) -> None:
    """The engine's whole runtime (topic admin, producer, consumer group, NATS) on credentials from config."""
    config = InfraConfig.from_env(state_dir=tmp_path_factory.mktemp("rt-nats"), nats_port=free_port())
    server = SecureNatsServer(config, auth="password")
    server.start()
    try:
        server.wait_ready(30)
        cfg = EngineConfig(namespace=unique_name, kafka=sasl(secure_kafka.bootstrap_servers),
                           nats=nats_credentials(server))
        async with Runtime(cfg) as rt:
            await rt.producer.send(rt.names.dlq, letter(3), key="k")
            consumer = rt.consumer("probe", ["dlq"], expect=("dead_letter",))
            async with consumer:
                with anyio.fail_after(60):
                    records = []
                    while not records:
                        records = await consumer.getmany(timeout_s=0.5)
                assert records[0].message.offset == 3  # type: ignore[attr-defined]
            assert rt.control is not None
            await rt.control.kv_put(f"{unique_name}-control", "hello", b"world")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def operator_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNatsServer]:
    state = tmp_path_factory.mktemp("operator-nats")
    config = InfraConfig.from_env(state_dir=state, nats_port=free_port())
    server = SecureNatsServer(config, auth="operator", operator=make_nats_operator(state / "keys"))
    try:
        server.start()
        server.wait_ready(30)
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(240)
async def test_runtime_on_nats_creds_in_operator_mode(operator_nats: SecureNatsServer, kafka_bootstrap: str,
                                                      unique_name: str, tmp_path: Path) -> None:
    """The engine's whole runtime on a ``.creds`` login: KV, object store, weights published and fetched."""
    from safetensors.numpy import save_file

    from streams.weights import WeightPublisher, WeightSubscriber

    assert operator_nats.operator is not None
    cfg = EngineConfig(namespace=unique_name, kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1),
                       nats=NatsConfig(url=operator_nats.url, credentials=str(operator_nats.operator.creds)))
    model = tmp_path / "model"  # what a weight version is: a (here made-up) Hugging Face model directory's files
    model.mkdir()
    save_file({"w": np.arange(300_000, dtype=np.float32)}, str(model / "model.safetensors"))  # > one 128 KiB chunk
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (model / name).write_text('{"made_up": true}')
    files = sorted(model.iterdir())
    async with Runtime(cfg) as rt:
        await rt.producer.send(rt.names.dlq, letter(2), key="k")
        nats = rt.require_control()
        await nats.kv_put(rt.names.bucket("control"), "hello", b"world")
        assert await nats.kv_get(rt.names.bucket("control"), "hello") == b"world"
        manifest = await WeightPublisher(nats, rt.names).publish(1, files)
        subscriber = WeightSubscriber(nats, rt.names, tmp_path / "fetched")
        latest = await WeightPublisher(nats, rt.names).latest()
        assert latest is not None and latest.version == manifest.version == 1
        vdir = await subscriber.fetch(latest)
        assert {f.name: f.read_bytes() for f in vdir.iterdir()} == {f.name: f.read_bytes() for f in files}


@pytest.mark.timeout(120)
async def test_nats_refuses_creds_of_another_account(operator_nats: SecureNatsServer, tmp_path: Path) -> None:
    """A well-formed .creds file whose account the server does not know (same operator, not in its resolver),
    and one of an account another operator signed: both refused with the server's reason."""
    assert operator_nats.operator is not None
    stranger, _ = make_account(operator_nats.operator.operator, "STRANGER")
    other_operator = make_nats_operator(tmp_path / "other-operator")
    for creds in (make_user_creds(stranger, "intruder", tmp_path / "stranger.creds"), other_operator.creds):
        cfg = NatsConfig(url=operator_nats.url, credentials=str(creds), timeout_s=3)
        with pytest.raises(NatsError, match=rf"{operator_nats.url}.*Authorization Violation"):
            await Nats(cfg).connect()


# -- HTTP -------------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
async def test_http_binds_loopback_and_drain_needs_the_token(kafka_bootstrap: str, nats_url: str,
                                                             unique_name: str, tmp_path: Path) -> None:
    base = dict(kafka=KafkaConfig(bootstrap=kafka_bootstrap, default_partitions=1), nats=NatsConfig(url=nats_url))
    assert TelemetryConfig().http_host == "127.0.0.1"

    # no token configured: the control surface is off
    cfg = EngineConfig(namespace=f"{unique_name}-a", **base)
    async with Deployment(cfg, roles=["reward"], run_dir=tmp_path / "a") as d, aiohttp.ClientSession() as http:
        assert d.http.url.startswith("http://127.0.0.1:")
        port = int(d.http.url.rsplit(":", 1)[1])
        assert not _accepts(_non_loopback_address(), port), "the HTTP server must not listen beyond loopback"
        async with http.post(f"{d.http.url}/drain", headers={"Authorization": "Bearer anything"}) as r:
            assert r.status == 403 and "control_token" in (await r.json())["error"]

    token = uuid.uuid4().hex
    cfg = EngineConfig(namespace=f"{unique_name}-b", telemetry=TelemetryConfig(control_token=token), **base)
    async with Deployment(cfg, roles=["reward"], run_dir=tmp_path / "b") as d, aiohttp.ClientSession() as http:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(d.run)  # returns once the drain finished
                while not d.supervisor.alive().get("reward"):
                    await anyio.sleep(0.05)
                reward = d.supervisor.actors["reward"]
                url = f"{d.http.url}/drain"
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token},
                                {"Authorization": f"Bearer {token}x"}, {"Authorization": "Bearer t\u00f6ken"}):
                    async with http.post(url, headers=headers) as r:
                        assert r.status == 401, headers
                assert not reward.draining
                async with http.get(url) as r:
                    assert r.status == 405  # state changes only by POST
                async with http.post(url, headers={"Authorization": f"Bearer {token}"}) as r:
                    assert r.status == 200 and (await r.json()) == {"draining": True}
        assert reward.draining and not any(d.supervisor.alive().values())
        assert d.supervisor.restarts("reward") == 0


def _non_loopback_address() -> str:
    """An address of this host that is not loopback (the route to a public address), else ''."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a source address
            return s.getsockname()[0]
        except OSError:
            return ""


def _accepts(host: str, port: int) -> bool:
    if not host or host.startswith("127."):
        return False
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0
