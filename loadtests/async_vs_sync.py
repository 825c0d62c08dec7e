"""Asynchronous pipeline vs a synchronous generate-then-score-then-train loop, same workload, same run.

Both runs use the same warm-started model, tasks, batch size and code paths (the whole Deployment:
scheduler, inference, sandboxes, reward, learner, weights over NATS); only the off-policy window
differs:

- sync: ``max_staleness = 0``: the scheduler admits one batch, then waits until the learner has
  trained on it and published the next version; generation, verification and training never overlap.
- async: ``max_staleness = S`` (default 2): generation of later batches overlaps training of earlier
  ones, and samples up to S versions old are trained with the importance-sampling correction.

Headline: ``speedup`` = time the sync run needs to reach the reward the async run reaches, over the
async run's time (falls back to the time for the same number of learner steps when the sync run
never reaches it: ``speedup_steps``).

With ``--rounds K`` it runs K sync/async pairs on the same warm-started model, alternating which mode
goes first, and prints each pair's same-steps ratio with their mean and 95% interval: on a machine
whose speed drifts by tens of percent, one pair says little.

Beside it, how busy the machine's CPUs were during each run (``/proc/stat``: 1 - idle / total over
all cores): asynchrony can only fill time a stage would otherwise leave idle, so the same-steps
speed-up on this machine is bounded by about ``async_cpu_busy / sync_cpu_busy`` (when both runs do
the same CPU work); a sync run that already keeps every core busy leaves nothing to overlap.

    python -m loadtests.async_vs_sync [--quick] [--json out.json] [--steps N] [--staleness S] [--rounds K]
    python -m loadtests.async_vs_sync --policies [--quick] [--json out.json] [--steps N] [--staleness S]

``--policies`` is the CPU run of the staleness policies (issue 32; ``loadtests/fleet.py --staleness-only``
is the simulated one): two async runs, ``learner.staleness_policy`` ``drop`` (today's) and ``downweight``
(no finished sample discarded for its age), alternating which goes first per round. For each, the
Kolmogorov-Smirnov distance between the completion lengths of the samples the learner judged (trained
or dropped as stale; zero-variance filtered ones apart) and of those it trained (``length_ks_<policy>``),
read from the learner's audit log and ``rollout.experience``, with its sample sizes and the distance two
samples that size reach by chance 5% of the time (``length_ks_critical_<policy>``, the asymptotic
two-sample bound ``1.358 * sqrt((n + m) / (n * m))``); and trained samples per second
(``trained_samples_per_s_<policy>``).

With no --bootstrap / --nats (or ROLLOUT_KAFKA_BOOTSTRAP / ROLLOUT_NATS_URL) it starts a private
broker and nats-server and stops them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio


from domains import score  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.schemas import Experience  # noqa: E402
from loadtests._stats import ci95, machine_cpu_jiffies  # noqa: E402
from ops.demo import DemoPlan, _quiet_libraries, default_config, warm_start  # noqa: E402
from ops.ledger import AUDIT_LOG, read_audit  # noqa: E402
from streams.kafka import Consumer  # noqa: E402


@dataclasses.dataclass
class RunResult:
    mode: str
    seconds: float
    steps: int
    samples: int
    cpu_busy: float
    """Fraction of the machine's CPU time (all cores) that was busy during the run."""
    # (seconds since start, running mean correctness of the last `window` samples)
    curve: list[tuple[float, float]]
    lengths: dict[str, int] = dataclasses.field(default_factory=dict)
    """sample_id -> completion length (tokens), of every experience the run published."""
    verdicts: dict[str, str] = dataclasses.field(default_factory=dict)
    """sample_id -> the learner's verdict (train, dropped_stale, filtered), from its audit log."""

    def time_to(self, reward: float) -> float | None:
        return next((t for t, r in self.curve if r >= reward), None)

    def final_reward(self) -> float:
        return self.curve[-1][1] if self.curve else 0.0


async def one_run(cfg: EngineConfig, run_dir: Path, steps: int, mode: str, window: int,
                  stall_s: float = 180.0) -> RunResult:
    from ops.deployment import Deployment

    recent: list[float] = []
    curve: list[tuple[float, float]] = []
    lengths: dict[str, int] = {}
    samples = 0
    async with Deployment(cfg, run_dir=run_dir) as d:
        watch = Consumer(cfg.kafka, topics=[d.rt.names.experience], group=f"{cfg.namespace}.bench",
                         expect=("experience",))
        async with watch, anyio.create_task_group() as tg:
            started, jiffies0 = time.monotonic(), machine_cpu_jiffies()
            tg.start_soon(d.run)
            step, last_step, last_progress = 0, 0, started
            while step < steps and not d.supervisor.finished("learner"):
                if step != last_step:
                    last_step, last_progress = step, time.monotonic()
                elif time.monotonic() - last_progress > stall_s:
                    for name, actor in d.supervisor.actors.items():
                        print(f"  stalled {mode}: {name}: {actor.statistics()}", flush=True)
                    raise RuntimeError(f"{mode}: no learner step for {stall_s:.0f}s (at step {step})")
                for r in await watch.getmany(timeout_s=0.2):
                    exp = r.message
                    assert isinstance(exp, Experience)
                    lengths[exp.sample_id] = len(exp.response_ids)
                    recent.append(score(exp.domain, exp.facts, "").correctness if exp.facts else exp.reward)
                    del recent[:-window]
                    samples += 1
                    if len(recent) == window:  # a partial window's mean is noise, not a reward level
                        curve.append((time.monotonic() - started, sum(recent) / len(recent)))
                    r.ack()
                learner = d.supervisor.actors.get("learner")
                step = int(learner.statistics().get("step", 0)) if learner is not None else 0
            seconds, jiffies1 = time.monotonic() - started, machine_cpu_jiffies()
            busy = (jiffies1[0] - jiffies0[0]) / max(1, jiffies1[1] - jiffies0[1])
            print(f"  {mode}: {step} steps in {seconds:.1f}s, {samples} samples, CPUs {busy:.0%} busy", flush=True)
            d.drain()
    return RunResult(mode, seconds, step, samples, busy, curve, lengths,
                     audit_verdicts(Path(cfg.learner.checkpoint_dir) / cfg.namespace / AUDIT_LOG))


@dataclasses.dataclass
class _Bench:
    """A run's warm-started model and stack; ``config`` makes one pipeline run's deployment on them."""

    plan: DemoPlan
    root: Path
    bootstrap: str
    nats_url: str

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    def config(self, name: str, staleness: int, **learner: Any) -> tuple[EngineConfig, Path]:
        run_dir = self.root / name
        cfg = default_config(f"avs-{name}-{int(time.time())}", self.bootstrap, self.nats_url, run_dir, self.plan)
        return cfg.model_copy(update={
            "scheduler": cfg.scheduler.model_copy(update={"max_staleness": staleness}),
            "inference": cfg.inference.model_copy(update={"model_dir": str(self.model_dir)}),
            "learner": cfg.learner.model_copy(update={"max_steps": self.plan.steps, **learner}),
        }), run_dir


@contextlib.asynccontextmanager
async def _warm_stack(args: argparse.Namespace) -> AsyncIterator[_Bench]:
    """A broker and nats-server (private unless given), and the tiny model warm-started into a temporary dir."""
    from loadtests._infra import private_stack

    _quiet_libraries()
    plan = DemoPlan(seed=args.seed, steps=args.steps or (4 if args.quick else 12))
    if args.quick:
        plan = dataclasses.replace(plan, sft_examples=600, sft_steps=60)
    with tempfile.TemporaryDirectory(prefix="rollout-avs-") as tmp, \
            (private_stack() if not (args.bootstrap and args.nats) else _given(args)) as (bootstrap, nats_url):
        bench = _Bench(plan, Path(tmp), bootstrap, nats_url)
        print(f"warm start ({plan.sft_steps} steps)", flush=True)
        await anyio.to_thread.run_sync(warm_start, bench.model_dir, plan)
        yield bench


def audit_verdicts(path: Path) -> dict[str, str]:
    """sample_id -> verdict in the lineage of a learner's audit log (``ops.ledger.read_audit``: steps a killed
    life made past its last checkpoint and torn lines left out; empty if there is no log)."""
    return {row.sample_id: row.verdict for row in read_audit(path).rows}


KS_CRITICAL_95 = 1.358
"""c(0.05) of the asymptotic two-sample Kolmogorov-Smirnov bound ``c * sqrt((n + m) / (n * m))``."""


def policy_row(run: RunResult) -> dict[str, Any]:
    """One staleness policy's CPU run: judged and trained lengths, their KS distance, trained samples/s."""
    from loadtests.fleet import ks_distance

    known = {sid: v for sid, v in run.verdicts.items() if sid in run.lengths}
    judged = [run.lengths[s] for s, v in known.items() if v in ("train", "dropped_stale")]
    trained = [run.lengths[s] for s, v in known.items() if v == "train"]
    if not judged or not trained:
        raise RuntimeError(f"{run.mode}: the learner judged {len(judged)} and trained {len(trained)} samples "
                           f"whose lengths were seen: nothing to compare")
    n, m = len(judged), len(trained)
    return {"policy": run.mode, "seconds": round(run.seconds, 2), "steps": run.steps, "judged": n, "trained": m,
            "dropped_stale": n - m, "filtered": sum(1 for v in known.values() if v == "filtered"),
            "length_ks": round(ks_distance(judged, trained), 4),
            "length_ks_critical": round(KS_CRITICAL_95 * ((n + m) / (n * m)) ** 0.5, 4),
            "mean_length_judged": round(sum(judged) / n, 2), "mean_length_trained": round(sum(trained) / m, 2),
            "trained_samples_per_s": round(m / run.seconds, 3), "cpu_busy": round(run.cpu_busy, 3)}


async def policies_async(args: argparse.Namespace) -> dict[str, Any]:
    """``--policies``: the staleness policies on the CPU pipeline (see the module docstring)."""
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    async with _warm_stack(args) as bench:
        plan = bench.plan
        for r in range(args.rounds):
            for policy in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
                cfg, run_dir = bench.config(f"{policy}-{r}", args.staleness, staleness_policy=policy)
                row = policy_row(await one_run(cfg, run_dir, plan.steps, policy, args.window))
                print(f"  {policy}: judged {row['judged']}, trained {row['trained']}, KS {row['length_ks']} "
                      f"(chance bound {row['length_ks_critical']}), {row['trained_samples_per_s']} trained/s",
                      flush=True)
                rows[policy].append(row)
    out: dict[str, Any] = {"steps": plan.steps, "staleness": args.staleness, "rounds": args.rounds,
                           "cpus": os.cpu_count(), "policy_runs": [row for p in POLICIES for row in rows[p]]}
    for policy in POLICIES:
        pooled = rows[policy]
        for key in ("length_ks", "length_ks_critical", "trained_samples_per_s", "judged", "trained", "dropped_stale"):
            values = [row[key] for row in pooled]
            out[f"{key}_{policy}"] = values[0] if len(values) == 1 else round(sum(values) / len(values), 4)
    drop, keep = out["trained_samples_per_s_drop"], out["trained_samples_per_s_downweight"]
    out["downweight_over_drop_throughput"] = round(keep / drop, 3) if drop and keep else None
    print(f"\n{'policy':<12}{'judged':>8}{'trained':>9}{'stale-dropped':>15}{'KS':>8}{'chance 5%':>11}"
          f"{'trained/s':>11}{'mean len judged/trained':>25}")
    for row in out["policy_runs"]:
        print(f"{row['policy']:<12}{row['judged']:>8}{row['trained']:>9}{row['dropped_stale']:>15}{row['length_ks']:>8.4f}"
              f"{row['length_ks_critical']:>11.4f}{row['trained_samples_per_s']:>11.3f}"
              f"{row['mean_length_judged']:>14.2f} / {row['mean_length_trained']:.2f}")
    print(f"downweight / drop trained samples per second: {out['downweight_over_drop_throughput']}x")
    return out


POLICIES = ("drop", "downweight")


async def main_async(args: argparse.Namespace) -> dict:
    out: dict = {}
    async with _warm_stack(args) as bench:
        plan = bench.plan
        runs: list[dict[str, RunResult]] = []
        for r in range(args.rounds):
            # alternate which mode goes first, so neither always runs on a warmer (or tireder) machine
            order = (("sync", 0), ("async", args.staleness))
            results = {}
            for mode, staleness in (order if r % 2 == 0 else order[::-1]):
                cfg, run_dir = bench.config(f"{mode}-{r}", staleness)
                results[mode] = await one_run(cfg, run_dir, plan.steps, mode, args.window)
            runs.append(results)
    results = runs[0]
    sync, asyn = results["sync"], results["async"]
    target = min(asyn.final_reward(), max((r for _, r in sync.curve), default=0.0))
    t_sync, t_async = sync.time_to(target), asyn.time_to(target)
    out.update({
        "steps": plan.steps, "staleness": args.staleness,
        "sync_seconds": round(sync.seconds, 2), "async_seconds": round(asyn.seconds, 2),
        "sync_final_reward": round(sync.final_reward(), 3), "async_final_reward": round(asyn.final_reward(), 3),
        "reward_target": round(target, 3),
        "sync_time_to_target": None if t_sync is None else round(t_sync, 2),
        "async_time_to_target": None if t_async is None else round(t_async, 2),
        "speedup_steps": round(sync.seconds / asyn.seconds, 3),
        "cpus": os.cpu_count(), "sync_cpu_busy": round(sync.cpu_busy, 3), "async_cpu_busy": round(asyn.cpu_busy, 3),
    })
    out["speedup"] = round(t_sync / t_async, 3) if t_sync and t_async else out["speedup_steps"]
    # over all rounds: the same-steps ratio of each round (sync seconds / async seconds), mean and 95% interval
    ratios = [rr["sync"].seconds / rr["async"].seconds for rr in runs]
    out["rounds"] = len(runs)
    out["speedup_steps_per_round"] = [round(x, 3) for x in ratios]
    out["speedup_steps_mean"] = round(sum(ratios) / len(ratios), 3)
    if len(ratios) > 1:
        out["speedup_steps_ci95"] = ci95(ratios, digits=3)
    out["sync_cpu_busy_mean"] = round(sum(rr["sync"].cpu_busy for rr in runs) / len(runs), 3)
    out["async_cpu_busy_mean"] = round(sum(rr["async"].cpu_busy for rr in runs) / len(runs), 3)
    print(f"\n{'run':<8}{'seconds':>9}{'steps':>7}{'samples':>9}{'final reward':>14}{'t(target)':>11}"
          f"{'CPUs busy':>11}")
    for res, t in ((sync, t_sync), (asyn, t_async)):
        print(f"{res.mode:<8}{res.seconds:>9.1f}{res.steps:>7}{res.samples:>9}{res.final_reward():>14.3f}"
              f"{'' if t is None else f'{t:.1f}':>11}{res.cpu_busy:>11.0%}")
    print(f"\nspeedup (time to reward {target:.3f}): {out['speedup']}x; same steps: {out['speedup_steps']}x")
    if len(runs) > 1:
        print(f"\n{'round':<7}{'first':>7}{'sync s':>9}{'async s':>9}{'same-steps ratio':>18}{'CPUs busy sync/async':>22}")
        for r, rr in enumerate(runs):
            print(f"{r:<7}{'sync' if r % 2 == 0 else 'async':>7}{rr['sync'].seconds:>9.1f}{rr['async'].seconds:>9.1f}"
                  f"{ratios[r]:>18.3f}{rr['sync'].cpu_busy:>13.0%} / {rr['async'].cpu_busy:.0%}")
        ci = out.get("speedup_steps_ci95")
        print(f"same-steps speedup over {len(runs)} rounds: mean {out['speedup_steps_mean']}x"
              + (f" (95% interval {ci[0]}..{ci[1]})" if ci else ""))
    return out


class _given:
    def __init__(self, args: argparse.Namespace) -> None:
        self.pair = (args.bootstrap, args.nats)

    def __enter__(self) -> tuple[str, str]:
        return self.pair

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (small warm start, 4 steps)")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    p.add_argument("--steps", type=int, help="learner steps per run (default 12; 4 with --quick)")
    p.add_argument("--staleness", type=int, default=2, help="max_staleness of the async run (default 2)")
    p.add_argument("--window", type=int, default=64, help="samples in the running reward mean (default 64)")
    p.add_argument("--rounds", type=int, default=1,
                   help="sync/async pairs, alternating which goes first; prints the mean same-steps ratio and "
                        "its 95%% interval (the headline figures stay those of the first pair)")
    p.add_argument("--policies", action="store_true",
                   help="instead: the staleness policies drop and downweight, both async (the CPU run of issue 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"))
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"))
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    out = anyio.run(policies_async if args.policies else main_async, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
