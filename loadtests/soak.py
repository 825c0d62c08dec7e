"""Soak: many sandbox sessions cycling through the sandbox role, Kafka in the loop, checked for leaks.

Run it as ``rollout loadtest soak --duration S [--sessions N] [--quick] [--json F]``.

- A private Kafka broker and nats-server on free ports (``ops.infra``; stopped by pid at the end).
- The sandbox role in its own process (``rollout run --role sandbox``), so its RSS, fds and children
  can be read from /proc.
- N sessions, each a loop of multi-turn episodes: ``open`` -> a few ``step`` s with idle gaps ->
  ``close`` on ``rollout.sandbox.requests``, replies read from ``rollout.sandbox.results``; plus a stream
  of code completions verified through ``rollout.completions`` -> ``rollout.outcomes``.
- Phases: warm-up; a quiescent point (every session between episodes, no verification in flight)
  where the baseline RSS and fd count are taken; the measured run; a second quiescent point (the end
  figures); then SIGTERM (drain) and a scan for what outlived the process: sandbox-uid processes,
  tmpfs mounts under the sandbox root, ``rollout/sbx-*`` cgroups, owner files, of the sandboxes that
  process owned.

Headline keys: ``leaked_processes``, ``leaked_fds``, ``rss_growth_fraction`` (+ sessions, cycles, errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import KafkaConfig
from engine.schemas import Completion, Outcome, SandboxRequest, SandboxResult
from engine.topics import Names

TESTS = [{"name": "t1", "code": "from solution import f\nassert f(2) == 4"}]
GOOD = "```python\ndef f(x):\n    return 2 * x\n```"
REPLY_TIMEOUT_S = 120.0
STEPS = ("echo $RANDOM >> log; wc -l < log", "ls -la /work | head -5", "python3 -c 'print(sum(range(1000)))'",
         "cat /work/in.txt; export N=$((N+1)); echo $N")


# -- what /proc says --------------------------------------------------------------------------------

def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _socket_kinds(pid: int) -> dict[str, str]:
    """Socket inode -> ``unix`` / ``tcp`` / ``udp`` / ``netlink``, from the process's /proc/net tables."""
    kinds = {}
    for table, kind in (("unix", "unix"), ("tcp", "tcp"), ("tcp6", "tcp"), ("udp", "udp"), ("udp6", "udp"),
                        ("netlink", "netlink")):
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            column = 6 if kind == "unix" else (5 if kind == "netlink" else 9)
            for line in lines:
                fields = line.split()
                if len(fields) > column:
                    kinds[fields[column]] = kind
    return kinds


def fd_census(pid: int) -> dict[str, int]:
    """The process's open descriptors by kind: unix/tcp/udp sockets, pipes, anon inodes, files, ...

    Each open bwrap sandbox holds exactly one (its unix control socket), so a leak shows as growth of
    ``total - open sandboxes`` between two quiescent points; the kinds say where it is.
    """
    sockets = _socket_kinds(pid)
    census: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            kind = "socket_" + sockets.get(target[8:-1], "other")
        elif target.startswith("pipe:"):
            kind = "pipe"
        elif target.startswith("anon_inode:"):
            kind = "anon_" + target.removeprefix("anon_inode:").strip("[]")
        elif target.startswith("/dev/"):
            kind = "device"
        else:
            kind = "file"
        census[kind] = census.get(kind, 0) + 1
    return dict(sorted(census.items()))


def owned_sandboxes(owner_pid: int) -> set[str]:
    """Ids (``sbx-<uid>``) of the sandboxes whose owner file names ``owner_pid``."""
    from sandboxes.bwrap import SANDBOX_ROOT

    mine = set()
    for owner in SANDBOX_ROOT.glob("sbx-*.owner"):
        with contextlib.suppress(OSError, IndexError):
            if owner.read_text().split()[0] == str(owner_pid):
                mine.add(owner.name.removesuffix(".owner"))
    return mine


def sandbox_uid_processes(uids: set[int]) -> dict[int, int]:
    """pid -> uid of live processes running as one of ``uids``."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                uid = os.stat(f"/proc/{entry}").st_uid
                if uid in uids:
                    found[int(entry)] = uid
    return found


def sandbox_mounts(ids: set[str]) -> list[str]:
    from sandboxes.bwrap import SANDBOX_ROOT

    root = str(SANDBOX_ROOT)
    out = []
    for line in Path("/proc/mounts").read_text().splitlines():
        target = line.split()[1]
        name = target.removeprefix(f"{root}/").split("/", 1)[0]
        if target.startswith(f"{root}/") and name in ids:
            out.append(target)
    return out


def wait_for_teardown(ids: set[str], timeout_s: float = 300.0) -> tuple[dict[str, int], float]:
    """:func:`leftovers` once nothing is left or ``timeout_s`` has passed; and how long that took.

    The kernel tears down a killed sandbox's pid namespace asynchronously: after the sandbox process
    has exited, a thousand namespaces take a while to empty. What is still there at the deadline is
    a leak; what goes before it is teardown.
    """
    t0 = time.monotonic()
    while True:
        found = leftovers(ids)
        if not any(found.values()) or time.monotonic() - t0 > timeout_s:
            return found, time.monotonic() - t0
        time.sleep(0.5)


def leftovers(ids: set[str]) -> dict[str, int]:
    """What of the sandboxes ``ids`` still exists on the host."""
    from sandboxes.bwrap import SANDBOX_ROOT
    from sandboxes.cgroups import list_groups

    uids = {int(i.removeprefix("sbx-")) for i in ids if i.removeprefix("sbx-").isdigit()}
    return {
        "leaked_processes": len(sandbox_uid_processes(uids)),
        "leaked_mounts": len(sandbox_mounts(ids)),
        "leaked_cgroups": len(list_groups() & ids),
        "leaked_owner_files": sum((SANDBOX_ROOT / f"{i}.owner").exists() for i in ids),
        "leaked_containers": 0,  # bwrap backend: no containers
    }


def sandboxes_rss_mb(ids: set[str]) -> float:
    uids = {int(i.removeprefix("sbx-")) for i in ids if i.removeprefix("sbx-").isdigit()}
    total = 0.0
    for pid in sandbox_uid_processes(uids):
        with contextlib.suppress(OSError):
            total += rss_mb(pid)
    return total


# -- the sandbox process ----------------------------------------------------------------------------

def write_config(path: Path, namespace: str, bootstrap: str, nats_url: str, sessions: int) -> None:
    # Episodes may hold episode_share (0.75) of max_sandboxes; leave room for verification too.
    max_sandboxes = math.ceil(sessions / 0.75) + 8
    path.write_text(f"""
namespace = "{namespace}"
[kafka]
bootstrap = "{bootstrap}"
default_partitions = 1
partitions = {{ "sandbox.requests" = 4, "completions" = 2 }}
[nats]
url = "{nats_url}"
[sandbox]
backend = "bwrap"
pool_size = 4
max_sandboxes = {max_sandboxes}
memory_mb = 128
pids = 32
timeout_s = 10
[supervision]
max_restarts = 0
drain_timeout_s = 60
""")


def start_sandbox_process(config: Path, run_dir: Path, log: Path) -> tuple[subprocess.Popen[str], str]:
    rollout = shutil.which("rollout", path=str(Path(sys.executable).parent)) or "rollout"
    with open(log, "w") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([rollout, "run", "--config", str(config), "--role", "sandbox",
                                 "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line, or EOF if it died; nothing else comes on stdout
    if not line:
        proc.wait()
        proc.stdout.close()
        raise RuntimeError(f"rollout run --role sandbox exited {proc.returncode} before ready; see {log}")
    return proc, json.loads(line)["http"]


# -- the driver -------------------------------------------------------------------------------------

class Driver:
    """N sessions of episodes plus a verification stream, paused at quiescent points on request."""

    def __init__(self, kafka: KafkaConfig, names: Names, sessions: int, gap_s: float) -> None:
        self.kafka = kafka
        self.names = names
        self.sessions = sessions
        self.gap_s = gap_s
        self.gate = asyncio.Event()
        self.stop = False
        self.active = 0
        self.idle = asyncio.Event()
        self.waiters: dict[tuple[str, int], asyncio.Future[SandboxResult]] = {}
        self.outcome_waiters: dict[str, asyncio.Future[Outcome]] = {}
        self.episodes = self.steps = self.verifications = self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.step_ms: list[float] = []

    def _error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    async def run(self, producer: Any, results: Any, outcomes: Any) -> None:
        self.producer = producer
        readers = [asyncio.create_task(self._read(results, self.waiters, lambda m: (m.episode_id, m.step))),
                   asyncio.create_task(self._read(outcomes, self.outcome_waiters, lambda m: m.completion["sample_id"]))]
        workers = [asyncio.create_task(self._session(i)) for i in range(self.sessions)]
        workers.append(asyncio.create_task(self._verifier()))
        try:
            await asyncio.gather(*workers)
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def quiesce(self) -> None:
        """Stop starting episodes and wait until none is open and no verification is in flight."""
        self.gate.clear()
        while self.active:
            self.idle.clear()
            await self.idle.wait()

    async def _read(self, consumer: Any, waiters: dict[Any, asyncio.Future[Any]], key: Any) -> None:
        while True:
            for record in await consumer.getmany(timeout_s=0.5):
                record.ack()
                fut = waiters.pop(key(record.message), None)
                if fut is not None and not fut.done():
                    fut.set_result(record.message)

    async def _ask(self, episode: str, step: int, action: str, **kw: Any) -> SandboxResult | None:
        fut: asyncio.Future[SandboxResult] = asyncio.get_running_loop().create_future()
        self.waiters[(episode, step)] = fut
        t0 = time.perf_counter()
        await self.producer.send(self.names.sandbox_requests, SandboxRequest(
            episode_id=episode, step=step, action=action, reply_partition=0, **kw), key=episode)
        try:
            reply = await asyncio.wait_for(fut, REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.waiters.pop((episode, step), None)
            self._error("reply_timeout")
            return None
        if action == "step":
            self.step_ms.append((time.perf_counter() - t0) * 1000)
        if reply.error:
            self._error(reply.error.split(":")[0])
        return reply

    def _enter(self) -> None:
        self.active += 1

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    async def _session(self, index: int) -> None:
        rng = random.Random(index)
        await asyncio.sleep(rng.uniform(0, self.gap_s))  # spread the first opens
        while not self.stop:
            await self.gate.wait()
            if self.stop:
                return
            self._enter()
            try:
                episode = f"s{index}-{uuid.uuid4().hex[:8]}"
                spec = {"setup_files": {"in.txt": f"session {index}\n"}, "checks": [{"cmd": "test -f /work/in.txt"}]}
                opened = await self._ask(episode, 0, "open", domain="terminal", spec=spec)
                if opened is None or opened.error:
                    continue
                for step in range(1, rng.randint(2, 4)):
                    await asyncio.sleep(rng.uniform(0.5, 1.5) * self.gap_s)
                    reply = await self._ask(episode, step, "step", command=rng.choice(STEPS))
                    self.steps += 1
                    if reply is not None and reply.exit_code != 0:
                        self._error("step_timeout" if reply.timed_out else "step_exit")
                closed = await self._ask(episode, 99, "close")
                if closed is not None and not closed.error:
                    self.episodes += 1
                    if closed.facts.get("checks_passed") != 1:
                        self._error("checks")
            finally:
                self._leave()
            await asyncio.sleep(rng.uniform(0.2, 1.0) * self.gap_s)

    async def _verifier(self) -> None:
        n = 0
        while not self.stop:
            await self.gate.wait()
            if self.stop:
                return
            self._enter()
            try:
                batch = []
                for _ in range(4):
                    n += 1
                    sample_id = f"v{n}"
                    fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
                    self.outcome_waiters[sample_id] = fut
                    await self.producer.send(self.names.completions, _completion(sample_id), key=sample_id)
                    batch.append((sample_id, fut))
                for sample_id, fut in batch:
                    try:
                        outcome = await asyncio.wait_for(fut, REPLY_TIMEOUT_S)
                    except asyncio.TimeoutError:
                        self.outcome_waiters.pop(sample_id, None)
                        self._error("outcome_timeout")
                        continue
                    self.verifications += 1
                    if outcome.error or outcome.facts.get("passed") != 1:
                        self._error("verify")
            finally:
                self._leave()
            await asyncio.sleep(0.5)


def _completion(sample_id: str) -> Completion:
    n = 3
    return Completion(sample_id=sample_id, task_id=sample_id, domain="code", group_index=0, group_size=1,
                      prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
                      logprobs=np.zeros(n, np.float32), loss_mask=np.ones(n, np.uint8),
                      weight_versions=np.zeros(n, np.int32), text=GOOD, finish_reason="stop",
                      spec={"tests": TESTS, "timeout_s": 10})


async def _drive(kafka: KafkaConfig, names: Names, driver: Driver, proc: subprocess.Popen[str],
                 warmup_s: float, duration_s: float) -> dict[str, Any]:
    from streams.kafka import Consumer, Producer

    pid = proc.pid
    figures: dict[str, Any] = {}
    results = Consumer(kafka, assign=[(names.sandbox_results, 0)], expect=(SandboxResult.SCHEMA,), from_end=True)
    outcomes = Consumer(kafka, assign_topics=[names.outcomes], expect=(Outcome.SCHEMA,), from_end=True)
    async with Producer(kafka, producer_id="soak-driver") as producer, results, outcomes:
        runner = asyncio.create_task(driver.run(producer, results, outcomes))
        peak_rss, peak_sandboxes_mb, peak_open = 0.0, 0.0, 0

        async def watch(until: float) -> None:
            nonlocal peak_rss, peak_sandboxes_mb, peak_open
            while time.monotonic() < until:
                if runner.done():
                    runner.result()  # a driver crash ends the soak with its error
                if proc.poll() is not None:
                    raise RuntimeError(f"the sandbox process exited {proc.returncode} during the soak")
                peak_rss = max(peak_rss, rss_mb(pid))
                if driver.active > peak_open:  # sample the sandboxes' memory when most are open
                    peak_open = driver.active
                    peak_sandboxes_mb = sandboxes_rss_mb(owned_sandboxes(pid))
                await asyncio.sleep(1.0)

        t0 = time.monotonic()
        driver.gate.set()
        await watch(t0 + warmup_s)
        await driver.quiesce()
        kinds = fd_census(pid)
        figures.update(baseline_rss_mb=rss_mb(pid), baseline_fds=sum(kinds.values()),
                       baseline_sandboxes=len(owned_sandboxes(pid)), baseline_fd_kinds=kinds)
        start_counts = (driver.episodes, driver.steps, driver.verifications)
        t1 = time.monotonic()
        driver.gate.set()
        await watch(t1 + duration_s)
        await driver.quiesce()
        measured_s = time.monotonic() - t1
        kinds = fd_census(pid)
        figures.update(end_rss_mb=rss_mb(pid), end_fds=sum(kinds.values()), end_sandboxes=len(owned_sandboxes(pid)),
                       end_fd_kinds=kinds)
        driver.stop = True
        driver.gate.set()
        await runner
    figures.update(peak_rss_mb=peak_rss, peak_open_episodes=peak_open, peak_sandboxes_rss_mb=peak_sandboxes_mb,
                   measured_s=measured_s, episodes_per_s=(driver.episodes - start_counts[0]) / measured_s,
                   steps_per_s=(driver.steps - start_counts[1]) / measured_s,
                   verifications_per_s=(driver.verifications - start_counts[2]) / measured_s)
    return figures


def run(duration_s: float, sessions: int, quick: bool = False) -> dict[str, Any]:
    """The whole soak; returns one flat dict of figures."""
    from ops.infra import InfraConfig, KafkaBroker, NatsServer, free_port

    if quick:
        duration_s, sessions = min(duration_s, 60.0), min(sessions, 100)
    warmup_s = max(10.0, min(120.0, duration_s * 0.2))
    # Sessions idle most of the time: the step rate stays near sessions / gap_s.
    gap_s = max(2.0, sessions / 50)
    state = Path(tempfile.mkdtemp(prefix="rollout-soak-"))
    infra = InfraConfig.from_env(state_dir=state / "infra", kafka_port=free_port(), kafka_controller_port=free_port(),
                                 nats_port=free_port(), kafka_heap="-Xmx512m -Xms256m")
    broker, nats = KafkaBroker(infra), NatsServer(infra)
    namespace = f"soak-{uuid.uuid4().hex[:8]}"
    names = Names(namespace)
    kafka = KafkaConfig(bootstrap=infra.kafka_bootstrap)
    figures: dict[str, Any] = {"sessions": sessions, "duration_s": duration_s, "warmup_s": warmup_s, "gap_s": gap_s}
    proc: subprocess.Popen[str] | None = None
    owned: set[str] = set()
    try:
        for service in (broker, nats):
            service.start()
        for service in (broker, nats):
            service.wait_ready()
        config = state / "soak.toml"
        write_config(config, namespace, infra.kafka_bootstrap, infra.nats_url, sessions)
        proc, _http = start_sandbox_process(config, state / "run", state / "sandbox.log")
        driver = Driver(kafka, names, sessions, gap_s)
        try:
            figures.update(asyncio.run(_drive(kafka, names, driver, proc, warmup_s, duration_s)))
        finally:
            owned = owned_sandboxes(proc.pid)
            figures.update(cycles=driver.episodes, steps=driver.steps, verifications=driver.verifications,
                           errors=driver.errors, error_kinds=json.dumps(driver.error_kinds, sort_keys=True),
                           p50_step_ms=float(np.percentile(driver.step_ms, 50)) if driver.step_ms else float("nan"),
                           p99_step_ms=float(np.percentile(driver.step_ms, 99)) if driver.step_ms else float("nan"))
            proc.send_signal(signal.SIGTERM)  # drain: the pool closes every sandbox
            try:
                figures["exit_code"] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                figures["exit_code"] = proc.wait()
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for service in (nats, broker):
            service.stop()
    found, figures["teardown_s"] = wait_for_teardown(owned)
    figures.update(found)
    if "end_fds" in figures:
        # One descriptor per open sandbox (its control socket): the pool's size may differ between
        # the two points, so what is compared is the descriptors held besides the sandboxes'.
        figures["leaked_fds"] = ((figures["end_fds"] - figures["end_sandboxes"])
                                 - (figures["baseline_fds"] - figures["baseline_sandboxes"]))
        figures["rss_growth_fraction"] = (figures["end_rss_mb"] - figures["baseline_rss_mb"]) / figures["baseline_rss_mb"]
        if figures.get("peak_open_episodes"):
            figures["mb_per_open_sandbox"] = figures["peak_sandboxes_rss_mb"] / figures["peak_open_episodes"]
    shutil.rmtree(state, ignore_errors=True)
    return figures


def table(f: dict[str, Any]) -> str:
    rows = [
        ("sessions", f"{f['sessions']}"), ("measured", f"{f.get('measured_s', float('nan')):.0f} s"),
        ("episodes (cycles)", f"{f.get('cycles', 0)}"), ("steps", f"{f.get('steps', 0)}"),
        ("verifications", f"{f.get('verifications', 0)}"), ("errors", f"{f.get('errors', 0)} {f.get('error_kinds', '')}"),
        ("episodes/s, steps/s", f"{f.get('episodes_per_s', 0):.1f}, {f.get('steps_per_s', 0):.1f}"),
        ("p50 / p99 step", f"{f.get('p50_step_ms', float('nan')):.0f} / {f.get('p99_step_ms', float('nan')):.0f} ms"),
        ("RSS baseline -> end", f"{f.get('baseline_rss_mb', 0):.0f} -> {f.get('end_rss_mb', 0):.0f} MB "
                                f"({f.get('rss_growth_fraction', float('nan')):+.1%}); peak {f.get('peak_rss_mb', 0):.0f} MB"),
        ("fds baseline -> end", f"{f.get('baseline_fds', 0)} -> {f.get('end_fds', 0)} with "
                                f"{f.get('baseline_sandboxes', 0)} -> {f.get('end_sandboxes', 0)} sandboxes open "
                                f"(leaked {f.get('leaked_fds')})"),
        ("fd kinds at end", ", ".join(f"{k} {v}" for k, v in f.get("end_fd_kinds", {}).items())),
        ("sandboxes peak open", f"{f.get('peak_open_episodes', 0)} using {f.get('peak_sandboxes_rss_mb', 0):.0f} MB "
                                f"({f.get('mb_per_open_sandbox', float('nan')):.1f} MB each)"),
        ("left after exit", f"processes {f.get('leaked_processes')}, mounts {f.get('leaked_mounts')}, "
                            f"cgroups {f.get('leaked_cgroups')}, owner files {f.get('leaked_owner_files')} "
                            f"(after {f.get('teardown_s', float('nan')):.1f} s of teardown)"),
        ("sandbox process exit", f"{f.get('exit_code')}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
