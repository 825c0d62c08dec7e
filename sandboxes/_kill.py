"""SIGKILL a sandbox's processes until none is left: the one loop both process backends (bwrap, docker) use."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

from sandboxes.base import SandboxError

__all__ = ["kill_all", "kill_all_now", "kill_pid"]


def kill_pid(pid: int) -> None:
    """SIGKILL ``pid``; one already gone is fine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def kill_all(pids: Callable[[], set[int]], what: str, deadline_s: float = 5.0) -> None:
    """SIGKILL every process ``pids()`` names until it names none; SandboxError naming ``what`` if some
    survive ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while alive := pids():
        for pid in alive:
            kill_pid(pid)
        if time.monotonic() > end:
            raise SandboxError(f"{what}: processes {sorted(alive)} survive SIGKILL")
        await asyncio.sleep(0.001)


def kill_all_now(pids: Callable[[], set[int]], deadline_s: float = 1.0) -> None:
    """:func:`kill_all` without yielding to the event loop (cleanup while cancelled), best effort."""
    end = time.monotonic() + deadline_s
    while (alive := pids()) and time.monotonic() < end:
        for pid in alive:
            kill_pid(pid)
        time.sleep(0.0005)
