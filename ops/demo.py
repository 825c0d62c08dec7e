"""The main job: a short real RL run on the local stack, with held-out accuracy before and after.

1. Build a tiny character-level Llama and give it a short supervised warm start on generated
   demonstrations of every domain, so it starts above zero reward.
2. Evaluate it greedily on held-out tasks (a fixed seed), per domain.
3. Run the whole pipeline as one process (scheduler -> inference -> sandboxes -> reward -> learner ->
   weights over NATS -> inference) until the learner has made ``steps`` optimizer steps.
4. Evaluate the final published weights on the same held-out tasks.
5. Print the reward per domain per policy version and the before/after table; write
   ``results.json`` and ``curves.png`` into the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio

from domains import DOMAINS, score
from actors.evaluate import DomainScore, evaluate
from actors.inference.actor import format_observation
from modelserver.launch import LocalServer
from engine.config import EngineConfig
from engine.schemas import Experience
from ops.deployment import load_deployment_config
from streams.kafka import Consumer
from streams.nats import Nats
from streams.weights import fetch_latest_model

log = logging.getLogger("rollout.demo")


@dataclasses.dataclass
class DemoPlan:
    """Sizes of the demo; the defaults take a few minutes on 2 CPU cores."""

    seed: int = 0
    sft_examples: int = 3000
    sft_steps: int = 200
    sft_lr: float = 3e-3
    steps: int = 60
    heldout: dict[str, int] = dataclasses.field(default_factory=lambda: {"arith": 64, "code": 32, "terminal": 64})
    eval_samples: int = 8
    """Sampled generations per held-out task (at ``eval_temperature``) for the headline accuracy."""
    eval_temperature: float = 1.0
    """The RL run's sampling temperature: the headline is the expected accuracy of the policy RL trained."""
    """Held-out tasks per domain, at most: distinct prompts, fewer where the space is smaller (arith 34, code 9)."""


def default_config(namespace: str, bootstrap: str, nats_url: str, run_dir: Path, plan: DemoPlan) -> EngineConfig:
    """The demo's deployment: every role in this process, small batches, frequent weight updates."""
    return EngineConfig.model_validate({
        "namespace": namespace,
        "kafka": {"bootstrap": bootstrap, "default_partitions": 2},
        "nats": {"url": nats_url},
        "scheduler": {"domains": {"arith": 1.0, "code": 1.0, "terminal": 1.0}, "group_size": 8,
                      "max_staleness": 1, "seed": plan.seed, "curriculum": False},
        "inference": {"max_new_tokens": 24, "temperature": 1.0, "concurrency": 64, "max_batch": 64,
                      "stream_interval": 8},
        "sandbox": {"pool_size": 8, "max_sandboxes": 48, "timeout_s": 5.0},
        "reward": {"group_timeout_s": 60.0, "drop_zero_variance": True, "normalize": "group"},
        "learner": {"batch_size": 32, "lr": 2e-4, "objective": "decoupled_ppo", "publish_every": 1,
                    "checkpoint_every": 10, "checkpoint_dir": str(run_dir / "checkpoints"),
                    "max_steps": plan.steps, "seed": plan.seed},
        "supervision": {"drain_timeout_s": 30.0},
    })


@dataclasses.dataclass
class RealPlan:
    """The real-model demo: a pretrained instruct model, no warm start, RL for a wall-clock budget."""

    model: str = "smollm2-135m"
    model_dir: str | None = None
    """An HF model directory to train instead of the prepared ``model``."""
    seed: int = 0
    seconds: float = 780.0
    """Wall-clock budget of the RL run (the pipeline's start counts)."""
    steps: int | None = None
    """Stop after this many learner steps instead, if sooner."""
    train: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"math": 1.0, "docqa": 1.0, "rg:chain_sum": 1.0})
    """Domains trained on at once, with their sampling weights. Chosen by measurement (docs/domains.md "The
    demo's domains"): untrained held-out accuracy at T = 1 above 0 with a constant answer well below half
    (math 0.023, docqa 0.109, rg:chain_sum 0.031 over 128 generations), short answers (8, 8 and 32 tokens),
    and math alone went 0.02 -> 0.57 in this budget."""
    heldout: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"math": 32, "docqa": 32, "rg:chain_sum": 32, "python": 12, "shell": 12})
    """Held-out tasks per domain: every domain is evaluated, trained on or not (none may get worse)."""
    balance: dict[str, Any] | None = dataclasses.field(
        default_factory=lambda: {"policy": "signal", "floor": 0.1, "cap": 0.6})
    """``scheduler.balance`` (None: the engine's default): adaptive balancing, every domain kept at >= 0.1."""
    loss_weighting: str = "domain_mean"
    """``learner.loss_weighting``: a domain weighs by its share of the samples, not of the tokens (rg:chain_sum
    answers are up to 4x longer than math's). Not yet picked by measurement (docs/learner.md)."""
    eval_samples: int = 4
    eval_temperature: float = 1.0


def real_config(namespace: str, bootstrap: str, nats_url: str, run_dir: Path, plan: RealPlan) -> EngineConfig:
    """The engine's learning setup for a ~100M-parameter instruct model on a 2-core machine.

    Geometry as the plain GRPO loop it is compared with (``loadtests/learning.py``): groups of 8, 64 samples
    a step, lr 5e-6, temperature 1. What the engine adds: zero-variance groups are dropped before they cost a
    learner step, generation overlaps training (one core each), and a group's prompt is computed once.
    """
    return EngineConfig.model_validate({
        "namespace": namespace,
        "kafka": {"bootstrap": bootstrap, "default_partitions": 2},
        "nats": {"url": nats_url},
        "scheduler": {"domains": plan.train, "group_size": 8, "max_staleness": 1, "seed": plan.seed,
                      "curriculum": False, "rebalance": False, **({"balance": plan.balance} if plan.balance else {})},
        "inference": {"max_new_tokens": 8, "temperature": 1.0, "concurrency": 64, "max_batch": 64,
                      "stream_interval": 8},
        "sandbox": {"pool_size": 4, "max_sandboxes": 16, "timeout_s": 5.0},
        "reward": {"group_timeout_s": 120.0, "drop_zero_variance": True, "normalize": "group_std"},
        "learner": {"batch_size": 64, "lr": 5e-6, "objective": "decoupled_ppo", "publish_every": 1,
                    "checkpoint_every": 1000, "checkpoint_dir": str(run_dir / "checkpoints"),
                    "max_steps": plan.steps, "seed": plan.seed, "torch_threads": 1,
                    "loss_weighting": plan.loss_weighting},
        "supervision": {"drain_timeout_s": 60.0},
    })


async def run_real_demo(run_dir: Path, plan: RealPlan, bootstrap: str, nats_url: str, config_path: str | None) -> int:
    from modelserver.prepare import prepare_model

    run_dir.mkdir(parents=True, exist_ok=True)
    namespace = f"demo-{int(time.time())}"
    t0 = time.monotonic()
    model_dir = Path(plan.model_dir) if plan.model_dir else await anyio.to_thread.run_sync(
        lambda: prepare_model(plan.model, log=lambda *_: None))
    cfg = real_config(namespace, bootstrap, nats_url, run_dir, plan)
    if config_path:
        cfg = load_deployment_config(config_path, overrides={"namespace": namespace})
    cfg = cfg.model_copy(update={"inference": cfg.inference.model_copy(update={"model_dir": str(model_dir)})})
    print(f"model {model_dir}", flush=True)
    print(f"1/3 held-out evaluation before RL ({', '.join(f'{d} {n}' for d, n in plan.heldout.items())} tasks, "
          f"{plan.eval_samples} samples each at T={plan.eval_temperature})", flush=True)
    before = await evaluate_dir(model_dir, run_dir, plan, "before", greedy=False)
    print("    " + ", ".join(f"{d}: {s.accuracy:.3f}" for d, s in sorted(before.sampled.items())), flush=True)
    print(f"2/3 RL through the pipeline on {', '.join(plan.train)} for {plan.seconds:.0f}s "
          f"({time.monotonic() - t0:.0f}s)", flush=True)
    curves = RewardCurves()
    rl_started = time.monotonic()
    final_dir = await rl_run(cfg, run_dir, plan, curves)
    rl_seconds = time.monotonic() - rl_started
    print(f"3/3 held-out evaluation after RL ({time.monotonic() - t0:.0f}s)", flush=True)
    after = await evaluate_dir(final_dir, run_dir, plan, "after", greedy=False)
    table = curves.table()
    print_tables(table, before, after, trained=set(trained_domains(cfg)))
    plot(table, before.sampled, after.sampled, run_dir / "curves.png")
    results = {
        "namespace": namespace, "model_dir": str(model_dir), "trained": trained_domains(cfg),
        "seconds": round(time.monotonic() - t0, 1),
        "rl_seconds": round(rl_seconds, 1), "plan": dataclasses.asdict(plan),
        "heldout_before": {d: dataclasses.asdict(s) for d, s in before.sampled.items()},
        "heldout_after": {d: dataclasses.asdict(s) for d, s in after.sampled.items()},
        "change": {d: round(after.sampled[d].accuracy - before.sampled[d].accuracy, 3) for d in before.sampled},
        "reward_per_version": {d: {str(v): r for v, r in s.items()} for d, s in table.items()},
        "final_model": str(final_dir),
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {run_dir / 'results.json'} and {run_dir / 'curves.png'} ({results['seconds']:.0f}s in all)")
    return 0


def demonstrations(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from every domain, multi-turn ones in the inference actor's format."""
    rng = random.Random(f"sft:{seed}")
    out = []
    # the project's own generated domains (plugins, families and task-file domains have their own data); long
    # documents (1k-8k tokens) are past the char model's context
    names = sorted(name for name in DOMAINS if DOMAINS[name].source == "generator" and DOMAINS[name].trainable
                   and "long-context" not in DOMAINS[name].tags)
    for i in range(n):
        domain = DOMAINS[names[i % len(names)]]
        prompt, ideal = domain.demonstrate(rng, rng.random() * 0.3)
        if domain.max_turns > 1:
            # one command per turn, each followed by its (empty) observation, then "exit"
            commands = [c for c in ideal.splitlines() if c]
            ideal = "".join(f"{c}\n{format_observation('')}" for c in commands) + "exit\n"
        out.append((prompt, ideal))
    return out


def warm_start(model_dir: Path, plan: DemoPlan) -> None:
    import torch

    from learning.core import sft_warm_start
    from modelserver.llm import build_char_tokenizer, build_tiny_model, save_model_dir, tiny_config

    torch.manual_seed(plan.seed)
    torch.set_num_threads(1)  # see LearnerConfig.torch_threads
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tokenizer)), seed=plan.seed)
    sft_warm_start(model, tokenizer, demonstrations(plan.sft_examples, plan.seed), steps=plan.sft_steps,
                   lr=plan.sft_lr, seed=plan.seed)
    save_model_dir(model, tokenizer, model_dir)


@dataclasses.dataclass(frozen=True)
class Heldout:
    """Held-out accuracy of one model: sampled (the headline) and greedy, per domain."""

    sampled: dict[str, DomainScore]
    greedy: dict[str, DomainScore]


async def evaluate_dir(model_dir: Path, run_dir: Path, plan: "DemoPlan | RealPlan", label: str, *,
                       greedy: bool = True) -> Heldout:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    async with LocalServer(model_dir, log_path=run_dir / "logs" / f"eval-{label}.log", torch_threads=0) as url:
        sampled = await evaluate(url, plan.heldout, seed=plan.seed, samples=plan.eval_samples,
                                 temperature=plan.eval_temperature, tokenizer=tokenizer)
        greedy_scores = await evaluate(url, plan.heldout, seed=plan.seed, tokenizer=tokenizer) if greedy else {}
    return Heldout(sampled, greedy_scores)


class RewardCurves:
    """Mean reward per domain per policy version, from the experience topic (what the learner sees)."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, int], float] = defaultdict(float)
        self.counts: dict[tuple[str, int], int] = defaultdict(int)

    def add(self, exp: Experience) -> None:
        versions = exp.weight_versions[exp.loss_mask.astype(bool)]
        version = int(versions.max()) if len(versions) else exp.admitted_version
        correctness = score(exp.domain, exp.facts, "").correctness if exp.facts else exp.reward
        self.sums[(exp.domain, version)] += correctness
        self.counts[(exp.domain, version)] += 1

    def table(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = defaultdict(dict)
        for (domain, version), n in sorted(self.counts.items()):
            out[domain][version] = self.sums[(domain, version)] / n
        return dict(out)

    def domains(self) -> set[str]:
        return {d for d, _ in self.counts}

    def recent(self, domain: str, last: int = 3) -> float | None:
        rows = sorted((v, self.sums[(d, v)], n) for (d, v), n in self.counts.items() if d == domain)[-last:]
        n = sum(r[2] for r in rows)
        return sum(r[1] for r in rows) / n if n else None


async def rl_run(cfg: EngineConfig, run_dir: Path, plan: "DemoPlan | RealPlan", curves: RewardCurves) -> Path:
    """The pipeline until the learner has made ``plan.steps`` steps (or ``plan.seconds`` passed); returns the
    final weights' dir."""
    from ops.deployment import Deployment

    started = time.monotonic()
    budget = getattr(plan, "seconds", None)
    progress = Progress(sys.stdout)
    async with Deployment(cfg, run_dir=run_dir) as deployment:
        print(f"pipeline up: namespace {cfg.namespace}, dashboard {deployment.http.url}/dashboard", flush=True)
        watch = Consumer(cfg.kafka, topics=[deployment.rt.names.experience], group=f"{cfg.namespace}.demo",
                         expect=("experience",))
        async with watch, anyio.create_task_group() as tg:
            tg.start_soon(deployment.run)
            while True:
                for r in await watch.getmany(timeout_s=0.5):
                    curves.add(r.message)  # type: ignore[arg-type]
                    r.ack()
                learner = deployment.supervisor.actors.get("learner")
                stats = learner.statistics() if learner is not None else {}
                step = int(stats.get("step", 0))
                elapsed = time.monotonic() - started
                parts = " ".join(f"{d}={v:.2f}" for d in sorted(curves.domains()) if (v := curves.recent(d)) is not None)
                goal = f"{elapsed:4.0f}/{budget:.0f}s" if budget else f"step {step}/{plan.steps}"
                fraction = elapsed / budget if budget else step / max(1, plan.steps or 1)
                progress.update(fraction, f"{goal} step {step:3d} trained {stats.get('trained', 0):5d} "
                                f"filtered {stats.get('filtered', 0):5d} stale {stats.get('dropped_stale', 0):4d} "
                                f"| recent reward {parts}")
                if deployment.supervisor.finished("learner") or (plan.steps and step >= plan.steps):
                    break
                if budget and elapsed >= budget and step >= 1:
                    break
            progress.close()
            deployment.drain()
        assert deployment.rt.control is not None
        return await fetch_final_weights(deployment.rt.control, deployment.rt.names, run_dir, deployment.model_dir)


class Progress:
    """One progress line: redrawn in place on a terminal, a plain line every ``every_s`` seconds in a log."""

    def __init__(self, out: Any, every_s: float = 30.0, width: int = 24) -> None:
        self.out, self.every_s, self.width = out, every_s, width
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self._last_text, self._last_print, self._printed = "", float("-inf"), ""

    def update(self, fraction: float, text: str) -> None:
        fraction = min(1.0, max(0.0, fraction))
        filled = int(round(self.width * fraction))
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {text}"
        if self.tty:
            if line != self._last_text:
                self.out.write(f"\r{line}\x1b[K")
                self.out.flush()
        elif time.monotonic() - self._last_print >= self.every_s:
            self.out.write(line + "\n")
            self.out.flush()
            self._last_print, self._printed = time.monotonic(), line
        self._last_text = line

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
        elif self._last_text and self._last_text != self._printed:
            self.out.write(self._last_text + "\n")
        self.out.flush()


async def fetch_final_weights(nats: Nats, names: Any, run_dir: Path, model_dir: Path | None) -> Path:
    """The latest published version as a complete HF directory (config and tokenizer from the start)."""
    assert model_dir is not None
    latest = await fetch_latest_model(nats, names, model_dir, run_dir / "final-weights", run_dir / "final-model")
    if latest is None:
        raise RuntimeError("the learner published no weights")
    return latest[1]


def plot(curves: dict[str, dict[int, float]], before: dict[str, DomainScore], after: dict[str, DomainScore],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for domain, series in sorted(curves.items()):
        xs = sorted(series)
        ys = [series[x] for x in xs]
        line, = ax1.plot(xs, ys, marker="o", ms=2, lw=0.6, alpha=0.35)
        window = 5  # a few versions: each version holds only a batch's worth of a domain's samples
        smooth = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        ax1.plot(xs, smooth, color=line.get_color(), lw=2, label=f"{domain} (mean of {window})")
    ax1.set_xlabel("policy version (learner steps)")
    ax1.set_ylabel("mean correctness of training samples")
    ax1.set_title("reward per domain during RL")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    domains = sorted(before)
    xs = list(range(len(domains)))
    ax2.bar([x - 0.2 for x in xs], [before[d].accuracy for d in domains], width=0.4, label="before RL")
    ax2.bar([x + 0.2 for x in xs], [after[d].accuracy for d in domains], width=0.4, label="after RL")
    ax2.set_xticks(list(xs), domains)
    ax2.set_ylim(0, 1)
    ax2.set_title("held-out accuracy (sampled, mean of k)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trained_domains(cfg: EngineConfig) -> list[str]:
    """The domains RL trains on: those with a positive sampling weight."""
    return sorted(d for d, w in cfg.scheduler.domains.items() if w > 0)


def print_tables(curves: dict[str, dict[int, float]], before: Heldout, after: Heldout, *,
                 trained: set[str] | None = None) -> None:
    """The reward per version and the held-out tables; ``trained`` (default: every domain with a reward curve)
    marks the domains RL trained on, the rest are shown as untrained (what transfer alone did)."""
    trained = set(curves) if trained is None else trained
    versions = sorted({v for s in curves.values() for v in s})
    print("\nreward (mean correctness of training samples) per domain per policy version")
    print("version " + "".join(f"{d:>10}" for d in sorted(curves)))
    for v in versions:
        print(f"{v:7d} " + "".join(f"{curves[d][v]:>10.2f}" if v in curves[d] else f"{'':>10}"
                                   for d in sorted(curves)))
    for title, b_scores, a_scores in (
            (f"sampled: mean of {next(iter(before.sampled.values())).samples} per task at the RL temperature",
             before.sampled, after.sampled),
            ("greedy", before.greedy, after.greedy)):
        if not b_scores:
            continue
        print(f"\nheld-out accuracy ({title}; fixed seed)")
        print(f"{'domain':<16}{'':<11}{'tasks':>6}{'before':>9}{'after':>9}{'change':>9}")
        for d in sorted(b_scores, key=lambda d: (d not in trained, d)):
            b, a = b_scores[d], a_scores[d]
            mark = "trained" if d in trained else "untrained"
            print(f"{d:<16}{mark:<11}{b.tasks:>6}{b.accuracy:>9.3f}{a.accuracy:>9.3f}{a.accuracy - b.accuracy:>+9.3f}")


async def run_demo(config_path: str | None, run_dir: Path, plan: DemoPlan, bootstrap: str, nats_url: str) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    namespace = f"demo-{int(time.time())}"
    cfg = default_config(namespace, bootstrap, nats_url, run_dir, plan)
    if config_path:
        cfg = load_deployment_config(config_path, overrides={"namespace": namespace})
    model_dir = run_dir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    t0 = time.monotonic()
    print(f"1/4 supervised warm start: {plan.sft_examples} demonstrations, {plan.sft_steps} steps", flush=True)
    await anyio.to_thread.run_sync(warm_start, model_dir, plan)
    print(f"2/4 held-out evaluation before RL ({time.monotonic() - t0:.0f}s)", flush=True)
    before = await evaluate_dir(model_dir, run_dir, plan, "before")
    print("    sampled " + ", ".join(f"{d}: {s.accuracy:.3f}" for d, s in sorted(before.sampled.items()))
          + "; greedy " + ", ".join(f"{d}: {s.accuracy:.3f}" for d, s in sorted(before.greedy.items())), flush=True)
    print(f"3/4 RL through the pipeline: {plan.steps} learner steps ({time.monotonic() - t0:.0f}s)", flush=True)
    cfg = cfg.model_copy(update={"inference": cfg.inference.model_copy(update={"model_dir": str(model_dir)})})
    curves = RewardCurves()
    final_dir = await rl_run(cfg, run_dir, plan, curves)
    print(f"4/4 held-out evaluation after RL ({time.monotonic() - t0:.0f}s)", flush=True)
    after = await evaluate_dir(final_dir, run_dir, plan, "after")
    table = curves.table()
    print_tables(table, before, after, trained=set(trained_domains(cfg)))
    plot(table, before.sampled, after.sampled, run_dir / "curves.png")
    results = {
        "namespace": namespace,
        "trained": trained_domains(cfg),
        "seconds": round(time.monotonic() - t0, 1),
        "plan": dataclasses.asdict(plan),
        # headline: sampled at the RL temperature (the expected accuracy RL optimises); greedy beside it
        "heldout_before": {d: dataclasses.asdict(s) for d, s in before.sampled.items()},
        "heldout_after": {d: dataclasses.asdict(s) for d, s in after.sampled.items()},
        "heldout_before_greedy": {d: dataclasses.asdict(s) for d, s in before.greedy.items()},
        "heldout_after_greedy": {d: dataclasses.asdict(s) for d, s in after.greedy.items()},
        "reward_per_version": {d: {str(v): r for v, r in s.items()} for d, s in table.items()},
        "improved": {d: after.sampled[d].accuracy > before.sampled[d].accuracy for d in before.sampled},
        "improved_greedy": {d: after.greedy[d].accuracy > before.greedy[d].accuracy for d in before.greedy},
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {run_dir / 'results.json'} and {run_dir / 'curves.png'} ({results['seconds']:.0f}s in all)")
    return 0


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("kafka").setLevel(logging.ERROR)  # "no partition metadata yet" while topics settle


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwind normally: servers and the pipeline stop by pid, nothing is left behind


def main_sync(args: Any) -> int:
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    _quiet_libraries()
    if getattr(args, "model", "tiny") != "tiny":
        real = RealPlan(model=args.model, seed=args.seed, seconds=args.seconds, steps=args.steps)
        if getattr(args, "model_dir", None):
            real = dataclasses.replace(real, model_dir=args.model_dir)
        if args.quick:
            real = dataclasses.replace(real, seconds=60, heldout={"math": 16, "docqa": 8, "rg:chain_sum": 8,
                                                                  "python": 4, "shell": 4},
                                       eval_samples=2)
        try:
            return anyio.run(run_real_demo, Path(args.run_dir), real, args.bootstrap, args.nats, args.config)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
    plan = DemoPlan(seed=args.seed, steps=args.steps or 60)
    if args.quick:
        plan = dataclasses.replace(plan, sft_examples=600, sft_steps=60, steps=3,
                                   heldout={"arith": 16, "code": 8, "terminal": 8})
    if getattr(args, "sft_steps", None) is not None:
        if args.sft_steps < 1:
            print(f"rollout demo: --sft-steps must be at least 1, got {args.sft_steps}", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, sft_steps=args.sft_steps)
    try:
        return anyio.run(run_demo, args.config, Path(args.run_dir), plan, args.bootstrap, args.nats)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
