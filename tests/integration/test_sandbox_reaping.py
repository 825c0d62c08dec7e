"""A process killed with SIGKILL has its sandboxes reaped within moments, not by a later sweep.

A child process starts a real bwrap pool (2 pre-warmed sandboxes, one checked out and used), prints its
sandbox ids and waits. The test SIGKILLs it (its whole process group, as ``loadtests/chaos.py`` does) and
polls, with a deadline, until the sandboxes' tmpfs mounts, cgroups and owner files are gone. No pool runs
in the test process, so nothing but the dead pool's death watcher can have reaped them; on a clean close
the watcher exits without a pass.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxes.bwrap import SANDBOX_ROOT
from sandboxes.cgroups import list_groups

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import asyncio, sys
from sandboxes import Limits, SandboxPool

async def main():
    pool = await SandboxPool("bwrap", Limits(memory_mb=64, pids=16, timeout_s=5), size=2, max_size=4).start()
    busy = await pool.checkout()
    assert (await busy.exec("echo hi > /work/f; cat /work/f")).stdout.strip() == "hi"
    print(" ".join(sorted(s.id for s in pool._all)), flush=True)
    if sys.argv[1] == "close":
        await pool.release(busy)
        await pool.close()
        print("closed", flush=True)
        return
    await asyncio.Event().wait()

asyncio.run(main())
"""


def mounted(ids: set[str]) -> set[str]:
    """The ids whose workspace is a mount point (as /proc/self/mountinfo lists it)."""
    points = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    return {i for i in ids if str(SANDBOX_ROOT / i) in points}


def leftovers(ids: set[str]) -> dict[str, set[str]]:
    return {"mounts": mounted(ids), "cgroups": list_groups() & ids,
            "owner files": {i for i in ids if (SANDBOX_ROOT / f"{i}.owner").exists()}}


def poll(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)


def start_child(mode: str) -> tuple[subprocess.Popen[str], set[str]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    ids = set(proc.stdout.readline().split())
    assert len(ids) == 2, f"the child printed no sandbox ids (rc {proc.poll()})"
    return proc, ids


def test_a_sigkilled_pools_sandboxes_are_reaped_within_seconds() -> None:
    proc, ids = start_child("hold")
    try:
        here = leftovers(ids)
        assert here["mounts"] == ids and here["cgroups"] == ids and here["owner files"] == ids, here
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    poll(lambda: not any(leftovers(ids).values()), 15, f"the killed pool's sandboxes reaped: {leftovers(ids)}")


def test_a_closed_pool_leaves_nothing_and_its_watcher_exits() -> None:
    proc, ids = start_child("close")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "closed"
    assert proc.wait(30) == 0  # close() waited for the watcher, which exited without a pass
    proc.stdout.close()
    assert not any(leftovers(ids).values()), leftovers(ids)
