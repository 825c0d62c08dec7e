"""Chaos: a real multi-process pipeline under SIGKILLs, a broker restart, a NATS restart and a lost host.

The pipeline runs as separate daemons (``rollout run --config F --role R``): one scheduler (with
``max_tasks``), one inference, two sandbox hosts, one reward, one learner, on a private Kafka broker and
nats-server (free ports, stopped by pid at the end). While it runs, the fault schedule:

- SIGKILLs a random role's process (its whole process group) at random moments and restarts it at once,
  as systemd would; ``--kills`` in all;
- restarts the Kafka broker once (stop, then start on the same data dir);
- restarts nats-server right after a learner step, i.e. around a weight publication;
- fails a sandbox host: SIGKILL one sandbox process and keep it down for ``--host-down`` seconds.

A process that exits on its own (its supervisor gave up) is restarted too. Then it waits for the run to
finish (the scheduler admitted ``max_tasks``, every admitted sample reached ``rollout.experience``, the
learner read every experience record), drains the learner (final checkpoint) and builds the ledger
(``ops/ledger.py``) from the topics and the learner's audit log.

    .venv/bin/python loadtests/chaos.py --quick --json runs/chaos.json
    .venv/bin/python loadtests/chaos.py --kills 24 --duration 240 --tasks 80

Headline keys: ``kills``, ``tasks_admitted``, ``samples_lost``, ``samples_trained_twice`` (targets: 0 lost,
0 trained twice).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ops.infra import InfraConfig, InfraError, KafkaBroker, NatsServer, free_port  # noqa: E402

ROLE_PROCS = ("scheduler", "inference", "sandbox-0", "sandbox-1", "reward", "learner")


# -- config ----------------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def write_toml(data: dict[str, Any], path: Path) -> Path:
    """A two-level TOML file: top-level scalars, then one table per section."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, fields in data.items():
        if isinstance(fields, dict):
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def pipeline_config(namespace: str, bootstrap: str, nats_url: str, work: Path, model_dir: Path, *,
                    max_tasks: int | None, batch_size: int = 8, group_size: int = 4,
                    domains: dict[str, float] | None = None, group_timeout_s: float = 30.0,
                    max_staleness: int = 2, **sections: dict[str, Any]) -> dict[str, Any]:
    """A small, fast pipeline: tiny model, short generations, small learner batches."""
    cfg: dict[str, Any] = {
        "namespace": namespace,
        "kafka": {"bootstrap": bootstrap, "default_partitions": 2},
        "nats": {"url": nats_url, "timeout_s": 10.0},
        "scheduler": {"domains": domains or {"arith": 1.0, "code": 1.0}, "group_size": group_size,
                      "max_staleness": max_staleness, "curriculum": False, "rebalance": False},
        "inference": {"model_dir": str(model_dir), "max_new_tokens": 8, "concurrency": 16, "max_batch": 16,
                      "request_timeout_s": 30.0, "weight_sync_timeout_s": 30.0},
        "sandbox": {"pool_size": 2, "max_sandboxes": 8, "timeout_s": 5.0},
        "reward": {"group_timeout_s": group_timeout_s, "normalize": "group",
                   # an untrained tiny model scores 0 everywhere: keep zero-variance groups trainable so the
                   # learner steps (and publishes, and checkpoints) often
                   "drop_zero_variance": False},
        "learner": {"batch_size": batch_size, "lr": 1e-4, "publish_every": 1, "checkpoint_every": 2,
                    "checkpoint_dir": str(work / "checkpoints"), "torch_threads": 1},
        "telemetry": {"heartbeat_s": 2.0},
        "supervision": {"max_restarts": 50, "restart_window_s": 60.0, "backoff_initial_s": 0.2,
                        "backoff_max_s": 2.0, "drain_timeout_s": 20.0},
    }
    if max_tasks is not None:
        cfg["scheduler"]["max_tasks"] = max_tasks
    for name, over in sections.items():
        cfg.setdefault(name, {}).update(over)
    return cfg


# -- one role process ------------------------------------------------------------------------------

class RoleProc:
    """One ``rollout run --role R`` daemon in its own process group, restartable; stopped by its pid only."""

    def __init__(self, name: str, role: str, config: Path, work: Path) -> None:
        self.name = name
        self.role = role
        self.config = config
        self.run_dir = work / "procs" / name
        self.log_path = work / "logs" / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http: str | None = None
        self.ready = threading.Event()
        self.starts = 0
        self.kills = 0
        self.held_down = False  # a failed host: not restarted until released

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready = threading.Event()
        self.http = None
        env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
        argv = [sys.executable, "-m", "ops.cli", "run", "--config", str(self.config), "--role", self.role,
                "--run-dir", str(self.run_dir), "--instance", self.name, "--log-level", "INFO"]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts} at {time.time():.3f}\n".encode())
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log, env=env,
                                         start_new_session=True)
        self.starts += 1
        threading.Thread(target=self._read_stdout, args=(self.proc, self.ready), daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen[bytes], ready: threading.Event) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("event") == "ready":
                self.http = line.get("http")
                ready.set()
        proc.stdout.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if not self.alive():
                raise RuntimeError(f"{self.name} exited before ready (rc {self.proc and self.proc.returncode}); "
                                   f"see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the whole process group we started (the daemon and its children)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.kills += 1
        self.proc.wait()

    def terminate(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the daemon (it drains); SIGKILL its group if it has not exited in ``timeout_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children left in the group (there should be none)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The daemon's ``/status`` JSON ({} if it does not answer)."""
        if not self.http or not self.alive():
            return {}
        try:
            with urllib.request.urlopen(f"{self.http}/status", timeout=timeout_s) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return {}


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB from /proc (None if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children file)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def wait_reaped(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until every thread of ``pid`` (a server we spawned) is gone, reaping it.

    /proc shows a JVM whose main thread exited as a zombie while its shutdown threads still hold the
    data-dir lock and the ports; starting the next broker then fails. ``waitpid`` returns only once the
    whole thread group has exited.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return
        except ChildProcessError:  # not our child: wait for /proc to forget it
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.05)


# -- the stack -------------------------------------------------------------------------------------

class Stack:
    """A private broker and nats-server (state under ``work``), restartable; stopped by pid."""

    def __init__(self, work: Path) -> None:
        self.infra = InfraConfig.from_env(state_dir=work / "infra", kafka_port=free_port(),
                                          kafka_controller_port=free_port(), nats_port=free_port())
        self.kafka = KafkaBroker(self.infra)
        self.nats = NatsServer(self.infra)

    def start(self) -> None:
        for s in (self.kafka, self.nats):
            s.start()
        for s in (self.kafka, self.nats):
            s.wait_ready()

    def restart(self, service: KafkaBroker | NatsServer, *, down_s: float = 0.0, kill: bool = False) -> float:
        """Stop (SIGTERM, or SIGKILL with ``kill``) and start on the same data dir; returns seconds down."""
        t0 = time.monotonic()
        pid = service.pid()
        if kill and pid is not None:
            os.kill(pid, signal.SIGKILL)
        service.stop()
        if pid is not None:
            wait_reaped(pid)
        time.sleep(down_s)  # the outage itself (fault schedule, not a readiness check)
        for attempt in range(3):
            service.start()
            try:
                service.wait_ready()
                break
            except InfraError:
                if attempt == 2:
                    raise
                service.stop()
        return time.monotonic() - t0

    def stop(self) -> None:
        for s in (self.nats, self.kafka):
            try:
                s.stop()
            except Exception as exc:  # keep stopping the others
                print(f"warning: stopping {s.name}: {exc}", file=sys.stderr)


# -- waiting for the end ---------------------------------------------------------------------------

def poll(cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(every_s)


def kv_get_json(nats_url: str, bucket: str, key: str) -> dict[str, Any]:
    import anyio

    from engine.config import NatsConfig
    from streams.nats import Nats, NatsError

    async def get() -> dict[str, Any]:
        try:
            async with Nats(NatsConfig(url=nats_url, timeout_s=5.0)) as n:
                raw = await n.kv_get(bucket, key)
        except NatsError:
            return {}
        return json.loads(raw) if raw else {}

    return anyio.run(get)


def experience_progress(cfg: Any) -> tuple[set[str], set[str], int]:
    """(expected sample ids from rollout.tasks, distinct sample ids on rollout.experience, experience records)."""
    from engine.schemas import Experience, Task
    from engine.topics import Names
    from ops.ledger import TopicRecord, read_topic

    names = Names(cfg.namespace)
    expected: set[str] = set()
    for rec in read_topic(cfg, names.tasks):
        if isinstance(rec, TopicRecord) and isinstance(rec.message, Task):
            expected |= {f"{rec.message.task_id}/{i}" for i in range(rec.message.group_size)}
    seen: set[str] = set()
    records = 0
    for rec in read_topic(cfg, names.experience):
        records += 1
        if isinstance(rec, TopicRecord) and isinstance(rec.message, Experience):
            seen.add(rec.message.sample_id)
    return expected, seen, records


def learner_read(proc: RoleProc) -> int | None:
    """Experience records the running learner has read since the beginning (folded + pending)."""
    stats = proc.status().get("learner")
    if not stats or "consumed" not in stats:
        return None
    return int(stats["consumed"]) + int(stats.get("duplicates", 0)) + int(stats.get("pending", 0))


# -- the run ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    tasks: int = 60
    kills: int = 20
    duration_s: float = 180.0
    host_down_s: float = 30.0
    broker_restarts: int = 1
    nats_restarts: int = 1
    seed: int = 0
    finish_timeout_s: float = 420.0
    domains: dict[str, float] = dataclasses.field(default_factory=lambda: {"arith": 1.0, "code": 1.0})


class Chaos:
    def __init__(self, plan: Plan, work: Path, *, log: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.work = work
        self.log = log
        self.rng = random.Random(plan.seed)
        self.stack = Stack(work)
        self.procs: dict[str, RoleProc] = {}
        self.events: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.cfg: Any = None
        self._lock = threading.Lock()
        self._stop_watch = threading.Event()
        self.unexpected_exits: dict[str, int] = {}

    def note(self, kind: str, **fields: Any) -> None:
        t = round(time.monotonic() - self.started, 1)
        self.events.append({"t": t, "event": kind, **fields})
        self.log(f"[{t:6.1f}s] {kind} " + " ".join(f"{k}={v}" for k, v in fields.items()))

    # -- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        from actors.llm import write_tiny_model_dir
        from engine.config import EngineConfig

        self.stack.start()
        model_dir = write_tiny_model_dir(self.work / "model", seed=self.plan.seed)
        namespace = f"chaos-{uuid.uuid4().hex[:8]}"
        data = pipeline_config(namespace, self.stack.infra.kafka_bootstrap, self.stack.infra.nats_url, self.work,
                               model_dir, max_tasks=self.plan.tasks, domains=self.plan.domains)
        path = write_toml(data, self.work / "chaos.toml")
        self.cfg = EngineConfig.model_validate(data)
        for name in ROLE_PROCS:
            self.procs[name] = RoleProc(name, name.split("-")[0], path, self.work)
        for name in ROLE_PROCS:  # topic creation tolerates the race (TopicAlreadyExists is fine)
            self.procs[name].start()
        for p in self.procs.values():
            p.wait_ready()
        self.note("pipeline ready", namespace=namespace)
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        """Restart a process that exited by itself (as systemd's Restart=on-failure would)."""
        while not self._stop_watch.wait(0.5):
            with self._lock:
                for p in self.procs.values():
                    if p.proc is not None and not p.alive() and not p.held_down and p.proc.returncode != 0:
                        rc = p.proc.returncode  # rc 0: the role finished (scheduler at max_tasks)
                        self.unexpected_exits[p.name] = self.unexpected_exits.get(p.name, 0) + 1
                        self.note("exited, restarting", proc=p.name, rc=rc)
                        p.start()

    # -- faults ----------------------------------------------------------------------------------
    def kill_and_restart(self, name: str) -> None:
        with self._lock:
            if self.procs[name].held_down or not self.procs[name].alive():
                # that host is down, or the process is between lives (or finished): hit a live one instead
                live = [n for n in ROLE_PROCS if self.procs[n].alive() and not self.procs[n].held_down]
                if not live:
                    return
                name = self.rng.choice(live)
            p = self.procs[name]
            p.kill()
            p.start()
        self.note("SIGKILL + restart", proc=name, pid=p.pid)

    def fail_host(self, name: str) -> None:
        with self._lock:
            p = self.procs[name]
            p.held_down = True
            p.kill()
        self.note("host down (SIGKILL, not restarted)", proc=name, for_s=self.plan.host_down_s)

    def recover_host(self, name: str) -> None:
        with self._lock:
            p = self.procs[name]
            p.held_down = False
            p.start()
        self.note("host back", proc=name)

    def restart_broker(self) -> None:
        self.note("kafka broker stopping")
        down = self.stack.restart(self.stack.kafka, down_s=self.rng.uniform(2, 6))
        self.note("kafka broker back", down_s=round(down, 1))

    def restart_nats_during_publish(self) -> None:
        """Wait for a learner step (each step publishes weights), then SIGKILL nats-server at once."""
        learner = self.procs["learner"]
        log_path = learner.log_path
        size = log_path.stat().st_size if log_path.exists() else 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = log_path.read_bytes()[size:].decode("utf-8", "replace") if log_path.exists() else ""
            if ": step " in text:
                break
            time.sleep(0.02)
        down = self.stack.restart(self.stack.nats, down_s=self.rng.uniform(1, 3), kill=True)
        self.note("nats-server SIGKILLed after a learner step and restarted", down_s=round(down, 1))

    def schedule(self) -> list[tuple[float, Callable[[], None], str]]:
        plan, rng = self.plan, self.rng
        d = plan.duration_s
        out: list[tuple[float, Callable[[], None], str]] = []
        kill_times = sorted(rng.uniform(0.05 * d, 0.95 * d) for _ in range(plan.kills))
        # every role is killed at least once, then random ones
        victims = list(ROLE_PROCS) + [rng.choice(ROLE_PROCS) for _ in range(max(0, plan.kills - len(ROLE_PROCS)))]
        rng.shuffle(victims)
        for t, v in zip(kill_times, victims[:plan.kills]):
            out.append((t, functools.partial(self.kill_and_restart, v), f"kill {v}"))
        for i in range(plan.broker_restarts):
            out.append((d * (0.35 + 0.3 * i), self.restart_broker, "broker restart"))
        for i in range(plan.nats_restarts):
            out.append((d * (0.55 + 0.2 * i), self.restart_nats_during_publish, "nats restart"))
        if plan.host_down_s > 0:
            out.append((d * 0.2, lambda: self.fail_host("sandbox-1"), "host down"))
            out.append((d * 0.2 + plan.host_down_s, lambda: self.recover_host("sandbox-1"), "host back"))
        return sorted(out, key=lambda x: x[0])

    def run_faults(self) -> None:
        t0 = time.monotonic()
        background: list[threading.Thread] = []
        for at, action, label in self.schedule():
            delay = at - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)  # the fault schedule's own clock, not a readiness check
            if label in ("broker restart", "nats restart"):  # outages overlap the kills that follow
                thread = threading.Thread(target=action, name=label, daemon=True)
                thread.start()
                background.append(thread)
            else:
                action()
        for thread in background:
            thread.join()

    # -- the end ---------------------------------------------------------------------------------
    def wait_finished(self) -> dict[str, Any]:
        from actors.scheduler import SCHEDULER_STATUS_KEY
        from engine.topics import Names

        names = Names(self.cfg.namespace)
        bucket = names.bucket(self.cfg.nats.kv_bucket)
        deadline = time.monotonic() + self.plan.finish_timeout_s
        sched: dict[str, Any] = {}

        def scheduler_done() -> bool:
            nonlocal sched
            sched = kv_get_json(self.stack.infra.nats_url, bucket, SCHEDULER_STATUS_KEY)
            return int(sched.get("tasks_admitted", 0)) >= self.plan.tasks

        try:
            poll(scheduler_done, deadline - time.monotonic(), "scheduler reaches max_tasks", every_s=2.0)
            self.note("scheduler done", tasks_admitted=sched.get("tasks_admitted"))
        except TimeoutError as exc:
            self.note("TIMEOUT", what=str(exc), scheduler=sched)
        state: dict[str, Any] = {}

        def all_experience() -> bool:
            expected, seen, records = experience_progress(self.cfg)
            state.update(expected=len(expected), seen=len(seen & expected), records=records)
            return expected <= seen

        try:
            poll(all_experience, deadline - time.monotonic(), "every admitted sample reaches rollout.experience",
                 every_s=3.0)
            self.note("every sample on rollout.experience", **state)
        except TimeoutError as exc:
            self.note("TIMEOUT", what=str(exc), **state)
        learner = self.procs["learner"]

        def learner_caught_up() -> bool:
            _, _, records = experience_progress(self.cfg)
            read = learner_read(learner)
            state.update(experience_records=records, learner_read=read)
            return read is not None and read >= records

        try:
            poll(learner_caught_up, max(30.0, deadline - time.monotonic()), "the learner reads every experience record",
                 every_s=2.0)
            self.note("learner caught up", **{k: state[k] for k in ("experience_records", "learner_read")})
        except TimeoutError as exc:
            self.note("TIMEOUT", what=str(exc), **state)
        return {"scheduler": sched, **state}

    def shutdown(self) -> dict[str, int | None]:
        """Stop the watchdog, drain every daemon (the learner's drain writes its final checkpoint)."""
        self._stop_watch.set()
        rcs: dict[str, int | None] = {}
        with self._lock:
            rcs["learner"] = self.procs["learner"].terminate()
            for name, p in self.procs.items():
                if name != "learner":
                    rcs[name] = p.terminate(timeout_s=40)
        leftovers = [p.name for p in self.procs.values() if p.alive()]
        if leftovers:
            self.note("still running after drain", procs=leftovers)
        return rcs


def run(plan: Plan, work: Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole chaos run; returns the flat results (headline keys first) and the ledger table."""
    from ops.ledger import build_ledger

    chaos = Chaos(plan, work, log=log)
    try:
        chaos.setup()
        chaos.run_faults()
        finish = chaos.wait_finished()
        rcs = chaos.shutdown()
        report = build_ledger(chaos.cfg)
    finally:
        chaos._stop_watch.set()
        for p in chaos.procs.values():
            if p.alive():
                p.kill()
        chaos.stack.stop()
    summary = report.summary()
    kills = sum(p.kills for p in chaos.procs.values())
    results = {
        "kills": kills,
        "tasks_admitted": summary["tasks_admitted"],
        "samples_lost": summary["samples_lost"],
        "samples_trained_twice": summary["samples_trained_twice"],
        "samples_expected": summary["samples_expected"],
        "checkpoint_agrees": summary["checkpoint_agrees"],
        "kills_by_proc": {p.name: p.kills for p in chaos.procs.values()},
        "unexpected_exits": chaos.unexpected_exits,
        "broker_restarts": plan.broker_restarts,
        "nats_restarts": plan.nats_restarts,
        "host_down_s": plan.host_down_s,
        "drain_exit_codes": rcs,
        "finish": finish,
        "seconds": round(time.monotonic() - chaos.started, 1),
        **{f"ledger_{k}": v for k, v in summary.items() if k not in ("fates",)},
        "fates": summary["fates"],
        "events": chaos.events,
    }
    results["table"] = report.table()
    return results


def flatten(results: dict[str, Any]) -> dict[str, Any]:
    """One flat JSON object (nested maps as dotted keys; the event log and the table left out)."""
    out: dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{prefix}.{k}" if prefix else str(k), v)
        elif not isinstance(value, list):
            out[prefix] = value

    put("", {k: v for k, v in results.items() if k not in ("table", "events")})
    return out


def print_results(results: dict[str, Any]) -> None:
    print()
    print(results["table"])
    print()
    print(f"{'kills':<28}{results['kills']:>8}   {results['kills_by_proc']}")
    print(f"{'unexpected exits':<28}{sum(results['unexpected_exits'].values()):>8}   {results['unexpected_exits']}")
    print(f"{'broker / nats restarts':<28}{results['broker_restarts']:>4} / {results['nats_restarts']}")
    print(f"{'tasks admitted':<28}{results['tasks_admitted']:>8}")
    print(f"{'samples lost':<28}{results['samples_lost']:>8}")
    print(f"{'samples trained twice':<28}{results['samples_trained_twice']:>8}")
    print(f"{'seconds':<28}{results['seconds']:>8}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 kills, 20 tasks, 60 s of faults")
    parser.add_argument("--json", help="write the flat results here")
    parser.add_argument("--kills", type=int, default=None, help="SIGKILLs in all (default 20; quick 6)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of the fault schedule (default 180)")
    parser.add_argument("--tasks", type=int, default=None, help="scheduler.max_tasks (default 60; quick 20)")
    parser.add_argument("--host-down", type=float, default=None, help="seconds a failed sandbox host stays down")
    parser.add_argument("--terminal", action="store_true", help="add the multi-turn terminal domain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    args = parser.parse_args(argv)
    plan = Plan(seed=args.seed)
    if args.quick:
        plan = dataclasses.replace(plan, tasks=20, kills=6, duration_s=60.0, host_down_s=15.0)
    if args.kills is not None:
        plan.kills = args.kills
    if args.duration is not None:
        plan.duration_s = args.duration
    if args.tasks is not None:
        plan.tasks = args.tasks
    if args.host_down is not None:
        plan.host_down_s = args.host_down
    if args.terminal:
        plan.domains = {"arith": 1.0, "code": 1.0, "terminal": 0.5}
    work = Path(tempfile.mkdtemp(prefix="rollout-chaos-"))
    print(f"work dir {work}", flush=True)
    try:
        results = run(plan, work, log=lambda s: print(s, flush=True))
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print_results(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(flatten(results), indent=2))
    ok = results["samples_lost"] == 0 and results["samples_trained_twice"] == 0 and results["checkpoint_agrees"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
