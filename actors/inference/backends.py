"""Inference backends by name: each registers itself with one :func:`register_inference_backend` call.

A backend either starts an embedded server for a deployment that names no ``inference.urls`` (its
``launch``), or serves only through servers started elsewhere (``launch`` None: the config must name
their URLs). ``inference.backend`` in the config and the deployment's inference role look the name up
here, so a new backend (e.g. a simulated one) is one module with one registration call. The built-in
backends' modules are imported on the first lookup, keeping this module cheap to import.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.config import InferenceConfig

class Launch(Protocol):
    """``launch(cfg.inference, model_dir, run_dir)``: ``async with`` it yields the URL of a healthy server."""

    def __call__(self, cfg: InferenceConfig, model_dir: Path, run_dir: Path) -> AbstractAsyncContextManager[str]: ...

BUILTIN_MODULES = ("actors.inference.launch",)
"""Modules whose import registers the backends that ship with the project (`local`, `sglang`)."""


@dataclass(frozen=True)
class InferenceBackend:
    name: str
    launch: Launch | None = None
    """Starts an embedded server when the config names no URLs; None: external servers only."""
    needs_model_dir: bool = False
    """The config must name the model directory (the servers' model, which the learner and tokenizer use)."""
    description: str = ""


_BACKENDS: dict[str, InferenceBackend] = {}
_builtins_loaded = False


def register_inference_backend(name: str, launch: Launch | None = None, *, needs_model_dir: bool = False,
                               description: str = "", replace: bool = False) -> InferenceBackend:
    """Make ``name`` an inference backend; ValueError if the name is taken (unless ``replace``) or malformed."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"inference backend name {name!r}: use letters, digits, '-' and '_'")
    if launch is not None and not callable(launch):
        raise TypeError(f"inference backend {name!r}: launch must be callable or None, got {launch!r}")
    if name in _BACKENDS and not replace:
        raise ValueError(f"inference backend {name!r} is already registered")
    backend = InferenceBackend(name, launch, needs_model_dir, description)
    _BACKENDS[name] = backend
    return backend


def unregister_inference_backend(name: str) -> None:
    """Forget ``name`` (tests that registered a backend clean up with this)."""
    _BACKENDS.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def inference_backend_names() -> tuple[str, ...]:
    """Every registered backend name, sorted."""
    _load_builtins()
    return tuple(sorted(_BACKENDS))


def inference_backend(name: str) -> InferenceBackend:
    """The backend registered as ``name``; ValueError naming the known ones otherwise."""
    _load_builtins()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown inference backend {name!r}; expected one of {inference_backend_names()}") from None
