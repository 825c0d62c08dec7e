"""Isolated sandboxes for verifiers and multi-turn episodes: bubblewrap (default), docker, and any backend
registered with :func:`register_sandbox_backend`.

    async with open_sandbox("bwrap", Limits(memory_mb=256)) as sb:
        result = await sb.exec("python3 -c 'print(1)'", timeout=5)

See docs/sandboxes.md.
"""

from sandboxes.base import ExecResult, Sandbox, SandboxError
from sandboxes.limits import Limits
from sandboxes.pool import SandboxPool, create_sandbox, open_sandbox
from sandboxes.registry import register_sandbox_backend, sandbox_backend_names, unregister_sandbox_backend
from sandboxes.session import SandboxSession

__all__ = [
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxError",
    "SandboxPool",
    "SandboxSession",
    "create_sandbox",
    "open_sandbox",
    "register_sandbox_backend",
    "sandbox_backend_names",
    "unregister_sandbox_backend",
]
