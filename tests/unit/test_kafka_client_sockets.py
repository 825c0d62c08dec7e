"""A kafka-python client closed while waiting on its broker closes its socket.

streams/kafka.py also patches kafka-python 3.0 to close sockets of connects aborted mid-way (a race
this test cannot force on loopback; it showed as ResourceWarnings in the suite before the patch)."""

from __future__ import annotations

import gc
import socket

from kafka import KafkaConsumer

from streams.kafka_client import _construct


def test_a_client_closed_while_its_broker_is_silent_closes_its_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(20)
        port = server.getsockname()[1]
        # A pinned api_version: the constructor does not wait for the broker; the client connects in
        # its IO thread and then waits for an ApiVersions answer that never comes.
        client = _construct(KafkaConsumer, bootstrap_servers=f"127.0.0.1:{port}", api_version=(2, 8),
                            request_timeout_ms=60000, metadata_max_age_ms=60000)
        conn, _ = server.accept()
        with conn:
            client.close()
            gc.collect()  # an unclosed socket would warn here (warnings are errors in this suite)
            conn.settimeout(20)
            while conn.recv(65536):  # the client's request, then EOF (a timeout if it kept its end open)
                pass
