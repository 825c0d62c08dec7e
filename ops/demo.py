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

from actors.domains import DOMAINS, score
from actors.evaluate import DomainScore, evaluate
from actors.inference.actor import format_observation
from actors.inference.launch import LocalServer
from engine.config import EngineConfig, load_config
from engine.schemas import Experience
from streams.kafka import Consumer
from streams.nats import Nats
from streams.weights import WeightPublisher, WeightSubscriber

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


def demonstrations(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from every domain, multi-turn ones in the inference actor's format."""
    rng = random.Random(f"sft:{seed}")
    out = []
    names = sorted(DOMAINS)
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

    from actors.learner_core import sft_warm_start
    from actors.llm import build_char_tokenizer, build_tiny_model, save_model_dir, tiny_config

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


async def evaluate_dir(model_dir: Path, run_dir: Path, plan: DemoPlan, label: str) -> Heldout:
    async with LocalServer(model_dir, log_path=run_dir / "logs" / f"eval-{label}.log") as url:
        sampled = await evaluate(url, plan.heldout, seed=plan.seed, samples=plan.eval_samples,
                                 temperature=plan.eval_temperature)
        greedy = await evaluate(url, plan.heldout, seed=plan.seed)
    return Heldout(sampled, greedy)


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

    def recent(self, domain: str, last: int = 3) -> float | None:
        rows = sorted((v, self.sums[(d, v)], n) for (d, v), n in self.counts.items() if d == domain)[-last:]
        n = sum(r[2] for r in rows)
        return sum(r[1] for r in rows) / n if n else None


async def rl_run(cfg: EngineConfig, run_dir: Path, plan: DemoPlan, curves: RewardCurves) -> Path:
    """The pipeline until the learner has made ``plan.steps`` steps; returns the final weights' dir."""
    from ops.deployment import Deployment

    started = time.monotonic()
    async with Deployment(cfg, run_dir=run_dir) as deployment:
        print(f"pipeline up: namespace {cfg.namespace}, dashboard {deployment.http.url}/dashboard", flush=True)
        watch = Consumer(cfg.kafka, topics=[deployment.rt.names.experience], group=f"{cfg.namespace}.demo",
                         expect=("experience",))
        async with watch, anyio.create_task_group() as tg:
            tg.start_soon(deployment.run)
            shown = ""
            while True:
                for r in await watch.getmany(timeout_s=0.5):
                    curves.add(r.message)  # type: ignore[arg-type]
                    r.ack()
                learner = deployment.supervisor.actors.get("learner")
                stats = learner.statistics() if learner is not None else {}
                step = int(stats.get("step", 0))
                parts = " ".join(f"{d}={v:.2f}" for d in sorted(DOMAINS)
                                 if (v := curves.recent(d)) is not None)
                line = (f"step {step:3d}/{plan.steps} trained {stats.get('trained', 0):5d} "
                        f"stale {stats.get('dropped_stale', 0):4d} filtered {stats.get('filtered', 0):5d} "
                        f"| recent reward {parts}")
                if line != shown:
                    print(f"\r[{time.monotonic() - started:5.0f}s] {line}   ", end="", flush=True)
                    shown = line
                if deployment.supervisor.finished("learner") or step >= plan.steps:
                    break
            print(flush=True)
            deployment.drain()
        assert deployment.rt.nats is not None
        return await fetch_final_weights(deployment.rt.nats, deployment.rt.names, run_dir, deployment.model_dir)


async def fetch_final_weights(nats: Nats, names: Any, run_dir: Path, model_dir: Path | None) -> Path:
    """The latest published version as a complete HF directory (config and tokenizer from the start)."""
    assert model_dir is not None
    manifest = await WeightPublisher(nats, names).latest()
    if manifest is None:
        raise RuntimeError("the learner published no weights")
    vdir = await WeightSubscriber(nats, names, run_dir / "final-weights").fetch(manifest)
    final = run_dir / "final-model"
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(model_dir, final)
    for f in vdir.iterdir():
        shutil.copy2(f, final / f.name)
    return final


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
    xs = range(len(domains))
    ax2.bar([x - 0.2 for x in xs], [before[d].accuracy for d in domains], width=0.4, label="before RL")
    ax2.bar([x + 0.2 for x in xs], [after[d].accuracy for d in domains], width=0.4, label="after RL")
    ax2.set_xticks(list(xs), domains)
    ax2.set_ylim(0, 1)
    ax2.set_title("held-out accuracy (sampled, mean of k)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(curves: dict[str, dict[int, float]], before: Heldout, after: Heldout) -> None:
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
        print(f"\nheld-out accuracy ({title}; fixed seed)")
        print(f"{'domain':<10}{'tasks':>6}{'before':>9}{'after':>9}{'change':>9}")
        for d in sorted(b_scores):
            b, a = b_scores[d], a_scores[d]
            print(f"{d:<10}{b.tasks:>6}{b.accuracy:>9.3f}{a.accuracy:>9.3f}{a.accuracy - b.accuracy:>+9.3f}")


async def run_demo(config_path: str | None, run_dir: Path, plan: DemoPlan, bootstrap: str, nats_url: str) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    namespace = f"demo-{int(time.time())}"
    cfg = default_config(namespace, bootstrap, nats_url, run_dir, plan)
    if config_path:
        cfg = load_config(config_path, overrides={"namespace": namespace})
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
    print_tables(table, before, after)
    plot(table, before.sampled, after.sampled, run_dir / "curves.png")
    results = {
        "namespace": namespace,
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
    plan = DemoPlan(seed=args.seed, steps=args.steps)
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
