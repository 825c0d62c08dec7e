"""bubblewrap, the default sandbox backend: not a server, just a binary that must work here."""

from __future__ import annotations

import subprocess

from ops.infra.errors import InfraError
from ops.infra.process import apt_install, find_executable

SMOKE_ARGS = ["--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]


def find_bwrap() -> str | None:
    return find_executable("bwrap")


def bwrap_works(bwrap: str | None = None, timeout_s: float = 10.0) -> str | None:
    """``None`` if an isolated ``true`` runs under bwrap, else the reason it does not."""
    bwrap = bwrap or find_bwrap()
    if bwrap is None:
        return "bwrap not found (apt-get install bubblewrap)"
    try:
        result = subprocess.run([bwrap, *SMOKE_ARGS], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"`bwrap {' '.join(SMOKE_ARGS)}` timed out"
    if result.returncode != 0:
        return f"`bwrap {' '.join(SMOKE_ARGS)}` failed (exit {result.returncode}): {result.stderr.strip()}"
    return None


def ensure_bwrap() -> str:
    """Path of a working ``bwrap``, installing Debian's bubblewrap first if it is missing."""
    if find_bwrap() is None:
        apt_install(["bubblewrap"])
    bwrap = find_bwrap()
    problem = bwrap_works(bwrap)
    if problem is not None or bwrap is None:
        raise InfraError(problem or "bwrap not found after installing bubblewrap")
    return bwrap
