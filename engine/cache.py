"""Where cached artefacts live: one root for the Kafka jars, prepared models and tools built once.

The root is ``$ROLLOUT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/rollout-engine`` (``~/.cache/rollout-engine``).
It sits at the bottom of the layering so that every package can find its cache (the model server's
prepared models, ops' Kafka jars) without importing the package that runs the local stack.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_DIR_ENV = "ROLLOUT_CACHE_DIR"
"""Environment variable naming the cache root."""


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/rollout-engine``, or ``~/.cache/rollout-engine``: the root when none is named."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-engine"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The cache root: ``$ROLLOUT_CACHE_DIR`` (stripped) if set and not blank, else :func:`default_cache_dir`."""
    env = os.environ if environ is None else environ
    named = env.get(CACHE_DIR_ENV, "").strip()
    return Path(named) if named else default_cache_dir(env)
