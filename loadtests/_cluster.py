"""The multi-process cluster harness shared by the chaos and backpressure benchmarks.

A private Kafka broker and nats-server (``Stack``), each pipeline role as its own ``rollout run --role R``
process group (``RoleProc``), the TOML config they read, and small probes (RSS, children, KV reads,
experience progress). Kept apart from ``loadtests/chaos.py`` so a benchmark that needs a real cluster
does not import the chaos schedule.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from ops.infra import InfraConfig, InfraError, KafkaBroker, NatsServer, free_port
from ops.infra.service import Service

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

    def command_prefix(self) -> list[str]:
        """What the daemon's command runs under (a host's ``ip netns exec``, which execs: the pid stays the
        daemon's); nothing here."""
        return []

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready = threading.Event()
        self.http = None
        env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
        argv = [*self.command_prefix(), sys.executable, "-m", "ops.cli", "run", "--config", str(self.config),
                "--role", self.role, "--run-dir", str(self.run_dir), "--instance", self.name, "--log-level", "INFO"]
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

def start_services(services: Sequence[Service]) -> None:
    """Start every service, then wait until each one answers (they come up side by side)."""
    for s in services:
        s.start()
    for s in services:
        s.wait_ready()


def stop_services(services: Sequence[Service]) -> None:
    """Stop every service in turn; one that fails to stop is reported and the rest are still stopped."""
    for s in services:
        try:
            s.stop()
        except Exception as exc:  # keep stopping the others
            print(f"warning: stopping {s.name}: {exc}", file=sys.stderr)


class Stack:
    """A private broker and nats-server (state under ``work``), restartable; stopped by pid."""

    def __init__(self, work: Path) -> None:
        self.infra = InfraConfig.from_env(state_dir=work / "infra", kafka_port=free_port(),
                                          kafka_controller_port=free_port(), nats_port=free_port())
        self.kafka = KafkaBroker(self.infra)
        self.nats = NatsServer(self.infra)

    def start(self) -> None:
        start_services((self.kafka, self.nats))

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
        stop_services((self.nats, self.kafka))


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
