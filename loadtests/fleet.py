"""A SIMULATED accelerator fleet under the real engine: async against sync, and throughput as the fleet grows.

Real: the private Kafka broker and nats-server, every role as its own ``rollout run --role R`` process
(scheduler with admission control, inference actor, sandbox actor with bwrap sandboxes, reward with group
normalisation, learner with its ledger, checkpoints and weight publication over NATS). SIMULATED: the
inference servers (``modelserver/sim``: roofline timing of an H100 SXM serving Qwen2.5-7B, synthetic
tokens) and the learner's step (``learner.simulate``: 6 x params x tokens / (gpus x peak x MFU) on 8 H100s,
publication time from 15.2 GB over 25 GB/s). See docs/fleet.md.

Two scale factors keep a 2-core machine able to play the fleet, both stated in the JSON:

- ``token_scale`` k: each synthetic token stands for k real ones. The sim server's step takes the time of
  k real decode steps at the real KV length and its response lengths are the long-tailed distribution
  divided by k (``SimEngine(token_scale=k)``); the learner counts k x the response tokens
  (``learner.simulate.response_token_scale``). Without it the HTTP stream of every token, not the
  engine's per-sample work, would be what is measured.
- ``time_scale``: wall seconds per simulated second, for the servers and the learner alike.

Response lengths: ``modelserver.sim.roofline.LengthModel`` defaults, a lognormal with median 1,500
tokens, sigma 0.9, capped at 16,384: an ASSUMED long tail shaped like the long-CoT RL length curves
(DeepSeek-R1, DAPO report means of several thousand tokens with a tail to the generation cap), not a
fit to one run's histogram.

Parts:

1. async (``max_staleness`` S) against sync (0), same workload and fleet, ``rounds`` pairs alternating
   which goes first: time to N trained samples (from the scheduler's start, all roles ready); the ratio
   per round, its mean ``async_over_sync`` and 95% interval.
2. partial rollouts (interrupt on weight update and resume: the default) against none
   (``inference.partial_rollouts = false``: an update waits for the generations in flight to end and holds
   new ones back), both async with the same bound, in the same rounds: ``partial_rollouts_over_none`` =
   mean of (seconds without / seconds with) and its 95% interval.
3. fleet growth: async runs on 1, 4, 16, 64 servers (batch 16 x servers, capped at 64: admitted samples
   grow with the fleet until then), measured from one learner step to another over >= ``window_s``:
   trained samples/s held over the measured window (``max_samples_per_s``: the best), and each role's CPU
   microseconds per trained sample (``engine_us_per_sample``): utime + stime (+ reaped children's, e.g.
   sandbox processes) of the role's process from ``/proc/<pid>/stat``, difference over the window; the
   Kafka broker's and the nats-server's CPU per trained sample over the same window (``infra_us_per_sample``).
4. ``calibration_error``: ``modelserver.sim.calibrate`` against the local engine on the real model
   (``--model-dir``, default the prepared SmolLM2-135M-Instruct; null with the reason when absent).
5. sandbox growth (``loadtests/_sandbox_fleet.py``): the real sandbox role (bwrap, ``max_sandboxes`` = 100,
   1,000, 3,000; 16 and 100 with ``--quick``) and the reward role on the same private broker, a driver keeping
   N ``code`` completions in flight whose programs each hold a sandbox ``sandbox_hold_s`` seconds; per size the
   sandboxes measured alive and busy, verifications/s held, CPU us per verification by role, memory, and which
   guard (memory, fds, pids) stopped the ramp (``sandbox_growth``, ``max_verifications_per_s``).

6. staleness policies (``staleness_policies``): ``learner.staleness_policy`` ``drop`` against ``downweight`` on
   the same SIMULATED fleet, an in-process event simulation (no broker) driving the real ``Learner`` and
   ``Admission`` (``STALENESS_NOTE``), thousands of trained samples per side: the Kolmogorov-Smirnov distance
   between the judged and the trained completion lengths (flat ``length_ks_<policy>``, weighted by the stale
   factor ``length_ks_weighted_<policy>``, zero-variance filtering's own shift ``length_ks_zero_variance_<policy>``)
   and trained samples per simulated second (``trained_samples_per_s_<policy>``).

    python -m loadtests.fleet [--quick] [--json F] [--plot PNG] [--sandboxes 100,1000,3000] [--sandboxes-only]
                              [--staleness-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests._stats import ci95

GPU = "H100 SXM"
MODEL = "Qwen2.5-7B"
ROLES = ("scheduler", "inference", "sandbox", "reward", "learner")
DEFAULT_MODEL_DIR = Path.home() / ".cache/rollout-engine/models/smollm2-135m-instruct"
PARTIAL_ROLLOUTS_NOTE = (
    "async, same staleness bound: time to the target with inference.partial_rollouts = false (a weight update "
    "waits for the generations in flight and holds new ones) over the time with partial rollouts (interrupt, "
    "resume on the new weights)")


@dataclass(frozen=True)
class Plan:
    """One benchmark's settings (``--quick`` shrinks them)."""

    token_scale: int = 256
    time_scale: float = 0.25
    staleness: int = 4
    batch_size: int = 16
    group_size: int = 4
    target_steps: int = 10
    """Async vs sync: learner steps whose samples are the 'N trained samples' (N = steps x batch)."""
    servers: int = 2
    """Sim servers of the async-vs-sync runs."""
    rounds: int = 3
    fleet: tuple[int, ...] = (1, 4, 16, 64)
    window_s: float = 40.0
    """Fleet growth: seconds measured per size (after the first learner step)."""
    fleet_batch_cap: int = 64
    """Fleet growth: batch = batch_size x servers up to this (a 2-core machine holds a few samples/s)."""
    calibrate: bool = True
    quick: bool = False
    """Calibrate with fewer points too."""
    sandboxes: tuple[int, ...] = (100, 1000, 3000)
    """Sandbox growth: ``max_sandboxes`` of the sandbox role, one run each (empty: not run)."""
    sandbox_hold_s: float = 20.0
    """Sandbox growth: seconds each verification's program holds its sandbox (a simulated test suite)."""
    sandbox_window_s: float = 60.0
    sandbox_ramp_timeout_s: float = 300.0
    sandboxes_only: bool = False
    """Run only the sandbox growth (parts 1-4 and 6 skipped)."""
    staleness_policies: bool = True
    """Part 6: the staleness policies' length distributions (in-process, no broker)."""
    staleness_only: bool = False
    """Run only part 6."""

    @staticmethod
    def quick_plan() -> "Plan":
        return Plan(time_scale=0.15, target_steps=6, rounds=2, fleet=(1, 4), window_s=15.0, fleet_batch_cap=32,
                    quick=True, sandboxes=(16, 100), sandbox_hold_s=5.0, sandbox_window_s=20.0,
                    sandbox_ramp_timeout_s=90.0)


# -- the simulated servers: N sim apps in one process ---------------------------------------------

def sim_options(token_scale: int, time_scale: float) -> Any:
    """The roofline of one H100 SXM serving Qwen2.5-7B, each synthetic token standing for ``token_scale``."""
    from modelserver.sim.roofline import Roofline
    from modelserver.sim.server import SimOptions

    return SimOptions(roofline=Roofline(), time_scale=time_scale, token_scale=token_scale)


async def _serve_sims(n: int, token_scale: int, time_scale: float, urls_file: Path) -> None:
    from modelserver.local.server import ServerConfig
    from modelserver.sim.server import serve_sim

    urls: list[str] = []
    bound = asyncio.Event()

    def on_bound(host: str, port: int) -> None:
        urls.append(f"http://{host}:{port}")
        if len(urls) == n:
            bound.set()

    options = sim_options(token_scale, time_scale)
    tasks = [asyncio.create_task(serve_sim(ServerConfig(port=0, max_batch=1024, seed=i), options, on_bound=on_bound))
             for i in range(n)]
    await bound.wait()
    tmp = urls_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(sorted(urls)))
    tmp.rename(urls_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class SimHost:
    """``python -m loadtests.fleet --sim-host N``: N simulated servers in one process; stopped by its pid."""

    def __init__(self, n: int, plan: Plan, work: Path) -> None:
        self.n, self.plan, self.work = n, plan, work
        self.proc: subprocess.Popen[bytes] | None = None
        self.urls: list[str] = []

    def start(self, timeout_s: float = 120.0) -> list[str]:
        urls_file = self.work / "sim-urls.json"
        urls_file.unlink(missing_ok=True)
        log = open(self.work / "sim-host.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtests.fleet", "--sim-host", str(self.n), "--token-scale",
             str(self.plan.token_scale), "--time-scale", str(self.plan.time_scale), "--urls-file", str(urls_file)],
            cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not urls_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim host exited (rc {self.proc.returncode}); see {self.work / 'sim-host.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sim host: no URLs after {timeout_s}s")
            time.sleep(0.2)
        self.urls = json.loads(urls_file.read_text())
        return self.urls

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- CPU time per process ----------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds_from_stat(stat: str, ticks_per_s: int = _TICK) -> float:
    """utime + stime + cutime + cstime (proc(5) fields 14-17) of one ``/proc/<pid>/stat`` line, in seconds."""
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces and ')'
    return sum(int(x) for x in fields[11:15]) / ticks_per_s  # field 3 (state) is fields[0]


def process_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children (a role's sandbox processes); 0.0 once it is gone."""
    try:
        return cpu_seconds_from_stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0


def us_per_sample(cpu_s: dict[str, float], samples: int) -> dict[str, float | None]:
    """CPU microseconds per sample for each role (None when no sample was counted)."""
    return {role: (round(s * 1e6 / samples, 1) if samples > 0 else None) for role, s in cpu_s.items()}


def ratio_stats(sync_s: list[float], async_s: list[float]) -> dict[str, Any]:
    """Per-round sync/async ratios (how many times faster async reached the target), mean and 95% interval."""
    if len(sync_s) != len(async_s) or not sync_s:
        raise ValueError(f"need as many sync as async times, at least one: {len(sync_s)} vs {len(async_s)}")
    ratios = [s / a for s, a in zip(sync_s, async_s)]
    return {"per_round": [round(r, 3) for r in ratios], "mean": round(sum(ratios) / len(ratios), 3),
            "ci95": ci95(ratios, digits=3)}


# -- one cluster run ---------------------------------------------------------------------------------

@dataclass
class RunResult:
    mode: str
    servers: int
    staleness: int
    batch_size: int
    seconds_to_target: float | None
    trained: int
    window_s: float
    samples_per_s: float
    cpu_s: dict[str, float]
    sim_cpu_s: float
    """CPU of the simulated servers' process (not the engine's)."""
    learner: dict[str, Any] = field(default_factory=dict)
    infra_cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU of the Kafka broker and the nats-server over the same window (the transport's cost)."""

    def row(self) -> dict[str, Any]:
        return {"mode": self.mode, "servers": self.servers, "staleness": self.staleness, "batch_size": self.batch_size,
                "seconds_to_target": self.seconds_to_target, "trained": self.trained,
                "window_s": round(self.window_s, 2), "samples_per_s": round(self.samples_per_s, 3),
                "engine_us_per_sample": us_per_sample(self.cpu_s, self.trained),
                "sim_servers_us_per_sample": us_per_sample({"sim": self.sim_cpu_s}, self.trained)["sim"],
                "infra_us_per_sample": us_per_sample(self.infra_cpu_s, self.trained),
                "dropped_stale": self.learner.get("dropped_stale"), "filtered": self.learner.get("filtered")}


def cluster_config(namespace: str, bootstrap: str, nats_url: str, work: Path, model_dir: Path, urls: list[str],
                   plan: Plan, *, staleness: int, batch_size: int, partial_rollouts: bool = True) -> dict[str, Any]:
    from loadtests._cluster import pipeline_config

    in_flight = (staleness + 1) * batch_size
    cfg = pipeline_config(namespace, bootstrap, nats_url, work, model_dir, max_tasks=None, batch_size=batch_size,
                          group_size=plan.group_size, max_staleness=staleness, group_timeout_s=300.0)
    cfg["kafka"]["default_partitions"] = 4
    cfg["inference"].update(backend="sglang", urls=urls, max_new_tokens=max(1, 16384 // plan.token_scale),
                            concurrency=max(in_flight, plan.group_size), request_timeout_s=600.0,
                            weight_sync_timeout_s=120.0, stream_interval=64, partial_rollouts=partial_rollouts)
    cfg["sandbox"].update(pool_size=4, max_sandboxes=32)
    cfg["learner"].update(checkpoint_every=20, simulate={
        "gpu": GPU, "gpus": 8, "model_params": 7.6e9, "mfu": 0.4, "peak_flops": 989e12, "bytes_per_param": 2,
        "transfer_bytes_per_s": 25e9, "time_scale": plan.time_scale, "response_token_scale": float(plan.token_scale)})
    return cfg


def run_cluster(stack: Any, work: Path, model_dir: Path, plan: Plan, *, mode: str, servers: int, staleness: int,
                batch_size: int, target: int | None, window_s: float | None, log: Any = print,
                partial_rollouts: bool = True) -> RunResult:
    """Start the sim host and every role; measure from the scheduler's start until ``target`` trained samples
    (or, with ``window_s``, over that many seconds after the first trained batch)."""
    from loadtests._cluster import RoleProc, write_toml

    run_dir = work / f"{mode}-{servers}-{int(time.time() * 1000) % 10**8}"
    run_dir.mkdir(parents=True)
    sims = SimHost(servers, plan, run_dir)
    procs: dict[str, RoleProc] = {}
    try:
        urls = sims.start()
        cfg = cluster_config(f"fleet-{run_dir.name}", stack.infra.kafka_bootstrap, stack.infra.nats_url, run_dir,
                             model_dir, urls, plan, staleness=staleness, batch_size=batch_size,
                             partial_rollouts=partial_rollouts)
        config = write_toml(cfg, run_dir / "cluster.toml")
        for role in ROLES:
            procs[role] = RoleProc(role, role, config, run_dir)
        for role in ROLES[1:]:  # the scheduler last: nothing is admitted before every role is up
            procs[role].start()
        for role in ROLES[1:]:
            procs[role].wait_ready()
        procs["scheduler"].start()
        procs["scheduler"].wait_ready()
        started = time.monotonic()
        cpu0 = {r: process_cpu_s(p.pid or 0) for r, p in procs.items()}
        assert sims.proc is not None
        sim0 = process_cpu_s(sims.proc.pid)
        infra_pids = {"kafka": stack.kafka.pid() or 0, "nats": stack.nats.pid() or 0}
        infra0 = {name: process_cpu_s(pid) for name, pid in infra_pids.items()}
        trained0, t0, last = 0, started, 0
        stats: dict[str, Any] = {}
        deadline = started + (window_s or 0) + 600.0
        while True:
            stats = procs["learner"].status().get("learner") or stats
            trained = int(stats.get("trained", 0))
            now = time.monotonic()
            if window_s is not None and trained0 == 0 and trained > 0:
                # the window runs from one learner step to another: it opens at the first one (pipeline full)
                trained0, t0 = trained, now
                cpu0 = {r: process_cpu_s(p.pid or 0) for r, p in procs.items()}
                sim0 = process_cpu_s(sims.proc.pid)
                infra0 = {name: process_cpu_s(pid) for name, pid in infra_pids.items()}
            if target is not None and trained >= target:
                break
            # ... and closes at the first step after window_s, with at least two steps inside
            if (window_s is not None and trained0 and trained != last and now - t0 >= window_s
                    and trained - trained0 >= 2 * batch_size):
                break
            last = trained
            if now > deadline:
                raise TimeoutError(f"{mode} on {servers} servers: {trained} trained after {now - started:.0f}s")
            for r, p in procs.items():
                if not p.alive():
                    raise RuntimeError(f"{r} exited (rc {p.proc and p.proc.returncode}); see {p.log_path}")
            time.sleep(0.25)
        end = time.monotonic()
        cpu = {r: process_cpu_s(p.pid or 0) - cpu0[r] for r, p in procs.items()}
        sim_cpu = process_cpu_s(sims.proc.pid) - sim0
        infra_cpu = {name: process_cpu_s(pid) - infra0[name] for name, pid in infra_pids.items()}
        counted = trained - trained0
        span = end - (t0 if window_s is not None else started)
        result = RunResult(mode, servers, staleness, batch_size, round(end - started, 2) if target else None,
                           counted, span, counted / span if span > 0 else 0.0, cpu, sim_cpu, stats, infra_cpu)
        log(f"  {mode:<6} servers {servers:>3} S={staleness} batch {batch_size:>4}: {counted} trained in {span:.1f}s "
            f"({result.samples_per_s:.2f}/s), stale-dropped {stats.get('dropped_stale')}")
        return result
    finally:
        for p in procs.values():  # every role drains at once, then each is waited for
            if p.alive() and p.proc is not None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.terminate(timeout_s=20.0)
        sims.stop()


# -- calibration -------------------------------------------------------------------------------------

def calibration(model_dir: Path | None, quick: bool, work: Path) -> dict[str, Any]:
    if model_dir is None or not (model_dir / "config.json").exists():
        return {"calibration_error": None, "calibration_note": f"no model directory at {model_dir}: not calibrated"}
    out = work / "calibration.json"
    argv = [sys.executable, "-m", "modelserver.sim.calibrate", "--model-dir", str(model_dir), "--json", str(out)]
    if quick:
        argv += ["--quick", "--repeats", "2"]
    proc = subprocess.run(argv, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        return {"calibration_error": None, "calibration_note": f"calibration failed: {proc.stderr[-500:]}"}
    result = json.loads(out.read_text())
    return {"calibration_error": round(result["calibration_error"], 4), "calibration_fit_error": result["fit_error"],
            "calibration_model_dir": str(model_dir),
            "calibration_note": "roofline forms fitted to the local engine's measured prefill and decode times "
                                "(real model, this CPU); mean relative error of the worse fit"}


# -- 6. staleness policies: an in-process event simulation of the fleet (SIMULATED) ----------------------

STALENESS_POLICIES = ("drop", "downweight")
STALENESS_NOTE = (
    "SIMULATED in one process (no broker, no role processes): the real Learner's offer/step/ledger and stale "
    "weights (learning.core) and the scheduler's Admission rule, driven by an event simulation of the sim "
    "servers' roofline (continuous batching, partial rollouts: a weight update interrupts and resumes, a "
    "sample's age is from its first token) and of the simulated learner's step and publication times. "
    "length_ks_<policy>: Kolmogorov-Smirnov distance between the lengths of the non-filtered samples the "
    "learner judged (generated and finished) and of those it trained; length_ks_weighted_<policy>: the same "
    "with each trained sample weighed by its stale loss factor; length_ks_zero_variance_<policy>: between all "
    "judged samples and those that passed zero-variance filtering (the filter's own shift, reported apart)")
TASK_MODEL_NOTE = (
    "ASSUMED task model: a group's difficulty d ~ U(0, 1); its samples' lengths lognormal with median "
    "1500 x (0.5 + d) tokens, sigma 0.9, cap 16384; each sample correct with probability 1 - d (wrong at the "
    "cap): harder prompts take longer and fail more, so zero-variance filtering moves lengths too")


@dataclass(frozen=True)
class StalenessPlan:
    """The staleness-policy simulation: one run per policy on the same tasks, lengths and rewards (one seed)."""

    trained_target: int = 8192
    """Trained samples per policy (the run ends at the first step reaching it)."""
    servers: int = 8
    batch_size: int = 64
    group_size: int = 8
    staleness: int = 4
    stale_decay: float = 0.5
    token_scale: int = 16
    """Tokens each simulated decode step adds to every running sequence (k real steps' time)."""
    prompt_tokens: int = 512
    seed: int = 0

    @staticmethod
    def quick_plan() -> "StalenessPlan":
        return StalenessPlan(trained_target=2048, token_scale=32)


def ks_distance(a: Any, b: Any, b_weights: Any = None) -> float:
    """Two-sample Kolmogorov-Smirnov distance ``sup |F_a - F_b|`` (``b`` optionally weighted)."""
    import numpy as np

    xa, xb = np.sort(np.asarray(a, dtype=float)), np.asarray(b, dtype=float)
    if not len(xa) or not len(xb):
        raise ValueError(f"KS distance needs two non-empty samples, got {len(xa)} and {len(xb)} values")
    w = np.ones(len(xb)) if b_weights is None else np.asarray(b_weights, dtype=float)
    if len(w) != len(xb) or not w.sum() > 0 or (w < 0).any():
        raise ValueError("b_weights: one non-negative weight per value of b, not all 0")
    order = np.argsort(xb, kind="stable")
    xb, cw = xb[order], np.cumsum(w[order]) / w.sum()
    grid = np.union1d(xa, xb)
    fa = np.searchsorted(xa, grid, side="right") / len(xa)
    idx = np.searchsorted(xb, grid, side="right") - 1
    fb = np.where(idx >= 0, cw[np.clip(idx, 0, None)], 0.0)
    return float(np.max(np.abs(fa - fb)))


def draw_group(seed: int, index: int, group_size: int) -> tuple[list[int], list[float]]:
    """Group ``index``'s response lengths and rewards under the assumed task model (``TASK_MODEL_NOTE``)."""
    import random

    from modelserver.sim.roofline import LengthModel

    rng = random.Random(seed * 1_000_003 + index)
    base = LengthModel()
    d = rng.random()
    model = LengthModel(median=base.median * (0.5 + d), sigma=base.sigma, max_tokens=base.max_tokens)
    lengths = [model.sample(rng) for _ in range(group_size)]
    rewards = [1.0 if n < base.max_tokens and rng.random() < 1.0 - d else 0.0 for n in lengths]
    return lengths, rewards


@dataclass
class _Seq:
    sid: str
    group: int
    length: int
    done: int = 0
    min_version: int | None = None


@dataclass
class _Server:
    running: list[_Seq] = field(default_factory=list)
    version: int = 0
    busy: bool = False


def simulate_staleness(policy: str, plan: StalenessPlan) -> dict[str, Any]:
    """One policy's run (SIMULATED, see ``STALENESS_NOTE``): lengths judged and trained, KS, throughput."""
    import heapq

    import numpy as np
    import torch

    from actors.learner_sim import publish_seconds, step_seconds
    from actors.scheduler import Admission, LearnerStatus
    from engine.config import LearnerConfig, LearnerSimulateConfig
    from engine.schemas import Experience
    from learning.core import Learner
    from modelserver.sim.roofline import Roofline

    if policy not in STALENESS_POLICIES:
        raise ValueError(f"staleness policy {policy!r} is not one of {', '.join(STALENESS_POLICIES)}")
    class CountingLearner(Learner):
        """The real offer, staleness, ledger and step bookkeeping; the step's time is simulated below."""

        def train_on(self, samples: Any) -> dict[str, float]:
            return {}

    roof, sim = Roofline(), LearnerSimulateConfig()
    cfg = LearnerConfig(batch_size=plan.batch_size, staleness_policy=policy, stale_decay=plan.stale_decay)
    learner = CountingLearner(torch.nn.Linear(1, 1), cfg, max_staleness=plan.staleness)  # type: ignore[arg-type]
    admission = Admission(plan.batch_size, plan.staleness)
    servers = [_Server() for _ in range(plan.servers)]
    events: list[tuple[float, int, str, int]] = []
    seq_no = 0

    def push(t: float, kind: str, arg: int) -> None:
        nonlocal seq_no
        seq_no += 1
        heapq.heappush(events, (t, seq_no, kind, arg))

    groups: dict[int, tuple[list[int], list[float]]] = {}
    finished: dict[int, list[_Seq]] = {}
    seqs: dict[int, _Seq] = {}  # finished, waiting for their event
    lengths: dict[str, int] = {}
    inbox: list[Experience] = []
    admitted = 0
    next_group = 0
    status_version = 0
    delivered = 0  # the newest version the servers can load
    learner_busy = False
    step_ends: list[tuple[float, int]] = []  # (time, trained so far) at each step's end
    folded: dict[str, str] = {}
    staleness_of: dict[str, int] = {}
    generated_tokens = 0
    now = 0.0

    def admit() -> None:
        nonlocal admitted, next_group
        status = LearnerStatus(version=status_version, never_trained=learner.never_trained)
        while admission.can_admit(admitted, plan.group_size, status):
            lens, rewards = draw_group(plan.seed, next_group, plan.group_size)
            groups[next_group] = (lens, rewards)
            for j, n in enumerate(lens):
                s = _Seq(f"g{next_group}-{j}", next_group, max(1, n))
                lengths[s.sid] = s.length
                server = min(range(len(servers)), key=lambda i: len(servers[i].running))
                servers[server].running.append(s)
                if not servers[server].busy:
                    servers[server].busy = True
                    push(now, "server", server)
            admitted += plan.group_size
            next_group += 1

    def server_step(i: int) -> None:
        nonlocal generated_tokens
        srv = servers[i]
        if not srv.running:
            srv.busy = False
            return
        pause = 0.0
        if delivered > srv.version:  # partial rollouts: interrupt, load the new weights, resume
            srv.version, pause = delivered, roof.weight_update_s()
        k = plan.token_scale
        fresh = [s for s in srv.running if s.min_version is None]
        kv = sum(plan.prompt_tokens + s.done for s in srv.running)
        dt = pause + sum(roof.prefill_s(plan.prompt_tokens) for _ in fresh)
        dt += k * roof.decode_step_s(kv + len(srv.running) * (k - 1) // 2)
        still = []
        for s in srv.running:
            if s.min_version is None:
                s.min_version = srv.version
            step = min(k, s.length - s.done)
            s.done += step
            generated_tokens += step
            if s.done >= s.length:
                push(now + dt, "finished", id(s))
                seqs[id(s)] = s
            else:
                still.append(s)
        srv.running = still
        push(now + dt, "server", i)

    def group_done(s: _Seq) -> None:
        done = finished.setdefault(s.group, [])
        done.append(s)
        if len(done) < plan.group_size:
            return
        lens, rewards = groups.pop(s.group)
        zero_variance = len(set(rewards)) == 1
        mean = sum(rewards) / len(rewards)
        for x in sorted(finished.pop(s.group), key=lambda x: x.sid):
            j = int(x.sid.rsplit("-", 1)[1])
            inbox.append(Experience(
                sample_id=x.sid, task_id=f"g{x.group}", domain="sim", prompt_ids=np.zeros(1, dtype=np.int32),
                response_ids=np.zeros(1, dtype=np.int32), logprobs=np.zeros(1, dtype=np.float32),
                loss_mask=np.ones(1, dtype=np.uint8), weight_versions=np.asarray([x.min_version], dtype=np.int32),
                reward=rewards[j], advantage=rewards[j] - mean, group_size=plan.group_size,
                filtered="zero_variance" if zero_variance else ""))

    def feed_learner() -> None:
        nonlocal learner_busy
        if learner_busy:
            return
        for exp in inbox:
            staleness_of[exp.sample_id] = learner.staleness(exp)
            learner.offer(exp)
        inbox.clear()
        if learner.ready:
            report = learner.step()
            for verdict, ids in (("train", report.trained), ("dropped_stale", report.dropped_stale),
                                 ("filtered", report.filtered)):
                for sid in ids:
                    folded[sid] = verdict
            tokens = sum(plan.prompt_tokens + lengths[sid] for sid in report.trained)
            learner_busy = True
            push(now + step_seconds(sim, tokens) + publish_seconds(sim), "published", report.version + 1)

    admit()
    while events and learner.ledger.trained < plan.trained_target:
        now, _, kind, arg = heapq.heappop(events)
        if kind == "server":
            server_step(arg)
        elif kind == "finished":
            group_done(seqs.pop(arg))
        elif kind == "published":
            learner_busy = False
            delivered = status_version = arg
            step_ends.append((now, learner.ledger.trained))
            for i, srv in enumerate(servers):
                if srv.running and not srv.busy:
                    srv.busy = True
                    push(now, "server", i)
        feed_learner()
        admit()
    return _staleness_row(policy, plan, folded, lengths, staleness_of, step_ends, generated_tokens, now,
                          learner.ledger.to_dict())


def _staleness_row(policy: str, plan: StalenessPlan, folded: dict[str, str], lengths: dict[str, int],
                   staleness_of: dict[str, int], step_ends: list[tuple[float, int]], generated_tokens: int,
                   end_s: float, ledger: dict[str, Any]) -> dict[str, Any]:
    from learning.core import stale_weight

    judged = [sid for sid, v in folded.items() if v != "filtered"]
    trained = [sid for sid, v in folded.items() if v == "train"]
    factors = stale_weight([staleness_of[sid] for sid in trained], plan.staleness, plan.stale_decay)
    (t0, n0), (t1, n1) = step_ends[0], step_ends[-1]
    all_judged = list(folded)
    return {
        "policy": policy, "judged": len(judged), "trained": len(trained),
        "dropped_stale": ledger["dropped_stale"], "filtered": ledger["filtered"],
        "stale_trained": sum(1 for sid in trained if staleness_of[sid] > plan.staleness),
        "length_ks": round(ks_distance([lengths[s] for s in judged], [lengths[s] for s in trained]), 4),
        "length_ks_weighted": round(ks_distance([lengths[s] for s in judged], [lengths[s] for s in trained],
                                                factors), 4),
        "length_ks_zero_variance": round(ks_distance([lengths[s] for s in all_judged],
                                                     [lengths[s] for s in judged]), 4),
        "mean_length_judged": round(sum(lengths[s] for s in judged) / len(judged), 1),
        "mean_length_trained": round(sum(lengths[s] for s in trained) / len(trained), 1),
        "trained_samples_per_s": round((n1 - n0) / (t1 - t0), 3) if t1 > t0 else None,
        "generated_tokens_per_s": round(generated_tokens / end_s, 1) if end_s > 0 else None,
        "simulated_s": round(end_s, 1), "steps": len(step_ends),
    }


def staleness_policies(plan: StalenessPlan, log: Any = print) -> dict[str, Any]:
    """Both staleness policies on the same simulated fleet; flat ``length_ks_<policy>`` and friends."""
    out: dict[str, Any] = {"staleness_note": STALENESS_NOTE, "staleness_task_model": TASK_MODEL_NOTE,
                           "staleness_plan": dict(plan.__dict__), "staleness_runs": []}
    for policy in STALENESS_POLICIES:
        row = simulate_staleness(policy, plan)
        log(f"  staleness_policy={policy:<10} trained {row['trained']} of {row['judged']} judged, "
            f"KS {row['length_ks']}, {row['trained_samples_per_s']} trained/s (simulated)")
        out["staleness_runs"].append(row)
        for key in ("length_ks", "length_ks_weighted", "length_ks_zero_variance", "trained_samples_per_s"):
            out[f"{key}_{policy}"] = row[key]
    drop, keep = out["trained_samples_per_s_drop"], out["trained_samples_per_s_downweight"]
    out["downweight_over_drop_throughput"] = round(keep / drop, 3) if drop and keep else None
    return out


# -- the benchmark -----------------------------------------------------------------------------------

def run(plan: Plan, work: Path, model_dir: Path | None, *, log: Any = print) -> dict[str, Any]:
    from modelserver.llm import write_tiny_model_dir
    from loadtests._cluster import Stack

    tiny = write_tiny_model_dir(work / "tiny-model")  # the inference actor's tokenizer; the sim learner's model
    out: dict[str, Any] = {
        "simulated": True, "gpu": GPU, "model": MODEL,
        "assumptions": {"inference": f"{GPU} roofline (989e12 bf16 FLOP/s at MFU 0.4, 3.35e12 B/s HBM at 0.7, 2 ms "
                                     f"step overhead, weight update 15.2 GB at 25 GB/s), {MODEL} bf16",
                        "learner": f"8 x {GPU}, 6 x 7.6e9 x tokens / (8 x 989e12 x 0.4); publication 15.2 GB at 25 GB/s",
                        "lengths": "lognormal median 1500, sigma 0.9, cap 16384 tokens (assumed long tail, "
                                   "LengthModel defaults; not a fit to a published run)"},
        "token_scale": plan.token_scale, "time_scale": plan.time_scale, "staleness": plan.staleness,
        "batch_size": plan.batch_size, "group_size": plan.group_size, "cpus": os.cpu_count(),
        "cpu_time_method": "utime+stime+cutime+cstime of each role's process (/proc/<pid>/stat), over the window, "
                           "per trained sample",
    }
    # 6. staleness policies (in-process: before the broker starts, the CPUs to itself)
    if plan.staleness_policies and not plan.sandboxes_only:
        log("staleness policies: drop vs downweight on the same SIMULATED fleet (in-process event simulation)")
        splan = StalenessPlan.quick_plan() if plan.quick else StalenessPlan()
        out.update(staleness_policies(dataclasses.replace(splan, staleness=plan.staleness), log=log))
    if plan.staleness_only:
        return out
    stack = Stack(work)
    stack.start()
    try:
        if not plan.sandboxes_only:
            _simulated_fleet(plan, stack, work, tiny, out, log)
        # 5. sandbox growth: the real sandbox role at growing max_sandboxes
        if plan.sandboxes:
            from loadtests._sandbox_fleet import run_growth

            out.update(run_growth(stack, work, tiny, plan.sandboxes, hold_s=plan.sandbox_hold_s,
                                  window_s=plan.sandbox_window_s, ramp_timeout_s=plan.sandbox_ramp_timeout_s, log=log))
    finally:
        stack.stop()
    # 4. calibration (after the clusters: it wants the CPUs to itself)
    if plan.calibrate and not plan.sandboxes_only:
        log("calibration: sim roofline fitted to the local engine on the real model")
        out.update(calibration(model_dir, plan.quick, work))
    else:
        out.update({"calibration_error": None,
                    "calibration_note": "skipped (--no-calibration)" if not plan.calibrate else "skipped (--sandboxes-only)"})
    return out


def _simulated_fleet(plan: Plan, stack: Any, work: Path, tiny: Path, out: dict[str, Any], log: Any) -> None:
    """Parts 1-3: async against sync, partial rollouts against none, fleet growth (into ``out``)."""
    # 1. async against sync
    target = plan.target_steps * plan.batch_size
    sync_s: list[float] = []
    async_s: list[float] = []
    nopartial_s: list[float] = []
    pairs: list[dict[str, Any]] = []
    log(f"async (S={plan.staleness}) vs sync (S=0): time to {target} trained samples on {plan.servers} "
        f"simulated servers, {plan.rounds} rounds")
    for r in range(plan.rounds):
        order = [("sync", 0, True), ("async", plan.staleness, True), ("nopartial", plan.staleness, False)]
        res: dict[str, RunResult] = {}
        for mode, s, partial in (order if r % 2 == 0 else order[::-1]):
            res[mode] = run_cluster(stack, work, tiny, plan, mode=mode, servers=plan.servers, staleness=s,
                                    batch_size=plan.batch_size, target=target, window_s=None, log=log,
                                    partial_rollouts=partial)
        assert res["sync"].seconds_to_target and res["async"].seconds_to_target
        assert res["nopartial"].seconds_to_target
        sync_s.append(res["sync"].seconds_to_target)
        async_s.append(res["async"].seconds_to_target)
        nopartial_s.append(res["nopartial"].seconds_to_target)
        pairs.append({"round": r, "first": "sync" if r % 2 == 0 else "nopartial",
                      "sync": res["sync"].row(), "async": res["async"].row(), "nopartial": res["nopartial"].row()})
    stats = ratio_stats(sync_s, async_s)
    partial_stats = ratio_stats(nopartial_s, async_s)
    out.update({"target_trained_samples": target, "async_vs_sync_servers": plan.servers,
                "async_over_sync": stats["mean"], "async_over_sync_ci95": stats["ci95"],
                "async_over_sync_per_round": stats["per_round"], "async_vs_sync_runs": pairs,
                "partial_rollouts_over_none": partial_stats["mean"],
                "partial_rollouts_over_none_ci95": partial_stats["ci95"],
                "partial_rollouts_over_none_per_round": partial_stats["per_round"],
                "partial_rollouts_note": PARTIAL_ROLLOUTS_NOTE})
    # 3. fleet growth
    growth: list[dict[str, Any]] = []
    log(f"fleet growth: async S={plan.staleness}, batch {plan.batch_size} x servers up to {plan.fleet_batch_cap}, "
        f"window >= {plan.window_s:.0f}s and 2 steps")
    for n in plan.fleet:
        res1 = run_cluster(stack, work, tiny, plan, mode="fleet", servers=n, staleness=plan.staleness,
                           batch_size=min(plan.batch_size * n, plan.fleet_batch_cap), target=None, window_s=plan.window_s, log=log)
        growth.append(res1.row())
    best = max(growth, key=lambda g: g["samples_per_s"])
    out.update({"fleet": growth, "max_samples_per_s": best["samples_per_s"],
                "max_samples_per_s_servers": best["servers"], "engine_us_per_sample": best["engine_us_per_sample"]})


def print_results(out: dict[str, Any]) -> None:
    from loadtests._sandbox_fleet import print_table

    if "staleness_runs" in out:
        _print_staleness(out)
    if "async_vs_sync_runs" in out:
        _print_simulated(out)
    print_table(out)


def _print_staleness(out: dict[str, Any]) -> None:
    plan = out["staleness_plan"]
    print(f"\nSIMULATED staleness policies ({plan['servers']} servers, batch {plan['batch_size']}, group "
          f"{plan['group_size']}, max_staleness {plan['staleness']}, stale_decay {plan['stale_decay']}; in-process)")
    print(f"{'policy':<12}{'judged':>8}{'trained':>9}{'dropped':>9}{'stale-trained':>15}{'KS':>8}{'KS weighted':>13}"
          f"{'KS zero-var':>13}{'mean len judged':>17}{'trained':>9}{'trained/s':>11}")
    for r in out["staleness_runs"]:
        print(f"{r['policy']:<12}{r['judged']:>8}{r['trained']:>9}{r['dropped_stale']:>9}{r['stale_trained']:>15}"
              f"{r['length_ks']:>8.4f}{r['length_ks_weighted']:>13.4f}{r['length_ks_zero_variance']:>13.4f}"
              f"{r['mean_length_judged']:>17.0f}{r['mean_length_trained']:>9.0f}{r['trained_samples_per_s']:>11.3f}")
    print(f"downweight_over_drop_throughput: {out['downweight_over_drop_throughput']}")


def _print_simulated(out: dict[str, Any]) -> None:
    print(f"\nSIMULATED fleet: {out['gpu']} serving {out['model']}; 1 synthetic token = {out['token_scale']} tokens; "
          f"time scale {out['time_scale']}")
    print(f"\n{'round':<6}{'first':>10}{'sync s':>9}{'async s':>9}{'ratio':>8}{'no-partial s':>14}")
    for p, ratio in zip(out["async_vs_sync_runs"], out["async_over_sync_per_round"]):
        print(f"{p['round']:<6}{p['first']:>10}{p['sync']['seconds_to_target']:>9.1f}"
              f"{p['async']['seconds_to_target']:>9.1f}{ratio:>8.2f}{p['nopartial']['seconds_to_target']:>14.1f}")
    ci = out["async_over_sync_ci95"]
    print(f"async_over_sync (time to {out['target_trained_samples']} trained samples): {out['async_over_sync']}x"
          + (f" (95% interval {ci[0]}..{ci[1]})" if ci else ""))
    partial = out["partial_rollouts_over_none"]
    pci = out.get("partial_rollouts_over_none_ci95")
    print(f"partial_rollouts_over_none: {'null' if partial is None else f'{partial}x'}"
          + (f" (95% interval {pci[0]}..{pci[1]})" if pci else "") + f" ({out['partial_rollouts_note']})")
    print(f"\n{'servers':>8}{'batch':>7}{'samples/s':>11}" + "".join(f"{r + ' us':>14}" for r in ROLES)
          + f"{'(sim servers us)':>18}{'kafka us':>10}{'nats us':>9}")
    for g in out["fleet"]:
        us = g["engine_us_per_sample"]
        print(f"{g['servers']:>8}{g['batch_size']:>7}{g['samples_per_s']:>11.2f}"
              + "".join(f"{'-' if us[r] is None else f'{us[r]:.0f}':>14}" for r in ROLES)
              + f"{g['sim_servers_us_per_sample'] or 0:>18.0f}"
              + "".join(f"{(g.get('infra_us_per_sample') or {}).get(n) or 0:>{w}.0f}" for n, w in (("kafka", 10), ("nats", 9))))
    print(f"max_samples_per_s: {out['max_samples_per_s']} (at {out['max_samples_per_s_servers']} servers)")
    err = out["calibration_error"]
    print(f"calibration_error: {'null' if err is None else f'{err:.1%}'} ({out['calibration_note']})")


def plot(out: dict[str, Any], path: Path) -> bool:
    """Samples/s and CPU microseconds per sample per role against the fleet size (top row) and verifications/s
    and CPU per verification against the sandboxes alive (bottom row, when measured); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from loadtests._sandbox_fleet import plot_panels

    panels = [k for k in ("fleet", "sandbox_growth") if out.get(k)]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 4 * len(panels)), squeeze=False)
    if "fleet" in panels:
        _plot_fleet(out, axes[0][0], axes[0][1])
    if "sandbox_growth" in panels:
        plot_panels(out, *axes[len(panels) - 1])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def _plot_fleet(out: dict[str, Any], a: Any, b: Any) -> None:
    fleet = out["fleet"]
    xs = [g["servers"] for g in fleet]
    a.plot(xs, [g["samples_per_s"] for g in fleet], "o-")
    a.set(xscale="log", xlabel="simulated servers", ylabel="trained samples / s (wall)",
          title="SIMULATED fleet: throughput the engine holds")
    a.set_ylim(bottom=0)
    for r in ROLES:
        b.plot(xs, [g["engine_us_per_sample"][r] or 0 for g in fleet], "o-", label=r)
    b.set(xscale="log", yscale="log", xlabel="simulated servers", ylabel="CPU us per trained sample",
          title="engine CPU per sample, by role")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds of 6 steps at time scale 0.15, fleet of 1 and 4 servers")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the fleet-growth PNG here (needs matplotlib)")
    p.add_argument("--rounds", type=int, help="async/sync pairs (default 3; 2 with --quick)")
    p.add_argument("--fleet", help="comma-separated server counts (default 1,4,16,64; 1,4 with --quick)")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR), help="real model for the calibration")
    p.add_argument("--no-calibration", action="store_true")
    p.add_argument("--sandboxes", help="comma-separated max_sandboxes of the sandbox growth (default 100,1000,3000; "
                                       "16,100 with --quick; 0: not run)")
    p.add_argument("--sandbox-hold", type=float, help="seconds each verification holds its sandbox (default 20; 5 "
                                                      "with --quick)")
    p.add_argument("--sandboxes-only", action="store_true", help="run only the sandbox growth")
    p.add_argument("--staleness-only", action="store_true",
                   help="run only the staleness policies' simulation (in-process, no broker; seconds to minutes)")
    # the sim host subprocess
    p.add_argument("--sim-host", type=int, help=argparse.SUPPRESS)
    p.add_argument("--token-scale", type=int, default=Plan.token_scale, help=argparse.SUPPRESS)
    p.add_argument("--time-scale", type=float, default=Plan.time_scale, help=argparse.SUPPRESS)
    p.add_argument("--urls-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the role processes, sim servers, broker and nats-server are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.sim_host is not None:
        if args.sim_host < 1 or not args.urls_file:
            p.error("--sim-host N needs N >= 1 and --urls-file")
        asyncio.run(_serve_sims(args.sim_host, args.token_scale, args.time_scale, Path(args.urls_file)))
        return 0
    plan = Plan.quick_plan() if args.quick else Plan()
    if args.rounds is not None:
        if args.rounds < 1:
            p.error(f"--rounds must be >= 1, got {args.rounds}")
        plan = Plan(**{**plan.__dict__, "rounds": args.rounds})
    if args.fleet:
        try:
            sizes = tuple(int(x) for x in args.fleet.split(","))
        except ValueError:
            p.error(f"--fleet: comma-separated server counts, got {args.fleet!r}")
        if not sizes or min(sizes) < 1:
            p.error(f"--fleet: server counts must be >= 1, got {args.fleet!r}")
        plan = Plan(**{**plan.__dict__, "fleet": sizes})
    if args.no_calibration:
        plan = Plan(**{**plan.__dict__, "calibrate": False})
    if args.sandboxes:
        try:
            counts = tuple(int(x) for x in args.sandboxes.split(",") if int(x) != 0)
        except ValueError:
            p.error(f"--sandboxes: comma-separated sandbox counts, got {args.sandboxes!r}")
        if any(c < 1 for c in counts):
            p.error(f"--sandboxes: counts must be >= 1 (or 0 for none), got {args.sandboxes!r}")
        plan = Plan(**{**plan.__dict__, "sandboxes": counts})
    if args.sandbox_hold is not None:
        if not args.sandbox_hold > 0:
            p.error(f"--sandbox-hold must be > 0, got {args.sandbox_hold}")
        plan = Plan(**{**plan.__dict__, "sandbox_hold_s": args.sandbox_hold})
    if args.sandboxes_only:
        if not plan.sandboxes:
            p.error("--sandboxes-only with no sandbox counts")
        plan = Plan(**{**plan.__dict__, "sandboxes_only": True})
    if args.staleness_only:
        if args.sandboxes_only:
            p.error("--staleness-only and --sandboxes-only exclude each other")
        plan = Plan(**{**plan.__dict__, "staleness_only": True, "calibrate": False})
    with tempfile.TemporaryDirectory(prefix="rollout-fleet-") as tmp:
        out = run(plan, Path(tmp), Path(args.model_dir) if args.model_dir else None)
    out["quick"] = args.quick
    print_results(out)
    if args.plot and plot(out, Path(args.plot)):
        out["plot"] = args.plot
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
