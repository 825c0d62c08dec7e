"""Multi-domain benchmark: many domains trained at once, each domain's held-out accuracy before and after.

Systems, one after the other on one machine, each for the same wall-clock budget (``--seconds``, default
1800), each as its own process, on the same mix of domains (``--domains``, equal weights):

- ``engine_adaptive``: ``rollout run`` (``python -m ops.cli run --config <generated toml>``) with adaptive
  balancing and per-domain loss weighting (:data:`SYSTEMS`: ``scheduler.balance.policy = "signal"``,
  ``learner.loss_weighting = "domain_mean"``);
- ``engine_static``: the engine as it balanced before (the old default ``zero_variance`` weights and
  ``token_mean`` loss);
- ``trl``: TRL's ``GRPOTrainer`` on the same mixed dataset, its reward functions calling the engine's own
  verifiers (``loadtests/_trl_multidomain.py``; the optional extra ``peers``: without ``trl`` the row says
  "not installed"). Multi-turn domains are engine-only: TRL trains the single-turn ones and the report keeps
  the multi-turn ones apart (``engine_only``).

The engine systems run ``--seeds`` times each (default 2; ``scheduler.seed`` and ``learner.seed``), TRL
``--trl-seeds`` times (default 1). Kafka and nats-server are started first on free ports (not counted) and
stopped before TRL runs. While an engine system runs, the scheduler's status is read every
``--status-every`` seconds: its sampling shares over time (and, with ``--eval-every N``, the eval role's
per-domain held-out accuracy during the run).

Then ONE evaluator (``loadtests/_multidomain_eval.py``, its own process) scores the base model and every
system's saved weights on the same held-out tasks of every domain (the trained ones and ``--untrained``),
``--eval-tasks`` tasks x ``--eval-samples`` samples at the training temperature, with Wilson 95% intervals.
Runs of several seeds are pooled (episodes added up). A domain is **up** for a system when its gain
(after - before) is beyond its 95% interval (Newcombe's interval of a difference of two proportions, from
the two Wilson intervals, is above 0), **down** when it falls by more than 0.05 and beyond its interval.

Prints a table; writes ``--json PATH`` (flat figures: ``domains_trained``, and for ``engine_adaptive``
``mean_gain``, ``worst_gain``, ``domains_up``, ``domains_down``; the same per system under ``systems``;
and ``domains``: per domain its constant-answer baseline, before, after and gain per system) and a PNG
(``--png``, default next to the JSON: before/after bars per domain, and each engine system's sampling shares
over time).

    python -m loadtests.multidomain [--seconds 1800] [--seeds 2] [--domains a,b,rg:c] [--untrained x]
        [--systems engine_adaptive,engine_static,trl] [--resume out.json] [--first-seed N] [--model-dir DIR]
        [--json out.json]
        [--png out.png] [--eval-tasks 32] [--eval-samples 4] [--quick]

The whole default run (2 x 2 engine runs and TRL, 30 minutes each, then the evaluation) is longer than one
working session, so it can be split: ``--systems`` runs a subset, and ``--resume FILE`` adds this session's
runs to the result FILE of an earlier one (read, then written back, unless ``--json`` names another file). A
resumed session takes the earlier session's domains, budget, model and evaluator settings (given again they must
be equal), reuses its base-model ("before") scores and scores only its own runs' weights with the same evaluator,
so the combined JSON is what one long session would have written. Without ``--systems`` it runs the systems the
file has no successful run of. A run already in the file with status ``ok`` is refused; a failed or
"not installed" one is replaced. ``--first-seed N`` numbers this session's engine runs from seed N, so a
session can add a second seed of a system the file already holds one of. The file records each session's
machine (a different CPU count or model is warned about: the budget is wall-clock, so the sessions belong on one
machine class); where they did not, ``by_machine`` in the JSON and a last table give each CPU's runs, steps and
figures apart, with adaptive - static on each, since a faster CPU trains more steps in the same budget.

``--quick`` checks the script: the tiny char model, the char domains (arith, code, terminal), a short budget,
the two engine systems, one seed. Bad input (an unknown domain, one without a held-out split or not
trainable, ``--seconds`` <= 0, a bad model directory, a stack that cannot start) is one line on stderr and
exit 2 before any system runs. A system that fails is reported failed with its last error line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests.learning import (BadInput, SystemResult, apply_engine_steps, check_engine_result, check_model_dir, finish,
                                last_error_line, run_child, stack)

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_DOMAINS = ("docqa", "python", "rg:basic_arithmetic", "rg:chain_sum", "rg:products", "rg:letter_counting",
                   "rg:aiw", "rg:rectangle_count")
"""Trained at once by default, chosen by measurement (docs/domains.md "The multi-domain benchmark's domains, with
the last integer read" and "Sixteen more families"; ``docs/results/domains-lenient-2026-12-07.json``,
``docs/results/domains-integer-2026-12-07.json``): SmolLM2-135M-Instruct's untrained held-out accuracy at T = 1
over 32 tasks x 4 samples (the benchmark's own evaluator geometry) is 0.078 to 0.31, and a constant answer wins
less than half the time (``rg:letter_counting``'s "1" comes closest, at 0.47). Every domain measured at 0.1 or
more with a constant answer below one half is here, and the next two."""
DEFAULT_UNTRAINED = ("rg:course_schedule", "math", "rg:number_sequence")
"""Evaluated, never trained: a domain falling there is a regression the training caused. ``rg:course_schedule``
scores 0.29 untrained (a fall is visible) but its constant answer ("True") wins 0.52, so it is not trained;
``math`` (the demo's domain) scores 0.008, too little to train on here; ``rg:number_sequence`` (0.055) was
trained until ``rg:aiw`` (0.109) replaced it."""
QUICK_DOMAINS = ("arith", "code", "terminal")
QUICK_UNTRAINED: tuple[str, ...] = ()
DEFAULT_SECONDS = 1800.0
QUICK_SECONDS = 45.0
DEFAULT_SEEDS = 2
MODEL_ENV = "ROLLOUT_MODEL_DIR"
DEFAULT_MODEL = Path.home() / ".cache" / "rollout-engine" / "models" / "smollm2-135m-instruct"
TEMPERATURE = 1.0
"""Training temperature of every system, and the evaluator's."""
DOWN_BY = 0.05
"""A domain is down when it falls by more than this and beyond its 95% interval."""
STOP_GRACE_S = 1800.0
"""How long a system may run past its budget (last step, saving) before it is killed: only against a hang."""

SYSTEMS: dict[str, dict[str, Any]] = {
    "engine_adaptive": {"scheduler": {"balance": {"policy": "signal", "floor": 0.03, "cap": 0.3}},
                        "learner": {"loss_weighting": "domain_mean"}},
    "engine_static": {"scheduler": {"balance": {"policy": "zero_variance"}},
                      "learner": {"loss_weighting": "token_mean"}},
    "trl": {},
}
"""Each system, in the order they run, with its overrides of the generated engine config (nested like the
TOML: ``{"scheduler": {"balance": {...}}}``); TRL's are not an engine config (empty)."""
ENGINE_SYSTEMS = ("engine_adaptive", "engine_static")
TRL_MISSING = ("trl is not importable here: it is the optional extra 'peers' (pip install -e '.[peers]'); "
               "add its row later with --systems trl --resume FILE")
HEADLINE = "engine_adaptive"
"""The system whose figures are the JSON's flat ``mean_gain``, ``domains_up`` and ``domains_down``."""


# -- arguments ---------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.multidomain", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, help=f"wall-clock budget per system run (default {DEFAULT_SECONDS:.0f}; "
                                                 f"{QUICK_SECONDS:.0f} with --quick)")
    p.add_argument("--seeds", type=int, help=f"runs of each engine system (default {DEFAULT_SEEDS}; 1 with --quick)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the engine systems' seeds are FIRST..FIRST+seeds-1 (default 0): a later session adds a seed "
                        "with --resume FILE --first-seed 1 --seeds 1")
    p.add_argument("--trl-seeds", type=int, default=1, help="runs of TRL (default 1)")
    p.add_argument("--domains", help="comma-separated domains trained at once (default: "
                                     f"{','.join(DEFAULT_DOMAINS)}; --quick: {','.join(QUICK_DOMAINS)})")
    p.add_argument("--untrained", help="comma-separated domains evaluated but not trained (default: "
                                       f"{','.join(DEFAULT_UNTRAINED) or 'none'}; '' for none)")
    p.add_argument("--systems", "--only", dest="only",
                   help=f"comma-separated systems to run, of {','.join(SYSTEMS)} (default: all; --quick: the engine's; "
                        "with --resume: those the file has no successful run of)")
    p.add_argument("--resume", metavar="FILE",
                   help="add this session's runs to FILE, an earlier session's --json (its settings and before-scores kept)")
    p.add_argument("--quick", action="store_true", help="the tiny char model, char domains, a short budget (a smoke run)")
    p.add_argument("--model-dir", default=os.environ.get(MODEL_ENV) or str(DEFAULT_MODEL),
                   help=f"Hugging Face model directory (default: ${MODEL_ENV}, else {DEFAULT_MODEL})")
    p.add_argument("--save-dir", help="keep each run's final weights in DIR/<system>.s<seed> (default: a temporary dir)")
    p.add_argument("--json", help="write the figures as one JSON object")
    p.add_argument("--png", help="per-domain before/after and sampling shares (default: the JSON path with .png)")
    p.add_argument("--eval-tasks", type=int, help="held-out tasks per domain (default 32; 4 with --quick)")
    p.add_argument("--eval-samples", type=int, help="samples per held-out task (default 4; 1 with --quick)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also run the engine's eval role every N weight versions (its curves go in the PNG; default 0: off)")
    p.add_argument("--engine-batch", type=int, help="the engine learner's batch size (default 64; 16 with --quick)")
    p.add_argument("--status-every", type=float, help="seconds between reads of the scheduler's status (default 15; 3 with --quick)")
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"),
                   help="use this Kafka broker instead of starting one (with --nats)")
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"), help="use this nats-server (with --bootstrap)")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class DomainSet:
    trained: list[str]
    untrained: list[str]
    multi_turn: list[str]
    """Trained domains TRL cannot train (engine-only)."""

    @property
    def evaluated(self) -> list[str]:
        return self.trained + self.untrained

    @property
    def single_turn(self) -> list[str]:
        return [d for d in self.trained if d not in self.multi_turn]


def engine_seeds(args: argparse.Namespace) -> range:
    """The seeds of this session's engine runs: ``--first-seed`` on, ``--seeds`` of them."""
    return range(args.first_seed, args.first_seed + args.seeds)


def _names(text: str, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise BadInput(f"{flag}: {n!r} is named twice")
        seen.add(n)
    return names


def check_domain(name: str, flag: str) -> bool:
    """Whether ``name`` is multi-turn; BadInput when it is unknown, not trainable or has no held-out split."""
    from domains import DOMAINS

    try:
        domain = DOMAINS[name]
    except KeyError as exc:
        raise BadInput(f"{flag}: {str(exc.args[0]) if exc.args else name}".splitlines()[0]) from None
    if not domain.trainable:
        raise BadInput(f"{flag}: {name!r} is an evaluation set (trainable = False), not a domain to train")
    try:
        held = domain.heldout(1)
    except Exception as exc:  # a file-only domain, a generator that fails
        raise BadInput(f"{flag}: {name!r} has no held-out split ({(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
    if not held:
        raise BadInput(f"{flag}: {name!r} has no held-out split (it draws no held-out task)")
    return domain.multi_turn


def validate(args: argparse.Namespace) -> tuple[list[str], DomainSet]:
    """Check the arguments and fill defaults in; returns the systems and the domains. Raises BadInput."""
    prior = load_prior(args.resume) if args.resume else None
    if prior is not None:
        adopt_settings(args, prior)
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if args.quick else DEFAULT_SECONDS
    if not args.seconds > 0:
        raise BadInput(f"--seconds must be > 0, got {args.seconds:g}")
    if args.seeds is None:
        args.seeds = 1 if args.quick else DEFAULT_SEEDS
    args.eval_tasks = args.eval_tasks if args.eval_tasks is not None else (4 if args.quick else 32)
    args.eval_samples = args.eval_samples if args.eval_samples is not None else (1 if args.quick else 4)
    args.engine_batch = args.engine_batch if args.engine_batch is not None else (16 if args.quick else 64)
    args.status_every = args.status_every if args.status_every is not None else (3.0 if args.quick else 15.0)
    for flag, value in (("--seeds", args.seeds), ("--trl-seeds", args.trl_seeds), ("--eval-tasks", args.eval_tasks),
                        ("--eval-samples", args.eval_samples), ("--engine-batch", args.engine_batch)):
        if value < 1:
            raise BadInput(f"{flag} must be >= 1, got {value}")
    if args.first_seed < 0:
        raise BadInput(f"--first-seed must be >= 0, got {args.first_seed}")
    if args.eval_every < 0:
        raise BadInput(f"--eval-every must be >= 0, got {args.eval_every}")
    if not args.status_every > 0:
        raise BadInput(f"--status-every must be > 0, got {args.status_every:g}")
    if args.only is not None:
        wanted = _names(args.only, "--systems")
        unknown = [s for s in wanted if s not in SYSTEMS]
        if unknown or not wanted:
            raise BadInput(f"--systems: unknown system {', '.join(unknown) or repr(args.only)}; choose from {', '.join(SYSTEMS)}")
        systems = [s for s in SYSTEMS if s in wanted]
    else:
        systems = list(ENGINE_SYSTEMS) if args.quick else list(SYSTEMS)
        if prior is not None:
            systems = [s for s in systems if not prior.ok_runs(s)]
            if not systems:
                raise BadInput(f"--resume {args.resume}: every system already has a successful run there; name --systems")
    if prior is not None:
        prior.check_new_runs(systems, args)
    trained = _names(args.domains, "--domains") if args.domains is not None else list(
        QUICK_DOMAINS if args.quick else DEFAULT_DOMAINS)
    if not trained:
        raise BadInput("--domains: no domain named")
    untrained = _names(args.untrained, "--untrained") if args.untrained is not None else [
        n for n in (QUICK_UNTRAINED if args.quick else DEFAULT_UNTRAINED) if n not in trained]  # --domains math: trained
    both = [n for n in untrained if n in trained]
    if both:
        raise BadInput(f"--untrained: {both[0]!r} is also in --domains")
    multi = [n for n in trained if check_domain(n, "--domains")]
    for n in untrained:
        check_domain(n, "--untrained")
    if "trl" in systems and len(multi) == len(trained):
        raise BadInput("--domains: every domain is multi-turn; TRL has nothing to train (leave trl out with --only)")
    if not args.quick:
        check_model_dir(Path(args.model_dir))
    if bool(args.bootstrap) != bool(args.nats):
        raise BadInput("--bootstrap and --nats go together (or neither: the benchmark starts its own)")
    domains = DomainSet(trained, untrained, multi)
    args.prior = prior
    check_configs(Plan(str(args.model_dir), args.seconds, Path("saved"), Path("work"), domains, args.engine_batch,
                       quick=args.quick, eval_every=args.eval_every, bootstrap="127.0.0.1:9092",
                       nats_url="nats://127.0.0.1:4222"), systems)
    return systems, domains


# -- resuming: an earlier session's result, added to -----------------------------------------------

RESUMED_SETTINGS = (("seconds", "--seconds", "seconds_budget"), ("eval_tasks", "--eval-tasks", "eval_tasks"),
                    ("eval_samples", "--eval-samples", "eval_samples"), ("engine_batch", "--engine-batch", "engine_batch"))
"""(argument, flag, JSON key): what the sessions of one result must share, taken from the file when not given."""


@dataclasses.dataclass
class Prior:
    """An earlier session's ``--json``, as ``--resume`` reads it."""

    path: str
    data: dict[str, Any]
    trained: list[str]
    untrained: list[str]
    scores: dict[str, Any]
    """The evaluator's output: ``{"base" | run name: {domain: figures} | "error: ..."}``."""
    runs: list[SystemResult]

    def ok_runs(self, system: str) -> list[SystemResult]:
        return [r for r in self.runs if r.extra.get("system") == system and r.status == "ok"]

    def check_new_runs(self, systems: list[str], args: argparse.Namespace) -> None:
        """BadInput when this session would run again a run the file holds with status ``ok``."""
        done = {r.name for r in self.runs if r.status == "ok"}
        for system in systems:
            for seed in engine_seeds(args) if system in ENGINE_SYSTEMS else range(args.trl_seeds):
                if f"{system}.s{seed}" in done:
                    raise BadInput(f"--resume {self.path}: {system}.s{seed} is already there (status ok); "
                                   f"leave {system} out of --systems, or add other seeds with --first-seed")

    @property
    def sessions(self) -> list[dict[str, Any]]:
        return list(self.data.get("sessions") or [])


def result_from_json(name: str, d: dict[str, Any]) -> SystemResult:
    """The :class:`SystemResult` a run's JSON (``SystemResult.to_json``) was written from."""
    fields = {f.name for f in dataclasses.fields(SystemResult)} - {"name", "extra", "curve"}
    r = SystemResult(name, **{k: d[k] for k in fields if k in d})
    r.curve = [(float(t), float(v)) for t, v in d.get("curve") or []]
    r.extra = {k: v for k, v in d.items() if k not in fields and k not in ("curve", "samples_per_s")}
    return r


def load_prior(path: str) -> Prior:
    """``--resume``'s file, read and checked (BadInput naming what is wrong)."""
    where = f"--resume {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BadInput(f"{where}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("domains"), dict) or not isinstance(data.get("systems"), dict):
        raise BadInput(f"{where}: not a multidomain.py result (no 'domains' and 'systems')")
    scores = data.get("scores")
    if not isinstance(scores, dict) or not isinstance(scores.get("base"), dict):
        raise BadInput(f"{where}: holds no evaluator scores of the base model (written before --resume existed, "
                       "or its evaluation failed); run it again")
    missing = [k for _, _, k in RESUMED_SETTINGS if k not in data] + [k for k in ("model_dir", "quick") if k not in data]
    if missing:
        raise BadInput(f"{where}: lacks {', '.join(missing)}")
    runs = [result_from_json(name, r) for fig in data["systems"].values() for name, r in (fig.get("runs") or {}).items()]
    trained = [d for d, f in data["domains"].items() if f.get("trained")]
    untrained = [d for d, f in data["domains"].items() if not f.get("trained")]
    return Prior(path, data, trained, untrained, scores, runs)


def adopt_settings(args: argparse.Namespace, prior: Prior) -> None:
    """Fills the arguments not given from ``prior``; BadInput when one given differs (the sessions of one
    result share their domains, budget, model and evaluator)."""
    data, where = prior.data, f"--resume {prior.path}"
    if bool(args.quick) != bool(data["quick"]):
        raise BadInput(f"{where}: it is {'a' if data['quick'] else 'not a'} --quick result; this session must match")
    if float(data.get("temperature", TEMPERATURE)) != TEMPERATURE:
        raise BadInput(f"{where}: sampled at temperature {data['temperature']}, this script at {TEMPERATURE}")
    for attr, flag, key in RESUMED_SETTINGS:
        given, theirs = getattr(args, attr), data[key]
        if given is None:
            setattr(args, attr, theirs)
        elif float(given) != float(theirs):
            raise BadInput(f"{where}: {flag} {given:g} differs from the file's {theirs:g}")
    for attr, flag, theirs in (("domains", "--domains", prior.trained), ("untrained", "--untrained", prior.untrained)):
        given = getattr(args, attr)
        if given is not None and set(_names(given, flag)) != set(theirs):
            raise BadInput(f"{where}: {flag} {given!r} differs from the file's {','.join(theirs)!r}")
        setattr(args, attr, ",".join(theirs))  # the file's order: the table's rows stay where they were
    if not args.quick and str(Path(args.model_dir).resolve()) != str(data["model_dir"]):
        raise BadInput(f"{where}: --model-dir {Path(args.model_dir).resolve()} differs from the file's {data['model_dir']}")


def machine() -> dict[str, Any]:
    """What the budget depends on: the CPU count and model (the sessions of one result belong on one class)."""
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu or platform.processor(), "platform": platform.platform()}


def machine_differs(sessions: list[dict[str, Any]], here: dict[str, Any]) -> str | None:
    """A warning when ``here`` is not the machine class of the first session, else None."""
    first = (sessions[0].get("machine") if sessions else None) or {}
    if not first:
        return None
    diffs = [f"{k} {first.get(k)!r} there, {here.get(k)!r} here" for k in ("cpus", "cpu") if first.get(k) != here.get(k)]
    return "; ".join(diffs) or None


# -- the generated engine config ---------------------------------------------------------------------

def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it, nested tables merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in overrides.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, float) and v == int(v) and abs(v) < 1e15:
        return f"{v:.1f}"
    return json.dumps(v)  # strings, ints, floats, booleans: a JSON scalar is a TOML scalar


def toml_text(cfg: dict[str, Any]) -> str:
    """TOML of ``cfg``: top-level scalars, then a table per dict of sections (one level of sub-tables); dicts
    nested deeper are inline tables. Keys that need it are quoted (``"rg:chain_sum" = 1.0``)."""
    cfg = _drop_none(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for section, body in cfg.items():
        if not isinstance(body, dict):
            continue
        lines += ["", f"[{section}]"]
        lines += [f"{_key(k)} = {_toml_value(v)}" for k, v in body.items() if not _is_table(k, v)]
        for k, v in body.items():
            if _is_table(k, v):
                lines += ["", f"[{section}.{k}]"] + [f"{_key(kk)} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def _key(k: str) -> str:
    """A TOML key: bare when it can be, else quoted (``"rg:chain_sum"``)."""
    return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else json.dumps(k)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without its None values, at every depth (TOML has no null: an absent key takes the default)."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


_SUBTABLES = {"balance"}
"""Section keys written as ``[section.key]`` tables (the rest of a section's dicts are inline tables: weights)."""


def _is_table(key: str, value: Any) -> bool:
    return isinstance(value, dict) and key in _SUBTABLES


@dataclasses.dataclass
class Plan:
    model_dir: str
    seconds: float
    save_root: Path
    work: Path
    domains: DomainSet
    engine_batch: int
    quick: bool = False
    eval_every: int = 0
    status_every: float = 15.0
    bootstrap: str | None = None
    nats_url: str | None = None


def engine_config(plan: Plan, system: str, seed: int, namespace: str) -> dict[str, Any]:
    """The ``rollout run`` config of one engine run: every domain at weight 1, the learning benchmark's geometry
    (groups of 8, 64 samples a step, lr 5e-6, T = 1; --quick: groups of 4, a higher lr), ``SYSTEMS[system]`` over it."""
    run = f"{system}.s{seed}"
    base: dict[str, Any] = {
        "namespace": namespace,
        "kafka": {"bootstrap": plan.bootstrap},
        "nats": {"url": plan.nats_url},
        "scheduler": {"domains": {d: 1.0 for d in plan.domains.trained}, "group_size": 4 if plan.quick else 8,
                      "max_staleness": 1, "curriculum": False, "seed": seed},
        "inference": {"model_dir": plan.model_dir, "max_new_tokens": 16 if plan.quick else 32,
                      "temperature": TEMPERATURE, "concurrency": 64, "max_batch": 64, "stream_interval": 8},
        "reward": {"drop_zero_variance": True, "normalize": "group_std"},
        "learner": {"batch_size": plan.engine_batch, "lr": 1e-4 if plan.quick else 5e-6, "objective": "decoupled_ppo",
                    "torch_threads": 1, "publish_every": 1, "checkpoint_every": 1000000, "seed": seed,
                    "checkpoint_dir": str(plan.work / f"{run}-checkpoints"), "export_dir": str(plan.save_root / run)},
        "sandbox": {"pool_size": 2, "max_sandboxes": 16, "timeout_s": 5.0},
        "supervision": {"drain_timeout_s": STOP_GRACE_S},
    }
    if plan.quick:  # the tiny model solves almost nothing: its all-zero groups still go through every stage
        base["reward"]["drop_zero_variance"] = False
    if plan.eval_every:
        base["eval"] = {"every_versions": plan.eval_every, "domains": {d: 16 for d in plan.domains.evaluated},
                        "temperature": TEMPERATURE, "samples": 1}
    return fit_bounds(merge(base, SYSTEMS[system]), len(plan.domains.trained))


def fit_bounds(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    """``scheduler.balance``'s floor and cap made feasible for ``n`` domains (floor <= 1/n <= cap), so one
    system definition serves any ``--domains``."""
    balance = cfg.get("scheduler", {}).get("balance")
    if not balance:
        return cfg
    balance = dict(balance)
    if "floor" in balance:
        balance["floor"] = min(float(balance["floor"]), 1.0 / n)
    if "cap" in balance:
        balance["cap"] = max(float(balance["cap"]), math.ceil(1000.0 / n) / 1000.0)
    return merge(cfg, {"scheduler": {"balance": balance}})


def check_configs(plan: Plan, systems: list[str]) -> None:
    """Every engine system's generated config loads (BadInput naming the system and the error otherwise)."""
    from engine.config import ConfigError, load_config

    with tempfile.TemporaryDirectory(prefix="rollout-multidomain-check-") as tmp:
        for system in systems:
            if system not in ENGINE_SYSTEMS:
                continue
            path = Path(tmp) / f"{system}.toml"
            path.write_text(toml_text(engine_config(plan, system, 0, "check")))
            try:
                load_config(path, environ={})
            except (ConfigError, ValueError) as exc:
                raise BadInput(f"{system}: its generated config is refused: {(str(exc).splitlines() or [''])[0]}") from None


# -- reading the run while it goes -------------------------------------------------------------------

class StatusPoller:
    """Reads the scheduler's status (and the eval role's, when present) from the run's NATS KV every ``every``
    seconds in a thread: ``shares`` = [(seconds since start, {domain: sampling share})], ``evals`` =
    [(seconds, {domain: held-out accuracy})]. Never fails the run: an error is kept in ``error``."""

    def __init__(self, config: Path, every: float) -> None:
        self.config, self.every = config, every
        self.shares: list[tuple[float, dict[str, float]]] = []
        self.evals: list[tuple[float, dict[str, float]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StatusPoller":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        import anyio

        try:
            anyio.run(self._loop)
        except Exception as exc:  # a figure for the reader, not one the run depends on
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]

    async def _loop(self) -> None:
        import anyio

        from actors.scheduler import SCHEDULER_STATUS_KEY
        from engine.config import load_config
        from engine.topics import Names
        from streams.nats import Nats

        eval_key = getattr(Names, "EVAL_STATUS_KEY", None)
        cfg = load_config(self.config, environ={})
        bucket = Names(cfg.namespace).bucket(cfg.nats.kv_bucket)
        nats = await Nats(cfg.nats).connect()
        try:
            while not self._stop.is_set():
                t = time.monotonic() - self._started
                raw = await nats.kv_get(bucket, SCHEDULER_STATUS_KEY)
                if raw:
                    weights = json.loads(raw).get("weights") or {}
                    self.shares.append((t, {str(k): float(v) for k, v in weights.items()}))  # every reading: a flat line is a figure too
                if eval_key:
                    raw = await nats.kv_get(bucket, eval_key)
                    if raw:
                        acc = {d: float(e["accuracy"]) for d, e in (json.loads(raw).get("domains") or {}).items()}
                        if acc and (not self.evals or self.evals[-1][1] != acc):
                            self.evals.append((t, acc))
                deadline = time.monotonic() + self.every
                while not self._stop.is_set() and time.monotonic() < deadline:
                    await anyio.sleep(0.2)
        finally:
            await nats.close()


# -- the systems -------------------------------------------------------------------------------------

def domain_samples(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Samples trained per domain, summed over the learner's ``steps.jsonl`` rows (their ``domains`` figures)."""
    out: dict[str, int] = {}
    for row in rows:
        for d, figures in (row.get("domains") or {}).items():
            out[d] = out.get(d, 0) + int(figures.get("samples", 0))
    return out


def trained_shares(rows: list[dict[str, Any]], spawned_wall: float) -> list[tuple[float, dict[str, float]]]:
    """Each step's share of trained samples per domain, against seconds since spawn."""
    out = []
    for row in rows:
        per = {d: float(f.get("samples", 0)) for d, f in (row.get("domains") or {}).items()}
        total = sum(per.values())
        if total > 0:
            out.append((float(row["wall"]) - spawned_wall, {d: n / total for d, n in per.items()}))
    return out


def run_engine(plan: Plan, system: str, seed: int) -> SystemResult:
    run_name = f"{system}.s{seed}"
    r = SystemResult(run_name, save_dir=str(plan.save_root / run_name))
    r.extra.update(system=system, seed=seed)
    namespace = f"multidomain-{system.replace('_', '-')}-s{seed}-{os.getpid()}-{int(time.time())}"
    config = plan.work / f"{run_name}.toml"
    config.write_text(toml_text(engine_config(plan, system, seed, namespace)))
    with StatusPoller(config, plan.status_every) as poller:
        run = run_child([sys.executable, "-m", "ops.cli", "run", "--config", str(config), "--run-dir",
                         str(plan.work / f"{run_name}-run"), "--log-level", "WARNING"], log_dir=plan.work / "logs",
                        name=run_name, stop_after=plan.seconds, hard_limit=plan.seconds + STOP_GRACE_S)
    spawned_wall = time.time() - run.wall_seconds
    steps_log = plan.work / f"{run_name}-checkpoints" / namespace / "steps.jsonl"
    rows = [json.loads(ln) for ln in steps_log.read_text().splitlines() if ln.strip()] if steps_log.exists() else []
    apply_engine_steps(r, rows, spawned_wall)
    finish(r, run)
    r.extra["domain_samples"] = domain_samples(rows)
    r.extra["trained_shares"] = [[round(t, 1), {d: round(s, 4) for d, s in sh.items()}]
                                 for t, sh in trained_shares(rows, spawned_wall)]
    r.extra["sampling_shares"] = [[round(t, 1), {d: round(s, 4) for d, s in sh.items()}] for t, sh in poller.shares]
    r.extra["eval_curve"] = [[round(t, 1), acc] for t, acc in poller.evals]
    if poller.error:
        r.extra["status_error"] = poller.error
    return check_engine_result(r, config)


def run_trl(plan: Plan, system: str, seed: int) -> SystemResult:
    run_name = f"{system}.s{seed}"
    r = SystemResult(run_name, save_dir=str(plan.save_root / run_name))
    r.extra.update(system=system, seed=seed, domains=plan.domains.single_turn)
    if importlib.util.find_spec("trl") is None:
        r.status, r.save_dir, r.error = "not installed", None, TRL_MISSING
        return r
    assert r.save_dir is not None
    run = run_child([sys.executable, "-m", "loadtests._trl_multidomain", plan.model_dir, f"{plan.seconds:g}",
                     r.save_dir, "--domains", ",".join(plan.domains.single_turn), "--seed", str(seed)],
                    log_dir=plan.work / "logs", name=run_name, stop_after=None, hard_limit=plan.seconds + STOP_GRACE_S)
    from loadtests.learning import apply_training_lines

    apply_training_lines(r, run.lines, samples_per_step=64)
    finish(r, run)
    if run.returncode == 3:
        r.status, r.error, r.save_dir = "not installed", TRL_MISSING, None
    return r


RUNNERS: dict[str, Callable[[Plan, str, int], SystemResult]] = {
    "engine_adaptive": run_engine, "engine_static": run_engine, "trl": run_trl}


def run_system(plan: Plan, system: str, seed: int, say: Callable[[str], None]) -> SystemResult:
    say(f"{system} seed {seed}: {plan.seconds:g}s budget")
    try:
        r = RUNNERS[system](plan, system, seed)
    except Exception as exc:  # the benchmark's own failure for this run; the others still run
        r = SystemResult(f"{system}.s{seed}", status="failed", error=f"{type(exc).__name__}: {exc}"[:300])
        r.extra.update(system=system, seed=seed)
    say(f"  {r.name}: {r.status}, {r.steps} steps" + (f" ({r.error})" if r.error else ""))
    return r


def evaluate(plan: Plan, runs: list[SystemResult], args: argparse.Namespace, *, base: bool = True) -> dict[str, Any]:
    """The one evaluator over the base model (unless ``base`` is False: a resumed session keeps the file's
    before-scores) and every finished run's weights: ``{name: {domain: figures}}`` (``name`` "base" or a run's
    name; a string for a model it could not score; ``evaluation_error`` when the evaluator itself failed)."""
    scored = [r for r in runs if r.status == "ok" and r.save_dir and Path(r.save_dir).is_dir()]
    if not base and not scored:
        return {}
    out = plan.work / "heldout.json"
    run = run_child([sys.executable, "-m", "loadtests._multidomain_eval", "--domains", ",".join(plan.domains.evaluated),
                     "--tasks", str(args.eval_tasks), "--samples", str(args.eval_samples), "--temperature",
                     f"{TEMPERATURE:g}", "--json", str(out), *([f"base={plan.model_dir}"] if base else []),
                     *(f"{r.name}={r.save_dir}" for r in scored)],
                    log_dir=plan.work / "logs", name="evaluate", stop_after=None, hard_limit=6 * 3600)
    if run.returncode != 0 or not out.exists():
        why = f"evaluation failed: {last_error_line(run.stderr_tail, run.returncode)}"
        for r in scored:
            r.error = why
        return {"base": why} if base else {"evaluation_error": why}
    scores: dict[str, Any] = json.loads(out.read_text())
    for r in scored:
        s = scores.get(r.name)
        if isinstance(s, str):
            r.status, r.error = "failed", s
    return scores


# -- the figures -------------------------------------------------------------------------------------

def wilson(successes: int, n: int) -> tuple[float, float] | None:
    if n <= 0:
        return None
    from engine.eval_stats import wilson_interval

    return wilson_interval(successes, n)


def gain_interval(s1: int, n1: int, s0: int, n0: int) -> tuple[float, float] | None:
    """95% interval of ``s1/n1 - s0/n0`` (Newcombe's hybrid score interval, from the two Wilson intervals)."""
    w1, w0 = wilson(s1, n1), wilson(s0, n0)
    if w1 is None or w0 is None:
        return None
    p1, p0 = s1 / n1, s0 / n0
    d = p1 - p0
    return (d - math.sqrt((p1 - w1[0]) ** 2 + (w0[1] - p0) ** 2), d + math.sqrt((w1[1] - p1) ** 2 + (p0 - w0[0]) ** 2))


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def system_of(r: SystemResult) -> str:
    """The system a run belongs to (its ``system`` extra; a run written without one is named after it)."""
    return str(r.extra.get("system", r.name))


def domain_figures(scores: dict[str, Any], runs: list[SystemResult], domains: DomainSet,
                   baselines: dict[str, tuple[float, str]]) -> dict[str, dict[str, Any]]:
    """Per domain: constant-answer baseline, before (base model) and per system after (seeds pooled), gain,
    their 95% intervals, up/down, samples trained."""
    base = scores.get("base") if isinstance(scores.get("base"), dict) else {}
    assert isinstance(base, dict)
    by_system: dict[str, list[SystemResult]] = {}
    for r in runs:
        by_system.setdefault(system_of(r), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for d in domains.evaluated:
        b = base.get(d) or {}
        s0, n0 = int(b.get("solved", 0)), int(b.get("episodes", 0))
        const, answer = baselines.get(d, (None, ""))
        fig: dict[str, Any] = {"trained": d in domains.trained, "engine_only": d in domains.multi_turn,
                               "constant_baseline": _r(const), "constant_answer": answer[:40],
                               "episodes": n0, "before": _r(s0 / n0) if n0 else None,
                               "before_ci95": [_r(x) for x in w] if (w := wilson(s0, n0)) else None, "systems": {}}
        for system, rs in by_system.items():
            per_seed = [scores.get(r.name) for r in rs]
            per: list[dict[str, Any]] = [p[d] for p in per_seed if isinstance(p, dict) and isinstance(p.get(d), dict)]
            s1, n1 = sum(int(p["solved"]) for p in per), sum(int(p["episodes"]) for p in per)
            trained_here = d in domains.trained and (system != "trl" or d not in domains.multi_turn)
            row: dict[str, Any] = {"trained": trained_here, "runs": len(per),
                                   "samples_trained": sum(int(r.extra.get("domain_samples", {}).get(d, 0)) for r in rs)
                                   if system != "trl" else None,
                                   "after": None, "after_ci95": None, "after_per_seed": [p.get("accuracy") for p in per],
                                   "gain": None, "gain_ci95": None, "up": None, "down": None}
            if n1 and n0:
                gain = s1 / n1 - s0 / n0
                gi = gain_interval(s1, n1, s0, n0)
                assert gi is not None
                w1 = wilson(s1, n1)
                assert w1 is not None
                row.update(after=_r(s1 / n1), after_ci95=[_r(x) for x in w1], gain=_r(gain),
                           gain_ci95=[_r(x) for x in gi], up=gi[0] > 0, down=gain < -DOWN_BY and gi[1] < 0)
            fig["systems"][system] = row
        out[d] = fig
    return out


def system_figures(domains: dict[str, dict[str, Any]], system: str) -> dict[str, Any]:
    """``mean_gain`` and ``worst_gain`` over the domains ``system`` trained; ``domains_up`` of those;
    ``domains_down`` of every evaluated domain (untrained ones included)."""
    rows = {d: f["systems"].get(system) for d, f in domains.items()}
    trained = [r for r in rows.values() if r and r["trained"] and r["gain"] is not None]
    gains = [r["gain"] for r in trained]
    return {"mean_gain": _r(sum(gains) / len(gains)) if gains else None, "worst_gain": _r(min(gains)) if gains else None,
            "domains_scored": len(trained), "domains_up": sum(bool(r["up"]) for r in trained),
            "domains_down": sum(bool(r and r["down"]) for r in rows.values())}


def mean_gain_on(domains: dict[str, dict[str, Any]], system: str, names: list[str]) -> float | None:
    gains = [domains[d]["systems"].get(system, {}).get("gain") for d in names if d in domains]
    vals = [g for g in gains if g is not None]
    return _r(sum(vals) / len(vals)) if vals and len(vals) == len(gains) else None


def machine_figures(runs: list[SystemResult], scores: dict[str, Any], domain_set: DomainSet,
                    baselines: dict[str, tuple[float, str]], sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Per CPU model (from the session that ran each run, the latest one for a re-run): each system's runs, steps
    and figures from that machine's runs alone, and adaptive - static there. The budget is wall-clock, so a
    faster CPU trains more steps: figures pooled across machines compare machines as much as systems."""
    where: dict[str, str] = {}
    for session in sessions:
        for name in session.get("runs", []):
            where[name] = str((session.get("machine") or {}).get("cpu") or "unknown")
    groups: dict[str, list[SystemResult]] = {}
    for r in runs:
        if r.status == "ok":
            groups.setdefault(where.get(r.name, "unknown"), []).append(r)
    out: dict[str, Any] = {}
    for cpu, rs in groups.items():
        domains = domain_figures(scores, rs, domain_set, baselines)
        systems: dict[str, Any] = {}
        for r in rs:
            s = systems.setdefault(system_of(r), {"runs": [], "steps": 0, "samples_trained": 0})
            s["runs"].append(r.name)
            s["steps"] += r.steps
            s["samples_trained"] += r.samples_trained
        for system, s in systems.items():
            s.update(system_figures(domains, system))
        a, b = systems.get(HEADLINE, {}), systems.get("engine_static", {})
        out[cpu] = {"systems": systems, **{f"adaptive_minus_static_{k}": _r(a[k] - b[k])
                                           if a.get(k) is not None and b.get(k) is not None else None
                                           for k in ("mean_gain", "worst_gain")}}
    return out


def summary(runs: list[SystemResult], scores: dict[str, Any], domain_set: DomainSet,
            baselines: dict[str, tuple[float, str]], *, args: argparse.Namespace, model_dir: str,
            infra_seconds: float | None, sessions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    domains = domain_figures(scores, runs, domain_set, baselines)
    systems: dict[str, Any] = {}
    for r in runs:
        s = systems.setdefault(system_of(r), {"runs": {}})
        s["runs"][r.name] = r.to_json()
    for system, s in systems.items():
        s.update(system_figures(domains, system))
        s["status"] = ("ok" if all(x["status"] == "ok" for x in s["runs"].values())
                       else "/".join(sorted({x["status"] for x in s["runs"].values()})))
        s["config_overrides"] = SYSTEMS.get(system, {})
    head = systems.get(HEADLINE, {})
    shared = domain_set.single_turn
    adaptive_shared = mean_gain_on(domains, HEADLINE, shared)
    static_shared = mean_gain_on(domains, "engine_static", domain_set.trained)
    trl_shared = mean_gain_on(domains, "trl", shared)
    seeds = [len(systems[s]["runs"]) for s in ENGINE_SYSTEMS if s in systems]
    return {
        "seconds_budget": args.seconds, "seeds": max(seeds) if seeds else args.seeds,
        "trl_seeds": len(systems["trl"]["runs"]) if "trl" in systems else args.trl_seeds, "model_dir": model_dir,
        "quick": bool(args.quick), "temperature": TEMPERATURE, "eval_tasks": args.eval_tasks,
        "eval_samples": args.eval_samples, "engine_batch": getattr(args, "engine_batch", None),
        "infra_seconds": _r(infra_seconds, 1),
        "domains_trained": len(domain_set.trained), "domains_untrained": len(domain_set.untrained),
        "engine_only_domains": domain_set.multi_turn,
        "mean_gain": head.get("mean_gain"), "worst_gain": head.get("worst_gain"),
        "domains_up": head.get("domains_up"), "domains_down": head.get("domains_down"),
        "adaptive_minus_static_mean_gain": _r(adaptive_all - static_shared)
        if (adaptive_all := mean_gain_on(domains, HEADLINE, domain_set.trained)) is not None and static_shared is not None else None,
        "adaptive_minus_trl_mean_gain": _r(adaptive_shared - trl_shared)
        if adaptive_shared is not None and trl_shared is not None else None,
        "systems": systems, "domains": domains, "scores": scores, "sessions": sessions or [],
        "by_machine": machine_figures(runs, scores, domain_set, baselines, sessions or []),
    }


def format_table(out: dict[str, Any]) -> str:
    def f(x: float | None, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    systems = list(out["systems"])
    lines = []
    head = f"{'domain':<30}{'const':>7}{'before':>8}" + "".join(f"{s[:16] + ' after':>24}{'gain':>8}" for s in systems)
    lines.append(head)
    for d, fig in out["domains"].items():
        tag = "" if fig["trained"] else " (untrained)"
        tag = " (engine only)" if fig["engine_only"] else tag
        line = f"{(d + tag)[:29]:<30}{f(fig['constant_baseline'], '.2f'):>7}{f(fig['before']):>8}"
        for s in systems:
            row = fig["systems"].get(s) or {}
            mark = "+" if row.get("up") else ("-" if row.get("down") else " ")
            ci = row.get("after_ci95")
            after = f"{f(row.get('after'))} [{ci[0]:.2f},{ci[1]:.2f}]" if ci else f(row.get("after"))
            line += f"{after:>24}{f(row.get('gain'), '+.3f') + mark:>8}"
        lines.append(line)
    lines.append("")
    lines.append(f"{'system':<18}{'status':<16}{'runs':>5}{'steps':>7}{'samples':>9}{'mean gain':>11}{'worst':>8}"
                 f"{'up':>4}{'down':>6}")
    for s, fig in out["systems"].items():
        runs = fig["runs"].values()
        lines.append(f"{s:<18}{fig['status'][:15]:<16}{len(fig['runs']):>5}{sum(r['steps'] for r in runs):>7}"
                     f"{sum(r['samples_trained'] for r in runs):>9}{f(fig['mean_gain'], '+.3f'):>11}"
                     f"{f(fig['worst_gain'], '+.3f'):>8}{fig['domains_up']:>4}{fig['domains_down']:>6}")
        for name, r in fig["runs"].items():
            if r.get("error"):
                lines.append(f"  {name}: {r['error']}")
    machines = out.get("by_machine") or {}
    if len(machines) > 1:  # the pooled rows mix CPUs of different speeds: each machine's own figures
        lines.append("")
        lines.append(f"{'machine':<30}{'system':<18}{'runs':>5}{'steps':>7}{'mean gain':>11}{'worst':>8}{'up':>4}"
                     f"{'down':>6}")
        for cpu, m in machines.items():
            for s, fig in m["systems"].items():
                lines.append(f"{cpu[:29]:<30}{s:<18}{len(fig['runs']):>5}{fig['steps']:>7}"
                             f"{f(fig['mean_gain'], '+.3f'):>11}{f(fig['worst_gain'], '+.3f'):>8}"
                             f"{fig['domains_up']:>4}{fig['domains_down']:>6}")
            if m["adaptive_minus_static_mean_gain"] is not None:
                lines.append(f"{cpu[:29]:<30}adaptive - static: mean {f(m['adaptive_minus_static_mean_gain'], '+.3f')}, "
                             f"worst {f(m['adaptive_minus_static_worst_gain'], '+.3f')}")
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(out["domains"])
    systems = list(out["systems"])
    curves = [(s, name, r) for s, fig in out["systems"].items() for name, r in fig["runs"].items()
              if r.get("sampling_shares") or r.get("trained_shares")]
    shown = [c for i, c in enumerate(curves) if i == 0 or c[0] != curves[i - 1][0]]  # one run per system
    evals = [(s, name, r) for s, name, r in shown if r.get("eval_curve")]
    panels = 1 + len(shown) + len(evals)
    fig, axes = plt.subplots(panels, 1, figsize=(max(8, 1.1 * len(domains) + 3), 3.6 * panels), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / (1 + len(systems))
    xs = range(len(domains))
    bars = [("before", [out["domains"][d]["before"] for d in domains], [out["domains"][d]["before_ci95"] for d in domains])]
    for s in systems:
        rows = [out["domains"][d]["systems"].get(s) or {} for d in domains]
        bars.append((s, [r.get("after") for r in rows], [r.get("after_ci95") for r in rows]))
    for i, (label, vals, cis) in enumerate(bars):
        ys = [v if v is not None else 0.0 for v in vals]
        err = [[max(0.0, y - c[0]) if c else 0.0 for y, c in zip(ys, cis)],
               [max(0.0, c[1] - y) if c else 0.0 for y, c in zip(ys, cis)]]
        ax.bar([x + (i - len(systems) / 2) * width for x in xs], ys, width, yerr=err, capsize=2, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([d + ("" if out["domains"][d]["trained"] else "*") for d in domains], rotation=30, ha="right")
    ax.set_ylabel("held-out solved (95% CI)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Held-out accuracy per domain, before and after {out['seconds_budget']:g}s (* untrained)")
    ax.legend(fontsize=8)
    for k, (s, name, r) in enumerate(shown, start=1):
        ax = axes[k][0]
        series = r.get("sampling_shares") or r.get("trained_shares")
        what = "scheduler sampling share" if r.get("sampling_shares") else "share of trained samples per step"
        names = sorted({d for _, sh in series for d in sh})
        for d in names:
            ax.plot([t for t, _ in series], [sh.get(d, 0.0) for _, sh in series], marker=".", label=d)
        ax.set_xlabel("seconds since the run started")
        ax.set_ylabel(what)
        ax.set_ylim(0, 1)
        ax.set_title(f"{name}: {what} over time")
        ax.legend(fontsize=7, ncol=3)
    for k, (s, name, r) in enumerate(evals, start=1 + len(shown)):
        ax = axes[k][0]
        names = sorted({d for _, acc in r["eval_curve"] for d in acc})
        for d in names:
            pts = [(t, acc[d]) for t, acc in r["eval_curve"] if d in acc]
            ax.plot([t for t, _ in pts], [a for _, a in pts], marker=".", label=d)
        ax.set_xlabel("seconds since the run started")
        ax.set_ylabel("held-out accuracy (eval role)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{name}: held-out accuracy during the run")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------------

def constant_baselines(names: list[str], n: int) -> dict[str, tuple[float, str]]:
    from loadtests.domains import constant_baseline

    return {d: constant_baseline(d, n, 0) for d in names}


def combine(prior: Prior, runs: list[SystemResult], scores: dict[str, Any]) -> tuple[list[SystemResult], dict[str, Any]]:
    """The file's runs and scores with this session's added: a run of the same name replaces the file's (only a
    failed or "not installed" one gets here), runs in :data:`SYSTEMS` order then by seed; the before-scores are
    the file's."""
    new = {r.name for r in runs}
    order = list(SYSTEMS)

    def place(r: SystemResult) -> tuple[int, int]:
        system = str(r.extra.get("system", r.name.split(".")[0]))
        return (order.index(system) if system in order else len(order), int(r.extra.get("seed", 0)))

    combined = sorted([r for r in prior.runs if r.name not in new] + runs, key=place)
    merged = {k: v for k, v in prior.scores.items() if k not in new and k != "evaluation_error"}
    merged.update({k: v for k, v in scores.items() if k != "base"})
    return combined, merged


def run(args: argparse.Namespace, systems: list[str], domains: DomainSet, *,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    prior: Prior | None = getattr(args, "prior", None)
    runs: list[SystemResult] = []
    here = machine()
    if prior is not None:
        say(f"resuming {prior.path}: {len(prior.runs)} runs there ({', '.join(r.name for r in prior.runs) or 'none'}); "
            f"this session runs {', '.join(systems)}")
        if (differs := machine_differs(prior.sessions, here)) is not None:
            say(f"warning: not the machine of the file's first session ({differs}); the budget is wall-clock")
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        say(f"trl: {TRL_MISSING}; its row will say 'not installed'")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rollout-multidomain-") as tmp:
        work = Path(tmp)
        save_root = Path(args.save_dir).resolve() if args.save_dir else work / "saved"
        save_root.mkdir(parents=True, exist_ok=True)
        if args.quick:
            from modelserver.llm import write_tiny_model_dir

            model_dir = str(write_tiny_model_dir(work / "tiny-model", seed=0))
        else:
            model_dir = str(Path(args.model_dir).resolve())
        plan = Plan(model_dir, args.seconds, save_root, work, domains, args.engine_batch, quick=args.quick,
                    eval_every=args.eval_every, status_every=args.status_every)
        say(f"{len(domains.trained)} domains trained ({', '.join(domains.trained)}); "
            f"{len(domains.untrained)} evaluated only; engine-only: {', '.join(domains.multi_turn) or 'none'}")
        engine = [s for s in systems if s in ENGINE_SYSTEMS]
        infra_seconds = None
        with stack(args, bool(engine)) as (plan.bootstrap, plan.nats_url, infra_seconds):
            if infra_seconds is not None:
                say(f"Kafka and NATS up in {infra_seconds:.1f}s (not counted)")
            for seed in engine_seeds(args):  # seeds interleaved: a machine that slows down costs both systems alike
                for system in engine:
                    runs.append(run_system(plan, system, seed, say))
        if "trl" in systems:
            for seed in range(args.trl_seeds):
                runs.append(run_system(plan, "trl", seed, say))
        if prior is None:
            say("evaluating the base model and the saved weights")
            scores = evaluate(plan, runs, args)
            all_runs = runs
        else:
            say("evaluating this session's saved weights (the base model's scores are the file's)")
            scores = evaluate(plan, runs, args, base=False)
            all_runs, scores = combine(prior, runs, scores)
        if not args.save_dir:
            for r in runs:
                r.save_dir = None
        session = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "systems": systems,
                   "runs": [r.name for r in runs], "machine": here, "infra_seconds": _r(infra_seconds, 1)}
        baselines = constant_baselines(domains.evaluated, 64)
        out = summary(all_runs, scores, domains, baselines, args=args, model_dir="tiny" if args.quick else model_dir,
                      infra_seconds=infra_seconds, sessions=(prior.sessions if prior else []) + [session])
        error = scores.get("evaluation_error") or scores.get("base")
        if isinstance(error, str):
            out["evaluation_error"] = error
        target = args.json or args.resume
        png = Path(args.png) if args.png else (Path(target).with_suffix(".png") if target else None)
        if png is not None:
            plot(out, png)
            out["png"] = str(png)
        say("")
        say(format_table(out))
        say(f"\n{HEADLINE}: mean_gain {out['mean_gain']}  worst_gain {out['worst_gain']}  domains_up "
            f"{out['domains_up']}  domains_down {out['domains_down']}  (of {out['domains_trained']} trained)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        systems, domains = validate(args)
    except BadInput as exc:
        print(f"multidomain.py: {exc}", file=sys.stderr)
        return 2
    try:
        out = run(args, systems, domains)
    except BadInput as exc:  # the stack: before any system ran
        print(f"multidomain.py: {exc}", file=sys.stderr)
        return 2
    target = args.json or args.resume  # a resumed session writes the combined result back, unless told where
    if target:
        Path(target).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
