"""Files a config names are checked before anything connects: each missing, unreadable or malformed file
is a ConfigError naming the source, the field and the path (certificates made by ``openssl``; nothing
running)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.runtime import Runtime
from engine.config import ConfigError, EngineConfig, KafkaConfig, NatsConfig, check_files, load_config
from ops.infra.secure import NKey, encode_jwt, format_creds, make_client_cert, make_test_ca
from streams.kafka import Consumer, Producer, ensure_topics
from streams.nats import Nats

UNREACHABLE_KAFKA = "127.0.0.1:1"
UNREACHABLE_NATS = "nats://127.0.0.1:1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_test_ca(d / "ca")
    client = make_client_cert(d / "ca", "client")
    other = make_client_cert(d / "other-ca", "other") if make_test_ca(d / "other-ca") else None
    assert other is not None
    combined = d / "combined.pem"  # certificate and key in one file
    combined.write_text(client.cert.read_text() + client.key.read_text())
    account, user = NKey.generate("account"), NKey.generate("user")
    creds = d / "u.creds"
    creds.write_text(format_creds(encode_jwt(account, user.public, "u", {"type": "user"}), user))
    account_jwt = encode_jwt(account, account.public, "a", {"type": "account"})
    account_creds = d / "account.creds"
    account_creds.write_text(format_creds(account_jwt, user))
    garbage = d / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    return {"ca": ca.ca_cert, "cert": client.cert, "key": client.key, "other_key": other.key,
            "combined": combined, "creds": creds, "account_creds": account_creds, "garbage": garbage,
            "dir": d}


def test_good_files_pass(pki: dict[str, Path]) -> None:
    check_files(EngineConfig(kafka=KafkaConfig(ssl_cafile=str(pki["ca"]), ssl_certfile=str(pki["cert"]),
                                               ssl_keyfile=str(pki["key"])),
                             nats=NatsConfig(credentials=str(pki["creds"]))))
    check_files(KafkaConfig(ssl_certfile=str(pki["combined"])))  # the key inside the certificate file
    check_files(EngineConfig())  # names no files


@pytest.mark.parametrize(("field", "name", "why"), [
    ("ssl_cafile", "missing.pem", "no such file"),
    ("ssl_cafile", "dir", "not a regular file"),
    ("ssl_cafile", "key", r"holds no PEM certificate"),
    ("ssl_cafile", "garbage", r"not a valid PEM certificate file"),
    ("ssl_certfile", "missing.pem", "no such file"),
    ("ssl_certfile", "creds", r"holds no PEM certificate"),
    ("ssl_certfile", "cert", r"holds no private key for its certificate and kafka.ssl_keyfile is not set"),
    ("ssl_keyfile", "missing.pem", "no such file"),
    ("ssl_keyfile", "ca", r"holds no PEM private key"),
    ("ssl_keyfile", "other_key", r"does not match the certificate in kafka.ssl_certfile="),
])
def test_kafka_files_are_checked(pki: dict[str, Path], field: str, name: str, why: str) -> None:
    path = pki.get(name, pki["dir"] / name)
    files = {"ssl_certfile": str(pki["cert"]), "ssl_keyfile": str(pki["key"])} if field != "ssl_cafile" else {}
    cfg = KafkaConfig(**{**files, field: str(path)})
    if field == "ssl_certfile" and name == "cert":
        cfg = KafkaConfig(ssl_certfile=str(path))
    with pytest.raises(ConfigError, match=rf"^run.toml: kafka.{field}: {path}: {why}"):
        check_files(cfg, "run.toml")


def test_a_key_without_a_certificate_is_refused(pki: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"^kafka.ssl_keyfile: set without kafka.ssl_certfile"):
        check_files(KafkaConfig(ssl_keyfile=str(pki["key"])))


def test_an_encrypted_key_is_refused(pki: dict[str, Path]) -> None:
    import subprocess

    encrypted = pki["dir"] / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(pki["key"]), "-out", str(encrypted), "-aes256",
                    "-passout", "pass:secret"], check=True, capture_output=True)
    with pytest.raises(ConfigError, match=rf"kafka.ssl_keyfile: {encrypted}: .*encrypted"):
        check_files(KafkaConfig(ssl_certfile=str(pki["cert"]), ssl_keyfile=str(encrypted)))


@pytest.mark.parametrize(("name", "why"), [
    ("missing.creds", "no such file"),
    ("dir", "not a regular file"),
    ("ca", r"not a NATS .creds file: no -----BEGIN NATS USER JWT----- block"),
    ("account_creds", r"holds a JWT of type 'account', not a user's"),
    ("no_seed", r"not a NATS .creds file: the user nkey seed \(SU...\) is missing"),
    ("bad_jwt", r"not a NATS .creds file: the line after -----BEGIN NATS USER JWT----- is not a JWT"),
])
def test_nats_credentials_are_checked(pki: dict[str, Path], name: str, why: str) -> None:
    text = pki["creds"].read_text()
    if name == "no_seed":
        (pki["dir"] / name).write_text(text.replace("\nSU", "\nXU"))
    if name == "bad_jwt":
        (pki["dir"] / name).write_text(text.replace("-----BEGIN NATS USER JWT-----\n", "-----BEGIN NATS USER JWT-----\nx"))
    path = pki.get(name, pki["dir"] / name)
    with pytest.raises(ConfigError, match=rf"^nats.credentials: {path}: {why}"):
        check_files(NatsConfig(credentials=str(path)))


def test_load_config_names_the_file_and_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text(f'[kafka]\nssl_cafile = "{tmp_path}/ca.pem"\n')
    load_config(f, environ={})  # without files=True: a config read on another host is not checked
    with pytest.raises(ConfigError, match=rf"^{f}: kafka.ssl_cafile: {tmp_path}/ca.pem: no such file$"):
        load_config(f, environ={}, files=True)
    creds = tmp_path / "x.creds"
    with pytest.raises(ConfigError, match=rf"^<defaults> \(\+ROLLOUT__\* environment\): nats.credentials: {creds}: "
                                          "no such file$"):
        load_config(environ={"ROLLOUT__NATS__CREDENTIALS": str(creds)}, files=True)


@pytest.mark.anyio
async def test_clients_check_files_before_connecting(tmp_path: Path) -> None:
    """Every client refuses at once, before trying the (unreachable) server."""
    missing = str(tmp_path / "missing.pem")
    kafka = KafkaConfig(bootstrap=UNREACHABLE_KAFKA, security_protocol="SSL", ssl_cafile=missing)
    match = rf"^kafka.ssl_cafile: {missing}: no such file"
    with pytest.raises(ConfigError, match=match):
        await Producer(kafka, producer_id="p").start()
    with pytest.raises(ConfigError, match=match):
        await Consumer(kafka, assign_topics=["t"]).start()
    with pytest.raises(ConfigError, match=match):
        await ensure_topics(kafka, {"t": 1})
    nats = NatsConfig(url=UNREACHABLE_NATS, credentials=str(tmp_path / "missing.creds"))
    with pytest.raises(ConfigError, match=rf"^nats.credentials: {tmp_path}/missing.creds: no such file"):
        await Nats(nats).connect()
    # the runtime checks NATS's files before it connects to Kafka
    with pytest.raises(ConfigError, match=r"^nats.credentials: "):
        await Runtime(EngineConfig(kafka=KafkaConfig(bootstrap=UNREACHABLE_KAFKA), nats=nats)).start()
