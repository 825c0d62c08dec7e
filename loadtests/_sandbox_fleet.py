"""Sandbox-fleet growth (issue #20, item 3): the real sandbox role at 100, 1,000, 3,000 sandboxes.

Part of ``loadtests/fleet.py`` (``--sandboxes N,M,...``; ``--sandboxes-only`` runs just this part). Real: the
private Kafka broker and nats-server of fleet.py's ``Stack``, the sandbox role (``rollout run --role sandbox``:
the verify actor over one bwrap pool of ``max_sandboxes`` = N) and the reward role (group normalisation) as
their own processes. Stand-in for inference: this process (the *driver*) produces ``code`` completions on
``rollout.completions`` and reads ``rollout.outcomes``.

Workload: every completion is a program that sleeps ``hold_s`` seconds at import (a simulated test suite of
``hold_s`` seconds); its one test imports it in the code verifier's runner (``python3 -I /verify/runner.py``
inside the sandbox), so each verification holds one sandbox for ``hold_s`` plus the real verification work
(writing files, starting Python, the nonce check, the reset). Groups of 4 completions per task.

Per size N the driver keeps N completions in flight (closed loop: an outcome read, one more produced), so
the role can hold N sandboxes busy. It ramps up in batches and admits a batch only while the guards allow:

- memory: MemAvailable, less the memory the sandboxes already asked for but not yet started would take
  (measured MB per busy sandbox, 12 MB until measured), must stay above ``floor`` (max 2 GiB, 10 % of RAM);
- fds: the sandbox role's open descriptors below 90 % of its RLIMIT_NOFILE;
- pids: processes on the host below 85 % of kernel.pid_max.

A guard that stops the ramp is recorded (``ramp_stopped``) and the size is measured at what it holds. Before a
size starts, MemAvailable must exceed the floor by 1 GiB, else the size is skipped with the reason.

Measured per size, over a window of ``window_s`` once the busy count has reached 90 % of the in-flight target
or stopped growing for ``hold_s``:

- ``alive``/``busy``: the role's sandboxes (owner files naming its pid) with processes in their pids
  cgroup (>= 1: alive; >= 3, i.e. besides bwrap and the init: running a test), sampled every 2 s;
- ``verifications_per_s``: outcomes read in the window / its seconds; latency p50/p95 (``Outcome.verify_s``);
- CPU microseconds per verification: each role process's own utime+stime and its reaped children's
  (cutime+cstime); the sandboxes' (every process running as a sandbox uid: bwrap, the init, and the tests,
  which the init reaps, so their CPU lands in its cutime: the sum over those processes at the window's end
  less at its start); the driver (this process) and the Kafka broker and nats-server, reported apart; the
  machine's busy fraction of its cores (/proc/stat), the part of it none of these account for (other jobs on
  the machine), and the sandbox role's busiest thread (its event loop) as a fraction of one core;
- memory: the sandboxes' ``memory.usage_in_bytes`` (memory cgroups) summed, and MemAvailable's fall since the
  roles were ready, per sandbox opened since then (host-side: page tables, kernel stacks, namespaces too;
  other jobs' memory moves it as well); peak RSS of each role process;
- fds of the sandbox role and its limit, host processes and pid_max.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROLES = ("sandbox", "reward")
GROUP = 4
MB = 1024 * 1024
_TICK = os.sysconf("SC_CLK_TCK")


# -- what /proc and the cgroups say ----------------------------------------------------------------

def meminfo_mb() -> dict[str, float]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def memory_floor_mb(total_mb: float) -> float:
    """MemAvailable the benchmark never goes below: 2 GiB or 10 % of RAM, whichever is more."""
    return max(2048.0, 0.10 * total_mb)


def cpu_split_s(pid: int) -> tuple[float, float]:
    """(utime + stime, cutime + cstime) of ``pid`` in seconds; (0, 0) once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    f = stat[stat.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / _TICK, (int(f[13]) + int(f[14])) / _TICK


def threads_cpu_s(pid: int) -> dict[tuple[int, str], float]:
    """(tid, name) -> utime + stime of each thread of ``pid`` (the busiest one runs the role's event loop)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        out[(int(task.name), stat[stat.index("(") + 1:stat.rindex(")")])] = (int(f[11]) + int(f[12])) / _TICK
    return out


def uid_processes_cpu_s(uids: set[int]) -> float:
    """utime + stime + cutime + cstime of every live process running as one of ``uids`` (a sandbox's bwrap, its
    init and whatever runs in it: the init reaps the tests, so their CPU lands in its cutime)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if os.stat(f"/proc/{entry}").st_uid not in uids:
                continue
            stat = Path(f"/proc/{entry}/stat").read_text()
            f = stat[stat.rindex(")") + 2:].split()
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / _TICK


def sandbox_uids(ids: set[str]) -> set[int]:
    return {int(i.removeprefix("sbx-")) for i in ids if i.removeprefix("sbx-").isdigit()}


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat (idle + iowait count as not busy)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = float(sum(f[:8]))
    return total - f[3] - f[4], total


def status_field(pid: int, name: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def nofile_soft(pid: int) -> int:
    """The soft RLIMIT_NOFILE of ``pid`` (/proc/<pid>/limits)."""
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return 1 << 62 if soft == "unlimited" else int(soft)
    except OSError:
        pass
    return 0


def host_processes() -> int:
    return sum(1 for e in os.listdir("/proc") if e.isdigit())


def pid_max() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class SandboxCensus:
    alive: int
    busy: int
    owned: int


def census(owner_pid: int) -> tuple[SandboxCensus, set[str]]:
    """The role's sandboxes by their pids cgroup: alive (>= 1 process), busy (>= 3: a test besides bwrap, init)."""
    from loadtests.soak import owned_sandboxes
    from sandboxes.cgroups import CGROUP_ROOT, PARENT

    ids = owned_sandboxes(owner_pid)
    alive = busy = 0
    for sid in ids:
        n = _read_int(CGROUP_ROOT / "pids" / PARENT / sid / "pids.current")
        if n is None:
            continue
        alive += n >= 1
        busy += n >= 3
    return SandboxCensus(alive, busy, len(ids)), ids


def cgroup_sum(ids: set[str], controller: str, file: str) -> dict[str, int]:
    """``file`` of each sandbox's ``controller`` cgroup (e.g. memory.usage_in_bytes)."""
    from sandboxes.cgroups import CGROUP_ROOT, PARENT

    out = {}
    for sid in ids:
        v = _read_int(CGROUP_ROOT / controller / PARENT / sid / file)
        if v is not None:
            out[sid] = v
    return out


# -- the workload ----------------------------------------------------------------------------------

def program(hold_s: float) -> str:
    return f"```python\nimport time\ntime.sleep({hold_s})\n\ndef f(x):\n    return x + 1\n```"


TEST = [{"name": "f(1)", "code": "from solution import f\nassert f(1) == 2\n"}]


def completion(task_id: str, index: int, hold_s: float, timeout_s: float) -> Any:
    from engine.schemas import Completion

    n = 3
    return Completion(sample_id=f"{task_id}/{index}", task_id=task_id, domain="code", group_index=index,
                      group_size=GROUP, prompt_ids=np.arange(4, dtype=np.int32),
                      response_ids=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32),
                      loss_mask=np.ones(n, np.uint8), weight_versions=np.zeros(n, np.int32),
                      text=program(hold_s), finish_reason="stop", spec={"tests": TEST, "timeout_s": timeout_s})


def role_config(namespace: str, bootstrap: str, nats_url: str, work: Path, model_dir: Path, *, max_sandboxes: int,
                hold_s: float) -> dict[str, Any]:
    from loadtests._cluster import pipeline_config

    cfg = pipeline_config(namespace, bootstrap, nats_url, work, model_dir, max_tasks=None, group_size=GROUP,
                          group_timeout_s=600.0)
    cfg["kafka"]["default_partitions"] = 4
    cfg["sandbox"] = {"backend": "bwrap", "pool_size": min(16, max_sandboxes), "max_sandboxes": max_sandboxes,
                      "memory_mb": 128, "pids": 32, "timeout_s": hold_s + 60.0, "idle_ttl_s": 600.0}
    cfg["supervision"]["drain_timeout_s"] = 30.0
    return cfg


# -- one size --------------------------------------------------------------------------------------

@dataclass
class Guard:
    floor_mb: float
    mb_per_sandbox: float = 12.0
    stopped: str | None = None

    def check(self, batch: int, pending: int, role_pid: int) -> str | None:
        """Why a batch of ``batch`` more must not be admitted now (None: it may)."""
        avail = meminfo_mb()["MemAvailable"]
        if avail - (pending + batch) * self.mb_per_sandbox < self.floor_mb:
            return (f"memory: MemAvailable {avail:.0f} MB, {pending} sandboxes still starting, floor "
                    f"{self.floor_mb:.0f} MB at {self.mb_per_sandbox:.1f} MB per busy sandbox")
        fds, limit = fd_count(role_pid), nofile_soft(role_pid)
        if fds + 3 * batch > 0.9 * limit:
            return f"fds: the sandbox role holds {fds} of RLIMIT_NOFILE {limit}"
        procs, pmax = host_processes(), pid_max()
        if procs + 3 * batch > 0.85 * pmax:
            return f"pids: {procs} processes on the host, kernel.pid_max {pmax}"
        return None


@dataclass
class Driver:
    """Keeps ``target`` completions in flight on ``rollout.completions``; reads ``rollout.outcomes``."""

    hold_s: float
    timeout_s: float
    target: int = 0
    produced: int = 0
    received: int = 0
    latencies: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time the outcome was read, its verify_s)."""
    errors: int = 0
    failed: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    """The first 80 characters of each outcome error, counted."""

    @property
    def in_flight(self) -> int:
        return self.produced - self.received

    async def produce(self, producer: Any, topic: str, n_groups: int) -> None:
        futs = []
        for _ in range(n_groups):
            task_id = uuid.uuid4().hex[:16]
            for i in range(GROUP):
                fut, _ = producer.send_nowait(topic, completion(task_id, i, self.hold_s, self.timeout_s), key=task_id)
                futs.append(fut)
        self.produced += GROUP * n_groups
        await asyncio.gather(*futs)

    async def read(self, consumer: Any) -> None:
        while True:
            for record in await consumer.getmany(timeout_s=0.5):
                record.ack()
                o = record.message
                self.received += 1
                self.latencies.append((time.monotonic(), float(o.verify_s)))
                if o.error:
                    self.errors += 1
                    kind = o.error[:80]
                    self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
                elif o.facts.get("passed") != 1:
                    self.failed += 1


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def log_warnings(path: Path, keep: int = 5) -> dict[str, int]:
    """WARNING and ERROR lines of a role's log, by their message's first 100 characters (``keep`` most common)."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if "WARNING" in line or "ERROR" in line:
                key = line.split("WARNING", 1)[-1].split("ERROR", 1)[-1].strip()[:100]
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:keep])


def _infra_pids(stack: Any) -> list[int]:
    pids = []
    for service in (stack.kafka, stack.nats):
        with contextlib.suppress(Exception):
            if (pid := service.pid()) is not None:
                pids.append(pid)
    return pids


def run_size(stack: Any, work: Path, model_dir: Path, n: int, *, hold_s: float, window_s: float,
             ramp_timeout_s: float, log: Any = print) -> dict[str, Any]:
    """One size: start the roles, ramp to ``n`` in flight, measure ``window_s``, stop; one row."""
    from loadtests._cluster import RoleProc, write_toml
    from loadtests.soak import wait_for_teardown

    mem0 = meminfo_mb()
    floor = memory_floor_mb(mem0["MemTotal"])
    row: dict[str, Any] = {"requested": n, "hold_s": hold_s, "mem_available_before_mb": round(mem0["MemAvailable"])}
    if mem0["MemAvailable"] < floor + 1024:
        row["skipped"] = (f"MemAvailable {mem0['MemAvailable']:.0f} MB is within 1 GiB of the floor {floor:.0f} MB "
                          "before the roles start")
        log(f"  sandboxes {n:>5}: skipped: {row['skipped']}")
        return row
    run_dir = work / f"sandboxes-{n}-{int(time.time() * 1000) % 10**8}"
    run_dir.mkdir(parents=True)
    cfg = role_config(f"sbxfleet-{run_dir.name}", stack.infra.kafka_bootstrap, stack.infra.nats_url, run_dir,
                      model_dir, max_sandboxes=n, hold_s=hold_s)
    config = write_toml(cfg, run_dir / "cluster.toml")
    procs = {role: RoleProc(role, role, config, run_dir) for role in ROLES}
    owned: set[str] = set()
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        row.update(asyncio.run(_drive(cfg, procs, n, hold_s=hold_s, window_s=window_s, ramp_timeout_s=ramp_timeout_s,
                                      floor_mb=floor, infra_pids=_infra_pids(stack), log=log)))
    finally:
        sandbox_pid = procs["sandbox"].pid
        if sandbox_pid is not None:
            from loadtests.soak import owned_sandboxes

            owned = owned_sandboxes(sandbox_pid)
        t0 = time.monotonic()
        for p in procs.values():
            if p.alive() and p.proc is not None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.terminate(timeout_s=240.0)
        left, teardown_s = wait_for_teardown(owned, timeout_s=240.0)
        row["role_log_warnings"] = {r: log_warnings(p.log_path) for r, p in procs.items()}
        row.update(stop_s=round(time.monotonic() - t0, 1), teardown_s=round(teardown_s, 1),
                   left_after_stop={k: v for k, v in left.items() if k != "leaked_containers"},
                   mem_available_after_mb=round(meminfo_mb()["MemAvailable"]))
    if "verifications_per_s" in row:
        log(f"  sandboxes {n:>5}: alive {row['alive_max']:>5}, busy (median) {row['busy_median']:>5}: "
            f"{row['verifications_per_s']:.2f} verifications/s, p50 {row['verify_s_p50']} s; "
            f"machine busy {row['machine_busy_fraction']:.0%} (other jobs {row['other_jobs_busy_fraction']:.0%}), "
            f"role's busiest thread {row['sandbox_busiest_thread_busy']:.0%}"
            + (f"; ramp stopped: {row['ramp_stopped']}" if row.get("ramp_stopped") else ""))
    return row


async def _drive(cfg: dict[str, Any], procs: dict[str, Any], n: int, *, hold_s: float, window_s: float,
                 ramp_timeout_s: float, floor_mb: float, infra_pids: list[int], log: Any) -> dict[str, Any]:
    from engine.config import KafkaConfig
    from engine.schemas import Outcome
    from engine.topics import Names
    from streams.kafka import Consumer, Producer

    kafka = KafkaConfig(bootstrap=cfg["kafka"]["bootstrap"])
    names = Names(cfg["namespace"])
    role_pid = procs["sandbox"].pid
    driver = Driver(hold_s, cfg["sandbox"]["timeout_s"])
    guard = Guard(floor_mb)
    outcomes = Consumer(kafka, assign_topics=[names.outcomes], expect=(Outcome.SCHEMA,))
    samples: list[tuple[float, SandboxCensus]] = []
    peaks: dict[str, Any] = {"rss_kb": {r: 0 for r in procs}, "fds": 0, "host_processes": 0,
                             "sandbox_mem_mb": 0.0, "sandbox_mem_alive": 0, "mem_used_mb": 0.0}
    ids: set[str] = set()
    base_c, _ = census(role_pid)  # the pool's pre-warmed sandboxes, open since before this baseline
    base_avail = meminfo_mb()["MemAvailable"]

    def sample() -> SandboxCensus:
        nonlocal ids
        c, ids = census(role_pid)
        samples.append((time.monotonic(), c))
        for r, p in procs.items():
            peaks["rss_kb"][r] = max(peaks["rss_kb"][r], status_field(p.pid, "VmRSS"))
        peaks["fds"] = max(peaks["fds"], fd_count(role_pid))
        peaks["host_processes"] = max(peaks["host_processes"], host_processes())
        used = base_avail - meminfo_mb()["MemAvailable"]
        if used > peaks["mem_used_mb"]:
            peaks["mem_used_mb"], peaks["mem_used_alive"] = used, c.alive
        mem = sum(cgroup_sum(ids, "memory", "memory.usage_in_bytes").values()) / MB
        if mem > peaks["sandbox_mem_mb"]:
            peaks["sandbox_mem_mb"], peaks["sandbox_mem_alive"] = mem, c.alive
        if c.alive - base_c.alive >= 50:  # the sandboxes' measured cost sets the guard's estimate
            guard.mb_per_sandbox = max(guard.mb_per_sandbox, used / (c.alive - base_c.alive))
        return c

    def check_alive() -> None:
        for r, p in procs.items():
            if not p.alive():
                raise RuntimeError(f"{r} exited (rc {p.proc and p.proc.returncode}); see {p.log_path}")

    async with Producer(kafka, producer_id="sandbox-fleet-driver") as producer, outcomes:
        reader = asyncio.create_task(driver.read(outcomes))
        try:
            # ramp: batches of up to 64 (16 groups), each admitted only while the guards allow it
            t_start = time.monotonic()
            cap = n - n % GROUP if n >= GROUP else GROUP
            last_busy, last_growth = 0, t_start
            next_sample = 0.0
            c = SandboxCensus(0, 0, 0)
            while True:
                now = time.monotonic()
                if now >= next_sample:
                    c = sample()
                    next_sample = now + 2.0
                    if c.busy > last_busy:
                        last_busy, last_growth = c.busy, now
                    check_alive()
                    if c.busy >= 0.9 * cap or (now - last_growth > max(hold_s, 10.0) and c.busy > 0):
                        break
                    if now - t_start > ramp_timeout_s:
                        break
                if driver.in_flight < cap and guard.stopped is None:
                    batch = min(64, cap - driver.in_flight)
                    why = guard.check(batch, max(0, driver.in_flight - c.busy), role_pid)
                    if why is not None:
                        guard.stopped = why
                        cap = max(GROUP, driver.in_flight - driver.in_flight % GROUP)
                        log(f"  sandboxes {n:>5}: ramp stopped at {driver.in_flight} in flight: {why}")
                    else:
                        await driver.produce(producer, names.completions, max(1, batch // GROUP))
                elif driver.in_flight < cap:  # refill what finished (closed loop)
                    if cap - driver.in_flight >= GROUP:
                        await driver.produce(producer, names.completions, (cap - driver.in_flight) // GROUP)
                await asyncio.sleep(0.1)
            ramp_s = time.monotonic() - t_start
            # the window
            ids0 = ids
            cpu0 = {r: cpu_split_s(p.pid) for r, p in procs.items()}
            threads0 = threads_cpu_s(role_pid)
            me0 = cpu_split_s(os.getpid())[0]
            infra0 = sum(sum(cpu_split_s(pid)) for pid in infra_pids)
            sb0 = uid_processes_cpu_s(sandbox_uids(ids0))
            busy0 = machine_busy()
            recv0, t0 = driver.received, time.monotonic()
            window_samples: list[SandboxCensus] = []
            while time.monotonic() - t0 < window_s:
                if cap - driver.in_flight >= GROUP:
                    await driver.produce(producer, names.completions, (cap - driver.in_flight) // GROUP)
                now = time.monotonic()
                if now >= next_sample:
                    window_samples.append(sample())
                    next_sample = now + 2.0
                    check_alive()
                await asyncio.sleep(0.1)
            t1 = time.monotonic()
            recv1 = driver.received
            cpu1 = {r: cpu_split_s(p.pid) for r, p in procs.items()}
            threads1 = threads_cpu_s(role_pid)
            me1 = cpu_split_s(os.getpid())[0]
            infra1 = sum(sum(cpu_split_s(pid)) for pid in infra_pids)
            _, ids1 = census(role_pid)
            sb1 = uid_processes_cpu_s(sandbox_uids(ids0 | ids1))
            busy1 = machine_busy()
            pool = (procs["sandbox"].status().get("sandbox.verify") or {}).get("pool") or {}
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
    span = t1 - t0
    done = recv1 - recv0
    per = 1e6 / done if done else None

    def us(seconds: float) -> float | None:
        return round(seconds * per, 1) if per is not None else None

    cpu_us: dict[str, float | None] = {}
    for r in procs:
        cpu_us[f"{r}_process"] = us(cpu1[r][0] - cpu0[r][0])
        cpu_us[f"{r}_children"] = us(cpu1[r][1] - cpu0[r][1])
    cpu_us["sandboxes"] = us(sb1 - sb0)
    cpu_us["driver"] = us(me1 - me0)
    cpu_us["broker_and_nats"] = us(infra1 - infra0)
    ours = (sum(sum(cpu1[r]) - sum(cpu0[r]) for r in procs) + (sb1 - sb0) + (me1 - me0) + (infra1 - infra0))
    deltas = {k: v - threads0.get(k, 0.0) for k, v in threads1.items()}
    busiest = max(deltas, key=lambda k: deltas[k]) if deltas else None
    lat = [v for t, v in driver.latencies if t0 <= t <= t1]
    busy_w = [c.busy for c in window_samples] or [samples[-1][1].busy]
    alive_w = [c.alive for c in window_samples] or [samples[-1][1].alive]
    machine = (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1])
    alive_max = max(c.alive for _, c in samples)
    mem_used = float(peaks["mem_used_mb"])
    return {
        "in_flight_target": cap, "ramp_s": round(ramp_s, 1), "ramp_stopped": guard.stopped,
        "alive_max": alive_max, "alive_median": int(statistics.median(alive_w)),
        "busy_median": int(statistics.median(busy_w)), "busy_max": max(c.busy for _, c in samples),
        "window_s": round(span, 1), "verifications": done,
        "verifications_per_s": round(done / span, 3) if span > 0 else 0.0,
        "ideal_verifications_per_s": round(statistics.median(busy_w) / hold_s, 3),
        "verify_s_p50": _pct(lat, 50), "verify_s_p95": _pct(lat, 95),
        "errors": driver.errors, "failed": driver.failed, "error_kinds": driver.error_kinds,
        "cpu_us_per_verification": cpu_us,
        "engine_us_per_verification": round(sum(v or 0.0 for k, v in cpu_us.items()
                                                if k not in ("driver", "broker_and_nats")), 1)
        if per is not None else None,
        "machine_busy_fraction": round(machine, 3), "cpus": os.cpu_count(),
        "other_jobs_busy_fraction": round(max(0.0, machine - ours / span / (os.cpu_count() or 1)), 3)
        if span > 0 else None,
        "sandbox_busiest_thread": busiest[1] if busiest else None,
        "sandbox_busiest_thread_busy": round(deltas[busiest] / span, 3) if busiest and span > 0 else None,
        "peak_rss_mb": {r: round(kb / 1024, 1) for r, kb in peaks["rss_kb"].items()},
        "peak_sandbox_cgroup_memory_mb": round(peaks["sandbox_mem_mb"], 1),
        "cgroup_mb_per_alive_sandbox": round(peaks["sandbox_mem_mb"] / peaks["sandbox_mem_alive"], 2)
        if peaks["sandbox_mem_alive"] else None,
        "peak_mem_used_mb": round(mem_used, 1),
        "host_mb_per_sandbox": round(mem_used / (peaks["mem_used_alive"] - base_c.alive), 2)
        if peaks.get("mem_used_alive", 0) - base_c.alive >= 16 else None,
        "alive_at_baseline": base_c.alive,
        "memory_floor_mb": round(floor_mb),
        "peak_sandbox_role_fds": peaks["fds"], "sandbox_role_nofile": nofile_soft(role_pid),
        "peak_host_processes": peaks["host_processes"], "pid_max": pid_max(),
        "pool": pool,
    }


def run_growth(stack: Any, work: Path, model_dir: Path, sizes: tuple[int, ...], *, hold_s: float, window_s: float,
               ramp_timeout_s: float, log: Any = print) -> dict[str, Any]:
    """Every size in turn on the running ``stack``; stops at the first size that had to be skipped."""
    log(f"sandbox growth: sizes {', '.join(map(str, sizes))}; each verification holds its sandbox {hold_s:g} s "
        f"(a simulated test suite), window {window_s:g} s")
    rows: list[dict[str, Any]] = []
    stopped = None
    for n in sizes:
        row = run_size(stack, work, model_dir, n, hold_s=hold_s, window_s=window_s, ramp_timeout_s=ramp_timeout_s,
                       log=log)
        rows.append(row)
        if row.get("skipped"):
            stopped = f"stopped before {n} sandboxes: {row['skipped']}"
            break
    measured = [r for r in rows if "verifications_per_s" in r]
    best = max(measured, key=lambda r: r["verifications_per_s"]) if measured else None
    return {"sandbox_growth": rows, "max_verifications_per_s": best["verifications_per_s"] if best else None,
            "max_verifications_per_s_sandboxes": best["requested"] if best else None,
            "sandbox_growth_stopped": stopped,
            "sandbox_growth_workload": (f"code completions whose program sleeps {hold_s:g} s at import (one test, "
                                        "run by the code verifier's runner in the sandbox): each verification holds "
                                        f"a sandbox for {hold_s:g} s plus the real verification work; groups of "
                                        f"{GROUP}; closed loop with N in flight")}


def print_table(out: dict[str, Any]) -> None:
    rows = out.get("sandbox_growth") or []
    if not rows:
        return
    print(f"\nsandbox growth ({out['sandbox_growth_workload']})")
    print(f"{'requested':>9}{'alive':>7}{'busy':>6}{'verif/s':>9}{'ideal/s':>9}{'p50 s':>7}{'sbx proc us':>12}"
          f"{'sandboxes us':>13}{'reward us':>10}{'engine us':>10}{'machine':>8}{'other':>6}{'thread':>7}{'MB/sbx':>7}"
          f"{'peak MB':>8}  stopped by")
    for r in rows:
        if "verifications_per_s" not in r:
            print(f"{r['requested']:>9}  skipped: {r.get('skipped')}")
            continue
        c = r["cpu_us_per_verification"]
        proc = (c["sandbox_process"] or 0) + (c["sandbox_children"] or 0)
        print(f"{r['requested']:>9}{r['alive_max']:>7}{r['busy_median']:>6}{r['verifications_per_s']:>9.2f}"
              f"{r['ideal_verifications_per_s']:>9.2f}{r['verify_s_p50'] or 0:>7.2f}{proc:>12.0f}"
              f"{c['sandboxes'] or 0:>13.0f}{(c['reward_process'] or 0) + (c['reward_children'] or 0):>10.0f}"
              f"{r['engine_us_per_verification'] or 0:>10.0f}{r['machine_busy_fraction']:>8.0%}"
              f"{r['other_jobs_busy_fraction'] or 0:>6.0%}{r['sandbox_busiest_thread_busy'] or 0:>7.0%}{r['cgroup_mb_per_alive_sandbox'] or 0:>7.1f}"
              f"{r['peak_mem_used_mb']:>8.0f}  {r.get('ramp_stopped') or '-'}")
    print(f"max_verifications_per_s: {out['max_verifications_per_s']} (at {out['max_verifications_per_s_sandboxes']} "
          "sandboxes requested)" + (f"; {out['sandbox_growth_stopped']}" if out.get("sandbox_growth_stopped") else ""))


def plot_panels(out: dict[str, Any], a: Any, b: Any) -> None:
    """Verifications/s (measured and the hold-bound ideal) and CPU us per verification against ``max_sandboxes``,
    each point labelled with the sandboxes measured alive."""
    rows = [r for r in out.get("sandbox_growth") or [] if "verifications_per_s" in r]
    xs = [r["requested"] for r in rows]
    ys = [r["verifications_per_s"] for r in rows]
    a.plot(xs, ys, "o-", label="measured")
    a.plot(xs, [r["ideal_verifications_per_s"] for r in rows], "x--", label="busy sandboxes / hold s")
    for x, y, r in zip(xs, ys, rows):
        a.annotate(f"{r['alive_max']} alive", (x, y), textcoords="offset points", xytext=(0, -14), ha="center",
                   fontsize=8)
    a.set(xscale="log", xlabel="max_sandboxes", ylabel="verifications / s",
          title="sandbox fleet: verifications the engine holds")
    a.set_ylim(bottom=0)
    a.legend()
    keys = {"sandbox role (process + reaped)": ("sandbox_process", "sandbox_children"),
            "sandboxes (bwrap, init, tests)": ("sandboxes",), "reward role": ("reward_process", "reward_children")}
    for label, ks in keys.items():
        b.plot(xs, [sum(r["cpu_us_per_verification"][k] or 0 for k in ks) for r in rows], "o-", label=label)
    b.set(xscale="log", yscale="log", xlabel="max_sandboxes", ylabel="CPU us per verification",
          title="CPU per verification, by role")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
