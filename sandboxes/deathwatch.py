"""A watcher process per sandbox pool that reaps the pool's sandboxes within moments of its owner's death.

A process killed with SIGKILL runs no cleanup: its sandboxes' workspaces (tmpfs mounts), cgroups and uid
claims stay until some live pool's periodic reaper pass (every 60 s) or a later start. So each pool
starts this small watcher (:func:`main`, ``--backend B --owner PID:START``), in its own
session (a kill of the owner's process group does not reach it). It waits on a pidfd of the owner
(polling /proc where pidfds are missing); when the owner is gone it runs the backend's reaper pass
(:func:`sandboxes.registry.sandbox_backend` ``.reap``, which judges sandboxes by their owner) and
exits. A pool that closes normally writes one byte on the watcher's stdin: it exits without a pass.
If the owner's parent leaves it a zombie, the pass waits until the zombie is reaped (the owner
file names a live process until then).
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.05
"""How often the owner's liveness is read where no pidfd is available, and while it is a zombie."""
ZOMBIE_WAIT_S = 300.0
"""How long a zombie owner is waited for before the watcher leaves the rest to the periodic reaper."""


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (tells a live process from a recycled pid); None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


_ENTRY = "import sys; from sandboxes.deathwatch import main; sys.exit(main(sys.argv[1:]))"
"""The watcher's command (not ``-m``: the package imports this module before runpy would run it)."""


class DeathWatch:
    """The owner side: the watcher process and the pipe whose byte tells it the pool closed normally."""

    def __init__(self, backend: str) -> None:
        pid = os.getpid()
        read_end, self._write_end = os.pipe()  # both non-inheritable: no other child keeps the watcher waiting
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, "--backend", backend,
                 "--owner", f"{pid}:{process_start_time(pid)}"],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
                cwd=Path(__file__).resolve().parents[1])
        finally:
            os.close(read_end)

    def close(self, timeout_s: float = 10.0) -> None:
        """The pool closed normally: the watcher exits without a pass. Idempotent."""
        if self._write_end < 0:
            return
        try:
            os.write(self._write_end, b"x")
        except OSError:  # the watcher is gone already
            pass
        os.close(self._write_end)
        self._write_end = -1
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait_for_death(pid: int, start: str) -> bool:
    """Block until the owner exits (True) or its pool closes normally (False: a byte on stdin)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if process_start_time(pid) != start:
        return True
    watched = [sys.stdin.fileno()] + ([pidfd] if pidfd is not None else [])
    while True:
        ready, _, _ = select.select(watched, [], [], None if pidfd is not None else POLL_S)
        if sys.stdin.fileno() in ready:
            if os.read(sys.stdin.fileno(), 1):
                return False  # closed normally
            watched.remove(sys.stdin.fileno())  # EOF: the owner is exiting; the pidfd (or polling) confirms it
        if pidfd is not None and pidfd in ready:
            return True
        if pidfd is None and process_start_time(pid) != start:
            return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--owner", required=True, help="PID:START (start time as in /proc/PID/stat)")
    args = parser.parse_args(argv)
    pid_text, _, start = args.owner.partition(":")
    if not pid_text.isdigit() or not start:
        parser.error(f"--owner must be PID:START, got {args.owner!r}")
    pid = int(pid_text)
    if not _wait_for_death(pid, start):
        return 0
    deadline = time.monotonic() + ZOMBIE_WAIT_S
    while process_start_time(pid) == start and time.monotonic() < deadline:  # a zombie: its owner file still names it
        time.sleep(POLL_S)
    import asyncio

    from sandboxes.registry import sandbox_backend

    reap = sandbox_backend(args.backend).reap
    if reap is not None:
        async def one_pass() -> int:
            return await reap()

        reaped = asyncio.run(one_pass())
        print(f"deathwatch: owner {pid} died; reaped {reaped} sandboxes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
