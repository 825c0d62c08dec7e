"""The sandbox role: multi-turn episode steps and verification, two stream actors sharing one pool.

- :class:`EpisodeActor` consumes ``rollout.sandbox.requests`` (key episode_id). ``open`` takes a
  sandbox from the pool for the whole episode (a :class:`~sandboxes.verifiers.TerminalEpisode`,
  ``setup_files`` written), ``step`` runs a command in the episode's shell session, ``close`` runs the
  final-state checks and gives the sandbox back (the pool resets it to pristine). Every reply goes to
  ``rollout.sandbox.results`` at the request's ``reply_partition``, key episode_id.
- :class:`VerifyActor` consumes ``rollout.completions`` (key task_id), runs the verifier of the
  completion's domain (``actors.domains.DOMAINS``; a built-in one named in ``spec["verifier"]``
  overrides it) and emits an :class:`~engine.schemas.Outcome` to ``rollout.outcomes``, key task_id.

Invariants:

- Hostile model output or specs never crash an actor: a verifier that fails on them yields facts with
  an ``error`` field and zero counts; absurd spec limits are clamped to the configured maxima
  (:func:`clamp_spec`).
- An infrastructure failure of the sandboxes themselves (``SandboxError``) is re-raised as a
  ``StreamError``, so the actor crashes, the supervisor restarts it and the record is re-delivered
  instead of being scored zero.
- Episodes live in the memory of the process that opened them. A step for an episode this process
  does not hold (the partition moved, the process restarted, the episode idled out) is answered with
  ``error="episode_unknown"``. Requests of one episode are handled one at a time, in arrival order,
  and a re-delivered request already answered is answered again from a cache, not re-executed.

Wiring (``rollout run``)::

    async with SandboxResources(cfg.sandbox) as resources:      # the pool lives as long as this block
        for spec in build_sandbox_actors(rt, resources):
            supervisor.add_spec(spec)
        await supervisor.run()

Without ``resources`` the actors share one created on demand: the pool starts with the first actor's
``setup`` and closes with the last ``teardown`` (a restart of the only actor then re-creates it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from opentelemetry.trace import SpanKind

from actors import tracing
from actors.domain_repo import episode_for
from actors.domains import DOMAINS
from actors.runtime import Runtime, StreamActor
from engine.actor import ActorSpec
from engine.config import SandboxConfig
from engine.schemas import EPISODES_FULL, SANDBOX_ERROR, Completion, Outcome, SandboxRequest, SandboxResult
from sandboxes import Limits, SandboxError, SandboxPool
from sandboxes.verifiers import VERIFIERS, Facts, TerminalEpisode, Verifier
from streams.kafka import Record, StreamError

log = logging.getLogger("rollout.actors.sandbox")

EPISODE_UNKNOWN = "episode_unknown"


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    """Knobs of the sandbox role beyond :class:`engine.config.SandboxConfig` (same meaning, same units)."""

    idle_timeout_s: float = 300.0
    """An episode with no request for this long is closed (sandbox released, no checks run)."""
    open_timeout_s: float = 30.0
    """How long an ``open`` waits for a free sandbox before replying ``sandbox_unavailable``."""
    episode_share: float = 0.75
    """Fraction of ``max_sandboxes`` episodes may hold, so verification never starves."""
    max_tests: int = 64
    """Most tests of one code spec that are run; further ones count as failed."""
    max_turns: int = 64
    """Largest ``max_turns`` an episode spec may ask for."""
    reply_cache: int = 4096
    """Replies remembered for re-delivered requests."""

    def __post_init__(self) -> None:
        if self.idle_timeout_s <= 0 or self.open_timeout_s <= 0:
            raise ValueError("SandboxSettings: timeouts must be > 0")
        if not 0 < self.episode_share <= 1:
            raise ValueError(f"SandboxSettings.episode_share must be in (0, 1], got {self.episode_share}")


# -- spec hygiene -----------------------------------------------------------------------------------


def _bounded(value: Any, maximum: float, *, integer: bool = False) -> tuple[float | int, bool]:
    """``value`` as a positive finite number no larger than ``maximum``; second item: was it changed."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    bounded = min(value, maximum) if ok else maximum
    if integer:
        bounded = max(1, int(bounded))
    return bounded, not ok or bounded != value


def clamp_spec(spec: dict[str, Any], cfg: SandboxConfig, settings: SandboxSettings) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``spec`` whose limits are within the configured maxima, and the fields that were changed.

    Limits a spec may carry: ``timeout_s`` (per command), ``checks[i].timeout_s``, ``max_turns``,
    ``memory_mb`` and ``pids`` (the pool's sandboxes have the configured ones whatever the spec says).
    A missing or non-numeric limit becomes the maximum.
    """
    out = dict(spec)
    clamped: list[str] = []
    maxima: dict[str, tuple[float, bool]] = {
        "timeout_s": (cfg.timeout_s, False),
        "max_turns": (settings.max_turns, True),
        "memory_mb": (cfg.memory_mb, True),
        "pids": (cfg.pids, True),
    }
    for name, (maximum, integer) in maxima.items():
        if name in out:
            out[name], changed = _bounded(out[name], maximum, integer=integer)
            if changed:
                clamped.append(name)
    checks = out.get("checks")
    if isinstance(checks, list):
        fixed = []
        for i, check in enumerate(checks):
            if isinstance(check, dict):
                check = dict(check)
                check["timeout_s"], changed = _bounded(check.get("timeout_s", cfg.timeout_s), cfg.timeout_s)
                if changed and "timeout_s" in checks[i]:
                    clamped.append(f"checks[{i}].timeout_s")
            fixed.append(check)
        out["checks"] = fixed
    tests = out.get("tests")
    if isinstance(tests, list) and len(tests) > settings.max_tests:
        out["tests"] = tests[: settings.max_tests]
        clamped.append("tests")
    return out, clamped


def pick_verifier(domain: str, spec: dict[str, Any]) -> tuple[str, Verifier]:
    """The verifier of a completion and the name its outcome carries: the built-in one named by
    ``spec["verifier"]`` if set, else the registered domain's (``Domain.verifier_name``, ``Domain.verify``)."""
    override = spec.get("verifier")
    if override is not None:
        if not isinstance(override, str) or override not in VERIFIERS:
            raise ValueError(f"spec.verifier {override!r} is not one of {sorted(VERIFIERS)}")
        return override, VERIFIERS[override]
    registered = DOMAINS.get(domain)
    if registered is None:
        raise ValueError(f"no verifier for domain {domain!r}: it is not registered (domains: {sorted(DOMAINS)})")
    return registered.verifier_name, registered.verify


def failed_facts(kind: str, spec: dict[str, Any], error: str) -> Facts:
    """Facts of a verification that could not be carried out: an ``error`` and nothing passed."""
    facts: Facts = {"error": error[:2000]}
    if kind == "answer":
        facts.update(extracted=None, correct=False)
    elif kind == "code":
        tests = spec.get("tests")
        facts.update(passed=0, total=len(tests) if isinstance(tests, list) else 0, tests=[], exit_codes=[])
    elif kind == "terminal":
        checks = spec.get("checks")
        facts.update(checks_passed=0, checks_total=len(checks) if isinstance(checks, list) else 0, turns=0)
    return facts


# -- shared resources -------------------------------------------------------------------------------


class SandboxResources:
    """The one :class:`SandboxPool` of a process, shared by its sandbox actors (reference-counted).

    ``async with SandboxResources(cfg) as res`` holds a reference for the block; each actor holds one
    from its ``setup`` to its ``teardown``. The pool starts with the first reference and closes with
    the last.
    """

    def __init__(self, cfg: SandboxConfig, settings: SandboxSettings | None = None) -> None:
        self.cfg = cfg
        self.settings = settings or SandboxSettings()
        self.limits = Limits(memory_mb=cfg.memory_mb, pids=cfg.pids, timeout_s=cfg.timeout_s)
        self._pool: SandboxPool | None = None
        self._refs = 0
        self._lock = asyncio.Lock()

    @property
    def pool(self) -> SandboxPool:
        if self._pool is None:
            raise RuntimeError("SandboxResources is not acquired")
        return self._pool

    def pool_statistics(self) -> dict[str, int] | None:
        """The shared pool's :class:`~sandboxes.pool.PoolStatistics` as a dict; None while no pool runs."""
        return dataclasses.asdict(self._pool.statistics()) if self._pool is not None else None

    @property
    def max_episodes(self) -> int:
        return max(1, int(self.cfg.max_sandboxes * self.settings.episode_share))

    async def acquire(self) -> SandboxPool:
        async with self._lock:
            if self._pool is None:
                pool = SandboxPool(self.cfg.backend, self.limits, size=min(self.cfg.pool_size, self.cfg.max_sandboxes),
                                   max_size=self.cfg.max_sandboxes, idle_ttl_s=self.cfg.idle_ttl_s)
                try:
                    await pool.start()
                except SandboxError as exc:
                    await pool.close()
                    raise StreamError(f"cannot start the {self.cfg.backend} sandbox pool: {exc}") from exc
                self._pool = pool
            self._refs += 1
            return self._pool

    async def release(self) -> None:
        async with self._lock:
            self._refs -= 1
            if self._refs == 0 and self._pool is not None:
                pool, self._pool = self._pool, None
                await pool.close()

    async def __aenter__(self) -> SandboxResources:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


@contextlib.asynccontextmanager
async def sandbox_resources(cfg: SandboxConfig, settings: SandboxSettings | None = None) -> AsyncIterator[SandboxResources]:
    """``async with sandbox_resources(cfg.sandbox) as res:`` the shared pool, started and closed."""
    async with SandboxResources(cfg, settings) as resources:
        yield resources


class _SandboxActorBase(StreamActor):
    """Holds a reference to the shared resources from setup to teardown."""

    def __init__(self, rt: Runtime, resources: SandboxResources, name: str | None = None) -> None:
        super().__init__(rt, name)
        self.resources = resources
        self.concurrency = resources.cfg.max_sandboxes
        self._holding = False

    async def setup(self) -> None:
        await self.resources.acquire()
        self._holding = True
        await super().setup()

    async def teardown(self) -> None:
        try:
            await super().teardown()
        finally:
            if self._holding:
                self._holding = False
                await self.resources.release()

    def statistics(self) -> dict[str, Any]:
        """The stream actor's counters and ``pool``: the shared pool's idle / in_use / created / resets /
        reaped / trimmed (both sandbox actors of a process report the same pool)."""
        stats = super().statistics()
        if (pool := self.resources.pool_statistics()) is not None:
            stats["pool"] = pool
        return stats


# -- episodes ---------------------------------------------------------------------------------------


class _KeyedLocks:
    """One FIFO lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


@dataclasses.dataclass(slots=True)
class _Live:
    episode: TerminalEpisode
    last_used: float


class EpisodeActor(_SandboxActorBase):
    """Runs multi-turn episodes: ``rollout.sandbox.requests`` -> ``rollout.sandbox.results``."""

    role: ClassVar[str] = "sandbox.episodes"
    topics: ClassVar[list[str]] = ["sandbox.requests"]
    expect: ClassVar[tuple[str, ...]] = (SandboxRequest.SCHEMA,)

    def __init__(self, rt: Runtime, resources: SandboxResources, name: str | None = None) -> None:
        super().__init__(rt, resources, name)
        self.settings = resources.settings
        self.episodes: dict[str, _Live] = {}
        self._locks = _KeyedLocks()
        self._replies: collections.OrderedDict[tuple[str, int, str], SandboxResult] = collections.OrderedDict()
        self._next_idle_check = 0.0
        self.opened = self.closed = self.idle_closed = self.replayed = self.unknown = 0

    async def handle(self, record: Record) -> None:
        req = record.message
        assert isinstance(req, SandboxRequest)
        partitions = self.rt.partitions("sandbox.results")
        if req.reply_partition >= partitions:
            raise ValueError(f"reply_partition {req.reply_partition} >= {partitions} partitions of sandbox.results")
        key = (req.episode_id, req.step, req.action)
        with tracing.tracer().start_as_current_span("sandbox.step", context=tracing.record_context(record),
                                                    kind=SpanKind.CONSUMER) as span:
            async with self._locks.hold(req.episode_id):
                reply = self._replies.get(key)
                replayed = reply is not None
                if reply is not None:
                    self.replayed += 1
                else:
                    reply = await self._answer(req)
                    if not reply.error or reply.error == EPISODE_UNKNOWN:
                        self._remember(key, reply)
            if span.is_recording():
                span.set_attributes({**tracing.record_attributes(record), "rollout.role": self.role,
                                     "rollout.episode_id": req.episode_id, "rollout.step": req.step,
                                     "rollout.action": req.action, "rollout.domain": req.domain,
                                     "rollout.replayed": replayed, "rollout.error": reply.error,
                                     "rollout.timed_out": reply.timed_out})
                if reply.exit_code is not None:
                    span.set_attribute("rollout.exit_code", reply.exit_code)
            self.emit(record, self.rt.names.sandbox_results, reply, key=req.episode_id, partition=req.reply_partition,
                      headers=tracing.trace_headers(span))

    def _remember(self, key: tuple[str, int, str], reply: SandboxResult) -> None:
        self._replies[key] = reply
        while len(self._replies) > self.settings.reply_cache:
            self._replies.popitem(last=False)

    async def _answer(self, req: SandboxRequest) -> SandboxResult:
        try:
            if req.action == "open":
                return await self._open(req)
            live = self.episodes.get(req.episode_id)
            if live is None:
                self.unknown += 1
                return SandboxResult(episode_id=req.episode_id, step=req.step, observation="", error=EPISODE_UNKNOWN)
            live.last_used = time.monotonic()
            if req.action == "step":
                return await self._step(req, live)
            return await self._close(req, live)
        except SandboxError as exc:
            raise StreamError(f"sandbox failure in episode {req.episode_id}: {exc}") from exc

    async def _open(self, req: SandboxRequest) -> SandboxResult:
        ok = SandboxResult(episode_id=req.episode_id, step=req.step, observation="")
        if req.episode_id in self.episodes:  # a re-delivered open whose reply fell out of the cache
            return ok
        if len(self.episodes) >= self.resources.max_episodes:
            return dataclasses.replace(ok, error=EPISODES_FULL)
        spec, clamped = clamp_spec(req.spec, self.resources.cfg, self.settings)
        episode = episode_for(req.domain, spec, self.resources.pool)
        try:
            await asyncio.wait_for(episode.open(), self.settings.open_timeout_s)
        except asyncio.TimeoutError:
            await episode.abandon()
            return dataclasses.replace(ok, error="sandbox_unavailable")
        except SandboxError:
            await episode.abandon()
            raise
        except Exception as exc:  # a spec the episode cannot be set up from (bad setup_files, ...)
            await episode.abandon()
            return dataclasses.replace(ok, error=f"bad_spec: {type(exc).__name__}: {exc}"[:2000])
        self.episodes[req.episode_id] = _Live(episode, time.monotonic())
        self.opened += 1
        return dataclasses.replace(ok, facts={"clamped": clamped} if clamped else {})

    async def _step(self, req: SandboxRequest, live: _Live) -> SandboxResult:
        observation = await live.episode.step(req.command)
        result = live.episode.last_result
        live.last_used = time.monotonic()
        return SandboxResult(
            episode_id=req.episode_id,
            step=req.step,
            observation=observation,
            exit_code=None if result is None else result.exit_code,
            timed_out=False if result is None else result.timed_out,
            error="" if result is not None else "max_turns",
        )

    async def _close(self, req: SandboxRequest, live: _Live) -> SandboxResult:
        del self.episodes[req.episode_id]
        facts = await live.episode.finish()
        self.closed += 1
        return SandboxResult(episode_id=req.episode_id, step=req.step, observation="", facts=facts)

    async def tick(self) -> None:
        now = time.monotonic()
        if now < self._next_idle_check:
            return
        self._next_idle_check = now + min(1.0, self.settings.idle_timeout_s / 4)
        idle = [eid for eid, live in self.episodes.items() if now - live.last_used > self.settings.idle_timeout_s]
        for episode_id in idle:
            async with self._locks.hold(episode_id):
                live = self.episodes.get(episode_id)
                if live is None or time.monotonic() - live.last_used <= self.settings.idle_timeout_s:
                    continue  # closed or used while we waited for the lock
                del self.episodes[episode_id]
                log.info("%s: closing episode %s, idle for %.0fs", self.name, episode_id, now - live.last_used)
                await live.episode.abandon()
                self.idle_closed += 1

    async def teardown(self) -> None:
        episodes, self.episodes = self.episodes, {}
        try:
            for live in episodes.values():
                await live.episode.abandon()
        finally:
            await super().teardown()

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(episodes=len(self.episodes), opened=self.opened, closed=self.closed,
                     idle_closed=self.idle_closed, replayed=self.replayed, unknown=self.unknown)
        return stats


# -- verification -----------------------------------------------------------------------------------


class VerifyActor(_SandboxActorBase):
    """Turns completions into outcomes: ``rollout.completions`` -> ``rollout.outcomes``."""

    role: ClassVar[str] = "sandbox.verify"
    topics: ClassVar[list[str]] = ["completions"]
    expect: ClassVar[tuple[str, ...]] = (Completion.SCHEMA,)

    def __init__(self, rt: Runtime, resources: SandboxResources, name: str | None = None) -> None:
        super().__init__(rt, resources, name)
        self.verified: collections.Counter[str] = collections.Counter()
        self.verifier_errors = 0
        self.episodes_lost = 0

    async def handle(self, record: Record) -> None:
        completion = record.message
        assert isinstance(completion, Completion)
        with tracing.tracer().start_as_current_span("verify", context=tracing.record_context(record),
                                                    kind=SpanKind.CONSUMER) as span:
            start = time.perf_counter()
            kind, facts, error = await self.verify(completion)
            self.verified[kind] += 1
            outcome = Outcome(completion=completion.to_body(), facts=facts, verifier=kind,
                              verify_s=time.perf_counter() - start, error=error)
            if span.is_recording():
                span.set_attributes({**tracing.record_attributes(record), "rollout.role": self.role,
                                     "rollout.sample_id": completion.sample_id, "rollout.task_id": completion.task_id,
                                     "rollout.domain": completion.domain, "rollout.verifier": kind,
                                     "rollout.error": error})
            self.emit(record, self.rt.names.outcomes, outcome, key=completion.task_id,
                      headers=tracing.trace_headers(span))

    async def verify(self, completion: Completion) -> tuple[str, Facts, str]:
        """(verifier kind, facts, error); never raises on bad model output or specs."""
        try:
            kind, verifier = pick_verifier(completion.domain, completion.spec)
        except ValueError as exc:
            self.verifier_errors += 1
            return "none", {"error": str(exc)}, str(exc)
        if kind == "terminal" and completion.finish_reason == SANDBOX_ERROR:
            # The episode lost its sandbox (a host died, the episode idled out, no reply in time) or
            # could not get one: nothing the model did. An error, so the reward actor leaves the
            # sample out of its group's statistics and the learner never trains on it; scored zero, a
            # lost sandbox would push the policy away from whatever the model was doing.
            self.episodes_lost += 1
            why = str(completion.episode_facts.get("error", "")) or "no reason given"
            return kind, dict(completion.episode_facts), f"episode lost its sandbox: {why}"[:2000]
        if kind == "terminal" and completion.episode_facts:
            return kind, dict(completion.episode_facts), ""  # judged when the episode closed
        spec, clamped = clamp_spec(completion.spec, self.resources.cfg, self.resources.settings)
        try:
            facts = await verifier(completion.text, spec, self.resources.pool)
            if not isinstance(facts, dict):  # a domain's own verifier broke its contract
                raise TypeError(f"verifier {kind!r} returned {type(facts).__name__}, not a dict of facts")
        except SandboxError as exc:
            raise StreamError(f"sandbox failure verifying {completion.sample_id}: {exc}") from exc
        except Exception as exc:  # hostile output or a malformed spec: a zero score, not a crash
            self.verifier_errors += 1
            error = f"{type(exc).__name__}: {exc}"
            log.info("%s: %s verifier failed on %s: %s", self.name, kind, completion.sample_id, error)
            return kind, failed_facts(kind, spec, error), error
        if clamped:
            facts["clamped"] = clamped
        return kind, facts, ""

    def statistics(self) -> dict[str, Any]:
        stats = super().statistics()
        stats.update(verified=dict(self.verified), verifier_errors=self.verifier_errors,
                     episodes_lost=self.episodes_lost)
        return stats


# -- wiring -----------------------------------------------------------------------------------------


def build_sandbox_actors(rt: Runtime, resources: SandboxResources | None = None) -> list[ActorSpec]:
    """The supervisor's specs of this process's episode actor and verify actor.

    Both share ``resources`` (one pool); see the module docstring for who starts and stops it. The
    episode actor drains after the inference actor when both run under one supervisor: multi-turn
    generations need their sandbox until they end, and a step waiting for a reply that a drained
    episode actor will never send would hold the inference actor's drain until its timeout.
    """
    shared = resources or SandboxResources(rt.cfg.sandbox)
    return [
        ActorSpec("sandbox.episodes", lambda: EpisodeActor(rt, shared), drain_after=("inference",)),
        ActorSpec("sandbox.verify", lambda: VerifyActor(rt, shared)),
    ]
