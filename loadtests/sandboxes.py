"""Sandbox cycle benchmark: acquire + exec(`true`) + release from a pre-warmed pool, N workers,
against `docker run --rm --network none IMAGE true` measured in the same run.

Run it as `rollout loadtest sandboxes --backend bwrap --concurrency 4 --duration 20 [--open N] [--quick] [--json F]`.
The `docker run` baseline is measured only when a Docker engine answers (the figures say when it was
skipped); the open phase (``--open N``: N sandboxes open at once, the memory they take) is its own flag.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

from sandboxes import Limits, SandboxPool

COMMAND = ["true"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def _cycles(pool: SandboxPool, concurrency: int, duration_s: float) -> dict[str, Any]:
    acquire, execs, reset, cycle = [], [], [], []
    failures = 0
    deadline = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal failures
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            sandbox = await pool.checkout()
            t1 = time.perf_counter()
            try:
                result = await sandbox.exec(COMMAND, timeout=10)
                failures += result.exit_code != 0
            except Exception:
                failures += 1
            t2 = time.perf_counter()
            await pool.release(sandbox)
            t3 = time.perf_counter()
            acquire.append(t1 - t0)
            execs.append(t2 - t1)
            reset.append(t3 - t2)
            cycle.append(t3 - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    ms = 1000.0
    out: dict[str, Any] = {"cycles": len(cycle), "execs_per_s": len(cycle) / elapsed, "failures": failures}
    for name, values in (("cycle", cycle), ("acquire", acquire), ("exec", execs), ("reset", reset)):
        for q in (50, 95, 99):
            out[f"p{q}_{name}_ms"] = percentile(values, q) * ms
    return out


def docker_run_baseline(runs: int) -> dict[str, Any]:
    """Wall time of `docker run --rm --network none IMAGE true`, sequentially."""
    from sandboxes.docker_image import ensure_image

    image = ensure_image()
    docker = shutil.which("docker") or "docker"
    times, failures = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        rc = subprocess.run([docker, "run", "--rm", "--network", "none", image, *COMMAND], capture_output=True).returncode
        times.append(time.perf_counter() - t0)
        failures += rc != 0
    return {
        "docker_run_p50_ms": statistics.median(times) * 1000,
        "docker_run_p99_ms": percentile(times, 99) * 1000,
        "docker_run_runs": runs,
        "docker_run_failures": failures,
    }


async def run(
    backend: str, concurrency: int, duration_s: float, quick: bool, baseline_skipped: str | None = None,
    open_count: int = 0,
) -> dict[str, Any]:
    """All figures of one run as a flat dict: the pooled cycles, then the `docker run` baseline (unless
    ``baseline_skipped`` says why not), then opening ``open_count`` sandboxes at once (0: no open phase).
    ``phase_<name>_s`` is the wall time each phase took."""
    if quick:
        duration_s = min(duration_s, 5.0)
    limits = Limits(memory_mb=256, pids=64, timeout_s=10)
    phases: dict[str, float] = {}
    started = time.perf_counter()
    pool = SandboxPool(backend, limits, size=concurrency, max_size=concurrency)
    await pool.start()
    try:
        phases["pool_start"] = time.perf_counter() - started
        started = time.perf_counter()
        await _cycles(pool, concurrency, min(1.0, duration_s / 5))  # warm-up, discarded
        figures = await _cycles(pool, concurrency, duration_s)
        phases["cycles"] = time.perf_counter() - started
    finally:
        await pool.close()
    figures.update(backend=backend, concurrency=concurrency, duration_s=duration_s, cpus=os.cpu_count())
    figures["docker_run_baseline"] = "skipped: " + baseline_skipped if baseline_skipped else "measured"
    figures["speedup_vs_docker_run"] = None
    if not baseline_skipped:
        started = time.perf_counter()
        baseline = await asyncio.to_thread(docker_run_baseline, 5 if quick else 20)
        phases["docker_run"] = time.perf_counter() - started
        figures.update(baseline)
        figures["speedup_vs_docker_run"] = baseline["docker_run_p50_ms"] / figures["p50_cycle_ms"]
    if open_count:
        started = time.perf_counter()
        figures.update(await open_many(backend, open_count))
        phases["open"] = time.perf_counter() - started
    for name, seconds in phases.items():
        figures[f"phase_{name}_s"] = round(seconds, 2)
    return figures


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def open_many(backend: str, count: int) -> dict[str, Any]:
    """Open ``count`` sandboxes at once (idle sessions: each has run one command), measure the memory
    they take from the host (MemAvailable before vs while all are open), then close them all."""
    from sandboxes import create_sandbox

    limits = Limits(memory_mb=64, pids=16, timeout_s=10)
    before = _mem_available_mb()
    started = time.perf_counter()
    opened: list[Any] = []
    sem = asyncio.Semaphore(16)  # opening is CPU-bound on 2 cores: a bounded fan-out is as fast

    async def one() -> None:
        async with sem:
            sb = await create_sandbox(backend, limits)
            opened.append(sb)
            result = await sb.exec(COMMAND, timeout=10)
            if result.exit_code != 0:
                raise RuntimeError(f"`true` in an open sandbox exited {result.exit_code}")

    try:
        await asyncio.gather(*(one() for _ in range(count)))
        open_s = time.perf_counter() - started
        used_mb = before - _mem_available_mb()
    finally:
        closing = time.perf_counter()
        await asyncio.gather(*(sb.close() for sb in opened), return_exceptions=True)
    return {"open_sandboxes": len(opened), "open_seconds": round(open_s, 2),
            "open_memory_mb": round(used_mb, 1), "open_memory_mb_each": round(used_mb / max(1, len(opened)), 2),
            "close_seconds": round(time.perf_counter() - closing, 2)}


def table(figures: dict[str, Any]) -> str:
    lines = [f"{'figure':<28}{'value':>14}", "-" * 42]
    for key, value in figures.items():
        text = f"{value:.2f}" if isinstance(value, float) else "-" if value is None else str(value)
        lines.append(f"{key:<28}{text:>14}")
    return "\n".join(lines)
