"""Knobs of the sandbox role and spec hygiene: limits a spec asks for are clamped to the configured maxima."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config import SandboxConfig


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    """Knobs of the sandbox role beyond :class:`engine.config.SandboxConfig` (same meaning, same units)."""

    idle_timeout_s: float = 300.0
    """An episode with no request for this long is closed (sandbox released, no checks run)."""
    open_timeout_s: float = 30.0
    """How long an ``open`` waits for a free sandbox before replying ``sandbox_unavailable``."""
    episode_share: float = 0.75
    """Fraction of ``max_sandboxes`` episodes may hold, so verification never starves."""
    max_tests: int = 64
    """Most tests of one code spec that are run; further ones count as failed."""
    max_turns: int = 64
    """Largest ``max_turns`` an episode spec may ask for."""
    reply_cache: int = 4096
    """Replies remembered for re-delivered requests."""

    def __post_init__(self) -> None:
        if self.idle_timeout_s <= 0 or self.open_timeout_s <= 0:
            raise ValueError("SandboxSettings: timeouts must be > 0")
        if not 0 < self.episode_share <= 1:
            raise ValueError(f"SandboxSettings.episode_share must be in (0, 1], got {self.episode_share}")


def _bounded(value: Any, maximum: float, *, integer: bool = False) -> tuple[float | int, bool]:
    """``value`` as a positive finite number no larger than ``maximum``; second item: was it changed."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    bounded = min(value, maximum) if ok else maximum
    if integer:
        bounded = max(1, int(bounded))
    return bounded, not ok or bounded != value


def clamp_spec(spec: dict[str, Any], cfg: SandboxConfig, settings: SandboxSettings) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``spec`` whose limits are within the configured maxima, and the fields that were changed.

    Limits a spec may carry: ``timeout_s`` (per command), ``checks[i].timeout_s``, ``max_turns``,
    ``memory_mb`` and ``pids`` (the pool's sandboxes have the configured ones whatever the spec says).
    A missing or non-numeric limit becomes the maximum.
    """
    out = dict(spec)
    clamped: list[str] = []
    maxima: dict[str, tuple[float, bool]] = {
        "timeout_s": (cfg.timeout_s, False),
        "max_turns": (settings.max_turns, True),
        "memory_mb": (cfg.memory_mb, True),
        "pids": (cfg.pids, True),
    }
    for name, (maximum, integer) in maxima.items():
        if name in out:
            out[name], changed = _bounded(out[name], maximum, integer=integer)
            if changed:
                clamped.append(name)
    checks = out.get("checks")
    if isinstance(checks, list):
        fixed = []
        for i, check in enumerate(checks):
            if isinstance(check, dict):
                check = dict(check)
                check["timeout_s"], changed = _bounded(check.get("timeout_s", cfg.timeout_s), cfg.timeout_s)
                if changed and "timeout_s" in checks[i]:
                    clamped.append(f"checks[{i}].timeout_s")
            fixed.append(check)
        out["checks"] = fixed
    tests = out.get("tests")
    if isinstance(tests, list) and len(tests) > settings.max_tests:
        out["tests"] = tests[: settings.max_tests]
        clamped.append("tests")
    return out, clamped
