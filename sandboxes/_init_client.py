"""The host's side of the sandbox init's protocol (``sandboxes/sandbox_init.py``), shared by the bwrap
and docker backends: one exec is one request with the write ends of this process's pipes attached."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sandboxes import _aio
from sandboxes.base import SANDBOX_ENV, WORKDIR, OutputCap, normalize_path

KILL_GRACE_S = 2.0
"""How long to wait for pipes to close after a kill before giving up on the output."""


def request(seq: int, argv: list[str], env: dict[str, str] | None, cwd: str | None, stdin: bool,
            rlimits: dict[str, int], **extra: Any) -> bytes:
    """One exec request to the init: ``argv`` run in ``cwd`` (default /work) with ``env`` added to
    :data:`SANDBOX_ENV`, under ``rlimits``; ``extra`` fields are the backend's own (docker's ``user``)."""
    if not argv:
        raise ValueError("empty command")
    return json.dumps({
        "seq": seq,
        "argv": argv,
        "env": {**SANDBOX_ENV, **(env or {})},
        "cwd": normalize_path(cwd) if cwd else WORKDIR,
        "stdin": stdin,
        "rlimits": rlimits,
        **extra,
    }).encode()


async def reply(control: socket.socket, seq: int) -> dict[str, Any] | None:
    """The init's reply to request ``seq``; None if the init is gone."""
    loop = asyncio.get_running_loop()
    while True:
        data = await loop.sock_recv(control, 1 << 16)
        if not data:
            return None
        message = json.loads(data)
        if message.get("seq") == seq:
            return message
        # a reply to an exec that was cancelled mid-flight: not ours


async def run(
    control: socket.socket,
    seq: int,
    request: bytes,
    stdin: bytes | None,
    timeout: float,
    output_bytes: int,
    kill: Callable[[], Awaitable[None]],
    kill_now: Callable[[], None],
) -> tuple[dict[str, Any] | None, OutputCap, OutputCap, bool]:
    """Send exec ``request`` (number ``seq``) to the init and collect its output.

    Returns (the init's reply ``{"seq", "exit_code", ...}``, or None if the init is gone; stdout;
    stderr; timed out). At ``timeout`` the
    command's processes are killed with ``kill`` (everything but the init); if this coroutine is
    cancelled, with ``kill_now``, which must not await (a second cancellation could land there).
    """
    start = time.perf_counter()
    out_cap, err_cap = OutputCap(output_bytes), OutputCap(output_bytes)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if stdin is not None else (-1, -1)
    ours = [out_r, err_r]
    tasks: list[asyncio.Future[Any]] = []
    finished = False
    timed_out = False
    message: dict[str, Any] | None = None
    try:
        try:
            socket.send_fds(control, [request], [fd for fd in (in_r, out_w, err_w) if fd >= 0])
        finally:
            for fd in (in_r, out_w, err_w):
                if fd >= 0:
                    os.close(fd)
        for fd in (out_r, err_r, in_w):
            if fd >= 0:
                os.set_blocking(fd, False)
        answer = asyncio.ensure_future(reply(control, seq))
        tasks = [asyncio.ensure_future(_aio.drain(out_r, out_cap)), asyncio.ensure_future(_aio.drain(err_r, err_cap)),
                 answer]
        if stdin is not None:
            tasks.append(asyncio.ensure_future(_aio.write_all(in_w, stdin)))  # closes in_w
            in_w = -1
        remaining = timeout - (time.perf_counter() - start)
        _, pending = await asyncio.wait(tasks, timeout=max(remaining, 0.0))
        timed_out = bool(pending)
        if timed_out:
            await kill()
            _, pending = await asyncio.wait(pending, timeout=KILL_GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        message = answer.result() if answer.done() and not answer.cancelled() else None
        for task in tasks:
            if task is not answer and task.done() and not task.cancelled():
                task.result()
        finished = True
    finally:
        if not finished:
            for task in tasks:
                task.cancel()
            kill_now()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        for fd in ours + ([in_w] if in_w >= 0 else []):
            os.close(fd)
    return message, out_cap, err_cap, timed_out
