"""How this project connects kafka-python clients: settings, construction, and errors that say why.

Kept apart from ``streams/kafka.py`` (the producer and consumer) because every client (producer,
consumer, topic admin) is built the same way: TLS/SASL settings from the config (:func:`client_security`),
the kafka-python workarounds applied first (``kafka_patches``, ``kafka_refusals``), the network client
closed when the constructor fails (:func:`_construct`), and a :class:`StreamError` naming the broker and
the reason when it cannot connect (:func:`_connect_error`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.net.compat import KafkaNetClient

from engine.config import KafkaConfig
from streams import kafka_patches as _kafka_patches
from streams import kafka_refusals as _kafka_refusals
from streams.kafka_refusals import is_refusal
from streams.protocols import TransportError

log = logging.getLogger("rollout.streams.kafka")


class StreamError(TransportError):
    """A Kafka operation that failed; the message says which and why."""


def client_security(cfg: KafkaConfig) -> dict[str, Any]:
    """kafka-python keyword arguments for the configured security settings."""
    out: dict[str, Any] = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol.startswith("SASL"):
        out.update(sasl_mechanism=cfg.sasl_mechanism or "PLAIN",
                   sasl_plain_username=cfg.sasl_username, sasl_plain_password=cfg.sasl_password)
    for field in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):  # kafka-python's names are the config's
        if value := getattr(cfg, field):
            out[field] = value
    return out


def kafka_reason(exc: BaseException, what: str = "the request") -> str:
    """``Type: detail`` of a kafka-python error, once: its ``str()`` already starts with the type's name, and
    an error raised with no detail (a request or ``Timer`` that expired) reads ``KafkaTimeoutError: None``;
    then say what timed out instead."""
    name = type(exc).__name__
    detail = [str(a) for a in exc.args if a is not None and str(a)]
    if not detail:
        return f"{name}: {what} timed out" if isinstance(exc, KafkaTimeoutError) else name
    return f"{name}: {'; '.join(detail)}"


def _connect_error(what: str, cfg: KafkaConfig, exc: KafkaError) -> StreamError:
    """A StreamError naming the broker and, for a refusal or a bootstrap that never completed, the security
    settings in use (never the password). A refusal the broker explained (wrong password, a certificate
    either side does not accept) comes at once (streams/kafka_refusals.py); a timeout may be either."""
    settings = (f"kafka.security_protocol={cfg.security_protocol}, sasl_mechanism={cfg.sasl_mechanism}, "
                f"sasl_username={cfg.sasl_username}, ssl_cafile={cfg.ssl_cafile}, ssl_certfile={cfg.ssl_certfile}")
    hint = ""
    if is_refusal(exc):
        hint = f" (the broker refused this client's security settings: {settings})"
    elif isinstance(exc, KafkaTimeoutError):
        hint = f" (unreachable, or it refused this client's security settings: {settings})"
    return StreamError(f"{what} {cfg.bootstrap}: {_describe(exc)}{hint}")


def _describe(exc: KafkaError) -> str:
    """``Type: message`` without the ``[Error N] Type: Type:`` repetitions kafka-python's errors carry; an
    error with no detail says what timed out (``kafka_reason``)."""
    if not any(a is not None and str(a) for a in exc.args):
        return kafka_reason(exc, "waiting for the broker")
    name, text = type(exc).__name__, re.sub(r"^\[Error -?\d+\] ", "", str(exc))
    while text.startswith(f"{name}: "):
        text = text[len(name) + 2:]
    return f"{name}: {text}" if text and text != name else name


_kafka_patches.apply()


def _construct(factory: Callable[..., Any], **kwargs: Any) -> Any:
    """``factory(**kwargs)`` (a kafka-python client class); if the constructor fails (e.g. the broker refused
    the login), close the network client it made: kafka-python leaves it open, two sockets per attempt."""
    _kafka_refusals.apply()
    made: list[KafkaNetClient] = []

    def network_client(**kw: Any) -> KafkaNetClient:
        made.append(_kafka_refusals.network_client(**kw))
        return made[-1]

    try:
        return factory(**kwargs, kafka_client=network_client)
    except BaseException:
        for client in made:
            try:
                client.close()
            except Exception as exc:  # closing is best effort; the constructor's error is the one to report
                log.debug("closing a failed client: %s", exc)
        raise
