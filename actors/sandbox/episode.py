"""Multi-turn episodes: open / step / close requests against one leased sandbox per episode."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from opentelemetry import trace

from domains import DOMAINS, Episode
from actors.runtime import Runtime
from actors.sandbox.resources import SandboxResources, _SandboxActorBase
from actors.sandbox.settings import clamp_spec
from engine.schemas import EPISODES_FULL, SandboxRequest, SandboxResult
from sandboxes import SandboxError
from streams.protocols import EventRecord, TransportError

log = logging.getLogger("rollout.actors.sandbox")

EPISODE_UNKNOWN = "episode_unknown"


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
    episode: Episode
    last_used: float
    attempt: str = ""
    """The ``SandboxRequest.attempt`` that opened it: requests of any other attempt never reach it."""


_ReplyKey = tuple[str, str, int, str]
"""(episode_id, attempt, step, action): what a reply is remembered by for re-delivered requests."""


class EpisodeActor(_SandboxActorBase):
    """Runs multi-turn episodes: ``rollout.sandbox.requests`` -> ``rollout.sandbox.results``."""

    role: ClassVar[str] = "sandbox.episodes"
    topics: ClassVar[list[str]] = ["sandbox.requests"]
    expect: ClassVar[tuple[str, ...]] = (SandboxRequest.SCHEMA,)
    span_name: ClassVar[str | None] = "sandbox.step"  # the runtime's span around handle (actors/runtime.py)

    def __init__(self, rt: Runtime, resources: SandboxResources, name: str | None = None) -> None:
        super().__init__(rt, resources, name)
        self.settings = resources.settings
        self.episodes: dict[str, _Live] = {}
        self._locks = _KeyedLocks()
        self._replies: collections.OrderedDict[_ReplyKey, SandboxResult] = collections.OrderedDict()
        # (episode_id, attempt) of episodes that ended here: a re-delivered open of one must not open it again
        self._ended: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._next_idle_check = 0.0
        self.opened = self.closed = self.idle_closed = self.replayed = self.unknown = self.superseded = 0

    async def handle(self, record: EventRecord) -> None:
        req = record.message
        assert isinstance(req, SandboxRequest)
        partitions = self.rt.partitions("sandbox.results")
        if req.reply_partition >= partitions:
            raise ValueError(f"reply_partition {req.reply_partition} >= {partitions} partitions of sandbox.results")
        key = (req.episode_id, req.attempt, req.step, req.action)
        async with self._locks.hold(req.episode_id):
            reply = self._replies.get(key)
            replayed = reply is not None
            if reply is not None:
                self.replayed += 1
            else:
                reply = dataclasses.replace(await self._answer(req), attempt=req.attempt)
                if not reply.error or reply.error == EPISODE_UNKNOWN:
                    self._remember(key, reply)
        span = trace.get_current_span()  # the runtime's "sandbox.step" span (span_name)
        if span.is_recording():
            span.set_attributes({"rollout.episode_id": req.episode_id, "rollout.step": req.step,
                                 "rollout.action": req.action, "rollout.domain": req.domain,
                                 "rollout.attempt": req.attempt,
                                 "rollout.replayed": replayed, "rollout.error": reply.error,
                                 "rollout.timed_out": reply.timed_out})
            if reply.exit_code is not None:
                span.set_attribute("rollout.exit_code", reply.exit_code)
        # emit parents the reply under this span (the runtime's traceparent for the handled record)
        self.emit(record, self.rt.names.sandbox_results, reply, key=req.episode_id, partition=req.reply_partition)

    def _remember(self, key: _ReplyKey, reply: SandboxResult) -> None:
        self._replies[key] = reply
        while len(self._replies) > self.settings.reply_cache:
            self._replies.popitem(last=False)

    def _end(self, episode_id: str) -> _Live:
        """Take an episode out of the live ones; its attempt can never be opened here again."""
        live = self.episodes.pop(episode_id)
        self._ended[(episode_id, live.attempt)] = None
        while len(self._ended) > self.settings.reply_cache:
            self._ended.popitem(last=False)
        return live

    async def _answer(self, req: SandboxRequest) -> SandboxResult:
        try:
            if req.action == "open":
                return await self._open(req)
            live = self.episodes.get(req.episode_id)
            if live is None or live.attempt != req.attempt:  # not held here, or held for another attempt
                self.unknown += 1
                return SandboxResult(episode_id=req.episode_id, step=req.step, observation="", error=EPISODE_UNKNOWN)
            live.last_used = time.monotonic()
            if req.action == "step":
                return await self._step(req, live)
            return await self._close(req, live)
        except SandboxError as exc:
            raise TransportError(f"sandbox failure in episode {req.episode_id}: {exc}") from exc

    async def _open(self, req: SandboxRequest) -> SandboxResult:
        ok = SandboxResult(episode_id=req.episode_id, step=req.step, observation="")
        if req.attempt and (req.episode_id, req.attempt) in self._ended:  # a re-delivered open of an ended attempt
            self.unknown += 1
            return dataclasses.replace(ok, error=EPISODE_UNKNOWN)
        held = self.episodes.get(req.episode_id)
        if held is not None and held.attempt == req.attempt:  # a re-delivered open whose reply fell out of the cache
            return ok
        if held is not None:
            # The group was generated again (its inference actor died): this attempt starts pristine, and the
            # old attempt's sandbox goes back to the pool now instead of after the idle timeout.
            self._end(req.episode_id)
            self.superseded += 1
            log.info("%s: episode %s attempt %r supersedes attempt %r; releasing its sandbox", self.name,
                     req.episode_id, req.attempt, held.attempt)
            await held.episode.abandon()
        if len(self.episodes) >= self.resources.max_episodes:
            return dataclasses.replace(ok, error=EPISODES_FULL)
        spec, clamped = clamp_spec(req.spec, self.resources.cfg, self.settings)
        domain = DOMAINS.get(req.domain)
        if domain is None or not domain.multi_turn:
            return dataclasses.replace(ok, error=f"bad_spec: domain {req.domain!r} has no multi-turn episodes here")
        episode = domain.new_episode(spec, self.resources.pool)
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
        self.episodes[req.episode_id] = _Live(episode, time.monotonic(), req.attempt)
        self.opened += 1
        return dataclasses.replace(ok, facts={"clamped": clamped} if clamped else {})

    async def _step(self, req: SandboxRequest, live: _Live) -> SandboxResult:
        answer = await live.episode.step(req.command)
        result = getattr(live.episode, "last_result", None)  # the step's ExecResult; None: the episode is over
        live.last_used = time.monotonic()
        # a tools episode answers with its messages (handed back whole, as tool turns); a shell one with text
        messages = answer if isinstance(answer, list) else []
        return SandboxResult(
            episode_id=req.episode_id,
            step=req.step,
            observation=answer if isinstance(answer, str) else "\n\n".join(str(m.get("content") or "") for m in answer),
            messages=messages,
            exit_code=None if result is None else result.exit_code,
            timed_out=False if result is None else result.timed_out,
            error="" if result is not None else "max_turns",
        )

    async def _close(self, req: SandboxRequest, live: _Live) -> SandboxResult:
        self._end(req.episode_id)
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
                self._end(episode_id)
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
                     idle_closed=self.idle_closed, replayed=self.replayed, unknown=self.unknown,
                     superseded=self.superseded)
        return stats


# -- verification -----------------------------------------------------------------------------------
