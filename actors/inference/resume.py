"""Taking over a generation another inference actor was cut off in: what ``rollout.tokens`` already holds.

Every generation streams its model tokens to ``rollout.tokens`` (key sample_id) as ``TokenChunk`` records
``seq`` 0, 1, 2, ... . When an inference actor dies mid-task, its task record was never acknowledged, so
the task comes again to whichever actor owns the partition next; the chunks the broker had acknowledged
are still on the topic. That actor reads them back (:class:`Frontiers`) and continues each sample from its
frontier, the tokens, logprobs and per-token versions as they were, instead of generating them again:

- a sample whose chunks end with a ``done`` one finished: it is rebuilt whole, nothing generated;
- a sample with chunks but no ``done`` is continued from ``prompt + its tokens``, with the budget left,
  its new chunks numbered on from the last one (so the stream of a sample stays one sequence);
- a sample with nothing on the topic is generated from scratch.

Within a sample the chunks are in production order (one key, one partition). A chunk with ``seq`` 0 starts
a generation again (an older actor that started from scratch): the frontier is rebuilt from it. A chunk
whose ``seq`` is not the next one is ignored, so the frontier is always one unbroken run. A retried chunk
(the same tokens at a ``seq`` already read) is harmless; anything else is a broken stream and is said
(``Frontier.broken``; the actor logs it and counts ``stream_breaks``): a gap or an out-of-order chunk (a
``seq`` past the next one), a chunk that disagrees with the one already read at its ``seq`` (two owners
racing), a chunk after the ``done`` one, or chunks whose ``seq`` 0 is not in the read. The sample is then
continued from the unbroken run before the break, and what came after it is generated again: never a
resume from a stream with a hole in it.

Only records that may have been worked on before this actor took over are looked up: those timestamped
before it owned their partition, that is before it started or, for a partition a rebalance moved to it
from another member (dead, or alive and scaled in), before that rebalance (``EventRecord.owned_since_ms``);
a record produced later was delivered to nobody else first. The read starts at ``max(record's timestamp,
takeover - window) - clock skew`` and is shared by every record it covers; a read made before a partition
was taken over lacks what its last owner streamed since, so that partition's records read again. Multi-turn
episodes are not continued (their sandbox state is gone with the episode's attempt): they start again in a
fresh sandbox, as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from engine.schemas import TokenChunk
from streams.protocols import EventLog

CLOCK_SKEW_MS = 60_000
"""Margin for producers' clocks (a record's timestamp is its producer's): the read starts this much earlier."""


@dataclasses.dataclass
class Frontier:
    """One sample's model tokens on ``rollout.tokens``: its chunks ``0 .. n - 1``, unbroken, as read (numpy
    arrays, not Python lists: a reader holds a whole window of the fleet's chunks)."""

    parts: list[TokenChunk] = dataclasses.field(default_factory=list)
    broken: str = ""
    """What broke the stream after the unbroken run (empty for a sound stream)."""
    ignored: int = 0
    """Chunks not taken: the one that broke the stream and every one after it."""

    @property
    def chunks(self) -> int:
        return len(self.parts)

    @property
    def finish_reason(self) -> str:
        """Why the generation ended, when its last chunk was ``done``; empty while it was still going."""
        last = self.parts[-1] if self.parts else None
        return (last.finish_reason or "stop") if last is not None and last.done else ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def add(self, chunk: TokenChunk) -> None:
        self.parts.append(chunk)

    def tokens(self) -> tuple[list[int], list[float], list[int]]:
        """The ids, behaviour logprobs and per-token versions, in order."""
        ids = [int(t) for c in self.parts for t in c.token_ids]
        lps = [float(x) for c in self.parts for x in c.logprobs]
        return ids, lps, [v for c in self.parts for v in c.versions()]


def _break(front: Frontier, chunk: TokenChunk) -> str:
    """Why ``chunk`` does not extend ``front``; empty for a retry of a chunk already read (the same tokens)."""
    if chunk.seq < front.chunks and np.array_equal(front.parts[chunk.seq].token_ids, chunk.token_ids):
        return ""
    if front.finished:
        return f"chunk {chunk.seq} after the done chunk {front.chunks - 1}"
    if chunk.seq > front.chunks:
        return f"chunk {chunk.seq} where {front.chunks} was next (a gap, or out of order)"
    return f"chunk {chunk.seq} disagrees with the chunk {chunk.seq} already read (two producers)"


def frontiers(chunks: Iterable[TokenChunk]) -> dict[str, Frontier]:
    """Each sample's frontier from its chunks in production order (see the module docstring). At the first
    break a frontier stops growing: it keeps the unbroken run before it (possibly none) and says why."""
    out: dict[str, Frontier] = {}
    for chunk in chunks:
        if chunk.seq == 0:
            out[chunk.sample_id] = Frontier()
        front = out.get(chunk.sample_id)
        if front is None:
            out[chunk.sample_id] = Frontier(broken=f"chunk {chunk.seq} with no chunk 0 before it in the read",
                                            ignored=1)
        elif front.broken:
            front.ignored += 1
        elif chunk.seq == front.chunks and not front.finished:
            front.add(chunk)
        elif why := _break(front, chunk):
            front.broken, front.ignored = why, 1
    return {sid: f for sid, f in out.items() if f.chunks or f.broken}


class Frontiers:
    """The frontiers an inference actor may take over, read from ``rollout.tokens`` once and shared."""

    def __init__(self, log: EventLog, topic: str, *, window_s: float, started_ms: int | None = None) -> None:
        self.log = log
        self.topic = topic
        self.window_ms = int(window_s * 1000)
        self.started_ms = started_ms if started_ms is not None else time.time_ns() // 1_000_000
        self._known: dict[str, Frontier] = {}
        self._read_from_ms: int | None = None
        self._read_at: float | None = None
        self._read_wall_ms: int | None = None
        self.reads = 0

    def _takeover_ms(self, owned_since_ms: int) -> int:
        return max(self.started_ms, owned_since_ms)

    def may_have_frontiers(self, record_ms: int, owned_since_ms: int = 0) -> bool:
        """Whether a record with this timestamp, on a partition this actor owns since ``owned_since_ms``,
        may have been worked on by an actor before this one."""
        return self.window_ms > 0 and record_ms < self._takeover_ms(owned_since_ms)

    async def take(self, record_ms: int, sample_ids: list[str], owned_since_ms: int = 0) -> dict[str, Frontier]:
        """The frontiers of ``sample_ids`` (those with any), given away: a later call does not see them again."""
        takeover = self._takeover_ms(owned_since_ms)
        since = max(record_ms, takeover - self.window_ms) - CLOCK_SKEW_MS
        now = time.monotonic()
        if self._read_at is not None and now - self._read_at > self.window_ms / 1000:
            self._known, self._read_from_ms = {}, None  # a window's worth of the fleet's chunks: not kept forever
        stale = self._read_wall_ms is not None and self._read_wall_ms < takeover  # read before the partition came
        if self._read_from_ms is None or since < self._read_from_ms or stale:
            self._read_at, self._read_wall_ms = now, time.time_ns() // 1_000_000
            found = await self.log.read_since(self.topic, {}, expect=(TokenChunk.SCHEMA,), since_ms=since)
            found.sort(key=lambda r: (r[0], r[1]))
            self._known = frontiers(m for _, _, m in found if isinstance(m, TokenChunk))
            self._read_from_ms = since
            self.reads += 1
        return {sid: self._known.pop(sid) for sid in sample_ids if sid in self._known}
