"""The scheduler role: picks tasks, admits them within the off-policy bound, publishes ``rollout.tasks``.

``SchedulerActor`` draws tasks from sources (the domains' generators of ``domains/`` and
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
- :class:`DomainMixer` — configured weights (``scheduler.domains``) times a balancing policy's factor
  (``scheduler.balance``: ``static``, ``zero_variance`` — ``1 - zero_variance_rate``, floored — or
  ``signal`` — the domain's learning signal over its recent groups), held within a floor and a cap per
  source; a domain whose verifier fails on every sample is paused.
- :class:`Curriculum` — per-domain difficulty in [0, 1], raised when the domain's recent success rate is
  high and lowered when it is low, at most once per ``min_samples`` new samples.

Observed statistics come from the reward actors' snapshots (KV key ``actors.reward.REWARD_STATS_KEY``):
each carries its writer's instance, epoch and cumulative counters; :class:`RewardStatsMerger` keeps every
writer's latest and differences them, so several reward actors add up instead of the last writer winning.
The mixer's windows and the merger's counters are checkpointed in the scheduler's status.
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import anyio
import anyio.lowlevel
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from actors import tracing
from domains import DOMAINS, Domain
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

BALANCE_POLICIES = ("static", "zero_variance", "signal")
"""The sampling-share policies of :class:`DomainMixer` (``scheduler.balance.policy``)."""

MIN_SIGNAL = 0.05
"""Least ``signal`` score of a measured domain: it keeps being sampled (and measured) at ~1/20 of a
full-signal domain's rate, so a domain that regains signal can be seen to."""

REWARD_COUNTERS = ("count", "groups", "zero_variance_groups", "correct_total", "verifier_errors")
"""Cumulative per-domain counters of a reward actor's snapshot that the scheduler differences."""


class RewardStatsMerger:
    """Per-domain statistics of several reward actors, merged; and what each new snapshot adds.

    Every reward actor puts its own cumulative counters (:data:`REWARD_COUNTERS`) under one KV key with its
    ``instance`` and ``epoch`` (new each time its statistics start from zero). The merger keeps each
    writer's latest counters, so the merged totals are the sum over writers (not the last writer's view),
    and :meth:`add` returns what a snapshot added since that writer's previous one: the scheduler's windows
    are built from these increments. A writer's new epoch (a restart) retires its old counters into
    ``retired``; a snapshot without instance or epoch (an older reward actor) is one anonymous writer.
    """

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        """instance -> {"epoch", "domains": {domain: {counter: value, "success": ema}}}."""
        self.retired: dict[str, dict[str, float]] = {}

    def add(self, snapshot: dict[str, Any]) -> dict[str, dict[str, float]]:
        """Take one snapshot; returns the per-domain increments of the counters since its writer's last."""
        instance, epoch = str(snapshot.get("instance", "")), str(snapshot.get("epoch", ""))
        domains = snapshot.get("domains", {})
        if not isinstance(domains, dict):
            raise ValueError("reward statistics: 'domains' is not an object")
        prev = self.latest.get(instance)
        if prev is not None and prev["epoch"] != epoch:  # the writer restarted: its counters start again
            for d, c in prev["domains"].items():
                r = self.retired.setdefault(d, {k: 0.0 for k in REWARD_COUNTERS})
                for k in REWARD_COUNTERS:
                    r[k] += float(c.get(k, 0.0))
            prev = None
        before = prev["domains"] if prev is not None else {}
        now: dict[str, dict[str, float]] = {}
        deltas: dict[str, dict[str, float]] = {}
        for d, s in domains.items():
            if not isinstance(s, dict):
                continue
            cur = {k: _number(s.get(k)) for k in REWARD_COUNTERS}
            if "zero_variance_groups" not in s:  # a writer that states only the rate
                cur["zero_variance_groups"] = _number(s.get("zero_variance_rate")) * cur["groups"]
            cur["success"] = _number(s.get("success"))
            old = before.get(d, {})
            if any(cur[k] < float(old.get(k, 0.0)) for k in REWARD_COUNTERS):
                old = {}  # counters went back under one epoch: read them as new
            delta = {k: cur[k] - float(old.get(k, 0.0)) for k in REWARD_COUNTERS}
            if any(delta.values()):
                deltas[d] = delta
            now[d] = cur
        for d, c in before.items():  # a domain the writer no longer lists keeps its last counters
            now.setdefault(d, c)
        self.latest[instance] = {"epoch": epoch, "domains": now}
        return deltas

    def merged(self) -> dict[str, dict[str, float]]:
        """Per-domain totals over every writer: counters summed, ``success`` count-weighted, rates derived."""
        out: dict[str, dict[str, float]] = {}
        for d, r in self.retired.items():
            out[d] = {**{k: r.get(k, 0.0) for k in REWARD_COUNTERS}, "success_weight": 0.0, "success": 0.0}
        for w in self.latest.values():
            for d, c in w["domains"].items():
                m = out.setdefault(d, {**{k: 0.0 for k in REWARD_COUNTERS}, "success_weight": 0.0, "success": 0.0})
                for k in REWARD_COUNTERS:
                    m[k] += float(c.get(k, 0.0))
                n = float(c.get("count", 0.0))
                if n > 0 and m["success_weight"] == 0:  # one writer: its figure as is
                    m["success"], m["success_weight"] = float(c.get("success", 0.0)), n
                elif n > 0:
                    total = m["success_weight"] + n
                    m["success"] = (m["success"] * m["success_weight"] + float(c.get("success", 0.0)) * n) / total
                    m["success_weight"] = total
        for m in out.values():
            m.pop("success_weight")
            m["zero_variance_rate"] = m["zero_variance_groups"] / m["groups"] if m["groups"] else 0.0
        return out

    def state(self) -> dict[str, Any]:
        return {"latest": self.latest, "retired": self.retired}

    def restore(self, state: dict[str, Any]) -> None:
        self.latest = {str(i): {"epoch": str(w.get("epoch", "")),
                                "domains": {str(d): {k: _number(v) for k, v in c.items()}
                                            for d, c in dict(w.get("domains", {})).items()}}
                       for i, w in dict(state.get("latest", {})).items()}
        self.retired = {str(d): {k: _number(v) for k, v in c.items()} for d, c in dict(state.get("retired", {})).items()}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


@dataclasses.dataclass(slots=True)
class DomainWindow:
    """One source's recent groups (``varied``: share with unequal rewards; ``solve``: mean correctness),
    plus its verifier-error streak and pauses."""

    groups: deque[tuple[float, float]] = dataclasses.field(default_factory=deque)
    pending_samples: float = 0.0
    """Samples scored whose groups were not yet counted (a snapshot between a sample and its group's flush)."""
    pending_correct: float = 0.0
    groups_seen: int = 0
    verifier_errors: int = 0
    error_streak: int = 0
    """Verifier errors since the last sample that was judged (all of them, when the verifier always fails)."""
    paused_until: float | None = None
    pauses: int = 0

    def add(self, delta: Mapping[str, float], window: int) -> None:
        groups = int(round(delta.get("groups", 0.0)))
        self.pending_samples += delta.get("count", 0.0)
        self.pending_correct += delta.get("correct_total", 0.0)
        if groups > 0:
            varied = max(0.0, min(1.0, 1.0 - delta.get("zero_variance_groups", 0.0) / groups))
            solve = self.pending_correct / self.pending_samples if self.pending_samples > 0 else 0.0
            solve = max(0.0, min(1.0, solve))
            for _ in range(min(groups, window)):
                self.groups.append((varied, solve))
            while len(self.groups) > window:
                self.groups.popleft()
            self.groups_seen += groups
            self.pending_samples = self.pending_correct = 0.0

    def solve_rate(self) -> float:
        return sum(s for _, s in self.groups) / len(self.groups) if self.groups else 0.0

    def varied_share(self) -> float:
        return sum(v for v, _ in self.groups) / len(self.groups) if self.groups else 0.0

    def progress(self) -> float:
        """|mean solve rate of the newer half of the window - that of the older half| (0 under 2 groups)."""
        n = len(self.groups)
        if n < 2:
            return 0.0
        solves = [s for _, s in self.groups]
        half = n // 2
        older, newer = solves[:half], solves[n - half:]
        return abs(sum(newer) / len(newer) - sum(older) / len(older))

    def state(self) -> dict[str, Any]:
        return {"groups": [[round(v, 4), round(s, 4)] for v, s in self.groups],
                "pending_samples": self.pending_samples, "pending_correct": self.pending_correct,
                "groups_seen": self.groups_seen, "verifier_errors": self.verifier_errors,
                "error_streak": self.error_streak, "paused_until": self.paused_until, "pauses": self.pauses}

    @classmethod
    def from_state(cls, state: dict[str, Any], window: int) -> "DomainWindow":
        w = cls(groups=deque(((float(v), float(s)) for v, s in state.get("groups", [])), maxlen=None),
                pending_samples=float(state.get("pending_samples", 0.0)),
                pending_correct=float(state.get("pending_correct", 0.0)),
                groups_seen=int(state.get("groups_seen", 0)), verifier_errors=int(state.get("verifier_errors", 0)),
                error_streak=int(state.get("error_streak", 0)), pauses=int(state.get("pauses", 0)))
        until = state.get("paused_until")
        w.paused_until = float(until) if isinstance(until, (int, float)) else None
        while len(w.groups) > window:
            w.groups.popleft()
        return w


class DomainMixer:
    """Sampling shares over sources: configured weights times a policy's factor, within floor and cap.

    Policies (``scheduler.balance.policy``; see :class:`engine.config.BalanceConfig`):

    - ``static``: the configured weights.
    - ``zero_variance``: weight x ``max(floor, 1 - zero_variance_rate)`` of the domain's all-time groups
      (merged over the reward actors), once it has ``min_groups`` groups: the engine's original rule.
    - ``signal``: weight x the domain's learning signal over its last ``window`` groups:
      ``varied x band(solve) + progress x |solve(newer half) - solve(older half)|``, at least
      :data:`MIN_SIGNAL`; a domain with fewer than ``min_groups`` groups in its window counts as 1.

    Under every policy the shares are then held within ``[floor, cap]`` per source (``share_floor``,
    ``share_cap``, ``floors``, ``caps``), and a source whose last ``pause_after`` samples all failed in
    the verifier is paused (share 0) for ``pause_s`` seconds, then probed again. The windows, streaks and
    pauses are the mixer's :meth:`state` (checkpointed in the scheduler's status).
    """

    def __init__(self, weights: dict[str, float], *, floor: float = 0.1, min_groups: int = 4,
                 policy: str = "zero_variance", window: int = 64, share_floor: float = 0.0, share_cap: float = 1.0,
                 floors: dict[str, float] | None = None, caps: dict[str, float] | None = None,
                 band: tuple[float, float] = (0.1, 0.9), band_min: float = 0.1, progress: float = 1.0,
                 pause_after: int = 16, pause_s: float = 120.0, regression_boost: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        for name, w in weights.items():
            if not w >= 0:
                raise ValueError(f"domain weight of {name!r} is {w}: weights must be non-negative")
        if weights and sum(weights.values()) <= 0:
            raise ValueError(f"domain weights {weights} are all 0: nothing would be sampled")
        if policy not in BALANCE_POLICIES:
            raise ValueError(f"balance policy {policy!r} is not one of {', '.join(BALANCE_POLICIES)}")
        self.base = dict(weights)
        self.floor = floor
        self.min_groups = min_groups
        self.policy = policy
        self.window = window
        self.share_floor, self.share_cap = share_floor, share_cap
        self.floors, self.caps = dict(floors or {}), dict(caps or {})
        for name in [*self.floors, *self.caps]:
            if name not in self.base:
                raise ValueError(f"balance floor/cap names {name!r}, not a source (sources: {sorted(self.base)})")
        for name in self.base:
            if self._floor(name) > self._cap(name):
                raise ValueError(f"balance floor {self._floor(name)} of {name!r} is above its cap {self._cap(name)}")
        self.band, self.band_min, self.progress_weight = band, band_min, progress
        self.pause_after, self.pause_s = pause_after, pause_s
        self.regression_boost = regression_boost
        self.regressed: set[str] = set()
        """Sources whose held-out accuracy regressed (the eval role's flags): boosted under ``signal``."""
        self.clock = clock
        self._factor = {name: 1.0 for name in weights}
        self.windows: dict[str, DomainWindow] = {name: DomainWindow() for name in weights}

    @classmethod
    def from_config(cls, weights: dict[str, float], cfg: SchedulerConfig, *,
                    clock: Callable[[], float] = time.time) -> "DomainMixer":
        b = cfg.balance
        return cls(weights, policy=cfg.balance_policy, min_groups=b.min_groups, window=b.window,
                   share_floor=b.floor, share_cap=b.cap, floors=b.floors, caps=b.caps, band=b.band,
                   band_min=b.band_min, progress=b.progress, pause_after=b.pause_after, pause_s=b.pause_s,
                   regression_boost=b.regression_boost, clock=clock)

    def _floor(self, name: str) -> float:
        return self.floors.get(name, self.share_floor)

    def _cap(self, name: str) -> float:
        return self.caps.get(name, self.share_cap)

    # -- observations ----------------------------------------------------------------------------
    def rebalance(self, name: str, stats: dict[str, Any]) -> None:
        """``zero_variance``: scale ``name``'s weight by ``1 - zero_variance_rate`` (at least ``floor``) of
        its all-time statistics once it has ``min_groups`` groups; other policies ignore these."""
        if self.policy == "zero_variance" and name in self._factor and int(stats.get("groups", 0)) >= self.min_groups:
            self._factor[name] = max(self.floor, 1.0 - float(stats.get("zero_variance_rate", 0.0)))

    def observe(self, name: str, delta: Mapping[str, float]) -> None:
        """Take what the reward actors counted for ``name``'s domain since the last snapshot (counter
        increments: ``groups``, ``zero_variance_groups``, ``count``, ``correct_total``, ``verifier_errors``)."""
        w = self.windows.get(name)
        if w is None:
            return
        w.add(delta, self.window)
        errors = int(round(delta.get("verifier_errors", 0.0)))
        w.verifier_errors += errors
        if delta.get("count", 0.0) > 0:
            w.error_streak = 0
            if w.paused_until is not None and self.clock() >= w.paused_until:
                w.paused_until = None  # the probe judged samples: resumed
        else:
            w.error_streak += errors
        if errors and self.pause_after and w.error_streak >= self.pause_after and not self.paused(name):
            w.paused_until = self.clock() + self.pause_s
            w.pauses += 1
            log.warning("domain %s paused for %.0fs: its verifier failed on the last %d samples (%d in all); "
                        "those samples are not trained", name, self.pause_s, w.error_streak, w.verifier_errors)
        if self.policy == "signal":
            self._factor[name] = self.signal(name)

    def band_factor(self, solve: float) -> float:
        """1 inside ``band``, falling linearly to ``band_min`` at solve rate 0 and 1."""
        lo, hi = self.band
        if solve < lo:
            return self.band_min + (1.0 - self.band_min) * solve / lo
        if solve > hi:
            return self.band_min + (1.0 - self.band_min) * (1.0 - solve) / (1.0 - hi)
        return 1.0

    def signal(self, name: str) -> float:
        """The ``signal`` policy's factor of ``name`` (1 until its window holds ``min_groups`` groups)."""
        w = self.windows[name]
        if len(w.groups) < self.min_groups:
            return self.regression_boost if name in self.regressed else 1.0
        score = w.varied_share() * self.band_factor(w.solve_rate()) + self.progress_weight * w.progress()
        return max(MIN_SIGNAL, score) * (self.regression_boost if name in self.regressed else 1.0)

    def set_regressed(self, names: set[str]) -> None:
        """The sources whose held-out accuracy regressed now (from the eval role); ``signal`` boosts them."""
        self.regressed = {n for n in names if n in self.windows}
        if self.policy == "signal":
            for name in self._factor:
                self._factor[name] = self.signal(name)

    def paused(self, name: str) -> bool:
        w = self.windows.get(name)
        return w is not None and w.paused_until is not None and self.clock() < w.paused_until

    def remove(self, name: str) -> None:
        """Stop sampling ``name`` (its source is exhausted)."""
        self.base.pop(name, None)
        self._factor.pop(name, None)

    # -- shares ----------------------------------------------------------------------------------
    @property
    def weights(self) -> dict[str, float]:
        """Current sampling shares (sum 1; empty when every source is removed)."""
        live = {n: w * (self._factor[n] if self.policy != "static" else 1.0)
                for n, w in self.base.items() if w > 0}
        if not live:
            return {}
        active = {n: w for n, w in live.items() if not self.paused(n)}
        if not active:  # everything paused: sampling nothing would read as "every source exhausted"
            active = live
        shares = self._bounded(active)
        return {n: shares.get(n, 0.0) for n in self.base}

    def _bounded(self, raw: dict[str, float]) -> dict[str, float]:
        """``raw`` normalised, then held within each source's floor and cap (mass moved to/from the rest)."""
        fixed: dict[str, float] = {}
        while True:
            free = {n: w for n, w in raw.items() if n not in fixed}
            mass = 1.0 - sum(fixed.values())
            total = sum(free.values())
            if not free or total <= 0:
                break
            shares = {n: w / total * mass for n, w in free.items()}
            over = {n: self._cap(n) for n, s in shares.items() if s > self._cap(n) + 1e-12}
            under = {n: self._floor(n) for n, s in shares.items() if s < self._floor(n) - 1e-12}
            if over:
                fixed.update(over)
            elif under:
                fixed.update(under)
            else:
                fixed.update(shares)
                break
        total = sum(fixed.values())
        return {n: s / total for n, s in fixed.items()} if total > 0 else {}

    def pick(self, rng: random.Random) -> str | None:
        weights = {n: w for n, w in self.weights.items() if w > 0}
        if not weights:
            return None
        names = sorted(weights)
        return rng.choices(names, weights=[weights[n] for n in names])[0]

    # -- state -----------------------------------------------------------------------------------
    def view(self) -> dict[str, dict[str, Any]]:
        """Per source what the status shows: share, factor, window figures, pauses."""
        shares = self.weights
        out: dict[str, dict[str, Any]] = {}
        for name, w in self.windows.items():
            out[name] = {"share": round(shares.get(name, 0.0), 4), "factor": round(self._factor.get(name, 0.0), 4),
                         "window_groups": len(w.groups), "varied": round(w.varied_share(), 4),
                         "solve": round(w.solve_rate(), 4), "progress": round(w.progress(), 4),
                         "groups_seen": w.groups_seen, "verifier_errors": w.verifier_errors,
                         "paused": self.paused(name), "pauses": w.pauses, "regressed": name in self.regressed}
        return out

    def state(self) -> dict[str, Any]:
        """The JSON-able state a restarted scheduler resumes from (:meth:`restore`)."""
        return {"policy": self.policy, "factor": dict(self._factor),
                "windows": {n: w.state() for n, w in self.windows.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state` (sources it does not name keep theirs; a factor of another policy is not reused)."""
        for name, w in dict(state.get("windows", {})).items():
            if name in self.windows:
                self.windows[name] = DomainWindow.from_state(w, self.window)
        if state.get("policy") == self.policy:
            for name, f in dict(state.get("factor", {})).items():
                if name in self._factor:
                    self._factor[name] = float(f)
        elif self.policy == "signal":
            for name in self._factor:
                self._factor[name] = self.signal(name)


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
    """Tools declared to the model (the domain's ``tools``; a task file row's own ``tools``)."""


class TaskSource(Protocol):
    """Where tasks come from. ``domain`` is the domain whose statistics steer it (None: not steered)."""

    name: str
    domain: str | None

    def next(self, difficulty: float) -> SourcedTask | None:
        """The next task, or None once the source is exhausted."""
        ...


class GeneratorSource:
    """Endless training tasks from a domain's generator.

    Draw ``n`` is seeded by (seed, replica, domain, ``n``) and says so in its spec (``generator_draw``,
    ``"<replica>:<n>"``): a restarted scheduler that restores ``position`` (its status, then the tasks
    topic past it) goes on where it stopped and never draws a task again, and replicas draw different tasks.
    """

    def __init__(self, domain: Domain, seed: int = 0, replica: int = 0) -> None:
        self.name = domain.name
        self.domain: str | None = domain.name
        self._domain = domain
        self.replica = replica
        self._seed = f"train:{seed}:{domain.name}" if replica == 0 else f"train:{seed}:replica{replica}:{domain.name}"
        self.position = 0
        """Draws made so far: the next one is draw ``position``."""

    def draw_id(self, n: int) -> str:
        return f"{self.replica}:{n}"

    def skip_issued(self, draws: list[str]) -> list[str]:
        """Move past draws of this source found already issued; returns those that were past ``position``."""
        mine = sorted({int(d.split(":", 1)[1]) for d in draws if d.split(":", 1)[0] == str(self.replica)})
        beyond = [n for n in mine if n >= self.position]
        if beyond:
            self.position = beyond[-1] + 1
        return [self.draw_id(n) for n in beyond]

    def next(self, difficulty: float) -> SourcedTask:
        n, self.position = self.position, self.position + 1
        prompt, spec = self._domain.generate(random.Random(f"{self._seed}:{n}"), difficulty)
        spec = dict(spec, generator_draw=self.draw_id(n))
        return SourcedTask(domain=self._domain.name, prompt=prompt, spec=spec, max_turns=self._domain.turns(spec),
                           difficulty=difficulty, stop=self._domain.stop, max_new_tokens=self._domain.budget(spec),
                           tools=self._domain.tools)


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
                           max_new_tokens=domain.budget(spec),
                           tools=task.tools if task.tools is not None else domain.tools)



POSITIONED_SOURCES = (GeneratorSource, TaskFileSource)
"""Sources with a ``position`` the scheduler's status keeps and ``skip_issued`` for what was published past it."""


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
            sources = [GeneratorSource(DOMAINS[d], cfg.seed, cfg.replica) for d in cfg.domains]
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
        self.mixer = DomainMixer.from_config({n: file_weights.get(n, cfg.domains.get(n, 1.0)) for n in self.sources},
                                             cfg)
        self.reward_stats = RewardStatsMerger()
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
        saved = await self.rt.require_control().kv_get(self._bucket, self._status_key)
        if saved:
            status = json.loads(saved)
            self.admitted_samples = int(status.get("admitted_samples", 0))
            self.tasks_admitted = int(status.get("tasks_admitted", 0))
            for name, position in status.get("source_positions", {}).items():
                source = self.sources.get(name)
                if isinstance(source, POSITIONED_SOURCES):
                    source.position = int(position)
            self._tasks_offsets = {int(p): int(o) for p, o in status.get("tasks_offsets", {}).items()}
            balance = status.get("balance_state")
            if isinstance(balance, dict):
                self.mixer.restore(balance.get("mixer", {}))
                self.reward_stats.restore(balance.get("reward_stats", {}))
            log.info("%s: resuming at %d tasks / %d samples admitted", self.name, self.tasks_admitted,
                     self.admitted_samples)
        await self._skip_issued_rows()
        self.learner = LearnerStatus.from_json(await self.rt.require_control().kv_get(self._bucket,
                                                                                    Names.LEARNER_VERSION_KEY))

    async def _skip_issued_rows(self) -> None:
        """Tasks on the tasks topic past the last status (issued, status not yet written): task-file rows and
        generator draws; skip them, counting them as admitted."""
        files = {n: s for n, s in self.sources.items() if isinstance(s, POSITIONED_SOURCES)}
        if not files:
            return
        issued: dict[str, list[str]] = {n: [] for n in files}
        group_sizes: dict[tuple[str, str], int] = {}
        for _, _, msg in await self.rt.event_log.read_since(self.names.tasks, self._tasks_offsets,
                                                           expect=(Task.SCHEMA,)):
            assert isinstance(msg, Task)
            source, row = msg.spec.get("task_file"), msg.spec.get("task_file_id")
            if row is None:  # a generator's draw: its source is named after its domain
                source, row = msg.domain, msg.spec.get("generator_draw")
            if isinstance(source, str) and source in issued and isinstance(row, str):
                issued[source].append(row)
                group_sizes[(source, row)] = msg.group_size
        for name, rows in issued.items():
            skipped = files[name].skip_issued(rows)
            if skipped:
                self.tasks_admitted += len(skipped)
                self.admitted_samples += sum(group_sizes[(name, row)] for row in skipped)
                log.warning("%s: %d task(s) of %s were issued after the last stored status; not issuing them again",
                            self.name, len(skipped), name)

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_learner)
            tg.start_soon(self._watch_stats)
            tg.start_soon(self._watch_eval)
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
        """A task's sampling parameters: its domain's budget and stops, the inference defaults otherwise, and
        ``scheduler.sampling``'s overrides over both."""
        overrides = self.cfg.sampling
        budget = overrides.max_new_tokens or max_new_tokens or self.rt.cfg.inference.max_new_tokens
        sampling: dict[str, Any] = {"max_new_tokens": budget, "temperature": self.rt.cfg.inference.temperature}
        if overrides.stop is not None:
            stop = overrides.stop
        if stop:
            sampling["stop"] = list(stop)
        if overrides.ignore_eos:
            sampling["ignore_eos"] = True
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
        async for raw in self.rt.require_control().kv_watch(self._bucket, Names.LEARNER_VERSION_KEY):
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
        async for raw in self.rt.require_control().kv_watch(self._bucket, REWARD_STATS_KEY):
            try:
                snapshot = json.loads(raw)
                if not isinstance(snapshot, dict):
                    raise ValueError("not a JSON object")
                self.apply_snapshot(snapshot)
            except (ValueError, AttributeError, TypeError) as exc:
                log.warning("%s: ignoring unreadable reward statistics: %s", self.name, exc)
                continue
            self._notify()

    async def _watch_eval(self) -> None:
        async for raw in self.rt.require_control().kv_watch(self._bucket, Names.EVAL_STATUS_KEY):
            try:
                domains = json.loads(raw)["domains"]
                regressed = {d for d, e in domains.items() if isinstance(e, dict) and e.get("regressed")}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("%s: ignoring an unreadable eval status: %s", self.name, exc)
                continue
            self.apply_eval(regressed)
            self._notify()

    def apply_eval(self, regressed_domains: set[str]) -> None:
        """Take the eval role's regression flags: the sources of those domains are boosted under ``signal``."""
        names = {s.name for s in self.sources.values() if s.domain in regressed_domains}
        if names != self.mixer.regressed:
            log.info("%s: held-out regressions: %s", self.name, ", ".join(sorted(names)) or "none")
        self.mixer.set_regressed(names)

    def apply_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Take one reward actor's statistics snapshot: its increments feed the balancing windows, and the
        totals merged over every reward actor feed ``zero_variance`` and the curriculum."""
        deltas = self.reward_stats.add(snapshot)
        for source in self.sources.values():
            delta = deltas.get(source.domain or "")
            if delta:
                self.mixer.observe(source.name, delta)
        self.apply_stats(self.reward_stats.merged())

    def apply_stats(self, domains: dict[str, dict[str, Any]]) -> None:
        """Rebalance weights (``zero_variance``) and move the curriculum from per-domain totals."""
        for source in self.sources.values():
            stats = domains.get(source.domain or "")
            if not stats:
                continue
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
        await self.rt.require_control().kv_put(self._bucket, self._status_key, json.dumps(self.status()).encode())
        self._status_written = tasks

    def status(self) -> dict[str, Any]:
        return {"admitted_samples": self.admitted_samples, "tasks_admitted": self.tasks_admitted,
                "learner_version": self.learner.version, "done": self.done,
                "capacity": self.admission.capacity(self.learner.version), "weights": self.mixer.weights,
                "difficulty": {s.domain: self._curriculum_for(s.domain).difficulty(s.domain)
                               for s in self.sources.values() if s.domain},
                "length_curriculum": self.length_curriculum.state() if self.length_curriculum else {},
                "source_positions": {n: s.position for n, s in self.sources.items()
                                     if isinstance(s, POSITIONED_SOURCES)},
                "tasks_offsets": {str(p): o for p, o in sorted(self._tasks_offsets.items())},
                "published_issued": self.published_issued,
                "balance_policy": self.mixer.policy, "balance": self.mixer.view(),
                "balance_state": {"mixer": self.mixer.state(), "reward_stats": self.reward_stats.state()},
                "updated_at": time.time()}

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        status = self.status()
        status.pop("balance_state")  # the windows themselves: checkpoint material, not a statistic
        stats.update(status, blocked_waits=self.blocked_waits)
        return stats
