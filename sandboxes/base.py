"""The backend-independent surface: :class:`ExecResult`, the :class:`Sandbox` interface and output capping."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from types import TracebackType

from sandboxes.limits import Limits

WORKDIR = "/work"
"""The sandboxed command's working directory and home; writable, wiped at reset."""
VERIFY_DIR = "/verify"
"""Files the sandboxed code may read but not change (tests, runners); see :meth:`Sandbox.write_protected_files`."""

SANDBOX_ENV: dict[str, str] = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
}
"""The whole environment a sandboxed command starts with; nothing of the parent's leaks in."""


class SandboxError(RuntimeError):
    """A sandbox could not be created, used or cleaned up (not a failure of the sandboxed command)."""


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``exit_code`` is the shell convention: 128 + N when killed by signal N."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    duration_s: float
    truncated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class OutputCap:
    """Keeps the first ``cap`` bytes fed to it and counts the rest, so a flood costs no memory."""

    __slots__ = ("cap", "_chunks", "_kept", "dropped")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._chunks: list[bytes] = []
        self._kept = 0
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.cap - self._kept
        if room >= len(data):
            self._chunks.append(data)
            self._kept += len(data)
            return
        if room > 0:
            self._chunks.append(data[:room])
            self._kept += room
        self.dropped += len(data) - max(room, 0)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def getvalue(self) -> bytes:
        return b"".join(self._chunks)

    def text(self) -> str:
        return self.getvalue().decode("utf-8", errors="replace")


def normalize_path(path: str) -> str:
    """An absolute in-sandbox path for ``path`` (relative paths are under /work); refuses ``..`` escapes."""
    absolute = path if path.startswith("/") else f"{WORKDIR}/{path}"
    parts: list[str] = []
    for part in absolute.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise ValueError(f"path {path!r} may not contain '..'")
        parts.append(part)
    return "/" + "/".join(parts)


class Sandbox(abc.ABC):
    """One isolated machine for one episode: a workspace that persists across execs until :meth:`reset`.

    Every method is async and never blocks the event loop for longer than a process spawn.
    """

    id: str
    limits: Limits

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str | list[str],
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) as the unprivileged sandbox user.

        When it returns, no process the command started is left alive. ``env`` is added to
        :data:`SANDBOX_ENV`; ``cwd`` defaults to /work; ``timeout`` to ``limits.timeout_s``.
        """

    @abc.abstractmethod
    async def write_files(self, files: dict[str, str | bytes]) -> None:
        """Write files into the workspace (relative paths are under /work), creating directories."""

    @abc.abstractmethod
    async def write_protected_files(self, files: dict[str, str | bytes]) -> None:
        """Write files under /verify (paths relative to it), readable but not writable by sandboxed code."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """The contents of a file in the sandbox (relative paths are under /work)."""

    @abc.abstractmethod
    async def reset(self) -> None:
        """Return to pristine: no file, process or setting of earlier execs survives."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill everything and free the sandbox's resources. Idempotent."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
