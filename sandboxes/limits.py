"""Resource limits of one sandbox, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use. Every bound is enforced by the kernel (cgroups, rlimits, tmpfs size),
    except ``timeout_s`` (a wall clock kept by the engine) and ``output_bytes`` (kept by the reader)."""

    memory_mb: int = 512
    """Memory of the whole process tree, page cache of workspace files included (cgroup memory)."""
    pids: int = 128
    """Processes and threads alive at once (cgroup pids)."""
    cpu: float = 1.0
    """CPU time as a fraction of cores (cgroup cpu quota); 0.5 is half a core."""
    timeout_s: float = 30.0
    """Wall clock of one exec when the call gives none; the whole process tree is killed at it."""
    output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; the rest is read and discarded (``truncated``)."""
    workspace_mb: int = 256
    """Size of the tmpfs holding /work, /tmp and /verify together."""
    nofile: int = 256
    """Open files per process (RLIMIT_NOFILE)."""
    fsize_mb: int = 256
    """Largest file a process may write (RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Limits.{f.name} must be a number, got {value!r}")
            if value <= 0:
                raise ValueError(f"Limits.{f.name} must be > 0, got {value!r}")
        for name in ("memory_mb", "pids", "output_bytes", "workspace_mb", "nofile", "fsize_mb"):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"Limits.{name} must be an integer, got {getattr(self, name)!r}")
        if self.memory_mb < 16:
            raise ValueError(f"Limits.memory_mb must be >= 16 (a shell needs a few MB), got {self.memory_mb}")
        if self.pids < 2:
            raise ValueError(f"Limits.pids must be >= 2 (the sandbox init and the command), got {self.pids}")
        if self.nofile < 16:
            raise ValueError(f"Limits.nofile must be >= 16, got {self.nofile}")
