"""The scheduler role: picks tasks, admits them within the off-policy bound, publishes ``rollout.tasks``.

``SchedulerActor`` draws tasks from sources (the domains' generators of ``actors/domains.py`` and
users' task files), picks a source by weight, and publishes each admitted task (keyed by task_id) for
``group_size`` samples. With ``scheduler.published_tasks`` it also consumes ``rollout.tasks.published``
(consumer group ``<ns>.scheduler-published``; tasks put there by `rollout tasks publish`) and issues
those first, as they arrive; a record is acknowledged (its offset committed) once the task it became
is acknowledged by the broker, so a restart neither loses nor repeats one (bar a crash in between). The decisions live in small pure classes:

- :class:`Admission` — AReaL's rule: admit a task of ``group_size`` samples only while
  ``admitted - filtered < (max_staleness + version + 1) * batch_size``, with ``version``
  and ``filtered`` from the learner's status (KV key ``Names.LEARNER_VERSION_KEY``, JSON
  ``{"version", "step", "consumed", "filtered"?, ...}``). ``filtered`` counts samples the learner
  consumed but will never train (zero-variance groups, stragglers, too stale): they leave the
  "running" set without becoming "accepted", and without subtracting them a run whose groups are all
  filtered would stall forever at the bound.
- :class:`DomainMixer` — configured weights (``scheduler.domains``), each multiplied by
  ``1 - zero_variance_rate`` of its domain (floored, so no domain starves and its statistics keep coming).
- :class:`Curriculum` — per-domain difficulty in [0, 1], raised when the domain's recent success rate is
  high and lowered when it is low, at most once per ``min_samples`` new samples.

Observed statistics come from the reward actors' snapshot (KV key ``actors.reward.REWARD_STATS_KEY``).
The scheduler's own counters are put under ``SCHEDULER_STATUS_KEY`` (replica k > 0 of several: under
``scheduler_status_key(k)``) and read back at start, so a restarted scheduler does not re-admit what its
predecessor admitted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import anyio
import anyio.lowlevel
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from actors import tracing
from actors.domains import DOMAINS, Domain
from actors.reward import REWARD_STATS_KEY
from actors.runtime import Runtime
from engine.actor import Actor
from engine.config import SchedulerConfig
from engine.curriculum import LengthCurriculum
from engine.schemas import PublishedTask, Task
from engine.topics import Names

log = logging.getLogger("rollout.actors.scheduler")

SCHEDULER_STATUS_KEY = "scheduler.status"
"""Control-bucket KV key of the scheduler's counters (JSON: admitted_samples, tasks_admitted, ...)."""


def scheduler_status_key(replica: int = 0) -> str:
    """The KV key of replica ``replica``'s counters: each replica keeps its own (its position in its own
    shard of the task files, its own offsets); replica 0, the only one of most deployments, the plain key."""
    return SCHEDULER_STATUS_KEY if replica == 0 else f"{SCHEDULER_STATUS_KEY}.{replica}"


# -- admission -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class LearnerStatus:
    """What the scheduler reads from the learner's KV status."""

    version: int = 0
    step: int = 0
    consumed: int = 0
    filtered: int = 0
    dropped_stale: int = 0
    never_trained: int = 0
    """Filtered or too-stale samples the learner has judged, including those still waiting for a step."""

    @property
    def excluded(self) -> int:
        """Samples that will never be trained: they leave the admitted set without being accepted."""
        return max(self.never_trained, self.filtered + self.dropped_stale)

    @classmethod
    def from_json(cls, raw: bytes | None) -> "LearnerStatus":
        """Parse the KV value; absent fields (or an absent value) read as 0."""
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(**{f.name: int(data.get(f.name, 0) or 0) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """The off-policy bound on admitted samples (AReaL's admission rule)."""

    batch_size: int
    max_staleness: int

    def capacity(self, version: int) -> int:
        """Samples that may be admitted in total (minus filtered ones) while the learner is at ``version``."""
        return (self.max_staleness + version + 1) * self.batch_size

    def can_admit(self, admitted: int, group_size: int, learner: LearnerStatus) -> bool:
        """Admit while the running samples leave room under the bound.

        A group may overshoot the bound by fewer than ``group_size`` samples: filtering and
        staleness drops are per sample, so the learner can be a few samples short of its batch with
        less than a whole group of room left, and requiring a whole group of room would then stall
        both forever. The overshoot waits for the next step (or is dropped as stale, accounted).
        """
        return admitted - learner.excluded < self.capacity(learner.version)


# -- domain weights and curriculum -----------------------------------------------------------------

class DomainMixer:
    """Sampling weights over sources, rebalanced from observed statistics."""

    def __init__(self, weights: dict[str, float], *, floor: float = 0.1, min_groups: int = 4) -> None:
        if any(w < 0 for w in weights.values()) or (weights and sum(weights.values()) <= 0):
            raise ValueError(f"domain weights must be non-negative with a positive sum, got {weights}")
        self.base = dict(weights)
        self.floor = floor
        self.min_groups = min_groups
        self._factor = {name: 1.0 for name in weights}

    def rebalance(self, name: str, stats: dict[str, Any]) -> None:
        """Scale ``name``'s weight by ``1 - zero_variance_rate`` (at least ``floor``) once it has enough groups."""
        if name in self._factor and int(stats.get("groups", 0)) >= self.min_groups:
            self._factor[name] = max(self.floor, 1.0 - float(stats.get("zero_variance_rate", 0.0)))

    def remove(self, name: str) -> None:
        """Stop sampling ``name`` (its source is exhausted)."""
        self.base.pop(name, None)
        self._factor.pop(name, None)

    @property
    def weights(self) -> dict[str, float]:
        """Current normalised weights (empty when every source is removed)."""
        raw = {n: w * self._factor[n] for n, w in self.base.items()}
        total = sum(raw.values())
        return {n: w / total for n, w in raw.items()} if total > 0 else {}

    def pick(self, rng: random.Random) -> str | None:
        weights = self.weights
        if not weights:
            return None
        names = sorted(weights)
        return rng.choices(names, weights=[weights[n] for n in names])[0]


class Curriculum:
    """Per-domain difficulty that rises with the observed success rate."""

    def __init__(self, *, start: float = 0.0, step: float = 0.1, raise_at: float = 0.8, lower_at: float = 0.2,
                 min_samples: int = 64) -> None:
        self.start = start
        self.step = step
        self.raise_at = raise_at
        self.lower_at = lower_at
        self.min_samples = min_samples
        self._difficulty: dict[str, float] = {}
        self._count_at_change: dict[str, int] = {}

    def difficulty(self, domain: str) -> float:
        return self._difficulty.get(domain, self.start)

    def observe(self, domain: str, count: int, success: float) -> float:
        """Take a domain's sample count and recent success rate; returns its (possibly new) difficulty.

        Moves at most one ``step`` per ``min_samples`` new samples, so the success rate measured at the
        new difficulty (an exponential average) has time to replace the old one.
        """
        since = self._count_at_change.setdefault(domain, count)
        level = self.difficulty(domain)
        if count - since < self.min_samples:
            return level
        if success >= self.raise_at and level < 1.0:
            level = min(1.0, level + self.step)
        elif success <= self.lower_at and level > 0.0:
            level = max(0.0, level - self.step)
        else:
            return level
        self._difficulty[domain] = round(level, 6)
        self._count_at_change[domain] = count
        return level


def length_curriculum(cfg: SchedulerConfig) -> LengthCurriculum | None:
    """The context-length curriculum ``scheduler.length_curriculum`` asks for (None when unset).

    Only domains that can turn a length into a difficulty (``Domain.length_to_difficulty``) can be steered,
    and one curriculum steers domains of one mapping.
    """
    lc = cfg.length_curriculum
    if lc is None:
        return None
    mappers: dict[str, Callable[[int], float]] = {}
    for name in lc.domains:
        domain = DOMAINS.get(name)
        if domain is None or domain.length_to_difficulty is None:
            steerable = sorted(n for n in DOMAINS if DOMAINS[n].length_to_difficulty is not None)
            raise ValueError(f"scheduler.length_curriculum.domains: {name!r} has no length mapping; "
                             f"supported: {steerable}")
        mappers[name] = domain.length_to_difficulty
    if len(set(mappers.values())) > 1:
        raise ValueError(f"scheduler.length_curriculum.domains: {sorted(mappers)} map lengths differently; "
                         "one curriculum steers domains of one mapping")
    return LengthCurriculum(lc.domains, lc.lengths, threshold=lc.threshold, window=lc.window,
                            to_difficulty=next(iter(mappers.values())))


# -- task sources ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class SourcedTask:
    """A task as a source produces it, before admission gives it an id and a version."""

    domain: str
    prompt: str
    spec: dict[str, Any]
    max_turns: int = 1
    difficulty: float = 0.0
    stop: tuple[str, ...] = ()
    max_new_tokens: int | None = None
    """The domain's generation budget; None: ``inference.max_new_tokens``."""
    tools: tuple[dict[str, Any], ...] = ()
    """Tools declared to the model (the domain's ``tools``; a JSONL row's own ``tools``)."""


class TaskSource(Protocol):
    """Where tasks come from. ``domain`` is the domain whose statistics steer it (None: not steered)."""

    name: str
    domain: str | None

    def next(self, difficulty: float) -> SourcedTask | None:
        """The next task, or None once the source is exhausted."""
        ...


class GeneratorSource:
    """Endless training tasks from a domain's generator, seeded."""

    def __init__(self, domain: Domain, seed: int = 0) -> None:
        self.name = domain.name
        self.domain: str | None = domain.name
        self._domain = domain
        self._rng = random.Random(f"train:{seed}:{domain.name}")

    def next(self, difficulty: float) -> SourcedTask:
        prompt, spec = self._domain.generate(self._rng, difficulty)
        return SourcedTask(domain=self._domain.name, prompt=prompt, spec=spec, max_turns=self._domain.turns(spec),
                           difficulty=difficulty, stop=self._domain.stop, max_new_tokens=self._domain.budget(spec),
                           tools=self._domain.tools)


class JsonlSource:
    """Tasks from a JSONL file, one per line: ``{"domain", "prompt", "spec", "max_turns"?, "tools"?}``; read once.

    ``tools`` (a list of function schemas) replaces the domain's own for that row."""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path)
        self.name = name or f"file:{self.path.name}"
        self.domain: str | None = None
        self._lines: Iterator[tuple[int, dict[str, Any]]] | None = None

    def _read(self) -> Iterator[tuple[int, dict[str, Any]]]:
        with self.path.open() as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, json.loads(line)

    def next(self, difficulty: float) -> SourcedTask | None:
        if self._lines is None:
            self._lines = self._read()
        item = next(self._lines, None)
        if item is None:
            return None
        lineno, row = item
        where = f"{self.path}:{lineno}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        missing = [k for k in ("domain", "prompt", "spec") if k not in row]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        domain = DOMAINS.get(row["domain"])
        max_turns = int(row.get("max_turns", domain.turns(row["spec"]) if domain else 1))
        tools = row.get("tools", list(domain.tools) if domain else [])
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
                for t in tools):
            raise ValueError(f'{where}: field tools: a list of {{"type": "function", "function": {{"name", ...}}}}')
        return SourcedTask(domain=row["domain"], prompt=row["prompt"], spec=row["spec"], max_turns=max_turns,
                           stop=domain.stop if domain else (), max_new_tokens=domain.max_new_tokens if domain else None,
                           tools=tuple(tools))


class TaskFileSource:
    """Tasks from a user's task file (:mod:`engine.tasks`), this replica's shard, each issued once.

    ``position`` counts the tasks issued; the scheduler stores it in its status (NATS KV) with the
    tasks topic's offsets at that moment and, on restart, restores it and then reads the tasks topic from
    those offsets: rows issued after the last status (a crash between a publication and the next status
    write) are found by their ``spec.task_file`` / ``task_file_id`` and not issued again, and none is skipped.
    """

    def __init__(self, path: str | Path, *, mapping: dict[str, str] | None = None, replica: int = 0,
                 replicas: int = 1) -> None:
        from engine.tasks import TaskFile, shard

        self.path = Path(path)
        self.name = f"file:{self.path.name}"
        self.domain: str | None = None
        self.tasks = shard(TaskFile(self.path, known_domains=DOMAINS, mapping=mapping).tasks, replica, replicas)
        self.position = 0
        for task in self.tasks:
            if not DOMAINS[task.domain].trainable:
                raise ValueError(f"scheduler.task_files: {self.path}:{task.row}: domain {task.domain!r} is an evaluation "
                                 "set (trainable = false), never trained on; evaluate it with rollout eval --tasks")

    def skip_issued(self, row_ids: list[str]) -> list[str]:
        """Move past rows found already issued (ids of this shard); returns the ids that were past ``position``."""
        index = {t.id: i for i, t in enumerate(self.tasks)}
        beyond = sorted((index[r] for r in set(row_ids) if r in index and index[r] >= self.position))
        if beyond:
            self.position = beyond[-1] + 1
        return [self.tasks[i].id for i in beyond]

    def next(self, difficulty: float) -> SourcedTask | None:
        if self.position >= len(self.tasks):
            return None
        task = self.tasks[self.position]
        self.position += 1
        domain = DOMAINS[task.domain]
        spec = dict(task.spec, task_file_id=task.id, task_file=self.name)
        return SourcedTask(domain=task.domain, prompt=task.prompt, spec=spec,
                           max_turns=task.max_turns or domain.turns(spec), stop=domain.stop,
                           max_new_tokens=domain.budget(spec), tools=domain.tools)


# -- the actor -------------------------------------------------------------------------------------

class SchedulerActor(Actor):
    """Publishes admitted tasks to ``rollout.tasks`` (see the module docstring)."""

    role: ClassVar[str] = "scheduler"
    publish_batch: int = 64
    """Tasks sent before waiting for the broker's acknowledgements."""
    status_interval_s: float = 1.0

    def __init__(self, rt: Runtime, name: str | None = None, *, sources: Sequence[TaskSource] | None = None,
                 fixed_difficulty: float = 0.0) -> None:
        super().__init__(name)
        self.rt = rt
        cfg = rt.cfg.scheduler
        self.cfg = cfg
        self.names: Names = rt.names
        if sources is None:
            for name in cfg.domains:  # a lookup resolves families (rg:NAME); the error says why (unknown, unavailable)
                try:
                    DOMAINS[name]
                except KeyError as exc:
                    raise ValueError(f"scheduler.domains: {exc}") from None
                if not DOMAINS[name].trainable:
                    raise ValueError(f"scheduler.domains: {name!r} is an evaluation set (trainable = false), never "
                                     "trained on; evaluate it with rollout eval")
            sources = [GeneratorSource(DOMAINS[d], cfg.seed) for d in cfg.domains]
            if cfg.task_files:
                names = [Path(p).name for p in cfg.task_files]
                if len(set(names)) != len(names):
                    raise ValueError(f"scheduler.task_files: file names must differ (positions are kept by name): {names}")
                sources = [TaskFileSource(path, mapping=cfg.task_fields, replica=cfg.replica, replicas=cfg.replicas)
                           for path in cfg.task_files]
            if not sources and not cfg.published_tasks:
                raise ValueError("scheduler: no task source (scheduler.domains and scheduler.task_files are empty "
                                 "and scheduler.published_tasks is off)")
        self.sources = {s.name: s for s in sources}
        file_weights = {f"file:{Path(p).name}": w for p, w in cfg.task_files.items()}
        self.mixer = DomainMixer({n: file_weights.get(n, cfg.domains.get(n, 1.0)) for n in self.sources})
        self.curriculum = Curriculum()
        self.length_curriculum = length_curriculum(cfg)
        self.fixed_difficulty = fixed_difficulty
        self.admission = Admission(batch_size=rt.cfg.learner.batch_size, max_staleness=cfg.max_staleness)
        self.learner = LearnerStatus()
        self._rng = random.Random(f"scheduler:{cfg.seed}")
        self._changed = anyio.Event()
        self._bucket = rt.kv_bucket
        self._status_key = scheduler_status_key(cfg.replica)
        self.admitted_samples = 0
        self.tasks_admitted = 0
        self.blocked_waits = 0
        self.done = False
        self._status_written: int | None = None
        self._tasks_offsets: dict[int, int] = {}
        """Next offset per partition of ``rollout.tasks`` after this scheduler's acknowledged tasks."""
        self._published: deque[Any] = deque()
        self._published_record: Any = None
        """Records of ``rollout.tasks.published`` received and not yet issued."""
        self.published_issued = 0

    # -- lifecycle -----------------------------------------------------------------------------
    async def setup(self) -> None:
        saved = await self.rt.require_nats().kv_get(self._bucket, self._status_key)
        if saved:
            status = json.loads(saved)
            self.admitted_samples = int(status.get("admitted_samples", 0))
            self.tasks_admitted = int(status.get("tasks_admitted", 0))
            for name, position in status.get("source_positions", {}).items():
                source = self.sources.get(name)
                if isinstance(source, TaskFileSource):
                    source.position = int(position)
            self._tasks_offsets = {int(p): int(o) for p, o in status.get("tasks_offsets", {}).items()}
            log.info("%s: resuming at %d tasks / %d samples admitted", self.name, self.tasks_admitted,
                     self.admitted_samples)
        await self._skip_issued_rows()
        self.learner = LearnerStatus.from_json(await self.rt.require_nats().kv_get(self._bucket,
                                                                                    Names.LEARNER_VERSION_KEY))

    async def _skip_issued_rows(self) -> None:
        """Task-file rows on the tasks topic past the last status (issued, status not yet written): skip them."""
        files = {n: s for n, s in self.sources.items() if isinstance(s, TaskFileSource)}
        if not files:
            return
        issued: dict[str, list[str]] = {n: [] for n in files}
        group_sizes: dict[tuple[str, str], int] = {}
        for _, _, msg in await self.rt.event_log.read_since(self.names.tasks, self._tasks_offsets,
                                                           expect=(Task.SCHEMA,)):
            assert isinstance(msg, Task)
            source, row = msg.spec.get("task_file"), msg.spec.get("task_file_id")
            if isinstance(source, str) and source in issued and isinstance(row, str):
                issued[source].append(row)
                group_sizes[(source, row)] = msg.group_size
        for name, rows in issued.items():
            skipped = files[name].skip_issued(rows)
            if skipped:
                self.tasks_admitted += len(skipped)
                self.admitted_samples += sum(group_sizes[(name, row)] for row in skipped)
                log.warning("%s: %d row(s) of %s were issued after the last stored status; not issuing them again",
                            self.name, len(skipped), name)

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_learner)
            tg.start_soon(self._watch_stats)
            if self.cfg.published_tasks:
                tg.start_soon(self._consume_published)
            try:
                await self._admit()
            finally:
                tg.cancel_scope.cancel()
        await self.put_status()

    # -- admission loop ------------------------------------------------------------------------
    async def _admit(self) -> None:
        pending: list[Any] = []
        last_status = time.monotonic()
        group_size = self.cfg.group_size
        while not self.draining:
            if self.cfg.max_tasks is not None and self.tasks_admitted >= self.cfg.max_tasks:
                self.done = True
                break
            if not self.admission.can_admit(self.admitted_samples, group_size, self.learner):
                await self._settle(pending)
                if self._status_written != self.tasks_admitted:
                    # Persist the count before waiting: a scheduler killed while blocked would otherwise
                    # restart from an older count and admit the same samples again (past max_tasks and
                    # past the off-policy bound).
                    await self.put_status()
                    last_status = time.monotonic()
                self.blocked_waits += 1
                await self.wait_changed(timeout_s=0.5)
                continue
            task = self._next_published() or self._next_task()
            if task is None and self.cfg.published_tasks:
                await self._settle(pending)
                await self.wait_changed(timeout_s=0.5)  # more may be published
                continue
            if task is None:
                self.done = True
                log.info("%s: every task source is exhausted", self.name)
                break
            await self.rt.producer.wait_room()
            fut = self._publish(task)
            record, self._published_record = self._published_record, None
            if record is not None:  # a published task: its record is done once the task is on the broker
                fut.add_done_callback(lambda f, r=record: None if f.cancelled() or f.exception() else r.ack())
            pending.append(fut)
            self.admitted_samples += group_size
            self.tasks_admitted += 1
            if len(pending) >= self.publish_batch:
                await self._settle(pending)
            if time.monotonic() - last_status >= self.status_interval_s:
                await self._settle(pending)
                await self.put_status()
                last_status = time.monotonic()
            await anyio.lowlevel.checkpoint()
        await self._settle(pending)

    def _publish(self, task: Task) -> Any:
        """Send ``task`` under a new trace (root span ``schedule``); returns the broker's acknowledgement future."""
        with tracing.tracer().start_as_current_span("schedule", context=Context(), kind=SpanKind.PRODUCER) as span:
            if span.is_recording():
                span.set_attributes({"rollout.role": self.role, "rollout.task_id": task.task_id,
                                     "rollout.domain": task.domain, "rollout.group_size": task.group_size,
                                     "rollout.admitted_version": task.admitted_version,
                                     "rollout.difficulty": task.difficulty,
                                     "messaging.destination.name": self.names.tasks})
            fut, _ = self.rt.producer.send_nowait(self.names.tasks, task, key=task.task_id,
                                                  headers=tracing.trace_headers(span))
        return fut

    async def _settle(self, pending: list[Any]) -> None:
        """Wait until every task sent so far is acknowledged by the broker; note where they landed."""
        for fut in pending:
            meta = await fut
            partition, offset = getattr(meta, "partition", None), getattr(meta, "offset", None)
            if isinstance(partition, int) and isinstance(offset, int):
                self._tasks_offsets[partition] = max(self._tasks_offsets.get(partition, 0), offset + 1)
        pending.clear()

    async def _consume_published(self) -> None:
        """Buffer the records of ``rollout.tasks.published``; commit those whose tasks are issued."""
        consumer = self.rt.consumer("scheduler-published", ["tasks.published"], expect=(PublishedTask.SCHEMA,))
        await consumer.start()
        try:
            while True:
                records = await consumer.getmany(timeout_s=0.5)
                if records:
                    self._published.extend(records)
                    self._notify()
                await consumer.commit()
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.close()

    def _next_published(self) -> Task | None:
        """The next published task as a :class:`Task` (its record acknowledged once the task is), or None."""
        while self._published:
            record = self._published.popleft()
            msg = record.message
            if not isinstance(msg, PublishedTask) or msg.domain not in DOMAINS:
                log.warning("%s: published task %r names an unknown domain %r; dropped", self.name,
                            getattr(msg, "id", "?"), getattr(msg, "domain", "?"))
                record.ack()
                continue
            domain = DOMAINS[msg.domain]
            spec = dict(msg.spec, task_file_id=msg.id)
            sampling = self._sampling(domain.max_new_tokens, domain.stop)
            self.published_issued += 1
            self._published_record = record
            return Task(task_id=f"{msg.domain}-{uuid.uuid4().hex[:20]}", domain=msg.domain, prompt=msg.prompt,
                        spec=spec, group_size=self.cfg.group_size, sampling=sampling,
                        max_turns=msg.max_turns or domain.turns(spec), admitted_version=self.learner.version,
                        tools=list(domain.tools))
        return None

    def _sampling(self, max_new_tokens: int | None, stop: Sequence[str]) -> dict[str, Any]:
        """A task's sampling parameters: its domain's budget and stops, the inference defaults otherwise."""
        sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens or self.rt.cfg.inference.max_new_tokens,
                                    "temperature": self.rt.cfg.inference.temperature}
        if stop:
            sampling["stop"] = list(stop)
        return sampling

    def _next_task(self) -> Task | None:
        while True:
            name = self.mixer.pick(self._rng)
            if name is None:
                return None
            source = self.sources[name]
            difficulty = (self._curriculum_for(source.domain).difficulty(source.domain)
                          if self.cfg.curriculum and source.domain else self.fixed_difficulty)
            sourced = source.next(difficulty)
            if sourced is None:
                self.mixer.remove(name)
                continue
            sampling = self._sampling(sourced.max_new_tokens, sourced.stop)
            return Task(task_id=f"{sourced.domain}-{uuid.uuid4().hex[:20]}", domain=sourced.domain,
                        prompt=sourced.prompt, spec=sourced.spec, group_size=self.cfg.group_size,
                        sampling=sampling, max_turns=sourced.max_turns, admitted_version=self.learner.version,
                        difficulty=sourced.difficulty, tools=list(sourced.tools))

    async def wait_changed(self, timeout_s: float) -> None:
        """Wait until the learner status or the statistics change, or ``timeout_s`` passes."""
        event = self._changed
        with anyio.move_on_after(timeout_s):
            await event.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- watchers ------------------------------------------------------------------------------
    async def _watch_learner(self) -> None:
        async for raw in self.rt.require_nats().kv_watch(self._bucket, Names.LEARNER_VERSION_KEY):
            try:
                status = LearnerStatus.from_json(raw)
            except (ValueError, TypeError) as exc:
                log.warning("%s: ignoring an unreadable learner status %r: %s", self.name, raw[:200], exc)
                continue
            if status.version < self.learner.version:
                log.warning("%s: learner version went back from %d to %d", self.name, self.learner.version,
                            status.version)
            self.learner = status
            self._notify()

    async def _watch_stats(self) -> None:
        async for raw in self.rt.require_nats().kv_watch(self._bucket, REWARD_STATS_KEY):
            try:
                domains = json.loads(raw).get("domains", {})
            except (ValueError, AttributeError) as exc:
                log.warning("%s: ignoring unreadable reward statistics: %s", self.name, exc)
                continue
            self.apply_stats(domains)
            self._notify()

    def apply_stats(self, domains: dict[str, dict[str, Any]]) -> None:
        """Rebalance weights and move the curriculum from per-domain statistics."""
        for source in self.sources.values():
            stats = domains.get(source.domain or "")
            if not stats:
                continue
            if self.cfg.rebalance:
                self.mixer.rebalance(source.name, stats)
            if self.cfg.curriculum and source.domain:
                self._curriculum_for(source.domain).observe(source.domain, int(stats.get("count", 0)),
                                                             float(stats.get("success", 0.0)))

    def _curriculum_for(self, domain: str) -> "Curriculum | LengthCurriculum":
        """The length curriculum for the domains it steers, the difficulty curriculum for the rest."""
        if self.length_curriculum is not None and self.length_curriculum.steers(domain):
            return self.length_curriculum
        return self.curriculum

    # -- status --------------------------------------------------------------------------------
    async def put_status(self) -> None:
        """Write the scheduler's counters to the control KV bucket."""
        tasks = self.tasks_admitted
        await self.rt.require_nats().kv_put(self._bucket, self._status_key, json.dumps(self.status()).encode())
        self._status_written = tasks

    def status(self) -> dict[str, Any]:
        return {"admitted_samples": self.admitted_samples, "tasks_admitted": self.tasks_admitted,
                "learner_version": self.learner.version, "done": self.done,
                "capacity": self.admission.capacity(self.learner.version), "weights": self.mixer.weights,
                "difficulty": {s.domain: self._curriculum_for(s.domain).difficulty(s.domain)
                               for s in self.sources.values() if s.domain},
                "length_curriculum": self.length_curriculum.state() if self.length_curriculum else {},
                "source_positions": {n: s.position for n, s in self.sources.items() if isinstance(s, TaskFileSource)},
                "tasks_offsets": {str(p): o for p, o in sorted(self._tasks_offsets.items())},
                "published_issued": self.published_issued,
                "updated_at": time.time()}

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(self.status(), blocked_waits=self.blocked_waits)
        return stats
