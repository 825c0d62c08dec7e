"""Event-loop primitives for child processes without helper threads: pidfd exit waits, pipe draining.

asyncio's own subprocess support parks one thread per child (ThreadedChildWatcher on 3.11); with
hundreds of sandboxes per process that is hundreds of threads, so sandboxes use these instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from sandboxes.base import OutputCap

READ_CHUNK = 1 << 18


def _wake(fut: asyncio.Future[None]) -> None:
    """Reader or writer callback: resolve ``fut`` once (the loop may call it again before it is removed)."""
    if not fut.done():
        fut.set_result(None)


async def _while_readable(fd: int, on_readable: Callable[[asyncio.Future[None]], None]) -> None:
    """Call ``on_readable(fut)`` each time ``fd`` is readable, until it resolves ``fut``; then stop watching."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, on_readable, fut)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def wait_readable(fd: int) -> None:
    """Wait until ``fd`` is readable (a pidfd becomes readable when its process exits)."""
    await _while_readable(fd, _wake)


async def drain(fd: int, cap: OutputCap) -> None:
    """Read the non-blocking ``fd`` until EOF into ``cap`` (which keeps a bounded prefix)."""

    def readable(fut: asyncio.Future[None]) -> None:
        try:
            while True:
                data = os.read(fd, READ_CHUNK)
                if not data:
                    _wake(fut)
                    return
                cap.feed(data)
        except BlockingIOError:
            return
        except OSError as exc:
            if not fut.done():
                fut.set_exception(exc)

    await _while_readable(fd, readable)


async def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to the non-blocking ``fd`` and close it; a reader that goes away is not an error."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    try:
        while view:
            try:
                n = os.write(fd, view)
                view = view[n:]
            except BlockingIOError:
                fut: asyncio.Future[None] = loop.create_future()
                loop.add_writer(fd, _wake, fut)
                try:
                    await fut
                finally:
                    loop.remove_writer(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        os.close(fd)


async def read_json_object(fd: int, limit: int = 1 << 16) -> bytes:
    """Read from ``fd`` until a complete top-level JSON object has arrived (bwrap's --info-fd)."""
    buf = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            await wait_readable(fd)
            continue
        if not data:
            return buf
        buf += data
        if buf.count(b"{") and buf.count(b"{") == buf.count(b"}"):
            return buf
        if len(buf) > limit:
            raise ValueError("info object too large")
