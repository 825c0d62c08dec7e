"""Workaround: kafka-python 3.0 hides a broker's refusal and retries it until its bootstrap timeout.

What it fixes, in kafka-python 3.0.12 (upstream: dpkp/kafka-python, ``kafka/net``):

1. A broker that refuses a SASL login sends the reason (``SaslAuthenticateResponse``: "Invalid
   username or password") and closes the connection. ``KafkaTCPTransport._sock_recv`` reads the
   response and then the end of the stream in one go and returns only the error: the response is
   dropped, the client sees ``socket disconnected``.
2. When a broker refuses a client at bootstrap (that SASL failure, a broker certificate the CA file
   does not verify, a client certificate the broker does not accept), the bootstrap loop logs it,
   backs off and tries again until ``bootstrap_timeout_ms`` (30 s), then raises ``KafkaTimeoutError:
   Unable to bootstrap`` without the reason. The connection manager remembers authentication failures
   per node (``_auth_failures``, raised by ``get_connection``), but only errors raised while
   connecting; a SASL failure arrives through the connection's ``init_future`` and is never recorded.

How: :func:`apply` makes the transport hand received bytes to the connection before it reports the end
of the stream (1); :class:`RefusalAwareManager` records a definitive refusal of a bootstrap connection
(its ``init_future``'s error) once upstream's ``_connect`` is done, so the bootstrap loop's next
``get_connection`` raises it: the client's constructor fails at once with the broker's reason (2). Only bootstrap nodes are watched, so
a running client's connections to brokers behave as upstream's.

Applied explicitly: ``streams.kafka_client._construct`` calls :func:`apply` (idempotent) and builds every
kafka-python client's network client with :func:`network_client`. Both can go when kafka-python
delivers data read before an EOF and fails a bootstrap on an authentication error by itself.
"""

from __future__ import annotations

import time
from typing import Any

import kafka.errors as Errors
from kafka.net.compat import KafkaNetClient
from kafka.net.manager import KafkaConnectionManager
from kafka.net.selector import NetworkSelector
from kafka.net.transport import KafkaTCPTransport

CERTIFICATE_REFUSALS = (
    "CERTIFICATE_VERIFY_FAILED",  # the broker's certificate is not signed by ssl_cafile (or names another host)
    "ALERT_CERTIFICATE_REQUIRED",  # mutual TLS: the client sent no certificate (TLS 1.3)
    "ALERT_HANDSHAKE_FAILURE",  # mutual TLS: the same, before TLS 1.3
    "ALERT_UNKNOWN_CA",  # mutual TLS: the client's certificate is signed by a CA the broker does not trust
    "ALERT_BAD_CERTIFICATE",
    "ALERT_CERTIFICATE_UNKNOWN",
)
"""OpenSSL reasons that no retry will change."""


def is_refusal(exc: BaseException) -> bool:
    """True for an error that says the broker refused this client's credentials or certificates."""
    if isinstance(exc, (Errors.SaslAuthenticationFailedError, Errors.UnsupportedSaslMechanismError)):
        return True
    text = str(exc).upper()
    return isinstance(exc, Errors.KafkaConnectionError) and any(reason in text for reason in CERTIFICATE_REFUSALS)


class RefusalAwareManager(KafkaConnectionManager):
    """A connection manager whose bootstrap stops at the first definitive refusal."""

    async def _connect(self, node: Any, conn: Any, *args: Any, **kwargs: Any) -> None:
        await super()._connect(node, conn, *args, **kwargs)
        # upstream's _connect clears the node's recorded failure once conn.initialize returns, which it
        # does also when the initialisation failed (the error goes to init_future): record it after that
        init = conn.init_future
        if self.cluster.is_bootstrap(node.node_id) and init.failed() and is_refusal(init.exception):
            self._auth_failures[node.node_id] = init.exception


def apply() -> None:
    """Patch ``KafkaTCPTransport._read_from_sock`` (and so the SSL transport's) to deliver the bytes read
    with the end of the stream before aborting. Idempotent."""
    if getattr(KafkaTCPTransport._read_from_sock, "_delivers_before_eof", False):
        return

    async def _read_from_sock(self: Any) -> None:  # upstream's loop, with the data handed over first
        while self._read and not self._closed:
            await self._net.wait_read(self._sock)
            recvd_data, err = self._sock_recv()
            if recvd_data:
                self.last_read = time.monotonic()
                if self._protocol and self._protocol._sensors:
                    self._protocol._sensors.bytes_received.record(len(recvd_data))
                try:
                    self._protocol.data_received(recvd_data)
                except Errors.KafkaProtocolError as e:
                    return self.abort(error=e)
                if err:
                    # let the coroutine waiting for that response (the SASL exchange) run and fail the
                    # connection with the broker's reason before the EOF fails it with "socket disconnected"
                    await self._net.sleep(0)
            if err:
                return self.abort(error=err)

    _read_from_sock._delivers_before_eof = True  # type: ignore[attr-defined]
    KafkaTCPTransport._read_from_sock = _read_from_sock


def network_client(**configs: Any) -> KafkaNetClient:
    """What kafka-python's ``kafka_client=`` option takes: its own network client, with the manager above."""
    net = NetworkSelector(**configs)
    return KafkaNetClient(net=net, manager=RefusalAwareManager(net, **configs))
