"""Commit-after-processing bookkeeping: which offset of each partition is safe to commit.

Records of one partition may finish out of order (handlers run concurrently). The committable
offset of a partition is the lowest offset still in flight, or one past the highest offset seen
when none is in flight: committing it never skips an unfinished record (Kafka's committed offset
is the next record to read).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class OffsetTracker(Generic[K]):
    """Per-partition in-flight offsets; pure logic, no Kafka. ``K`` names a partition (e.g. (topic, index))."""

    def __init__(self) -> None:
        self._inflight: dict[K, list[int]] = {}
        self._done: dict[K, set[int]] = {}
        self._next: dict[K, int] = {}
        self._committed: dict[K, int] = {}

    def start(self, partition: K, offset: int) -> None:
        """A record was handed to a handler."""
        heapq.heappush(self._inflight.setdefault(partition, []), offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def finish(self, partition: K, offset: int) -> None:
        """The record's effects are acknowledged; its offset may be committed."""
        heap = self._inflight.get(partition)
        if heap is None:
            return  # partition was revoked meanwhile: someone else will reprocess it
        self._done.setdefault(partition, set()).add(offset)
        done = self._done[partition]
        while heap and heap[0] in done:
            done.discard(heapq.heappop(heap))

    def committable(self) -> dict[K, int]:
        """Partition -> offset to commit, for partitions that advanced since the last commit."""
        out: dict[K, int] = {}
        for p, nxt in self._next.items():
            heap = self._inflight.get(p)
            safe = heap[0] if heap else nxt
            if safe > self._committed.get(p, -1):
                out[p] = safe
        return out

    def mark_committed(self, offsets: Mapping[K, int]) -> None:
        for p, off in offsets.items():
            self._committed[p] = max(self._committed.get(p, -1), off)

    def revoke(self, partitions: Iterable[K]) -> None:
        """Forget partitions taken away by a rebalance."""
        for p in partitions:
            self._inflight.pop(p, None)
            self._done.pop(p, None)
            self._next.pop(p, None)
            self._committed.pop(p, None)

    def in_flight(self) -> int:
        return sum(len(h) for h in self._inflight.values())
