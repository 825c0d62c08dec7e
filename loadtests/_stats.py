"""Small measurement helpers shared by the load tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def machine_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, all cores, from ``/proc/stat``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def ci95(values: list[float], digits: int = 4) -> list[float] | None:
    """Mean +- 1.96 standard errors, rounded, or None for fewer than two values."""
    if len(values) < 2:
        return None
    mean, half = float(np.mean(values)), 1.96 * float(np.std(values, ddof=1)) / len(values) ** 0.5
    return [round(mean - half, digits), round(mean + half, digits)]
