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

    .venv/bin/python -m loadtests.chaos --quick --json runs/chaos.json
    .venv/bin/python -m loadtests.chaos --kills 24 --duration 240 --tasks 80

Headline keys: ``kills``, ``tasks_admitted``, ``samples_lost``, ``samples_trained_twice`` (targets: 0 lost,
0 trained twice), and, read from the topics after the run (:func:`frontier_figures`):

- ``prompts_skipped``: tasks the scheduler counted as admitted (its KV status, which a restarted scheduler
  resumes from) that never reached ``rollout.tasks``, plus tasks on it of which no sample was ever generated;
- ``prompts_duplicated``: admissions of a prompt (domain, prompt, spec) beyond its first, under another task
  id; exact: a generator task's spec names its draw (``generator_draw``), so a small problem a generator
  draws twice, at two draws, is two prompts;
- ``tokens_regenerated``: tokens generated again after a kill among those the broker had acknowledged
  on ``rollout.tokens``: per sample, in offset order, each generation after the first (its chunks' ``seq``
  start again at 0) counts the positions it repeats of what earlier generations had streamed;
- ``samples_taken_over`` / ``tokens_kept_after_takeover``: generations a restarted inference process
  continued where the killed one stopped (a chunk with ``seq`` > 0 from another producer), and the streamed
  tokens those kept (actors/inference/resume.py);
- ``recovery_s.<role>.p50`` / ``.p99``: SIGKILL to the restarted daemon's ready line, per role;
- with ``--long``, inference kills are aimed: each waits until ``rollout.tokens`` shows a generation in flight
  (a chunk in the last 0.8 s, no ``done`` since). ``inference_kills_in_generation`` counts those that found
  one, and ``in_flight_taken_over`` / ``in_flight_regenerated`` / ``in_flight_finished_by_first`` say what
  became of the generations they saw (continued by the successor, generated again from the start, or ended
  before the kill landed).

``--kills N`` stretches the fault schedule to at least ``SECONDS_PER_KILL`` x N seconds unless
``--duration`` is given (restarts on a small host take seconds each).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtests._cluster import (ROLE_PROCS, RoleProc, Stack, experience_progress, kv_get_json, learner_read,
                                pipeline_config, poll, write_toml)

SECONDS_PER_KILL = 3.0
"""The fault schedule's length per kill when ``--kills`` is given without ``--duration``."""
AIM_WAIT_S = 30.0
"""How long an aimed inference kill waits for a generation in flight before it kills anyway."""
IN_FLIGHT_WINDOW_S = 0.8
"""A generation is in flight when it streamed a chunk this recently and no ``done`` chunk since."""

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
    max_new_tokens: int = 8
    """``inference.max_new_tokens``: with the tiny model a generation of 8 tokens lasts milliseconds and an
    inference kill almost never lands inside one; a few hundred make generations last long enough for the
    successor's takeover to be exercised (``--long``)."""
    stream_interval: int = 1
    aim_inference_kills: bool = False
    """An inference kill waits (up to ``AIM_WAIT_S``) until ``rollout.tokens`` shows a generation in flight, so
    it lands inside one and its successor has acknowledged tokens to continue from (``--long``)."""
    fixed_length: bool = False
    """Every generation runs to ``max_new_tokens`` (``scheduler.sampling``: ``ignore_eos``, no stop strings and
    the budget over each domain's): the tiny model otherwise stops after a few tokens whatever the budget
    (``--long``)."""


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
        self.recovery_s: dict[str, list[float]] = {}  # role -> SIGKILL to the restarted daemon's ready line
        self.not_recovered: dict[str, int] = {}
        self.aimed_kills: list[set[str]] = []  # per aimed inference kill: the samples seen in flight when it fired
        self.aim_waited_s = 0.0  # time aimed kills spent waiting: the rest of the schedule moves back by it

    def note(self, kind: str, **fields: Any) -> None:
        t = round(time.monotonic() - self.started, 1)
        self.events.append({"t": t, "event": kind, **fields})
        self.log(f"[{t:6.1f}s] {kind} " + " ".join(f"{k}={v}" for k, v in fields.items()))

    # -- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        from modelserver.llm import write_tiny_model_dir
        from engine.config import EngineConfig

        self.stack.start()
        model_dir = write_tiny_model_dir(self.work / "model", seed=self.plan.seed)
        namespace = f"chaos-{uuid.uuid4().hex[:8]}"
        data = pipeline_config(namespace, self.stack.infra.kafka_bootstrap, self.stack.infra.nats_url, self.work,
                               model_dir, max_tasks=self.plan.tasks, domains=self.plan.domains,
                               inference={"max_new_tokens": self.plan.max_new_tokens,
                                          "stream_interval": self.plan.stream_interval})
        if self.plan.fixed_length:
            data["scheduler"]["sampling"] = {"ignore_eos": True, "max_new_tokens": self.plan.max_new_tokens, "stop": []}
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
    def generations_in_flight(self, pid: int) -> set[str]:
        """Samples that process ``pid`` streamed a chunk of on ``rollout.tokens`` in the last
        ``IN_FLIGHT_WINDOW_S``, with no ``done`` chunk in that time (the broker's time index picks the window;
        nothing is committed). Chunks of an earlier life of the role do not count: a producer id ends in its
        process id (``<host>-<pid>``, or ``<instance>:<pid>`` under ``--instance`` as here)."""
        from engine.schemas import TokenChunk
        from engine.topics import Names
        from streams.kafka import read_range

        since_ms = int((time.time() - IN_FLIGHT_WINDOW_S) * 1000)
        streaming: set[str] = set()
        done: set[str] = set()
        for _, _, env in read_range(self.cfg.kafka, Names(self.cfg.namespace).tokens, since_ms=since_ms,
                                    timeout_s=10.0, client_id="rollout-chaos-aim"):
            chunk = getattr(env, "message", None)
            if isinstance(chunk, TokenChunk) and str(getattr(env, "producer", "")).endswith((f"-{pid}", f":{pid}")):
                (done if chunk.done else streaming).add(chunk.sample_id)
        return streaming - done

    def _aim(self, p: RoleProc) -> set[str]:
        """Wait up to ``AIM_WAIT_S`` for a generation of ``p``'s current life in flight; the samples found
        (empty: none came)."""
        deadline = time.monotonic() + AIM_WAIT_S
        while time.monotonic() < deadline and not self._stop_watch.is_set():
            try:
                found = self.generations_in_flight(p.pid) if p.pid is not None else set()
            except Exception as exc:  # the broker is restarting: look again
                self.log(f"aim: rollout.tokens not readable now ({exc!r})")
                found = set()
            if found:
                return found
            time.sleep(0.1)  # the watch's polling cadence, not a readiness wait
        return set()

    def kill_and_restart(self, name: str) -> None:
        in_flight: set[str] | None = None
        if name == "inference" and self.plan.aim_inference_kills and self.procs[name].alive():
            waited = time.monotonic()
            in_flight = self._aim(self.procs[name])
            self.aim_waited_s += time.monotonic() - waited
        with self._lock:
            if self.procs[name].held_down or not self.procs[name].alive():
                # that host is down, or the process is between lives (or finished): hit a live one instead
                live = [n for n in ROLE_PROCS if self.procs[n].alive() and not self.procs[n].held_down]
                if not live:
                    return
                name = self.rng.choice(live)
            p = self.procs[name]
            killed_at = time.monotonic()
            p.kill()
            p.start()
        if in_flight is not None and name == "inference":
            self.aimed_kills.append(in_flight)
            self.note("SIGKILL + restart", proc=name, pid=p.pid, generations_in_flight=len(in_flight))
        else:
            self.note("SIGKILL + restart", proc=name, pid=p.pid)
        threading.Thread(target=self._time_recovery, args=(p, killed_at), daemon=True).start()

    def _time_recovery(self, p: RoleProc, killed_at: float) -> None:
        """Seconds from the SIGKILL to the role's next ready line, whichever life prints it (one started while
        the broker is down exits and is restarted by the watchdog: that is part of recovering)."""
        while time.monotonic() - killed_at < 300.0 and not self._stop_watch.is_set():
            if p.ready.wait(0.2):  # p.ready: the current life's event (each start makes a new one)
                with self._lock:
                    self.recovery_s.setdefault(p.role, []).append(time.monotonic() - killed_at)
                return
        with self._lock:
            self.not_recovered[p.role] = self.not_recovered.get(p.role, 0) + 1

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
            # an aimed kill's wait delays what follows instead of bunching it up behind the kill
            delay = at + self.aim_waited_s - (time.monotonic() - t0)
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


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def regenerated_tokens(chunks: list[tuple[int, int, int]]) -> int:
    """Of one sample's token chunks on the topic, ``(offset, seq, tokens)``: how many token positions a later
    generation produced again that an earlier one had already streamed (a generation starts at ``seq`` 0)."""
    regenerated = streamed = current = 0  # streamed: the longest prefix earlier generations had on the topic
    for _, seq, n in sorted(chunks):
        if seq == 0 and current:  # a new generation of the sample (its group generated again)
            streamed = max(streamed, current)
            current = 0
        regenerated += max(0, min(current + n, streamed) - current)
        current += n
    return regenerated


def taken_over(chunks: list[tuple[int, int, int, str]]) -> tuple[int, int]:
    """Of one sample's token chunks on the topic, ``(offset, seq, tokens, producer)``: how many times another
    process continued the generation where a dead one stopped (a chunk with ``seq`` > 0 from a producer other
    than the previous chunk's), and how many streamed tokens those continuations kept instead of generating
    them again."""
    times = kept = current = 0
    previous = None
    for _, seq, n, producer in sorted(chunks):
        if seq == 0:
            current = 0
        elif previous is not None and producer != previous:
            times += 1
            kept += current
        current += n
        previous = producer
    return times, kept


def in_flight_fates(chunks: dict[str, list[tuple[int, int, int, str]]], watched: set[str]) -> dict[str, int]:
    """What became of the generations an aimed kill saw in flight, from their chunks ``(offset, seq, tokens,
    producer)``: continued by another process (``taken_over``), generated again from the start (``regenerated``),
    or finished by the process that started them (``finished_by_first``: it ended before the kill landed)."""
    fates = {"taken_over": 0, "regenerated": 0, "finished_by_first": 0}
    for sample in watched:
        records = sorted(chunks.get(sample, []))
        if taken_over(records)[0]:
            fates["taken_over"] += 1
        elif sum(1 for _, seq, _, _ in records if seq == 0) > 1:
            fates["regenerated"] += 1
        elif records and len({producer for *_, producer in records}) == 1:
            fates["finished_by_first"] += 1
    return fates


def frontier_figures(cfg: Any, scheduler_admitted: int, watched: set[str] | None = None) -> dict[str, int]:
    """``prompts_skipped``, ``prompts_duplicated`` and ``tokens_regenerated`` from the topics (see the module
    docstring), and the fates of the ``watched`` generations (seen in flight by aimed kills); records re-sent
    with the same message id are counted once."""
    from engine.schemas import Task, TokenChunk
    from engine.topics import Names
    from ops.ledger import TopicRecord, read_topic

    names = Names(cfg.namespace)
    tasks: dict[str, tuple[str, str, str]] = {}
    for rec in read_topic(cfg, names.tasks):
        if isinstance(rec, TopicRecord) and isinstance(rec.message, Task):
            t = rec.message
            tasks[t.task_id] = (t.domain, t.prompt, json.dumps(t.spec, sort_keys=True, default=str))
    chunks: dict[str, list[tuple[int, int, int, str]]] = {}  # sample -> (offset, seq, tokens, producer)
    seen_ids: set[str] = set()
    generated_tasks: set[str] = set()
    for rec in read_topic(cfg, names.tokens):
        if not isinstance(rec, TopicRecord) or not isinstance(rec.message, TokenChunk) or rec.message_id in seen_ids:
            continue
        seen_ids.add(rec.message_id)
        c = rec.message
        generated_tasks.add(c.task_id)
        chunks.setdefault(c.sample_id, []).append((rec.offset, c.seq, len(c.token_ids), rec.producer))
    prompts = list(tasks.values())
    takeovers = [taken_over(records) for records in chunks.values()]
    return {
        "prompts_skipped": max(0, scheduler_admitted - len(tasks)) + len(set(tasks) - generated_tasks),
        "prompts_duplicated": len(prompts) - len(set(prompts)),
        "tokens_regenerated": sum(regenerated_tokens([(o, seq, n) for o, seq, n, _ in records])
                                  for records in chunks.values()),
        "tokens_streamed": sum(n for records in chunks.values() for _, _, n, _ in records),
        "samples_taken_over": sum(times for times, _ in takeovers),
        "tokens_kept_after_takeover": sum(kept for _, kept in takeovers),
        **{f"in_flight_{k}": v for k, v in in_flight_fates(chunks, watched or set()).items()},
    }


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
        watched = set().union(*chaos.aimed_kills) if chaos.aimed_kills else set()
        frontier = frontier_figures(chaos.cfg, int(finish.get("scheduler", {}).get("tasks_admitted", 0)), watched)
    finally:
        chaos._stop_watch.set()
        for p in chaos.procs.values():
            if p.alive():
                p.kill()
        chaos.stack.stop()
    summary = report.summary()
    kills = sum(p.kills for p in chaos.procs.values())
    seconds = round(time.monotonic() - chaos.started, 1)
    results = {
        "kills": kills,
        "tasks_admitted": summary["tasks_admitted"],
        "samples_lost": summary["samples_lost"],
        "samples_trained_twice": summary["samples_trained_twice"],
        "trained_twice": summary["samples_trained_twice"],
        **frontier,
        "recovery_s": {role: {"p50": _percentile(chaos.recovery_s.get(role, []), 0.5),
                              "p99": _percentile(chaos.recovery_s.get(role, []), 0.99),
                              "n": len(chaos.recovery_s.get(role, []))}
                       for role in sorted({p.role for p in chaos.procs.values()})},
        "not_recovered": chaos.not_recovered,
        "inference_kills_aimed": len(chaos.aimed_kills),
        "aim_waited_s": round(chaos.aim_waited_s, 1),
        "inference_kills_in_generation": sum(1 for found in chaos.aimed_kills if found),
        "generations_in_flight_at_kills": len(watched),
        "fault_schedule_s": plan.duration_s,
        "seconds_per_kill": round(seconds / kills, 1) if kills else None,
        "samples_expected": summary["samples_expected"],
        "checkpoint_agrees": summary["checkpoint_agrees"],
        "kills_by_proc": {p.name: p.kills for p in chaos.procs.values()},
        "unexpected_exits": chaos.unexpected_exits,
        "broker_restarts": plan.broker_restarts,
        "nats_restarts": plan.nats_restarts,
        "host_down_s": plan.host_down_s,
        "drain_exit_codes": rcs,
        "finish": finish,
        "seconds": seconds,
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
    for key in ("prompts_skipped", "prompts_duplicated", "tokens_regenerated", "tokens_streamed", "samples_taken_over",
                "tokens_kept_after_takeover", "inference_kills_aimed", "inference_kills_in_generation",
                "generations_in_flight_at_kills", "in_flight_taken_over", "in_flight_regenerated",
                "in_flight_finished_by_first"):
        print(f"{key.replace('_', ' '):<28}{results[key]:>8}")
    for role, r in results["recovery_s"].items():
        print(f"{'recovery s ' + role:<28}{'p50 ' + str(r['p50']):>12}{'p99 ' + str(r['p99']):>12}   n={r['n']}")
    print(f"{'seconds per kill':<28}{str(results['seconds_per_kill']):>8}")
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
    parser.add_argument("--long", action="store_true",
                        help="long generations (every one 384 tokens: scheduler.sampling ignore_eos and max_new_tokens; 16 tokens "
                             "per rollout.tokens record), "
                             "and inference kills aimed at a generation in flight, so the takeover is exercised")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    args = parser.parse_args(argv)
    plan = Plan(seed=args.seed)
    if args.quick:
        plan = dataclasses.replace(plan, tasks=20, kills=6, duration_s=60.0, host_down_s=15.0)
    if args.kills is not None:
        plan.kills = args.kills
        if args.kills < 0:
            parser.error(f"--kills must be >= 0, got {args.kills}")
        plan.duration_s = max(plan.duration_s, SECONDS_PER_KILL * args.kills)
    if args.duration is not None:
        plan.duration_s = args.duration
    if args.tasks is not None:
        plan.tasks = args.tasks
    if args.host_down is not None:
        plan.host_down_s = args.host_down
    if args.terminal:
        plan.domains = {"arith": 1.0, "code": 1.0, "terminal": 0.5}
    if args.long:
        plan.max_new_tokens, plan.stream_interval, plan.fixed_length, plan.aim_inference_kills = 384, 16, True, True
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
