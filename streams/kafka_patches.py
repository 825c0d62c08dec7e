"""Workaround: kafka-python 3.0 leaks sockets of connections that never completed.

What it fixes, in kafka-python 3.0.x (upstream: dpkp/kafka-python, ``kafka/net``):

1. ``KafkaNetSocket.connect`` creates a socket and awaits ``sock_connect``; when the connect fails or
   its coroutine is closed (a client closed while still connecting), the socket is not closed. It is
   reclaimed only by the garbage collector, with a ``ResourceWarning: unclosed <socket ...>``.
2. ``NetworkSelector.close`` closes connection transports "after their buffered data is flushed",
   which never happens once the selector itself is gone, so sockets still registered leak the same way.

Upstream: no issue for these two leaks was found (searched dpkp/kafka-python issues for unclosed
sockets on connect failure); the nearest upstream change is dpkp/kafka-python#2973 ("kafka.net.transport:
close connection on socket write error"), which closes on write errors but not on an aborted connect.

How: :func:`apply` replaces ``KafkaNetSocket.connect`` with a copy that closes the socket on any
exception (including cancellation), and wraps ``NetworkSelector.close`` to close sockets still
registered. Applied once when ``streams.kafka_client`` is imported, before any client is built (idempotent).
Remove this module when kafka-python closes sockets on an aborted connect by itself.
"""

from __future__ import annotations

import socket
from typing import Any

from kafka.net import inet as _kafka_inet
from kafka.net.selector import NetworkSelector as _KafkaNetworkSelector


def apply() -> None:
    """kafka-python 3.0's ``KafkaNetSocket.connect`` keeps a half-open socket when the connect fails or
    its coroutine is closed (a client closed while connecting): the socket is only reclaimed by the
    garbage collector, with a ResourceWarning. Close it there instead. Idempotent."""
    cls = _kafka_inet.KafkaNetSocket
    if getattr(cls.connect, "_closes_on_abort", False):
        return

    async def connect(self: Any, net: Any, addrinfo: tuple[Any, ...], socket_options: Any = (),
                      timeout_at: float | None = None) -> Any:
        family, sock_type, proto, _canonname, sockaddr = addrinfo
        sock = self.socket(family, sock_type, proto)
        try:
            sock.setblocking(False)
            for option in socket_options:
                sock.setsockopt(*option)
            return await self.sock_connect(net, sock, sockaddr, timeout_at=timeout_at)
        except BaseException:
            sock.close()
            raise

    connect._closes_on_abort = True  # type: ignore[attr-defined]
    cls.connect = connect

    # Closing the client closes its connections' transports "after their buffered data is flushed",
    # which never happens once the selector is gone: close what is still registered there first.
    selector_close = _KafkaNetworkSelector.close

    def close(self: Any) -> None:
        if not self._closed:
            own = {id(self._wakeup_r), id(self._wakeup_w)}
            leftovers = [key.fileobj for key in list(self._selector.get_map().values())
                         if id(key.fileobj) not in own and isinstance(key.fileobj, socket.socket)]
            selector_close(self)
            for sock in leftovers:
                sock.close()
            return
        selector_close(self)

    _KafkaNetworkSelector.close = close
