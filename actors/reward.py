"""The reward role: outcomes in, experience out, one task's group at a time.

``RewardActor`` consumes ``rollout.outcomes`` (keyed by task_id, so a group's samples meet in one
actor), scores each outcome with its domain's reward function (``domains/``), keeps per-domain
running statistics, assembles groups and emits ``rollout.experience`` with group-relative advantages.

Delivery (the design's rule: a record is acked only after what it produced is acknowledged):

- A grouped outcome is ``defer_ack``-ed: ``handle`` returns at once (no handler slot is held while a
  group waits, so waiting groups can never starve the poll loop), and the outcome is acked only after
  every experience of its group is acknowledged by the broker. A crash before that re-delivers the
  whole group.
- A group is flushed when ``group_size`` distinct samples arrived, or by ``tick()`` once
  ``reward.group_timeout_s`` passed since its first sample (emitting what arrived). A sample of an
  already flushed group (a straggler) is emitted alone with ``filtered="straggler"``.
- Every sample is emitted exactly once per flush, possibly with ``filtered`` set (``zero_variance``,
  ``straggler``, ``verifier_error``), so the learner's ledger counts every admitted sample.
- Duplicates (same outcome message id, or same sample_id within a group) are acked and dropped.
- An experience's message id is derived from its sample_id, so if a crash makes this actor (or the
  partition's next owner) emit a sample again, the learner's de-duplication by message id still sees
  one sample.

Statistics: per domain a Welford mean/std of rewards, an exponential average of correctness (the
scheduler's curriculum signal), cumulative counters (samples, correctness sum, groups, zero-variance
groups, verifier errors). A snapshot is put under ``REWARD_STATS_KEY`` in the control KV bucket every
``stats_interval_s``, with the writer's ``instance`` and ``epoch`` (new whenever these statistics start
from zero). With several reward actors each writes its own partitions' counters to the same key; the
scheduler keeps every writer's latest and differences them (``actors.scheduler.RewardStatsMerger``), so the
counts add up rather than the last writer winning.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from opentelemetry import trace

from actors import tracing
from domains import RewardBreakdown, score
from actors.runtime import Runtime, StreamActor
from engine.config import RewardConfig
from engine.schemas import Completion, Experience, Outcome
from streams.protocols import EventConsumer, EventRecord

log = logging.getLogger("rollout.actors.reward")

REWARD_STATS_KEY = "reward.stats"
"""Control-bucket KV key of the reward actors' statistics snapshot (JSON, see ``RewardActor.snapshot``)."""

ZERO_VARIANCE_EPS = 1e-6
ADVANTAGE_EPS = 1e-6
SUCCESS_EMA_ALPHA = 0.05

T = TypeVar("T")


# -- statistics ------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Welford:
    """Running count, mean and (population) variance in one pass, numerically stable."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, x: float) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)

    @property
    def variance(self) -> float:
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.variance)


@dataclasses.dataclass(slots=True)
class DomainStats:
    """Running statistics of one domain."""

    rewards: Welford = dataclasses.field(default_factory=Welford)
    success: float | None = None
    """Exponential average of correctness (the reward without format and length terms)."""
    correct_total: float = 0.0
    """Sum of correctness over the samples judged (``count`` of them): a counter the scheduler differences."""
    groups: int = 0
    zero_variance_groups: int = 0
    timed_out_groups: int = 0
    stragglers: int = 0
    verifier_errors: int = 0
    error_groups: int = 0
    """Groups whose every sample failed in the verifier: not counted in ``groups`` (nothing was judged)."""

    def observe(self, reward: RewardBreakdown) -> None:
        self.rewards.update(reward.total)
        c = reward.correctness
        self.correct_total += c
        self.success = c if self.success is None else self.success + SUCCESS_EMA_ALPHA * (c - self.success)

    def snapshot(self) -> dict[str, Any]:
        return {
            "count": self.rewards.count,
            "mean": self.rewards.mean,
            "std": self.rewards.std,
            "success": self.success if self.success is not None else 0.0,
            "correct_total": self.correct_total,
            "groups": self.groups,
            "zero_variance_groups": self.zero_variance_groups,
            "zero_variance_rate": self.zero_variance_groups / self.groups if self.groups else 0.0,
            "timed_out_groups": self.timed_out_groups,
            "stragglers": self.stragglers,
            "verifier_errors": self.verifier_errors,
            "error_groups": self.error_groups,
        }


# -- advantages ------------------------------------------------------------------------------------

def is_zero_variance(rewards: Sequence[float]) -> bool:
    """All rewards equal (no learning signal in the group)."""
    return len(rewards) == 0 or float(np.std(rewards)) < ZERO_VARIANCE_EPS


def group_advantages(rewards: Sequence[float], normalize: str, *, domain_std: float = 1.0,
                     eps: float = ADVANTAGE_EPS) -> list[float]:
    """Group-relative advantages: reward minus the group mean, scaled by ``normalize``.

    ``group``: no scaling; ``group_std``: divided by the group's std (+eps); ``domain``: divided by the
    domain's running std (+eps). The advantages of a group sum to zero.
    """
    if not rewards:
        return []
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean()
    if normalize == "group":
        scale = 1.0
    elif normalize == "group_std":
        scale = float(r.std()) + eps
    elif normalize == "domain":
        scale = domain_std + eps
    else:
        raise ValueError(f"normalize must be group, group_std or domain, got {normalize!r}")
    return [float(a) for a in centred / scale]


# -- group assembly (pure) -------------------------------------------------------------------------

class Arrival(enum.Enum):
    """What ``GroupAssembler.add`` made of a sample."""

    DUPLICATE = "duplicate"
    """Seen before (in its pending group or its flushed group): drop it."""
    PENDING = "pending"
    """Added; its group is still incomplete."""
    COMPLETE = "complete"
    """Added and its group is now complete: ``take`` it."""
    STRAGGLER = "straggler"
    """Its group was flushed already: emit it alone, filtered."""


@dataclasses.dataclass(slots=True)
class _Group(Generic[T]):
    group_size: int
    deadline: float
    items: dict[str, T] = dataclasses.field(default_factory=dict)


class GroupAssembler(Generic[T]):
    """Collects samples by task_id until a group is complete or its deadline passes; no I/O.

    Flushed groups are remembered (their sample ids, up to ``remember`` groups) so late samples are
    recognised as stragglers and re-deliveries as duplicates.
    """

    def __init__(self, timeout_s: float, *, remember: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.remember = remember
        self.clock = clock
        self._pending: dict[str, _Group[T]] = {}
        self._closed: collections.OrderedDict[str, set[str]] = collections.OrderedDict()

    def add(self, task_id: str, sample_id: str, group_size: int, item: T) -> Arrival:
        closed = self._closed.get(task_id)
        if closed is not None:
            if sample_id in closed:
                return Arrival.DUPLICATE
            closed.add(sample_id)
            return Arrival.STRAGGLER
        group = self._pending.get(task_id)
        if group is None:
            group = self._pending[task_id] = _Group(group_size, self.clock() + self.timeout_s)
        if sample_id in group.items:
            return Arrival.DUPLICATE
        group.items[sample_id] = item
        return Arrival.COMPLETE if len(group.items) >= group.group_size else Arrival.PENDING

    def take(self, task_id: str) -> list[T]:
        """Remove a pending group and remember it as flushed; its samples in arrival order ([] if none)."""
        group = self._pending.pop(task_id, None)
        if group is None:
            return []
        self._closed[task_id] = set(group.items)
        while len(self._closed) > self.remember:
            self._closed.popitem(last=False)
        return list(group.items.values())

    def expired(self) -> list[str]:
        """Task ids of pending groups whose deadline has passed."""
        now = self.clock()
        return [tid for tid, g in self._pending.items() if g.deadline <= now]

    def is_pending(self, task_id: str) -> bool:
        return task_id in self._pending

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def pending_samples(self) -> int:
        return sum(len(g.items) for g in self._pending.values())


class _SeenIds:
    """A bounded set of recently seen message ids."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, mid: str) -> bool:
        """Record ``mid``; False if it was already there."""
        if mid in self._ids:
            return False
        self._ids[mid] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True


def experience_message_id(sample_id: str) -> str:
    """The message id of a sample's experience: stable, so re-emission de-duplicates downstream."""
    return "exp-" + hashlib.blake2b(sample_id.encode(), digest_size=16).hexdigest()


# -- the actor -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Scored:
    """One outcome, scored, waiting for its group."""

    record: EventRecord
    experience: Experience
    """Everything but the advantage and the filter, filled in when the group is flushed."""
    reward: RewardBreakdown
    verifier_error: bool
    trace_headers: dict[str, str] = dataclasses.field(default_factory=dict)
    """Headers that parent the experience's consumer under this sample's ``reward`` span."""


class RewardActor(StreamActor):
    """Scores outcomes, assembles groups, emits experience (see the module docstring)."""

    role: ClassVar[str] = "reward"
    topics: ClassVar[list[str]] = ["outcomes"]
    expect: ClassVar[tuple[str, ...]] = (Outcome.SCHEMA,)
    span_name: ClassVar[str | None] = "reward"  # the runtime's span around handle (actors/runtime.py)
    stats_interval_s: float = 2.0
    max_pending_samples: int = 8192
    """Outcomes held unacknowledged in incomplete groups before fetching pauses (until timeouts flush)."""

    def __init__(self, rt: Runtime, name: str | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rt, name)
        self.cfg: RewardConfig = rt.cfg.reward
        self.assembler: GroupAssembler[_Scored] = GroupAssembler(self.cfg.group_timeout_s, clock=clock)
        self.stats: dict[str, DomainStats] = collections.defaultdict(DomainStats)
        self._seen = _SeenIds(1 << 17)
        self._last_stats_put = 0.0
        self.epoch = hashlib.blake2b(f"{rt.instance}:{time.time_ns()}:{id(self)}".encode(), digest_size=8).hexdigest()
        """Names this actor's run of statistics (they start from zero): the scheduler differences counters within one."""
        self.duplicates = 0
        self.emitted = 0
        self._riders: dict[str, list[EventRecord]] = {}
        """Re-deliveries of outcomes whose group is still pending: acknowledged with the group, so a
        re-delivery never lets the committed offset pass an outcome that has not been emitted yet."""

    def make_consumer(self) -> EventConsumer:
        return self.rt.consumer(self.role, self.topics, self.expect,
                                max_in_flight=max(self.concurrency * 4, self.max_pending_samples))

    # -- handling ------------------------------------------------------------------------------
    async def handle(self, record: EventRecord) -> None:
        outcome = record.message
        assert isinstance(outcome, Outcome)
        completion = outcome.completion_msg()
        span = trace.get_current_span()  # the runtime's "reward" span (span_name)
        if not self._seen.add(record.message_id):
            # a re-delivered outcome is a handled message too: its span says so and scores nothing
            if span.is_recording():
                span.set_attributes({"rollout.sample_id": completion.sample_id, "rollout.task_id": completion.task_id,
                                     "rollout.domain": completion.domain, "rollout.duplicate": True,
                                     "rollout.arrival": Arrival.DUPLICATE.value})
            self._duplicate(record, completion.task_id)
            return
        scored = self._score(record, outcome, completion)
        scored = dataclasses.replace(scored, trace_headers=tracing.trace_headers(span))
        arrival = self.assembler.add(completion.task_id, completion.sample_id, completion.group_size, scored)
        if span.is_recording():
            span.set_attributes({"rollout.sample_id": completion.sample_id, "rollout.task_id": completion.task_id,
                                 "rollout.domain": completion.domain, "rollout.reward": scored.reward.total,
                                 "rollout.correctness": scored.reward.correctness,
                                 "rollout.arrival": arrival.value, "rollout.verifier_error": scored.verifier_error,
                                 "rollout.duplicate": arrival is Arrival.DUPLICATE})
        if arrival is Arrival.DUPLICATE:
            self._duplicate(record, completion.task_id)
            return
        self._observe(completion.domain, scored)
        if arrival is Arrival.STRAGGLER:
            self.stats[completion.domain].stragglers += 1
            straggler = dataclasses.replace(scored.experience, advantage=0.0, filtered="straggler")
            await self._send(scored, straggler)
        else:
            self.defer_ack(record)
            if arrival is Arrival.COMPLETE:
                await self._flush(completion.task_id, timed_out=False)

    def _duplicate(self, record: EventRecord, task_id: str) -> None:
        self.duplicates += 1
        if self.assembler.is_pending(task_id):
            self.defer_ack(record)
            self._riders.setdefault(task_id, []).append(record)

    def _score(self, record: EventRecord, outcome: Outcome, completion: Completion) -> _Scored:
        domain = completion.domain
        verifier_error = bool(outcome.error)
        if verifier_error:
            reward = RewardBreakdown(correctness=0.0, format=0.0, tokens=int(completion.loss_mask.sum()), total=0.0)
        else:
            reward = score(domain, outcome.facts, completion, self.cfg, verifier=outcome.verifier)
        facts = dict(outcome.facts)
        facts["reward_terms"] = {"correctness": reward.correctness, "format": reward.format, "tokens": reward.tokens}
        if verifier_error:
            facts["verifier_error"] = outcome.error
        experience = Experience(
            sample_id=completion.sample_id, task_id=completion.task_id, domain=domain,
            prompt_ids=completion.prompt_ids, response_ids=completion.response_ids,
            logprobs=completion.logprobs, loss_mask=completion.loss_mask,
            weight_versions=completion.weight_versions, reward=reward.total, advantage=0.0,
            group_size=completion.group_size, admitted_version=completion.admitted_version, facts=facts,
            temperature=completion.temperature)
        experience.validate()  # a bad sample fails here, alone, not when its group is flushed
        return _Scored(record, experience, reward, verifier_error)

    def _observe(self, domain: str, scored: _Scored) -> None:
        if scored.verifier_error:
            self.stats[domain].verifier_errors += 1
        else:
            self.stats[domain].observe(scored.reward)

    async def _flush(self, task_id: str, *, timed_out: bool) -> None:
        """Emit a group's experiences, wait for the broker, then ack the group's outcomes."""
        members = self.assembler.take(task_id)
        if not members:
            return  # flushed meanwhile by a handler that completed it
        valid = [m for m in members if not m.verifier_error]
        rewards = [m.experience.reward for m in valid]
        domain = members[0].experience.domain
        stats = self.stats[domain]
        zero_variance = is_zero_variance(rewards)
        advantages = group_advantages(rewards, self.cfg.normalize, domain_std=stats.rewards.std)
        if valid:
            stats.groups += 1
            stats.zero_variance_groups += zero_variance
        else:  # nothing judged: no evidence about the domain's signal (the verifier failed on every sample)
            stats.error_groups += 1
        stats.timed_out_groups += timed_out
        drop = zero_variance and self.cfg.drop_zero_variance
        by_sample = {m.experience.sample_id: a for m, a in zip(valid, advantages)}
        futures = []
        for m in members:
            if m.verifier_error:
                exp = dataclasses.replace(m.experience, filtered="verifier_error")
            elif drop:
                exp = dataclasses.replace(m.experience, advantage=0.0, filtered="zero_variance")
            else:
                exp = dataclasses.replace(m.experience, advantage=by_sample[m.experience.sample_id])
            futures.append(self._send_nowait(m, exp))
        await asyncio.gather(*futures)
        for m in members:
            m.record.ack()
        for record in self._riders.pop(task_id, ()):
            record.ack()

    def _send_nowait(self, scored: _Scored, experience: Experience) -> asyncio.Future:
        """Produce ``experience`` (from ``scored``) as a child of its sample's ``reward`` span."""
        fut, _ = self.rt.producer.send_nowait(self.rt.names.experience, experience, key=experience.task_id,
                                              headers=scored.trace_headers,
                                              message_id=experience_message_id(experience.sample_id))
        self.emitted += 1
        return fut

    async def _send(self, scored: _Scored, experience: Experience) -> None:
        await self._send_nowait(scored, experience)

    # -- timers --------------------------------------------------------------------------------
    async def tick(self) -> None:
        for task_id in self.assembler.expired():
            log.info("%s: group %s timed out after %.1fs; emitting what arrived", self.name, task_id,
                     self.cfg.group_timeout_s)
            await self._flush(task_id, timed_out=True)
        now = time.monotonic()
        if self.rt.control is not None and now - self._last_stats_put >= self.stats_interval_s:
            self._last_stats_put = now
            await self.put_stats()

    async def put_stats(self) -> None:
        """Write the statistics snapshot to the control KV bucket."""
        nats = self.rt.require_control()
        await nats.kv_put(self.rt.kv_bucket, REWARD_STATS_KEY, json.dumps(self.snapshot()).encode())

    async def serve(self) -> None:
        try:
            await super().serve()
        finally:
            if self.assembler.pending_groups:
                # Not acked, so not committed: the partition's next owner re-delivers them.
                log.info("%s: handing back %d incomplete groups (%d outcomes)", self.name,
                         self.assembler.pending_groups, self.assembler.pending_samples)

    # -- introspection -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Per-domain statistics (the ``REWARD_STATS_KEY`` value)."""
        return {"updated_at": time.time(), "instance": f"{self.rt.instance}/{self.name}", "epoch": self.epoch,
                "domains": {d: s.snapshot() for d, s in sorted(self.stats.items())}}

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(emitted=self.emitted, duplicates=self.duplicates,
                     pending_groups=self.assembler.pending_groups, pending_samples=self.assembler.pending_samples,
                     domains={d: s.snapshot() for d, s in sorted(self.stats.items())})
        return stats


__all__ = ["REWARD_STATS_KEY", "Arrival", "DomainStats", "GroupAssembler", "RewardActor", "Welford",
           "experience_message_id", "group_advantages", "is_zero_variance"]
