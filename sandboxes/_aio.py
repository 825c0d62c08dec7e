"""Event-loop primitives for child processes without helper threads: pidfd exit waits, pipe draining.

asyncio's own subprocess support parks one thread per child (ThreadedChildWatcher on 3.11); with
hundreds of sandboxes per process that is hundreds of threads, so sandboxes use these instead.
"""

from __future__ import annotations

import asyncio
import os

from sandboxes.base import OutputCap

READ_CHUNK = 1 << 18


async def wait_readable(fd: int) -> None:
    """Wait until ``fd`` is readable (a pidfd becomes readable when its process exits)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def drain(fd: int, cap: OutputCap) -> None:
    """Read the non-blocking ``fd`` until EOF into ``cap`` (which keeps a bounded prefix)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            while True:
                data = os.read(fd, READ_CHUNK)
                if not data:
                    if not fut.done():
                        fut.set_result(None)
                    return
                cap.feed(data)
        except BlockingIOError:
            return
        except OSError as exc:
            if not fut.done():
                fut.set_exception(exc)

    loop.add_reader(fd, readable)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


def _wake(fut: asyncio.Future[None]) -> None:
    """Writer callback: resolve ``fut`` once (the loop may call it again before it is removed)."""
    if not fut.done():
        fut.set_result(None)


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
