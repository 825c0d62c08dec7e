"""The dashboard's memory: time series sampled from actors' statistics, in bounded ring buffers.

Every ``interval_s`` the :class:`Recorder` reads a stats source (actor name -> ``statistics()``),
turns it into points of a few charts (:data:`CHARTS`) and appends them to one ring buffer per
series (``capacity`` points each: 600 at 1 s is the last ten minutes). Counters become per-second
rates between successive samples; a counter that goes down (the actor restarted) skips one point.

Which statistic feeds which chart (:func:`gauges`, :func:`counters`):

- ``reward``: each domain's mean reward over a moving window (``reward_window_s``, 60 s: the rewards
  that arrived in it, from the reward actors' running ``domains`` count and mean, count-weighted over
  instances; since the start while the run is younger), and ``eval <domain>``, the held-out accuracy an
  eval role reports (an actor whose statistics carry ``eval``: domain -> ``{"accuracy", ...}``);
- ``throughput``: tasks admitted, samples generated, records handled per role, experiences
  emitted and samples trained, per second;
- ``tokens``: tokens generated per second (its own chart: thousands beside tens would flatten the rest);
- ``staleness``: versions between the learner and the oldest inference weights, and samples
  dropped as stale per second;
- ``sandbox``: open episodes (each holds a sandbox), the pool's sandboxes in use (the sandbox actors'
  ``pool`` statistics; the actors of a process share one pool, so the largest report counts), and
  records in flight in the sandbox actors;
- ``lag``: consumer lag (uncommitted records) and records in flight per actor;
- ``learner``: the last optimizer step's policy entropy, KL to the reference (k3), clip fraction,
  gradient norm, the same-version train/serve mismatch (p99, max: nats) and the canary's last probe gap
  (the learner's ``metrics``);
- ``balance``: each domain's sampling share (the scheduler's ``balance``: 0 while paused) and its share of
  the last step's gradient (``grad <domain>``: the learner's ``step_domains``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from engine.actor import Supervisor

StatsSource = Callable[[], dict[str, dict[str, Any]]]
"""Returns actor name -> that actor's statistics (a snapshot)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Chart:
    id: str
    title: str
    unit: str


CHARTS = (
    Chart("reward", "Reward per domain", "mean reward, moving window; eval accuracy"),
    Chart("throughput", "Throughput", "per second"),
    Chart("tokens", "Generation", "tokens per second"),
    Chart("staleness", "Staleness", "versions / stale samples per s"),
    Chart("sandbox", "Sandbox use", "sandboxes / records"),
    Chart("lag", "Consumer lag", "records"),
    Chart("learner", "Learner step", "nats / fraction / norm"),
    Chart("balance", "Domain balance", "sampling share; gradient share of the last step"),
)

LEARNER_SERIES = (("entropy", "entropy"), ("kl_ref", "KL to reference"), ("clip_frac", "clip fraction"),
                  ("grad_norm", "grad norm"), ("mismatch_p99", "train/serve mismatch p99"),
                  ("mismatch_max", "train/serve mismatch max"), ("canary_gap", "canary gap"))
"""(key of the learner's step metrics, series name) on the ``learner`` chart."""

Point = tuple[str, str, float]
"""(chart id, series name, value)."""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def reward_totals(stats: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """domain -> (sum of rewards, count) since the reward actors started, over every instance."""
    reward: dict[str, tuple[float, float]] = {}
    for s in stats.values():
        domains = s.get("domains")
        if isinstance(domains, dict):
            for domain, d in domains.items():
                if not isinstance(d, dict):
                    continue
                mean, count = _num(d.get("mean")), _num(d.get("count")) or 0.0
                if mean is not None and count > 0:
                    total, n = reward.get(domain, (0.0, 0.0))
                    reward[domain] = (total + mean * count, n + count)
    return reward


def gauges(stats: dict[str, dict[str, Any]]) -> list[Point]:
    """Instantaneous values of one sample of every actor's statistics (reward: the mean since start;
    the :class:`Recorder` plots a moving window instead)."""
    points: list[Point] = []
    learner_versions: list[float] = []
    weight_versions: list[float] = []
    pool_in_use: list[float] = []
    for name, s in sorted(stats.items()):
        role = str(s.get("role", name))
        evals = s.get("eval")
        if isinstance(evals, dict):
            for domain, d in evals.items():
                if isinstance(d, dict) and (v := _num(d.get("accuracy"))) is not None:
                    points.append(("reward", f"eval {domain}", v))
        if role == "learner" and (v := _num(s.get("version"))) is not None:
            learner_versions.append(v)
        if role == "learner" and isinstance(metrics := s.get("metrics"), dict):
            for key, series in LEARNER_SERIES:
                if (v := _num(metrics.get(key))) is not None:
                    points.append(("learner", series, v))
        elif (v := _num(s.get("learner_version"))) is not None:
            learner_versions.append(v)
        if isinstance(balance := s.get("balance"), dict):
            for domain, b in balance.items():
                if isinstance(b, dict) and (v := _num(b.get("share"))) is not None:
                    points.append(("balance", str(domain), v))
        if role == "learner" and isinstance(step_domains := s.get("step_domains"), dict):
            for domain, d in step_domains.items():
                if isinstance(d, dict) and (v := _num(d.get("grad_share"))) is not None:
                    points.append(("balance", f"grad {domain}", v))
        if (v := _num(s.get("weight_version"))) is not None:
            weight_versions.append(v)
        if role.startswith("sandbox"):
            if (v := _num(s.get("episodes"))) is not None:
                points.append(("sandbox", "episodes", v))
            pool = s.get("pool")
            if isinstance(pool, dict) and (v := _num(pool.get("in_use"))) is not None:
                pool_in_use.append(v)
            if (v := _num(s.get("in_flight"))) is not None:
                points.append(("sandbox", f"{name} in flight", v))
        if (v := _num(s.get("lag"))) is not None:
            points.append(("lag", f"{name} lag", v))
        if (v := _num(s.get("in_flight"))) is not None:
            points.append(("lag", f"{name} in flight", v))
    for domain, (total, n) in sorted(reward_totals(stats).items()):
        points.append(("reward", domain, total / n))
    if pool_in_use:
        points.append(("sandbox", "pool in use", max(pool_in_use)))
    if learner_versions and weight_versions:
        points.append(("staleness", "version gap", max(learner_versions) - min(weight_versions)))
    return _summed(points)


def counters(stats: dict[str, dict[str, Any]]) -> list[Point]:
    """Monotonic counters of one sample, summed per series; the recorder turns them into rates."""
    points: list[Point] = []
    for name, s in stats.items():
        role = str(s.get("role", name))
        for key, series in (("tasks_admitted", "tasks admitted"), ("samples_done", "samples generated"),
                            ("emitted", "experiences emitted"),
                            ("trained", "samples trained")):
            if (v := _num(s.get(key))) is not None:
                points.append(("throughput", series, v))
        if (v := _num(s.get("tokens_out"))) is not None:
            points.append(("tokens", "tokens out", v))
        if (v := _num(s.get("handled"))) is not None:
            points.append(("throughput", f"{role} records", v))
        if (v := _num(s.get("dropped_stale"))) is not None:
            points.append(("staleness", "dropped stale", v))
    return _summed(points)


def _summed(points: Iterable[Point]) -> list[Point]:
    out: dict[tuple[str, str], float] = {}
    for chart, series, value in points:
        out[(chart, series)] = out.get((chart, series), 0.0) + value
    return [(c, s, v) for (c, s), v in out.items()]


def supervisor_source(supervisor: Supervisor, lag: Callable[[], dict[str, int]] | None = None) -> StatsSource:
    """A stats source over the supervisor's live actors, with consumer lag merged in when given
    (e.g. ``lambda: heartbeater.lag``)."""

    def read() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        lags = lag() if lag is not None else {}
        for name, actor in supervisor.actors.items():
            try:
                stats = dict(actor.statistics())
            except Exception:  # a broken statistics() must not stop the other series
                continue
            stats.setdefault("role", actor.role)
            if name in lags:
                stats["lag"] = lags[name]
            out[name] = stats
        return out

    return read


class Recorder:
    """Samples ``source`` every ``interval_s`` into ring buffers; ``await recorder.run()``."""

    def __init__(self, source: StatsSource, *, interval_s: float = 1.0, capacity: int = 600,
                 reward_window_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        if interval_s <= 0 or capacity < 2 or reward_window_s <= 0:
            raise ValueError("interval_s and reward_window_s must be positive and capacity at least 2")
        self.source = source
        self.interval_s = interval_s
        self.capacity = capacity
        self.reward_window_s = reward_window_s
        self.clock = clock
        # domain -> (t, reward sum, count) at past samples, oldest first, back to one older than the window
        self._reward_history: dict[str, deque[tuple[float, float, float]]] = {}
        self.series: dict[str, dict[str, deque[tuple[float, float]]]] = {c.id: {} for c in CHARTS}
        self.samples = 0
        self._counters: dict[tuple[str, str], tuple[float, float]] = {}  # (chart, series) -> (t, value)

    @classmethod
    def from_supervisor(cls, supervisor: Supervisor, *, lag: Callable[[], dict[str, int]] | None = None,
                        **kw: Any) -> "Recorder":
        return cls(supervisor_source(supervisor, lag), **kw)

    def _append(self, chart: str, series: str, t: float, value: float) -> None:
        buf = self.series[chart].get(series)
        if buf is None:
            buf = self.series[chart][series] = deque(maxlen=self.capacity)
        buf.append((t, value))

    def _windowed_reward(self, domain: str, t: float, total: float, count: float) -> float | None:
        """The mean of the rewards of ``domain`` that arrived in the last ``reward_window_s``."""
        history = self._reward_history.setdefault(domain, deque())
        if history and count < history[-1][2]:  # the reward actor restarted: its totals start again
            history.clear()
        history.append((t, total, count))
        cutoff = t - self.reward_window_s
        while len(history) > 1 and history[1][0] <= cutoff:
            history.popleft()
        # the newest sample at or before the window's start; none yet: everything since the start
        _, base_total, base_count = history[0] if history[0][0] <= cutoff else (t, 0.0, 0.0)
        if count - base_count <= 0:
            return None  # no reward of this domain arrived in the window
        return (total - base_total) / (count - base_count)

    def sample(self) -> None:
        """Read the source once and append this instant's points."""
        t = self.clock()
        stats = self.source()
        for chart, series, value in gauges(stats):
            if chart != "reward" or series.startswith("eval "):
                self._append(chart, series, t, value)
        for domain, (total, count) in sorted(reward_totals(stats).items()):
            if (mean := self._windowed_reward(domain, t, total, count)) is not None:
                self._append("reward", domain, t, mean)
        for chart, series, value in counters(stats):
            prev = self._counters.get((chart, series))
            self._counters[(chart, series)] = (t, value)
            if prev is not None and t > prev[0] and value >= prev[1]:
                self._append(chart, series, t, (value - prev[1]) / (t - prev[0]))
        self.samples += 1

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            self.sample()
            await anyio.sleep(self.interval_s)

    def data(self) -> dict[str, Any]:
        """What ``GET /dashboard/data`` returns: every chart with its series' points and latest values."""
        charts = []
        for chart in CHARTS:
            series = [{"name": name, "points": [[round(t, 3), v] for t, v in buf], "latest": buf[-1][1]}
                      for name, buf in sorted(self.series[chart.id].items()) if buf]
            charts.append({"id": chart.id, "title": chart.title, "unit": chart.unit, "series": series})
        return {"now": self.clock(), "interval_s": self.interval_s, "samples": self.samples, "charts": charts}
