"""Inference backends by name: each registers itself with one :func:`register_inference_backend` call.

A backend either starts an embedded server for a deployment that names no ``inference.urls`` (its
``launch``), or serves only through servers started elsewhere (``launch`` None: the config must name
their URLs). ``inference.backend`` in the config and the deployment's inference role look the name up
here, so a new backend (e.g. a simulated one) is one module with one registration call. The registry is
the engine's one mechanism (:class:`engine.registry.Registry`): the built-in backends' modules are imported
on the first lookup, keeping this module cheap to import, and installed packages add backends through the
``rollout_engine.inference_backends`` entry-point group (an :class:`InferenceBackend`, or a module that
registers on import).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.registry import Registry

if TYPE_CHECKING:
    from engine.config import InferenceConfig

class Launch(Protocol):
    """``launch(cfg.inference, model_dir, run_dir)``: ``async with`` it yields the URL of a healthy server."""

    def __call__(self, cfg: InferenceConfig, model_dir: Path, run_dir: Path) -> AbstractAsyncContextManager[str]: ...

BUILTIN_MODULES = ("modelserver.launch",)
"""Modules whose import registers the backends that ship with the project (`local`, `sglang`)."""


@dataclass(frozen=True)
class InferenceBackend:
    name: str
    launch: Launch | None = None
    """Starts an embedded server when the config names no URLs; None: external servers only."""
    needs_model_dir: bool = False
    """The config must name the model directory (the servers' model, which the learner and tokenizer use)."""
    description: str = ""


def _adopt(registry: Registry[InferenceBackend], obj: object, origin: str) -> None:
    if not isinstance(obj, InferenceBackend):
        raise TypeError(f"expected an InferenceBackend (or a module that registers one), got {type(obj).__name__}")
    registry.register(obj.name, obj, origin=origin, replace=registry.origin(obj.name) == origin)


BACKENDS: Registry[InferenceBackend] = Registry(
    "inference backend", entry_point_group="rollout_engine.inference_backends", builtin_modules=BUILTIN_MODULES,
    adopt=_adopt)


def register_inference_backend(name: str, launch: Launch | None = None, *, needs_model_dir: bool = False,
                               description: str = "", replace: bool = False) -> InferenceBackend:
    """Make ``name`` an inference backend; ValueError if the name is taken (unless ``replace``) or malformed."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"inference backend name {name!r}: use letters, digits, '-' and '_'")
    if launch is not None and not callable(launch):
        raise TypeError(f"inference backend {name!r}: launch must be callable or None, got {launch!r}")
    return BACKENDS.register(name, InferenceBackend(name, launch, needs_model_dir, description), replace=replace,
                             origin=getattr(launch, "__module__", "") or "")


def unregister_inference_backend(name: str) -> None:
    """Forget ``name`` (tests that registered a backend clean up with this)."""
    BACKENDS.unregister(name)


def inference_backend_names() -> tuple[str, ...]:
    """Every registered backend name, sorted."""
    return tuple(BACKENDS.names())


def inference_backend(name: str) -> InferenceBackend:
    """The backend registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown inference backend {name!r}; expected one of {inference_backend_names()}") from None
