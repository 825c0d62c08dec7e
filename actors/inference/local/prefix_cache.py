"""The local engine's retained prefix cache: keys and values of finished sequences, kept for reuse.

When a sequence leaves the engine (finished, aborted or retracted) the keys and values of its cached
tokens are copied out of its slot into an entry here, so the same prompt sent again, or the next turn
of a multi-turn episode (whose prompt extends the last turn's prompt + output), copies that prefix
back into its new slot instead of computing it: ``meta_info.cached_tokens`` reports how many.

Invariants:

- An entry holds exactly ``len(tokens)`` positions, computed under one weights *epoch*; the engine
  bumps the epoch and clears the cache on every weight change, and :meth:`PrefixCache.lookup` ignores
  entries of another epoch, so no prefix computed under old weights is ever served.
- The cache holds at most ``max_tokens`` tokens in all (``max_tokens x bytes_per_token`` bytes);
  least recently used entries are evicted first. An entry that is a prefix of a newer one is dropped
  (the newer one answers every lookup it would); a new entry that is a prefix of a held one is not
  stored (the held one is refreshed instead).
- Lookups scan entries (a handful: the budget bounds them) for the longest common token prefix; the
  scan is linear in tokens compared, small next to the forward pass a hit saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "PrefixCacheStatistics"]


@dataclass(frozen=True)
class PrefixCacheStatistics:
    """An immutable snapshot of the prefix cache's counters."""

    entries: int
    tokens: int
    bytes: int
    max_tokens: int
    lookups: int
    hits: int
    hit_tokens: int
    evicted_tokens: int
    flushes: int


@dataclass
class _Entry:
    tokens: list[int]
    kv: torch.Tensor  # (layers, 2, kv_heads, len(tokens), head_dim)
    epoch: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:  # C-speed comparison for the common full-match case
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not: bisect on slice equality
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """A token-prefix -> KV store bounded in tokens, LRU-evicted; see the module docstring."""

    def __init__(self, max_tokens: int, bytes_per_token: int, *, min_tokens: int = 2) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.bytes_per_token = bytes_per_token
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._tokens = 0
        self._lookups = self._hits = self._hit_tokens = self._evicted = self._flushes = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def lookup(self, tokens: list[int], limit: int, epoch: int) -> tuple[int, torch.Tensor | None]:
        """The longest cached prefix of ``tokens`` (at most ``limit`` long) of this ``epoch``: ``(n, kv)``.

        ``kv`` holds at least ``n`` positions (slice it); ``(0, None)`` on a miss. A hit counts in the
        statistics only once the caller uses it (:meth:`record_hit`).
        """
        if not self._entries or limit < 1:
            return 0, None
        self._lookups += 1
        best, best_id = 0, None
        for key, entry in self._entries.items():
            if entry.epoch != epoch:
                continue
            n = min(common_prefix(tokens, entry.tokens), limit)
            if n > best:
                best, best_id = n, key
        if best_id is None or best < self.min_tokens:
            return 0, None
        self._entries.move_to_end(best_id)
        return best, self._entries[best_id].kv

    def record_hit(self, tokens: int) -> None:
        """A lookup's prefix was copied into a sequence: ``tokens`` not computed."""
        self._hits += 1
        self._hit_tokens += tokens

    def insert(self, tokens: list[int], export: Callable[[int], torch.Tensor], epoch: int) -> bool:
        """Keep the KV of ``tokens`` (``export(n)`` copies it out); False when not stored."""
        n = len(tokens)
        if n < self.min_tokens or n > self.max_tokens:
            return False
        for key, entry in list(self._entries.items()):
            if entry.epoch != epoch:
                self._drop(key)
                continue
            shared = common_prefix(tokens, entry.tokens)
            if shared == n:  # already held inside a longer (or equal) entry
                self._entries.move_to_end(key)
                return False
            if shared == len(entry.tokens):  # the new entry supersedes this one
                self._drop(key)
        while self._entries and self._tokens + n > self.max_tokens:
            key = next(iter(self._entries))
            self._evicted += len(self._entries[key].tokens)
            self._drop(key)
        self._entries[self._next_id] = _Entry(list(tokens), export(n), epoch)
        self._next_id += 1
        self._tokens += n
        return True

    def clear(self) -> int:
        """Free every entry; returns how many tokens were held."""
        held = self._tokens
        self._entries.clear()
        self._tokens = 0
        self._flushes += 1
        return held

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tokens -= len(entry.tokens)

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            entries=len(self._entries),
            tokens=self._tokens,
            bytes=sum(e.kv.numel() * e.kv.element_size() for e in self._entries.values()),
            max_tokens=self.max_tokens,
            lookups=self._lookups,
            hits=self._hits,
            hit_tokens=self._hit_tokens,
            evicted_tokens=self._evicted,
            flushes=self._flushes,
        )
