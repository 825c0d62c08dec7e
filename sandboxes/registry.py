"""Sandbox backends by name: each backend module registers itself with one call.

A backend is a module that ends with ``register_sandbox_backend("NAME", create, reap=...)``. Everything
that chooses a backend (the pool, ``sandbox.backend`` in the config, the CLI's ``--backend`` choices)
looks the name up here, so adding a backend touches no other file. The registry is the engine's one
mechanism (:class:`engine.registry.Registry`): the built-in backends' modules are imported on the first
lookup (importing this module stays cheap), and installed packages add backends through the
``rollout_engine.sandbox_backends`` entry-point group (a :class:`SandboxBackend`, or a module that
registers on import). See docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine.registry import Registry
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


def _adopt(registry: Registry[SandboxBackend], obj: object, origin: str) -> None:
    if not isinstance(obj, SandboxBackend):
        raise TypeError(f"expected a SandboxBackend (or a module that registers one), got {type(obj).__name__}")
    registry.register(obj.name, obj, origin=origin, replace=registry.origin(obj.name) == origin)


BACKENDS: Registry[SandboxBackend] = Registry("sandbox backend", entry_point_group="rollout_engine.sandbox_backends",
                                              builtin_modules=BUILTIN_MODULES, adopt=_adopt)


def register_sandbox_backend(name: str, create: Callable[[Limits], Awaitable[Sandbox]], *,
                             reap: Callable[[], Awaitable[int]] | None = None, description: str = "",
                             replace: bool = False) -> SandboxBackend:
    """Make ``name`` a sandbox backend; ValueError if the name is taken (unless ``replace``) or malformed."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"sandbox backend name {name!r}: use letters, digits, '-' and '_'")
    if not callable(create):
        raise TypeError(f"sandbox backend {name!r}: create must be callable, got {create!r}")
    return BACKENDS.register(name, SandboxBackend(name, create, reap, description), replace=replace,
                             origin=getattr(create, "__module__", "") or "")


def unregister_sandbox_backend(name: str) -> None:
    """Forget ``name`` (tests that registered a backend clean up with this)."""
    BACKENDS.unregister(name)


def sandbox_backend_names() -> tuple[str, ...]:
    """Every registered backend name, sorted (the CLI's ``--backend`` choices)."""
    return tuple(BACKENDS.names())


def sandbox_backend(name: str) -> SandboxBackend:
    """The backend registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {name!r}; expected one of {sandbox_backend_names()}") from None
