"""The retained tiers of copied-out keys and values (hot, int8, disk), below the local engine's KV store.

The slot store (``local/kvstore.py``) uses all three: when a sequence leaves the engine (finished,
aborted or retracted) the keys and values of its cached tokens are copied out of its row into an entry
of the hot tier. The paged store keeps retained prefixes in their pool blocks (``local/radix.py``) and
uses the int8 and disk tiers only, for what its tree evicts. Either way, the same prompt sent again, or the next turn
of a multi-turn episode (whose prompt extends the last turn's prompt + output), copies that prefix
back into its new cache instead of computing it: ``meta_info.cached_tokens`` reports how many.

Invariants:

- An entry holds exactly ``len(tokens)`` positions, computed under one weights *epoch*; the store
  bumps the epoch and clears the cache on every weight change, and :meth:`PrefixCache.lookup` ignores
  entries of another epoch, so no prefix computed under old weights is ever served.
- The cache holds at most ``max_tokens`` tokens in all (``max_tokens x bytes_per_token`` bytes);
  least recently used entries are evicted first. An entry that is a prefix of a newer one is dropped
  (the newer one answers every lookup it would); a new entry that is a prefix of a held one is not
  stored (the held one is refreshed instead).
- Lookups scan entries (a handful: the budget bounds them) for the longest common token prefix; the
  scan is linear in tokens compared, small next to the forward pass a hit saves.

A second, compressed tier (``int8_tokens`` > 0, off by default): an entry evicted from the hot tier is
quantised to int8 (one fp32 scale per position, head and K/V: symmetric, ``amax / 127`` over the head
dimension; about 1/4 of fp32's bytes, 1/2 of bf16's) and kept LRU within its own token budget; a lookup
whose best match is there dequantises it back into the serving dtype and promotes it to the hot tier.
Keys and values restored from int8 are close to, not equal to, the ones computed (the greedy-agreement
cost is measured by ``loadtests/long_context.py``); weight changes clear both tiers alike.

A third tier on disk (``disk_tokens`` > 0, below the int8 tier, off by default): an entry the int8 tier
evicts (least recently used) is written, still int8, to a file of its own in a private directory (made
under ``disk_dir``, or the system's temporary directory; removed by :meth:`PrefixCache.close`) and kept
LRU within its own token budget; a lookup whose best match is on disk reads it back into the int8 tier
(with a hot tier: into the hot tier, dequantised) and removes the file. A file that cannot be read is
dropped and the lookup falls back to the next best match. Weight changes delete the files.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

__all__ = ["PrefixCache", "PrefixCacheStatistics"]

log = logging.getLogger(__name__)


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
    int8_entries: int = 0
    int8_tokens: int = 0
    int8_bytes: int = 0
    int8_max_tokens: int = 0
    int8_hits: int = 0
    int8_hit_tokens: int = 0
    disk_entries: int = 0
    disk_tokens: int = 0
    disk_bytes: int = 0
    disk_max_tokens: int = 0
    disk_hits: int = 0
    disk_hit_tokens: int = 0


@dataclass
class _Entry:
    tokens: list[int]
    kv: torch.Tensor  # (layers, 2, kv_heads, len(tokens), head_dim)
    epoch: int


@dataclass
class _Int8Entry:
    tokens: list[int]
    q: torch.Tensor  # int8, the shape of the entry's kv
    scale: torch.Tensor  # fp32, (layers, 2, kv_heads, len(tokens), 1)
    dtype: torch.dtype
    epoch: int

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


@dataclass
class _DiskEntry:
    tokens: list[int]
    path: Path  # torch.save of {"q", "scale"} (an _Int8Entry's tensors)
    dtype: torch.dtype
    epoch: int
    nbytes: int


def quantize_int8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last (head) dimension: ``kv ~= q * scale``."""
    x = kv.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


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


def _longest(entries: "OrderedDict[int, _Entry] | OrderedDict[int, _Int8Entry] | OrderedDict[int, _DiskEntry]", tokens: list[int], limit: int,
             epoch: int, floor: int) -> tuple[int, int | None]:
    """The entry of ``epoch`` sharing the longest prefix with ``tokens`` (capped at ``limit``) beyond ``floor``."""
    best, best_id = floor, None
    for key, entry in entries.items():
        if entry.epoch != epoch:
            continue
        n = min(common_prefix(tokens, entry.tokens), limit)
        if n > best:
            best, best_id = n, key
    return best, best_id


_AnyEntry = TypeVar("_AnyEntry", "_Entry", "_Int8Entry", "_DiskEntry")


def _held(entries: "OrderedDict[int, _AnyEntry]", tokens: list[int], epoch: int,
          drop: Callable[[int], None]) -> bool:
    """Whether an entry of ``entries`` already holds ``tokens`` (as a prefix; refreshed if so).

    On the way, entries of another epoch and entries that ``tokens`` holds (it supersedes them) are dropped.
    """
    for key, entry in list(entries.items()):
        if entry.epoch != epoch:
            drop(key)
            continue
        shared = common_prefix(tokens, entry.tokens)
        if shared == len(tokens):  # already held inside a longer (or equal) entry
            entries.move_to_end(key)
            return True
        if shared == len(entry.tokens):  # the new entry supersedes this one
            drop(key)
    return False


class PrefixCache:
    """A token-prefix -> KV store bounded in tokens, LRU-evicted; see the module docstring."""

    def __init__(self, max_tokens: int, bytes_per_token: int, *, min_tokens: int = 2, int8_tokens: int = 0,
                 int8_only: bool = False, disk_tokens: int = 0, disk_dir: str | Path | None = None) -> None:
        """``int8_only``: no hot tier (``max_tokens`` 0); the paged store's prefix tree feeds the int8 tier
        through :meth:`store_int8` and a hit leaves it (the sequence's blocks go back to the tree).
        ``disk_tokens``: the disk tier's budget below the int8 tier (0: none), in ``disk_dir``."""
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens must be >= 0, got {max_tokens}")
        if int8_tokens < 0:
            raise ValueError(f"prefix cache int8_tokens must be >= 0 (0: no int8 tier), got {int8_tokens}")
        if disk_tokens < 0:
            raise ValueError(f"prefix cache disk_tokens must be >= 0 (0: no disk tier), got {disk_tokens}")
        self.max_tokens = max_tokens
        if int8_only and max_tokens:
            raise ValueError("an int8-only prefix cache has no hot tier: max_tokens must be 0")
        self.int8_max_tokens = int8_tokens if (max_tokens > 0 or int8_only) else 0
        self._cold: OrderedDict[int, _Int8Entry] = OrderedDict()
        self._cold_tokens = 0
        self._cold_hits = self._cold_hit_tokens = 0
        self.disk_max_tokens = disk_tokens if self.int8_max_tokens > 0 else 0
        self._disk: OrderedDict[int, _DiskEntry] = OrderedDict()
        self._disk_tokens = self._disk_bytes = 0
        self._disk_hits = self._disk_hit_tokens = 0
        self.disk_dir: Path | None = None
        if self.disk_max_tokens:
            if disk_dir is not None and not Path(disk_dir).is_dir():
                raise ValueError(f"prefix cache disk_dir {str(disk_dir)!r} is not a directory")
            self.disk_dir = Path(tempfile.mkdtemp(prefix="rollout-kv-", dir=disk_dir))
        self.bytes_per_token = bytes_per_token
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._tokens = 0
        self._lookups = self._hits = self._hit_tokens = self._evicted = self._flushes = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def lookup(self, tokens: list[int], limit: int, epoch: int, *, floor: int = 0) -> tuple[int, torch.Tensor | None]:
        """The longest cached prefix of ``tokens`` (at most ``limit``, more than ``floor`` long) of ``epoch``: ``(n, kv)``.

        ``kv`` holds at least ``n`` positions (slice it); ``(0, None)`` on a miss. A hit counts in the
        statistics only once the caller uses it (:meth:`record_hit`).
        """
        if not (self._entries or self._cold or self._disk) or limit < 1:
            return 0, None
        self._lookups += 1
        best, best_id = _longest(self._entries, tokens, limit, epoch, floor)
        cold_best, cold_id = _longest(self._cold, tokens, limit, epoch, best)
        while self._disk:
            disk_best, disk_id = _longest(self._disk, tokens, limit, epoch, max(best, cold_best))
            if disk_id is None or disk_best < self.min_tokens:
                break
            kv = self._load_disk(disk_id, disk_best)
            if kv is not None:
                return disk_best, kv
        if cold_id is not None and cold_best >= self.min_tokens:
            return cold_best, self._promote(cold_id, cold_best)
        if best_id is None or best < self.min_tokens:
            return 0, None
        self._entries.move_to_end(best_id)
        return best, self._entries[best_id].kv

    def _promote(self, key: int, used: int) -> torch.Tensor:
        """Dequantise an int8 entry; its kv. With a hot tier the entry moves there; without one (int8-only, below
        the paged store's tree) it stays, refreshed: the hit may use only a prefix of it, and the rest must not
        be lost."""
        cold = self._cold[key]
        self._cold_hits += 1
        self._cold_hit_tokens += used
        kv = dequantize_int8(cold.q, cold.scale, cold.dtype)
        if self.max_tokens > 0:
            self._drop_cold(key)
            self._store_hot(cold.tokens, kv, cold.epoch)
        else:
            self._cold.move_to_end(key)
        return kv

    def _load_disk(self, key: int, used: int) -> torch.Tensor | None:
        """Read a disk entry back (into the hot tier, dequantised, or the int8 tier); its kv, or None if
        its file cannot be read (the entry is dropped)."""
        entry = self._disk[key]
        try:
            saved = torch.load(entry.path, weights_only=True)
            q, scale = saved["q"], saved["scale"]
        except Exception as exc:  # a file gone or damaged: a miss, never a wrong answer
            log.warning("prefix cache: dropping disk entry %s: %r", entry.path, exc)
            self._drop_disk(key)
            return None
        self._drop_disk(key)
        self._disk_hits += 1
        self._disk_hit_tokens += used
        kv = dequantize_int8(q, scale, entry.dtype)
        if self.max_tokens > 0:
            self._store_hot(entry.tokens, kv, entry.epoch)
        else:
            self._store_cold_q(self._next_id, entry.tokens, q, scale, entry.dtype, entry.epoch)
            self._next_id += 1
        return kv

    def record_hit(self, tokens: int) -> None:
        """A lookup's prefix was copied into a sequence: ``tokens`` not computed."""
        self._hits += 1
        self._hit_tokens += tokens

    def insert(self, tokens: list[int], export: Callable[[int], torch.Tensor], epoch: int) -> bool:
        """Keep the KV of ``tokens`` (``export(n)`` copies it out); False when not stored."""
        n = len(tokens)
        if n < self.min_tokens or n > self.max_tokens:
            return False
        if _held(self._entries, tokens, epoch, self._drop):
            return False
        for key, cold in list(self._cold.items()):  # the int8 copies this entry supersedes or contains
            if cold.epoch != epoch or common_prefix(tokens, cold.tokens) == len(cold.tokens):
                self._drop_cold(key)
        self._store_hot(list(tokens), export(n), epoch)
        return True

    def _store_hot(self, tokens: list[int], kv: torch.Tensor, epoch: int) -> None:
        n = len(tokens)
        while self._entries and self._tokens + n > self.max_tokens:
            key = next(iter(self._entries))
            self._evicted += len(self._entries[key].tokens)
            self._demote(key)
        self._entries[self._next_id] = _Entry(tokens, kv, epoch)
        self._next_id += 1
        self._tokens += n

    def _demote(self, key: int) -> None:
        """Evict a hot entry: into the int8 tier when it has one (and the entry fits), else dropped."""
        entry = self._entries[key]
        self._drop(key)
        self._store_cold(key, entry.tokens, entry.kv, entry.epoch)

    def store_int8(self, tokens: list[int], export: Callable[[int], torch.Tensor], epoch: int) -> bool:
        """Keep ``tokens``' KV (``export(n)`` copies it out) in the int8 tier; False when not stored.

        Not stored when an int8 entry already holds it (as a prefix); entries it holds are dropped.
        """
        n = len(tokens)
        if n < self.min_tokens or n > self.int8_max_tokens:
            return False
        if _held(self._cold, tokens, epoch, self._drop_cold):
            return False
        self._store_cold(self._next_id, list(tokens), export(n), epoch)
        self._next_id += 1
        return True

    def _store_cold(self, key: int, tokens: list[int], kv: torch.Tensor, epoch: int) -> None:
        if len(tokens) <= self.int8_max_tokens:
            q, scale = quantize_int8(kv)
            self._store_cold_q(key, tokens, q, scale, kv.dtype, epoch)

    def _store_cold_q(self, key: int, tokens: list[int], q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      epoch: int) -> None:
        n = len(tokens)
        if n > self.int8_max_tokens:
            return
        while self._cold and self._cold_tokens + n > self.int8_max_tokens:
            self._spill(next(iter(self._cold)))
        self._cold[key] = _Int8Entry(tokens, q, scale, dtype, epoch)
        self._cold_tokens += n

    def _drop_cold(self, key: int) -> None:
        cold = self._cold.pop(key)
        self._cold_tokens -= len(cold.tokens)

    def _spill(self, key: int) -> None:
        """The int8 tier evicts an entry: onto disk when there is a disk tier (and the entry fits)."""
        cold = self._cold[key]
        self._drop_cold(key)
        n = len(cold.tokens)
        if self.disk_dir is None or n > self.disk_max_tokens or _held(self._disk, cold.tokens, cold.epoch, self._drop_disk):
            return
        while self._disk and self._disk_tokens + n > self.disk_max_tokens:
            self._drop_disk(next(iter(self._disk)))
        path = self.disk_dir / f"{key}.pt"
        try:
            torch.save({"q": cold.q, "scale": cold.scale}, path)
        except OSError as exc:  # a full or failing disk: the entry is only lost, as without the tier
            log.warning("prefix cache: could not write %s: %r", path, exc)
            path.unlink(missing_ok=True)
            return
        self._disk[key] = _DiskEntry(cold.tokens, path, cold.dtype, cold.epoch, cold.nbytes)
        self._disk_tokens += n
        self._disk_bytes += cold.nbytes

    def _drop_disk(self, key: int) -> None:
        entry = self._disk.pop(key)
        self._disk_tokens -= len(entry.tokens)
        self._disk_bytes -= entry.nbytes
        entry.path.unlink(missing_ok=True)

    def clear(self) -> int:
        """Free every entry (deleting the disk tier's files); returns how many tokens were held."""
        held = self._tokens + self._cold_tokens + self._disk_tokens
        self._entries.clear()
        self._cold.clear()
        for key in list(self._disk):
            self._drop_disk(key)
        self._tokens = self._cold_tokens = 0
        self._flushes += 1
        return held

    def close(self) -> None:
        """Free everything and remove the disk tier's directory (idempotent)."""
        self.clear()
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)

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
            int8_entries=len(self._cold),
            int8_tokens=self._cold_tokens,
            int8_bytes=sum(c.nbytes for c in self._cold.values()),
            int8_max_tokens=self.int8_max_tokens,
            int8_hits=self._cold_hits,
            int8_hit_tokens=self._cold_hit_tokens,
            disk_entries=len(self._disk),
            disk_tokens=self._disk_tokens,
            disk_bytes=self._disk_bytes,
            disk_max_tokens=self.disk_max_tokens,
            disk_hits=self._disk_hits,
            disk_hit_tokens=self._disk_hit_tokens,
        )
