"""cgroup v1 groups for sandboxes: ``/sys/fs/cgroup/<controller>/rollout/<sandbox id>``.

Only the controllers that are mounted and writable are used; :attr:`CgroupSet.controllers` says which.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path(os.environ.get("ROLLOUT_CGROUP_ROOT", "/sys/fs/cgroup"))
PARENT = "rollout"
CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD_US = 100_000


def available_controllers() -> tuple[str, ...]:
    """The v1 controllers under which we can create groups (root, writable hierarchy)."""
    found = []
    for name in CONTROLLERS:
        base = CGROUP_ROOT / name
        if not (base / "cgroup.procs").exists():
            continue
        try:
            (base / PARENT).mkdir(exist_ok=True)
        except OSError:
            continue
        if os.access(base / PARENT, os.W_OK):
            found.append(name)
    return tuple(found)


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class CgroupSet:
    """One sandbox's groups across the controllers (memory, pids, cpu)."""

    def __init__(self, name: str, controllers: tuple[str, ...]) -> None:
        self.name = name
        self.controllers = controllers
        self.dirs = {c: CGROUP_ROOT / c / PARENT / name for c in controllers}

    def create(self, memory_mb: int, pids: int, cpu: float) -> None:
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        if "memory" in self.dirs:
            limit = str(memory_mb * 1024 * 1024)
            _write(self.dirs["memory"] / "memory.limit_in_bytes", limit)
            try:  # without swap accounting this file does not exist
                _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", limit)
            except OSError:
                pass
        if "pids" in self.dirs:
            _write(self.dirs["pids"] / "pids.max", str(pids))
        if "cpu" in self.dirs:
            try:
                _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(cpu * CFS_PERIOD_US))))
            except OSError:
                pass

    def add(self, pid: int) -> None:
        """Move ``pid`` into every group (its later children are born there)."""
        for d in self.dirs.values():
            _write(d / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        """Processes in the group (from the pids controller, or any other)."""
        for c in ("pids", "memory", "cpu"):
            if c in self.dirs:
                try:
                    return [int(x) for x in (self.dirs[c] / "cgroup.procs").read_text().split()]
                except FileNotFoundError:
                    return []
        return []

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this group so far."""
        if "memory" not in self.dirs:
            return 0
        try:
            for line in (self.dirs["memory"] / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except FileNotFoundError:
            pass
        return 0

    def memory_failcnt(self) -> int:
        if "memory" not in self.dirs:
            return 0
        try:
            return int((self.dirs["memory"] / "memory.failcnt").read_text())
        except FileNotFoundError:
            return 0

    def kill_all(self, deadline_s: float = 5.0) -> bool:
        """SIGKILL every process in the group until it is empty; False if processes remain at the deadline.

        Loops because a process may fork between the read of cgroup.procs and the kill; pids.max bounds
        how long that can go on.
        """
        end = time.monotonic() + deadline_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > end:
                return False
            time.sleep(0.001)

    def remove(self) -> None:
        """Delete the groups (after :meth:`kill_all`); a group still busy is left for the reaper."""
        for d in self.dirs.values():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise


def list_groups() -> set[str]:
    """Names of all sandbox groups under ``rollout/`` in any controller."""
    names: set[str] = set()
    for c in CONTROLLERS:
        base = CGROUP_ROOT / c / PARENT
        if base.is_dir():
            names.update(p.name for p in base.iterdir() if p.is_dir())
    return names
