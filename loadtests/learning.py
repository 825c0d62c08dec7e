"""Learning benchmark: the engine beside a plain GRPO loop and TRL's GRPOTrainer, on one machine.

Each system trains SmolLM2-135M-Instruct on the plain loop's task (one-digit + - *, "Answer with just
the number", reward 1 iff the first number is right) for the same wall-clock budget, one after the
other (never at the same time: they would share the cores), each as its own process:

- ``engine``: the real pipeline, ``python -m ops.cli run --config <generated toml>`` (= ``rollout
  run``), against a Kafka broker and nats-server started first on free ports (``infra_seconds``, not
  counted). Its budget starts when the daemon is spawned (model loading counts); at the budget it gets
  SIGTERM, drains and its learner exports the final weights (``learner.export_dir``). Its curve is the
  learner's ``steps.jsonl`` (``reward_all``: every sample folded into a step, trained or filtered).
- ``minimal``: ``../shared/baselines/grpo_minimal.py`` (``--minimal PATH``), run unmodified through
  ``loadtests/_minimal_runner.py``, which saves the model the script trained.
- ``trl``: ``loadtests/_trl_runner.py``, TRL's ``GRPOTrainer`` with the same task, reward and geometry
  (the optional extra ``peers``; without ``trl`` the row says "not installed").

Then ONE evaluation (``loadtests/_learning_task.py``, its own process) scores the base model and every
system's saved weights by the plain loop's held-out rule. Prints a table, writes ``--json PATH``
(``engine_over_minimal``, ``engine_over_trl``: engine held-out after over theirs, null when not
available) and a PNG of training reward against wall-clock time (``--png``, default next to the JSON).

    python -m loadtests.learning [--seconds 780] [--only engine,minimal] [--model-dir DIR]
        [--save-dir DIR] [--json out.json] [--png out.png] [--quick] [--eval-tasks N]

The model directory is ``--model-dir`` or ``ROLLOUT_MODEL_DIR``. Bad input (no or unreadable model
directory, ``--seconds`` <= 0, an unknown system, a missing plain loop, a stack that cannot start) is
one line on stderr and exit 2 before any system runs. A system that fails is reported failed with its
last error line; the others still run and the JSON is still written.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]

SYSTEMS = ("engine", "minimal", "trl")
"""In the order they run: the engine first, so the broker and nats-server are stopped before the others."""
DEFAULT_SECONDS = 780.0
QUICK_SECONDS = 120.0
DEFAULT_MINIMAL = ROOT.parent / "shared" / "baselines" / "grpo_minimal.py"
MODEL_ENV = "ROLLOUT_MODEL_DIR"
ENGINE_DOMAIN = "math"
FALLBACK_DOMAIN = "arith"
STOP_GRACE_S = 1800.0
"""How long a system may run past its budget (last step, final evaluation, saving) before it is killed: only
against a hang. Generous, because on a shared machine the plain loop's own held-out evaluation alone was
seen to take 10 minutes."""
RSS_INTERVAL_S = 0.5


class BadInput(ValueError):
    """What was wrong with the command line or the machine, in one line (exit 2)."""


# -- results -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class SystemResult:
    name: str
    status: str = "not run"
    """``ok``, ``failed``, ``not installed`` or ``not run``."""
    error: str | None = None
    steps: int = 0
    samples_trained: int = 0
    seconds: float | None = None
    """Wall clock from spawn to the end of the last training step."""
    wall_seconds: float | None = None
    """Wall clock from spawn to the process's exit (budget, last step, saving)."""
    peak_rss_mb: float | None = None
    curve: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """(seconds since spawn, training reward of the step)."""
    save_dir: str | None = None
    heldout_before: float | None = None
    heldout_after: float | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def samples_per_s(self) -> float | None:
        return self.samples_trained / self.seconds if self.seconds else None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "error": self.error, "steps": self.steps,
                "samples_trained": self.samples_trained, "seconds": _round(self.seconds, 1),
                "wall_seconds": _round(self.wall_seconds, 1), "samples_per_s": _round(self.samples_per_s, 3),
                "heldout_before": self.heldout_before, "heldout_after": self.heldout_after,
                "peak_rss_mb": _round(self.peak_rss_mb, 0), "save_dir": self.save_dir,
                "curve": [[round(t, 1), round(r, 4)] for t, r in self.curve], **self.extra}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` rounded, or None when either is missing or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return round(num / den, 3)


def summary(results: dict[str, SystemResult], *, seconds: float, infra_seconds: float | None,
            model_dir: str, eval_tasks: int) -> dict[str, Any]:
    """The JSON object: figures per system plus the headline ratios."""
    after = {n: r.heldout_after for n, r in results.items()}
    return {"seconds_budget": seconds, "model_dir": model_dir, "eval_tasks": eval_tasks,
            "infra_seconds": _round(infra_seconds, 1),
            "engine_over_minimal": ratio(after.get("engine"), after.get("minimal")),
            "engine_over_trl": ratio(after.get("engine"), after.get("trl")),
            "systems": {n: r.to_json() for n, r in results.items()}}


def format_table(results: dict[str, SystemResult]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = (f"{'system':<9}{'status':<15}{'steps':>6}{'samples':>9}{'seconds':>9}{'samples/s':>11}"
            f"{'held-out before':>17}{'after':>8}{'peak RSS MB':>13}")
    lines = [head]
    for r in results.values():
        lines.append(f"{r.name:<9}{r.status:<15}{r.steps:>6}{r.samples_trained:>9}{f(r.seconds, '.0f'):>9}"
                     f"{f(r.samples_per_s, '.2f'):>11}{f(r.heldout_before, '.3f'):>17}{f(r.heldout_after, '.3f'):>8}"
                     f"{f(r.peak_rss_mb, '.0f'):>13}")
        if r.error:
            lines.append(f"{'':<9}{r.error}")
    return "\n".join(lines)


def plot(results: dict[str, SystemResult], path: Path, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results.values():
        if r.curve:
            ax.plot([t for t, _ in r.curve], [v for _, v in r.curve], marker=".", label=r.name)
    ax.axvline(seconds, color="grey", linestyle=":", label="budget")
    ax.set_xlabel("seconds since the system's process started")
    ax.set_ylabel("training reward (batch mean)")
    ax.set_xlim(left=0)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Learning benchmark: training reward vs wall clock")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- arguments ---------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, help=f"wall-clock budget per system (default {DEFAULT_SECONDS:.0f}; "
                                                 f"{QUICK_SECONDS:.0f} with --quick)")
    p.add_argument("--quick", action="store_true", help="a short budget and a smaller engine batch (a smoke run)")
    p.add_argument("--only", help=f"comma-separated systems to run, of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--model-dir", default=os.environ.get(MODEL_ENV),
                   help=f"Hugging Face model directory (default: ${MODEL_ENV})")
    p.add_argument("--minimal", default=str(DEFAULT_MINIMAL), help="the plain GRPO loop script")
    p.add_argument("--save-dir", help="keep each system's final weights in DIR/<system> (default: a temporary dir)")
    p.add_argument("--json", help="write the figures as one JSON object")
    p.add_argument("--png", help="training reward vs wall clock (default: the JSON path with .png)")
    p.add_argument("--eval-tasks", type=int, default=48, help="held-out tasks of the evaluation (default 48, "
                                                              "the plain loop's; fewer only for smoke runs)")
    p.add_argument("--engine-batch", type=int, help="the engine learner's batch size (default 64 = 8 x 8; 16 with --quick)")
    p.add_argument("--bootstrap", default=os.environ.get("ROLLOUT_KAFKA_BOOTSTRAP"),
                   help="use this Kafka broker instead of starting one (with --nats)")
    p.add_argument("--nats", default=os.environ.get("ROLLOUT_NATS_URL"), help="use this nats-server (with --bootstrap)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> list[str]:
    """Check the arguments and fill defaults in; returns the systems to run. Raises BadInput."""
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if args.quick else DEFAULT_SECONDS
    if not args.seconds > 0:
        raise BadInput(f"--seconds must be > 0, got {args.seconds:g}")
    if args.eval_tasks < 1:
        raise BadInput(f"--eval-tasks must be >= 1, got {args.eval_tasks}")
    if args.engine_batch is None:
        args.engine_batch = 16 if args.quick else 64
    if args.engine_batch < 1:
        raise BadInput(f"--engine-batch must be >= 1, got {args.engine_batch}")
    systems = list(SYSTEMS)
    if args.only is not None:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in SYSTEMS]
        if unknown or not wanted:
            raise BadInput(f"--only: unknown system {', '.join(unknown) or repr(args.only)}; "
                           f"choose from {', '.join(SYSTEMS)}")
        systems = [s for s in SYSTEMS if s in wanted]
    if not args.model_dir:
        raise BadInput(f"no model directory: pass --model-dir DIR or set {MODEL_ENV}")
    check_model_dir(Path(args.model_dir))
    if "minimal" in systems:
        script = Path(args.minimal)
        if not script.is_file() or not os.access(script, os.R_OK):
            raise BadInput(f"--minimal: the plain loop {script} is missing or unreadable")
    if bool(args.bootstrap) != bool(args.nats):
        raise BadInput("--bootstrap and --nats go together (or neither: the benchmark starts its own)")
    return systems


def check_model_dir(path: Path) -> None:
    """The model directory has what every system loads: a readable config, weights and a tokenizer."""
    if not path.is_dir():
        raise BadInput(f"model directory {path}: not a directory")
    config = path / "config.json"
    try:
        json.loads(config.read_text())
    except OSError as exc:
        raise BadInput(f"model directory {path}: cannot read config.json ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"model directory {path}: config.json is not JSON ({exc})") from None
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise BadInput(f"model directory {path}: no weights (*.safetensors)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        f = path / name
        if not f.is_file() or not os.access(f, os.R_OK):
            raise BadInput(f"model directory {path}: {name} is missing or unreadable")


# -- child processes ---------------------------------------------------------------------------------

def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and all its descendants now (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        todo.extend(parents.get(pid, []))
    return total


@dataclasses.dataclass
class ChildRun:
    returncode: int | None
    wall_seconds: float
    peak_rss: int
    lines: list[tuple[float, str]]
    """(seconds since spawn, line) of its stdout."""
    stderr_tail: str
    killed: bool = False
    """Still running at ``hard_limit`` and killed."""


def run_child(cmd: list[str], *, log_dir: Path, name: str, stop_after: float | None, hard_limit: float,
              env: dict[str, str] | None = None) -> ChildRun:
    """Run ``cmd`` in its own session; SIGTERM at ``stop_after`` seconds (if given), SIGKILL of its process
    group at ``hard_limit``. Samples the process tree's RSS every ``RSS_INTERVAL_S``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    err_path = log_dir / f"{name}.stderr"
    lines: list[tuple[float, str]] = []
    with open(err_path, "w") as err, open(log_dir / f"{name}.stdout", "w") as out_log:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True, env=env)
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, started, lines, out_log), daemon=True)
        reader.start()
        peak, termed, killed = 0, False, False
        try:
            while proc.poll() is None:
                peak = max(peak, tree_rss_bytes(proc.pid))
                elapsed = time.monotonic() - started
                if stop_after is not None and not termed and elapsed >= stop_after:
                    proc.send_signal(signal.SIGTERM)
                    termed = True
                if elapsed >= hard_limit:
                    killed = True
                    break
                time.sleep(RSS_INTERVAL_S)
        finally:
            _kill_group(proc)  # it, or whatever of its session outlived it
            proc.wait()
            wall = time.monotonic() - started
            reader.join(timeout=10)
    return ChildRun(proc.returncode, wall, peak, lines, _tail(err_path), killed)


def _read_lines(stream: TextIO, started: float, lines: list[tuple[float, str]], log: TextIO) -> None:
    for line in stream:
        lines.append((time.monotonic() - started, line.rstrip("\n")))
        log.write(line)
        log.flush()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this run created (start_new_session), nothing else
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, size: int = 20000) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - size))
        return f.read().decode(errors="replace")


def last_error_line(stderr: str, returncode: int | None) -> str:
    """The line of a failed run's stderr that says what went wrong (the exception's, when there is one)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt", "Exit")) or head.startswith("rollout"):
            return ln[:300]
    return (lines[-1][:300] if lines else f"exited with {returncode}")


def json_lines(lines: list[tuple[float, str]]) -> Iterator[tuple[float, dict[str, Any]]]:
    for t, line in lines:
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                yield t, obj


def apply_training_lines(result: SystemResult, lines: list[tuple[float, str]], samples_per_step: int) -> None:
    """Steps and curve from ``{"step", "t", "train_reward"}`` lines (timed by their arrival)."""
    for t, obj in json_lines(lines):
        if "train_reward" in obj and "step" in obj:
            result.curve.append((t, float(obj["train_reward"])))
    result.steps = len(result.curve)
    result.samples_trained = result.steps * samples_per_step
    result.seconds = result.curve[-1][0] if result.curve else None


def finish(result: SystemResult, run: ChildRun, *, ok_codes: tuple[int, ...] = (0,)) -> None:
    result.wall_seconds = run.wall_seconds
    result.peak_rss_mb = run.peak_rss / 2 ** 20 if run.peak_rss else None
    if run.returncode in ok_codes:
        result.status = "ok"
    else:
        result.status = "failed"
        result.error = (f"killed: still running {run.wall_seconds:.0f}s after it started" if run.killed
                        else last_error_line(run.stderr_tail, run.returncode))


# -- the systems -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    model_dir: str
    seconds: float
    save_root: Path
    work: Path
    minimal: str
    engine_batch: int
    bootstrap: str | None = None
    nats_url: str | None = None


def run_minimal(plan: Plan) -> SystemResult:
    r = SystemResult("minimal", save_dir=str(plan.save_root / "minimal"))
    assert r.save_dir is not None
    run = run_child([sys.executable, "-m", "loadtests._minimal_runner", plan.minimal, plan.model_dir,
                     f"{plan.seconds:g}", r.save_dir], log_dir=plan.work / "logs", name="minimal", stop_after=None,
                    hard_limit=plan.seconds + STOP_GRACE_S)
    apply_training_lines(r, run.lines, samples_per_step=64)
    for _, obj in json_lines(run.lines):
        if "heldout_after" in obj:
            r.extra["self_reported"] = obj  # the loop's own evaluation, for reference only
    finish(r, run)
    return r


def run_trl(plan: Plan) -> SystemResult:
    r = SystemResult("trl", save_dir=str(plan.save_root / "trl"))
    if importlib.util.find_spec("trl") is None:
        r.status, r.save_dir = "not installed", None
        return r
    assert r.save_dir is not None
    run = run_child([sys.executable, "-m", "loadtests._trl_runner", plan.model_dir, f"{plan.seconds:g}",
                     r.save_dir], log_dir=plan.work / "logs", name="trl", stop_after=None,
                    hard_limit=plan.seconds + STOP_GRACE_S)
    apply_training_lines(r, run.lines, samples_per_step=64)
    finish(r, run)
    if run.returncode == 3:
        r.status, r.error, r.save_dir = "not installed", None, None
    return r


def engine_domain() -> str:
    """``math`` (the plain loop's task as an engine domain) when registered, else ``arith``."""
    from domains import DOMAINS

    return ENGINE_DOMAIN if ENGINE_DOMAIN in DOMAINS else FALLBACK_DOMAIN


def engine_config(plan: Plan, namespace: str, domain: str) -> str:
    """The generated ``rollout run`` config: the plain loop's geometry on the local stack."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    return f"""namespace = {q(namespace)}

[kafka]
bootstrap = {q(plan.bootstrap)}

[nats]
url = {q(plan.nats_url)}

[scheduler]
domains = {{ {domain} = 1.0 }}
group_size = 8
max_staleness = 1
curriculum = false
rebalance = false

[inference]
model_dir = {q(plan.model_dir)}
max_new_tokens = 8
temperature = 1.0
concurrency = 64
max_batch = 64
stream_interval = 8

[reward]
drop_zero_variance = true
normalize = "group_std"

[learner]
batch_size = {plan.engine_batch}
lr = 5e-6
objective = "decoupled_ppo"
torch_threads = 1
publish_every = 1
checkpoint_every = 1000000
checkpoint_dir = {q(str(plan.work / "engine-checkpoints"))}
export_dir = {q(str(plan.save_root / "engine"))}

[sandbox]
pool_size = 0

[supervision]
drain_timeout_s = {STOP_GRACE_S:g}
"""


def run_engine(plan: Plan) -> SystemResult:
    r = SystemResult("engine", save_dir=str(plan.save_root / "engine"))
    namespace = f"learning-{os.getpid()}-{int(time.time())}"
    domain = engine_domain()
    r.extra["domain"] = domain
    if domain != ENGINE_DOMAIN:
        print(f"  engine: domain {ENGINE_DOMAIN!r} is not registered; using {domain!r}", flush=True)
    config = plan.work / "engine.toml"
    config.write_text(engine_config(plan, namespace, domain))
    run = run_child([sys.executable, "-m", "ops.cli", "run", "--config", str(config), "--run-dir",
                     str(plan.work / "engine-run"), "--log-level", "WARNING"], log_dir=plan.work / "logs",
                    name="engine", stop_after=plan.seconds, hard_limit=plan.seconds + STOP_GRACE_S)
    spawned_wall = time.time() - run.wall_seconds
    steps_log = plan.work / "engine-checkpoints" / namespace / "steps.jsonl"
    rows = [json.loads(ln) for ln in steps_log.read_text().splitlines() if ln.strip()] if steps_log.exists() else []
    apply_engine_steps(r, rows, spawned_wall)
    finish(r, run)
    return check_engine_result(r, config)


def check_engine_result(r: SystemResult, config: Path) -> SystemResult:
    """The learner's last status on ``r`` (why no step was made, when none was), and ``failed`` when the learner
    exported no weights: the end of every engine run of the learning and multi-domain benchmarks."""
    try:
        r.extra["learner_status"] = learner_status(config)
    except Exception as exc:  # a figure for the reader, not one the run depends on
        r.extra["learner_status"] = f"unreadable: {type(exc).__name__}: {exc}"
    status = r.extra["learner_status"]
    if r.steps == 0 and isinstance(status, dict) and r.error is None:
        r.error = (f"no learner step: {status.get('consumed', 0)} samples consumed, {status.get('filtered', 0)} "
                   f"filtered, {status.get('dropped_stale', 0)} stale")
    if r.status == "ok" and not Path(r.save_dir).is_dir():  # type: ignore[arg-type]
        r.status, r.error = "failed", "the learner exported no weights"
    return r


def learner_status(config: Path) -> dict[str, Any] | None:
    """The learner's last status (``Names.LEARNER_VERSION_KEY``: consumed, trained, filtered, stale) from NATS."""
    import anyio

    from engine.config import load_config
    from engine.topics import Names
    from streams.nats import Nats

    cfg = load_config(config, environ={})

    async def get() -> bytes | None:
        nats = await Nats(cfg.nats).connect()
        try:
            return await nats.kv_get(Names(cfg.namespace).bucket(cfg.nats.kv_bucket), Names.LEARNER_VERSION_KEY)
        finally:
            await nats.close()

    raw = anyio.run(get)
    return json.loads(raw) if raw else None


def apply_engine_steps(result: SystemResult, rows: list[dict[str, Any]], spawned_wall: float) -> None:
    """Steps, samples and curve from the learner's ``steps.jsonl`` rows (``wall`` is Unix time)."""
    for row in rows:
        reward = row.get("reward_all")
        if reward is None:
            reward = row.get("reward_trained")
        if reward is not None:
            result.curve.append((float(row["wall"]) - spawned_wall, float(reward)))
    result.steps = len(rows)
    result.samples_trained = sum(int(row.get("trained", 0)) for row in rows)
    result.seconds = float(rows[-1]["wall"]) - spawned_wall if rows else None


def evaluate(plan: Plan, results: dict[str, SystemResult], eval_tasks: int) -> None:
    """Score the base model and every finished system's weights in one separate process."""
    scored = {n: r for n, r in results.items() if r.status == "ok" and r.save_dir and Path(r.save_dir).is_dir()}
    out = plan.work / "heldout.json"
    run = run_child([sys.executable, "-m", "loadtests._learning_task", "--base", plan.model_dir,
                     "--tasks", str(eval_tasks), "--json", str(out), *(f"{n}={r.save_dir}" for n, r in scored.items())],
                    log_dir=plan.work / "logs", name="evaluate", stop_after=None, hard_limit=3600)
    if run.returncode != 0 or not out.exists():
        for r in scored.values():
            r.error = f"evaluation failed: {last_error_line(run.stderr_tail, run.returncode)}"
        return
    scores = json.loads(out.read_text())
    base = scores.get("base")
    for name, r in results.items():
        r.heldout_before = base if isinstance(base, float) else None
        s = scores.get(name)
        if isinstance(s, float):
            r.heldout_after = s
        elif isinstance(s, str):
            r.status, r.error = "failed", s


# -- main --------------------------------------------------------------------------------------------

def run_system(name: str, runner: Callable[[Plan], SystemResult], plan: Plan, say: Callable[[str], None]) -> SystemResult:
    say(f"{name}: {plan.seconds:g}s budget")
    try:
        r = runner(plan)
    except Exception as exc:  # the benchmark's own failure for this system; the others still run
        r = SystemResult(name, status="failed", error=f"{type(exc).__name__}: {exc}"[:300])
    say(f"  {name}: {r.status}, {r.steps} steps" + (f" ({r.error})" if r.error else ""))
    return r


@contextmanager
def stack(args: argparse.Namespace, need: bool) -> Iterator[tuple[str | None, str | None, float | None]]:
    """``(bootstrap, nats_url, infra_seconds)``: the given broker, a private one, or none when not needed."""
    if not need:
        yield None, None, None
        return
    if args.bootstrap:
        yield args.bootstrap, args.nats, None
        return
    from loadtests._infra import private_stack

    started = time.monotonic()
    entered = False
    try:
        with private_stack() as (bootstrap, nats_url):
            entered = True
            yield bootstrap, nats_url, time.monotonic() - started
    except Exception as exc:
        if entered:
            raise
        raise BadInput(f"the Kafka/NATS stack cannot start: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def run(args: argparse.Namespace, systems: list[str], *, say: Callable[[str], None] = print) -> dict[str, Any]:
    runners = {"engine": run_engine, "minimal": run_minimal, "trl": run_trl}
    results: dict[str, SystemResult] = {}
    with tempfile.TemporaryDirectory(prefix="rollout-learning-") as tmp:
        work = Path(tmp)
        save_root = Path(args.save_dir).resolve() if args.save_dir else work / "saved"
        save_root.mkdir(parents=True, exist_ok=True)
        plan = Plan(str(Path(args.model_dir).resolve()), args.seconds, save_root, work,
                    str(Path(args.minimal).resolve()), args.engine_batch)
        infra_seconds = None
        # The engine runs first, inside the stack's lifetime; the broker and nats-server are stopped
        # before the other systems run, so they cost those nothing.
        with stack(args, "engine" in systems) as (plan.bootstrap, plan.nats_url, infra_seconds):
            if infra_seconds is not None:
                say(f"Kafka and NATS up in {infra_seconds:.1f}s (not counted)")
            if "engine" in systems:
                results["engine"] = run_system("engine", runners["engine"], plan, say)
        for name in systems:
            if name != "engine":
                results[name] = run_system(name, runners[name], plan, say)
        say("evaluating the base model and the saved weights")
        evaluate(plan, results, args.eval_tasks)
        out = summary(results, seconds=args.seconds, infra_seconds=infra_seconds, model_dir=plan.model_dir,
                      eval_tasks=args.eval_tasks)
        if not args.save_dir:
            for r in results.values():
                r.save_dir = None
            for s in out["systems"].values():
                s["save_dir"] = None
        png = Path(args.png) if args.png else (Path(args.json).with_suffix(".png") if args.json else None)
        if png is not None:
            plot(results, png, args.seconds)
            out["png"] = str(png)
        say("")
        say(format_table(results))
        say(f"\nengine_over_minimal: {out['engine_over_minimal']}   engine_over_trl: {out['engine_over_trl']}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        systems = validate(args)
    except BadInput as exc:
        print(f"learning.py: {exc}", file=sys.stderr)
        return 2
    try:
        out = run(args, systems)
    except BadInput as exc:  # the stack: before any system ran
        print(f"learning.py: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
