"""The local engine's KV stores: one interface over where keys and values live and how prefixes are reused.

The engine schedules sequences; a :class:`KVStore` answers every question about their caches, so the
engine never asks which store it has. The layers, each a module with one job:

- the **runner** (``local/runner.py``): the forward pass, and the keys and values themselves (a pool of
  blocks addressed through block tables, or one row per sequence); the paged runner's pool of blocks and
  their reference counts (``local/blockpool.py``) and its block tables (``local/blocktable.py``: which
  blocks each sequence holds, a window's released ones, what another sequence may share);
- the **store** (this module): admission (will a request's worst case fit), sharing a prefix with a
  running sequence, retaining a leaving sequence's prefix and finding it again, a sliding window's
  released blocks, the statistics;
- the **retained tiers** below it: the radix tree over pool blocks (``local/radix.py``, paged store) or
  the hot tier of copied tensors (``local/prefix_cache.py``, slot store), then int8 and disk
  (``local/prefix_cache.py``, both stores).

:class:`PagedStore` is the default (``kv_cache = "paged"``): block tables into one bounded pool,
admission control, a GRPO group's common prompt shared by reference. :class:`SlotStore`
(``kv_cache = "slot"``) gives each sequence a row and copies prefixes; it is kept as the simpler oracle
the tests compare the paged store against, and for models the paged gather does not suit.

The store keeps the weights *epoch* (:meth:`KVStore.invalidate` bumps it on every weight change): KV
computed under another epoch is never reused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from typing import Any, Protocol

from transformers import PreTrainedModel

from modelserver.local.prefix_cache import PrefixCache
from modelserver.local.protocol import BadRequest, SamplingParams
from modelserver.local.radix import BlockRadix
from modelserver.local.runner import KV_CACHES, PagedRunner, Runner, SlotRunner, build_runner

__all__ = ["KVHolder", "KVStore", "PagedStore", "SlotStore", "build_store"]


class KVHolder(Protocol):
    """What a store reads and updates of a sequence (the engine's ``Sequence``)."""

    prompt_ids: list[int]
    params: SamplingParams
    kv_id: int | None
    cached: int
    cached_tokens: int


class KVStore(ABC):
    """Where a running sequence's keys and values live, and how computed prefixes are reused."""

    kind: str
    runner: Runner
    """The forward pass over this store's keys and values (``local/runner.py``)."""
    cold: PrefixCache
    """The retained tiers of copied tensors (hot, int8, disk; the paged store uses int8 and disk only)."""

    def __init__(self, context_length: int, chunk_size: int) -> None:
        self.context_length = context_length
        self.chunk_size = chunk_size
        self.shared_tokens = 0
        """Prompt tokens taken from running sequences (a group's samples) instead of computed."""
        self.epoch = 0
        """Bumped by every weight change: KV computed under another epoch is never reused."""
        self.blocked = 0
        """Requests the last admission left queued for want of memory (the engine sets it every step)."""

    # -- requests and admission ------------------------------------------------------------------
    def check_request(self, prompt: int, max_new_tokens: int) -> None:
        """Raise :class:`BadRequest` when a request could never be served by this store."""

    def credit(self, source_kv: int | None, n: int) -> int:
        """What a waiting sequence saves by taking the first ``n`` positions of the running ``source_kv``
        (admission counts it; the caller shares them at once when admitted): 0 unless the store shares."""
        return 0

    def admit(self, seq: KVHolder, running: Seq[KVHolder], credit: int) -> bool:
        """Whether ``seq`` may start now, given the sequences running (False: it waits in the queue)."""
        return True

    def can_share(self, source_kv: int, n: int) -> bool:
        """Whether a sequence may take the first ``n`` positions of ``source_kv`` and go on from there."""
        return True

    def after_step(self, running: Seq[KVHolder]) -> None:
        """Between steps: give back what no later query reads (a sliding window's old blocks)."""

    # -- prefixes ----------------------------------------------------------------------------------
    @abstractmethod
    def share(self, seq: KVHolder, best: int, source: KVHolder | None, *, restore: bool = True) -> None:
        """Give ``seq`` the longest prefix of its prompt (short of its last token) that the retained tiers
        or ``source`` (a running sequence holding ``best`` of its positions) hold; update ``seq.cached``.
        ``restore=False``: nothing that takes new memory (the int8 and disk tiers)."""

    @abstractmethod
    def retain(self, tokens: list[int], kv_id: int, cached: int) -> None:
        """Keep a leaving sequence's computed prefix (``tokens[:cached]``) for reuse."""

    def clear(self) -> None:
        """Drop every retained prefix (``/flush_cache``)."""
        self.cold.clear()

    def invalidate(self) -> None:
        """The weights changed in place: drop every retained prefix and bump the epoch."""
        self.epoch += 1
        self.clear()

    def close(self) -> None:
        self.cold.close()

    # -- statistics --------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """The ``EngineStatistics`` fields this store owns."""
        cache = self.cold.statistics()
        return dict(
            kv_cache=self.kind,
            kv_bytes_per_token=self.runner.bytes_per_token(),
            kv_slot_bytes=self.runner.cache_bytes(),
            shared_prefix_tokens=self.shared_tokens,
            prefix_cache_tokens=cache.tokens,
            prefix_cache_bytes=cache.bytes,
            prefix_cache_max_tokens=cache.max_tokens,
            prefix_cache_lookups=cache.lookups,
            prefix_cache_hits=cache.hits,
            prefix_cache_hit_tokens=cache.hit_tokens,
            prefix_cache_evicted_tokens=cache.evicted_tokens,
            prefix_cache_flushes=cache.flushes,
            prefix_cache_int8_tokens=cache.int8_tokens,
            prefix_cache_int8_bytes=cache.int8_bytes,
            prefix_cache_int8_max_tokens=cache.int8_max_tokens,
            prefix_cache_int8_hits=cache.int8_hits,
            prefix_cache_int8_hit_tokens=cache.int8_hit_tokens,
            prefix_cache_disk_tokens=cache.disk_tokens,
            prefix_cache_disk_bytes=cache.disk_bytes,
            prefix_cache_disk_max_tokens=cache.disk_max_tokens,
            prefix_cache_disk_hits=cache.disk_hits,
            prefix_cache_disk_hit_tokens=cache.disk_hit_tokens,
        )

    def _take(self, seq: KVHolder, source: KVHolder | None, best: int) -> None:
        """Copy (or share) the first ``best`` positions of the running ``source`` into ``seq``."""
        if source is not None and source.kv_id is not None and seq.kv_id is not None and best > seq.cached:
            self.runner.copy_prefix(seq.kv_id, source.kv_id, best)
            self.shared_tokens += best - seq.cached
            seq.cached = seq.cached_tokens = best


class SlotStore(KVStore):
    """A row per sequence; retained prefixes are tensors copied out (hot tier, then int8 and disk)."""

    kind = "slot"
    runner: SlotRunner

    def __init__(self, runner: SlotRunner, cold: PrefixCache, *, context_length: int, chunk_size: int) -> None:
        super().__init__(context_length, chunk_size)
        self.runner = runner
        self.cold = cold

    def share(self, seq: KVHolder, best: int, source: KVHolder | None, *, restore: bool = True) -> None:
        limit = len(seq.prompt_ids) - 1
        if seq.kv_id is None:
            return
        retained, kv = self.cold.lookup(seq.prompt_ids, limit, self.epoch) if best < limit else (0, None)
        if kv is not None and retained > best:
            self.runner.import_prefix(seq.kv_id, kv, retained)
            self.cold.record_hit(retained - seq.cached)
            seq.cached = seq.cached_tokens = retained
        else:
            self._take(seq, source, best)

    def retain(self, tokens: list[int], kv_id: int, cached: int) -> None:
        if self.cold.enabled:
            runner = self.runner
            self.cold.insert(tokens[:cached], lambda n: runner.export_prefix(kv_id, n), self.epoch)


class PagedStore(KVStore):
    """Block tables into one bounded pool; retained prefixes stay in their blocks (a radix tree), evicted
    ones go to the int8 and disk tiers. Admission keeps every running sequence's worst case in the pool."""

    kind = "paged"
    runner: PagedRunner

    def __init__(self, runner: PagedRunner, cold: PrefixCache, retained_tokens: int, *, context_length: int,
                 chunk_size: int) -> None:
        super().__init__(context_length, chunk_size)
        self.runner = runner
        self.cold = cold
        self.tree = BlockRadix(runner, retained_tokens, on_evict=self._demote if cold.int8_max_tokens else None)

    # -- admission ---------------------------------------------------------------------------------
    def _worst_case_tokens(self, prompt: int, max_new_tokens: int) -> int:
        return min(prompt + max_new_tokens, self.context_length)

    def worst_case_blocks(self, prompt: int, max_new_tokens: int) -> int:
        """The most blocks a sequence holds at once: its whole worst case, or with a sliding window (whose
        older blocks are released after every step) the sinks' blocks, a window and a chunk, and margins."""
        runner = self.runner
        worst = runner.blocks_for(self._worst_case_tokens(prompt, max_new_tokens))
        if runner.window is None:
            return worst
        return min(worst, runner.tables.sink_blocks + runner.blocks_for(runner.window + self.chunk_size) + 3)

    def check_request(self, prompt: int, max_new_tokens: int) -> None:
        if self.worst_case_blocks(prompt, max_new_tokens) > self.runner.max_blocks:
            raise BadRequest(
                f"The request can need {self._worst_case_tokens(prompt, max_new_tokens)} tokens of KV cache "
                f"(input {prompt} + max_new_tokens {max_new_tokens}), more than the server's KV pool holds "
                f"({self.runner.max_blocks * self.runner.block_size} tokens, --kv-cache-tokens); "
                f"lower max_new_tokens or raise the pool.")

    def _future_blocks(self, seq: KVHolder, credit: int = 0) -> int:
        """Blocks ``seq`` may still allocate: its worst case minus the blocks its table holds (or, not yet
        admitted, the ``credit`` of blocks it will share)."""
        worst = self.worst_case_blocks(len(seq.prompt_ids), seq.params.max_new_tokens)
        held = self.runner.tables.held_blocks(seq.kv_id) if seq.kv_id is not None else credit
        return max(0, worst - held)

    def credit(self, source_kv: int | None, n: int) -> int:
        """Full blocks of the prompt that the running ``source_kv`` holds computed now: sharing them by
        reference, the new sequence never allocates them. (The tree's unshared blocks are not counted:
        making room may evict them.)"""
        return self.runner.tables.shared_blocks(source_kv, n) if source_kv is not None else 0

    def admit(self, seq: KVHolder, running: Seq[KVHolder], credit: int) -> bool:
        """Admit ``seq`` only if every running sequence's worst case and its own fit in the free blocks
        (evicting the tree's unshared leaves if needed), so no generation ever runs out of blocks mid-way.

        A sample of a group whose prompt another sample has computed counts only what it adds (the group
        of 8 on an 8k-token prompt needs 8k + 8 x its new tokens, not 8 x 8k): ``credit``.
        """
        need = self._future_blocks(seq, credit) + sum(self._future_blocks(r) for r in running)
        short = need - self.runner.pool.free_blocks
        if short > 0:
            if self.tree.evictable() < short:
                return False
            self.tree.evict(short)
            if self.runner.pool.free_blocks < need:
                return False
        return True

    def can_share(self, source_kv: int, n: int) -> bool:
        return self.runner.tables.can_share(source_kv, n)

    def after_step(self, running: Seq[KVHolder]) -> None:
        if self.runner.window is not None:
            for seq in running:  # a sliding window: blocks no later query reads go back
                if seq.kv_id is not None:
                    self.runner.tables.release_outside_window(seq.kv_id, seq.cached)

    # -- prefixes ----------------------------------------------------------------------------------
    def share(self, seq: KVHolder, best: int, source: KVHolder | None, *, restore: bool = True) -> None:
        """Adopt the tree's blocks, share a running sequence's, or restore from the int8 / disk tiers.

        Only a sequence holding nothing yet restores from int8 (new blocks): with blocks already shared,
        replacing them could leave the pool short of what admission counted on.
        """
        if seq.kv_id is None:
            return
        limit = len(seq.prompt_ids) - 1
        blocks, tail_block, tail = self.tree.match(seq.prompt_ids, limit) if best < limit else ([], -1, 0)
        tree = len(blocks) * self.tree.block_size + tail
        floor = max(best, tree, seq.cached)
        cold, kv = (self.cold.lookup(seq.prompt_ids, limit, self.epoch, floor=floor)
                    if restore and seq.cached == 0 and floor < limit else (0, None))
        if kv is not None and cold > floor:
            self.runner.import_prefix(seq.kv_id, kv, cold)
            self.cold.record_hit(cold)
            seq.cached = seq.cached_tokens = cold
        elif tree > best and tree > seq.cached:
            self.runner.adopt(seq.kv_id, blocks, tail_block, tail)
            self.tree.record_hit(tree - seq.cached)
            seq.cached = seq.cached_tokens = tree
        else:
            self._take(seq, source, best)

    def retain(self, tokens: list[int], kv_id: int, cached: int) -> None:
        # with a window, what comes before the first released block (the sinks' blocks)
        keep = min(cached, self.runner.tables.live_prefix(kv_id))
        if keep >= 2:
            self.tree.insert(tokens[:keep], self.runner.tables.table(kv_id))

    def _demote(self, tokens: list[int], blocks: list[int]) -> None:
        """The tree evicts a leaf: keep its whole prefix in the int8 tier."""
        runner = self.runner
        self.cold.store_int8(tokens, lambda n: runner.export_blocks(blocks, n), self.epoch)

    def clear(self) -> None:
        super().clear()
        self.tree.clear()

    def statistics(self) -> dict[str, Any]:
        fields = super().statistics()
        cache, tree = self.cold.statistics(), self.tree.statistics()
        fields.update(
            kv_block_size=self.runner.block_size, kv_blocks_total=self.runner.max_blocks,
            kv_blocks_used=self.runner.pool.used_blocks, kv_waiting_for_blocks=self.blocked,
            prefix_cache_tokens=tree.tokens, prefix_cache_bytes=tree.bytes,
            prefix_cache_max_tokens=tree.max_tokens, prefix_cache_lookups=tree.lookups + cache.lookups,
            prefix_cache_hits=tree.hits + cache.hits, prefix_cache_hit_tokens=tree.hit_tokens + cache.hit_tokens,
            prefix_cache_evicted_tokens=tree.evicted_tokens, prefix_cache_flushes=tree.flushes)
        return fields


def build_store(model: PreTrainedModel, kind: str, *, max_seqs: int, kv_tokens: int, block_size: int,
                attention_window: int | None, attention_sinks: int, retained_tokens: int, int8_tokens: int,
                disk_tokens: int, disk_dir: str | None, chunk_size: int) -> KVStore:
    """The store of ``kind`` (one of ``KV_CACHES``) over ``model``, with ``retained_tokens`` of retained
    prefixes (0: none) and the int8 and disk tiers below them."""
    runner = build_runner(model, kind, max_seqs=max_seqs, kv_tokens=kv_tokens, block_size=block_size,
                          attention_window=attention_window, attention_sinks=attention_sinks)
    if isinstance(runner, PagedRunner):
        cold = PrefixCache(0, runner.bytes_per_token(), int8_only=True, int8_tokens=int8_tokens if retained_tokens else 0,
                           disk_tokens=disk_tokens, disk_dir=disk_dir)
        return PagedStore(runner, cold, retained_tokens, context_length=runner.context_length, chunk_size=chunk_size)
    if isinstance(runner, SlotRunner):
        cold = PrefixCache(retained_tokens, runner.bytes_per_token(), int8_tokens=int8_tokens,
                           disk_tokens=disk_tokens, disk_dir=disk_dir)
        return SlotStore(runner, cold, context_length=runner.context_length, chunk_size=chunk_size)
    raise ValueError(f"kv_cache must be one of {list(KV_CACHES)}, not {kind!r}")
