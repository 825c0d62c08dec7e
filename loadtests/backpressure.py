"""Backpressure: a learner that stops must throttle admission, and no process may grow without bound.

The pipeline runs as separate daemons (scheduler without ``max_tasks``, inference, one sandbox host,
reward, learner with ``max_steps``) on a private broker and nats-server. The learner makes
``max_steps`` steps and exits, so its version freezes: the scheduler's admission rule then caps the
admitted samples at ``(max_staleness + version + 1) * batch_size + filtered``. For ``--duration``
seconds after that the script samples every role process's RSS (``/proc/<pid>/status`` VmRSS, plus the
inference server child) and the scheduler's counters, and checks:

- admitted samples stop at the admission bound (they do not move once the learner is gone);
- every process's RSS stays flat: growth from the first sample after the bound is reached to the
  median of the last third is below ``--max-growth`` (fraction) + 32 MiB of slack.

    .venv/bin/python -m loadtests.backpressure --quick --json runs/backpressure.json

Headline keys: ``admitted_samples``, ``admission_bound``, ``admitted_after_stop``, ``max_rss_growth_fraction``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from loadtests._cluster import RoleProc, Stack, children_of, kv_get_json, pipeline_config, poll, rss_kb, write_toml

SLACK_KB = 32 * 1024


@dataclasses.dataclass
class Plan:
    duration_s: float = 90.0
    sample_every_s: float = 2.0
    max_steps: int = 2
    batch_size: int = 8
    max_staleness: int = 1
    max_growth: float = 0.25
    domains: dict[str, float] = dataclasses.field(default_factory=lambda: {"arith": 1.0, "code": 1.0})


def process_rss(procs: dict[str, RoleProc]) -> dict[str, int]:
    """RSS (KiB) of each running role daemon, and of the inference daemon's server child."""
    out: dict[str, int] = {}
    for name, p in procs.items():
        if p.pid is None or not p.alive():
            continue
        if (kb := rss_kb(p.pid)) is not None:
            out[name] = kb
        if name == "inference":
            for child in children_of(p.pid):
                if (kb := rss_kb(child)) is not None:
                    out[f"inference-server:{child}"] = kb
    return out


def run(plan: Plan, work: Path, *, log: Any = print) -> dict[str, Any]:
    from modelserver.llm import write_tiny_model_dir
    from actors.scheduler import SCHEDULER_STATUS_KEY
    from engine.config import EngineConfig
    from engine.topics import Names

    started = time.monotonic()
    stack = Stack(work)
    procs: dict[str, RoleProc] = {}
    try:
        stack.start()
        model_dir = write_tiny_model_dir(work / "model")
        namespace = f"bp-{uuid.uuid4().hex[:8]}"
        data = pipeline_config(namespace, stack.infra.kafka_bootstrap, stack.infra.nats_url, work, model_dir,
                               max_tasks=None, batch_size=plan.batch_size, max_staleness=plan.max_staleness,
                               domains=plan.domains, learner={"max_steps": plan.max_steps, "checkpoint_every": 100})
        path = write_toml(data, work / "backpressure.toml")
        bucket = Names(namespace).bucket(EngineConfig.model_validate(data).nats.kv_bucket)
        for name in ("learner", "scheduler", "inference", "sandbox", "reward"):
            procs[name] = RoleProc(name, name, path, work)
        procs["learner"].start()
        procs["learner"].wait_ready()
        for name in ("scheduler", "inference", "sandbox", "reward"):
            procs[name].start()
        for name in ("scheduler", "inference", "sandbox", "reward"):
            procs[name].wait_ready()
        log(f"[{time.monotonic() - started:5.1f}s] pipeline ready ({namespace})")

        # the learner makes max_steps steps and exits: from then on nothing frees admission capacity
        procs["learner"].proc.wait(timeout=300)  # type: ignore[union-attr]
        learner = kv_get_json(stack.infra.nats_url, bucket, "learner.version")
        bound = (plan.max_staleness + int(learner.get("version", 0)) + 1) * plan.batch_size
        log(f"[{time.monotonic() - started:5.1f}s] learner stopped at {learner}; admission bound {bound} "
            f"(+ filtered/stale {int(learner.get('filtered', 0)) + int(learner.get('dropped_stale', 0))})")
        sched: dict[str, Any] = {}
        limit = bound + int(learner.get("filtered", 0)) + int(learner.get("dropped_stale", 0))

        def at_bound() -> bool:
            sched.update(kv_get_json(stack.infra.nats_url, bucket, SCHEDULER_STATUS_KEY))
            group = int(data["scheduler"]["group_size"])
            return int(sched.get("admitted_samples", 0)) + group > limit

        poll(at_bound, 120, "the scheduler reaches the admission bound", every_s=1.0)
        admitted_at_stop = int(sched["admitted_samples"])
        log(f"[{time.monotonic() - started:5.1f}s] scheduler at the bound: {admitted_at_stop} samples admitted; "
            f"sampling RSS for {plan.duration_s:.0f}s")

        samples: list[dict[str, int]] = []
        t_end = time.monotonic() + plan.duration_s
        while time.monotonic() < t_end:
            samples.append(process_rss(procs))
            time.sleep(plan.sample_every_s)  # the sampling period, not a readiness check
        final = kv_get_json(stack.infra.nats_url, bucket, SCHEDULER_STATUS_KEY)
        sched_stats = procs["scheduler"].status().get("scheduler", {})
    finally:
        for p in procs.values():
            p.terminate(timeout_s=30)
        stack.stop()

    rows: dict[str, dict[str, float]] = {}
    for name in sorted({k for s in samples for k in s}):
        series = [s[name] for s in samples if name in s]
        if len(series) < 3:
            continue
        first, tail = series[0], statistics.median(series[-max(1, len(series) // 3):])
        rows[name] = {"first_mb": first / 1024, "last_mb": tail / 1024, "max_mb": max(series) / 1024,
                      "growth_fraction": (tail - first) / first,
                      "ok": float(tail - first <= plan.max_growth * first + SLACK_KB)}
    admitted_final = int(final.get("admitted_samples", 0))
    results: dict[str, Any] = {
        "admitted_samples": admitted_final,
        "admission_bound": limit,
        "admitted_after_stop": admitted_final - admitted_at_stop,
        "max_rss_growth_fraction": max((r["growth_fraction"] for r in rows.values()), default=0.0),
        "rss_flat": all(r["ok"] for r in rows.values()) and bool(rows),
        "blocked_waits": int(sched_stats.get("blocked_waits", 0)),
        "learner_version": int(learner.get("version", 0)),
        "samples_taken": len(samples),
        "seconds": round(time.monotonic() - started, 1),
    }
    for name, r in rows.items():
        key = name.split(":")[0]
        for k, v in r.items():
            results[f"{key}.{k}"] = round(v, 4)
    results["_rows"] = rows
    return results


def print_results(results: dict[str, Any]) -> None:
    print(f"\n{'process':<20}{'first MB':>10}{'last MB':>10}{'max MB':>10}{'growth':>9}  flat")
    for name, r in results["_rows"].items():
        print(f"{name:<20}{r['first_mb']:>10.1f}{r['last_mb']:>10.1f}{r['max_mb']:>10.1f}"
              f"{r['growth_fraction']:>+9.1%}  {'yes' if r['ok'] else 'NO'}")
    print(f"\nadmitted samples {results['admitted_samples']} (bound {results['admission_bound']}, "
          f"{results['admitted_after_stop']} admitted after the bound was reached); scheduler blocked "
          f"{results['blocked_waits']} times; learner frozen at v{results['learner_version']}; "
          f"{results['seconds']:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 30 s of sampling")
    parser.add_argument("--json", help="write the flat results here")
    parser.add_argument("--duration", type=float, default=None, help="seconds of RSS sampling at the bound")
    parser.add_argument("--max-growth", type=float, default=None, help="allowed RSS growth fraction per process")
    args = parser.parse_args(argv)
    plan = Plan()
    if args.quick:
        plan.duration_s = 30.0
    if args.duration is not None:
        plan.duration_s = args.duration
    if args.max_growth is not None:
        plan.max_growth = args.max_growth
    with tempfile.TemporaryDirectory(prefix="rollout-backpressure-") as tmp:
        results = run(plan, Path(tmp))
    print_results(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({k: v for k, v in results.items() if not k.startswith("_")}, indent=2))
    ok = results["rss_flat"] and results["admitted_after_stop"] == 0 and results["admitted_samples"] <= results["admission_bound"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
