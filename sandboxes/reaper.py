"""Removes what dead sandbox owners left behind: processes, cgroups, workspaces, uid claims.

Ours are recognised by name only inside our own namespaces (``rollout/sbx-*`` cgroups, ``sbx-*``
entries of the sandbox root) and judged dead by their owner file: the owner pid is gone, or the pid
now belongs to another process (its start time differs). Processes are found through the cgroups,
never by name.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sandboxes import bwrap
from sandboxes.cgroups import CgroupSet, available_controllers, list_groups


@dataclass(frozen=True)
class ReapReport:
    sandboxes: int
    processes: int


def _owner_alive(owner_file: Path) -> bool:
    try:
        pid_text, start = owner_file.read_text().split()
    except (OSError, ValueError):
        return False
    return bwrap.process_start_time(int(pid_text)) == start


def reap(root: Path | None = None) -> ReapReport:
    """One pass over the host; safe to run while live sandboxes (of any process) exist."""
    root = root or bwrap.SANDBOX_ROOT
    controllers = available_controllers()
    dead: set[str] = set()
    if root.is_dir():
        for entry in root.iterdir():
            name = entry.name.removesuffix(".owner")
            if not name.startswith(bwrap.PREFIX) or name.startswith(f"{bwrap.PREFIX}u"):
                continue
            if not _owner_alive(root / f"{name}.owner"):
                dead.add(name)
    for name in list_groups():
        if name.startswith(bwrap.PREFIX) and not _owner_alive(root / f"{name}.owner"):
            dead.add(name)
    killed = 0
    for name in sorted(dead):
        group = CgroupSet(name, controllers)
        killed += len(group.pids())
        group.kill_all()
        group.remove()
        workspace = root / name
        if workspace.exists():
            bwrap._umount(workspace)
            shutil.rmtree(workspace, ignore_errors=True)
        try:
            (root / f"{name}.owner").unlink()
        except FileNotFoundError:
            pass
    return ReapReport(sandboxes=len(dead), processes=killed)


def leftover_processes(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (for tests that check nothing survived)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found
