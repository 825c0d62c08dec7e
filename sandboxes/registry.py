"""Sandbox backends by name: each backend module registers itself with one call.

A backend is a module that ends with ``register_sandbox_backend("NAME", create, reap=...)``. Everything
that chooses a backend (the pool, ``sandbox.backend`` in the config, the CLI's ``--backend`` choices)
looks the name up here, so adding a backend touches no other file. The built-in backends' modules are
imported on the first lookup, so importing this module stays cheap. See docs/extending.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sandboxes.base import Sandbox
from sandboxes.limits import Limits

BUILTIN_MODULES = ("sandboxes.bwrap", "sandboxes.docker_backend")
"""Modules whose import registers the backends that ship with the project."""


@dataclass(frozen=True)
class SandboxBackend:
    """How to open a sandbox of one backend, and how to clean up leftovers of dead processes."""

    name: str
    create: Callable[[Limits], Awaitable[Sandbox]]
    """A new sandbox with these limits; the caller closes it."""
    reap: Callable[[], Awaitable[int]] | None = None
    """Remove sandboxes left by dead processes; how many. None: the backend leaves nothing behind."""
    description: str = ""


_BACKENDS: dict[str, SandboxBackend] = {}
_builtins_loaded = False


def register_sandbox_backend(name: str, create: Callable[[Limits], Awaitable[Sandbox]], *,
                             reap: Callable[[], Awaitable[int]] | None = None, description: str = "",
                             replace: bool = False) -> SandboxBackend:
    """Make ``name`` a sandbox backend; ValueError if the name is taken (unless ``replace``) or malformed."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"sandbox backend name {name!r}: use letters, digits, '-' and '_'")
    if not callable(create):
        raise TypeError(f"sandbox backend {name!r}: create must be callable, got {create!r}")
    if name in _BACKENDS and not replace:
        raise ValueError(f"sandbox backend {name!r} is already registered")
    backend = SandboxBackend(name, create, reap, description)
    _BACKENDS[name] = backend
    return backend


def unregister_sandbox_backend(name: str) -> None:
    """Forget ``name`` (tests that registered a backend clean up with this)."""
    _BACKENDS.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def sandbox_backend_names() -> tuple[str, ...]:
    """Every registered backend name, sorted (the CLI's ``--backend`` choices)."""
    _load_builtins()
    return tuple(sorted(_BACKENDS))


def sandbox_backend(name: str) -> SandboxBackend:
    """The backend registered as ``name``; ValueError naming the known ones otherwise."""
    _load_builtins()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {name!r}; expected one of {sandbox_backend_names()}") from None
