"""The soak's descriptor census: what it counts is what the process holds, by kind."""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "loadtests" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("loadtests_soak_census", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_census_sees_new_sockets_and_pipes_by_kind() -> None:
    soak = load_soak()
    before = soak.fd_census(os.getpid())
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener = socket.create_server(("127.0.0.1", 0))
    r, w = os.pipe()
    try:
        after = soak.fd_census(os.getpid())
    finally:
        for s in (a, b, listener):
            s.close()
        os.close(r)
        os.close(w)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    assert {k: v for k, v in delta.items() if v} == {"socket_unix": 2, "socket_tcp": 1, "pipe": 2}
    assert sum(after.values()) == sum(before.values()) + 5
