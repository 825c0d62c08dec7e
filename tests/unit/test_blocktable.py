"""The paged KV store's block tables alone (``modelserver/local/blocktable.py``): which blocks each sequence
holds, the references that keeps on the pool, a sliding window's released blocks, what may be shared."""

from __future__ import annotations

import pytest
import torch

from modelserver.local.blockpool import BlockPool, OutOfBlocks
from modelserver.local.blocktable import HOLE, BlockTables

BS = 4


def _tables(max_tokens: int = 8 * BS, *, max_seqs: int = 4, window: int | None = None, sinks: int = 0) -> BlockTables:
    pool = BlockPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, max_tokens=max_tokens, block_size=BS,
                     initial_tokens=BS)
    return BlockTables(pool, max_seqs=max_seqs, window=window, sinks=sinks)


# ------------------------------------------------------------------------ tables and references


def test_acquire_reserve_adopt_release_keep_the_refcounts_and_give_every_block_back() -> None:
    t = _tables()
    pool = t.pool
    a, b = t.acquire(), t.acquire()
    assert (a, b) == (0, 1) and t.table(a) == []
    t.reserve(a, 10)  # 10 positions: 3 blocks, the last one half full
    assert t.table(a) == [0, 1, 2] and t.held_blocks(a) == 3 and pool.free_blocks == 5
    t.reserve(a, 12)  # still inside the last block: nothing new
    assert t.table(a) == [0, 1, 2]
    t.reserve(b, 5)  # b's own blocks, dropped by the adoption below
    assert t.table(b) == [3, 4] and pool.free_blocks == 3
    own = t.adopt(b, t.table(a)[:2], own_tail=True)
    assert own == 3 and t.table(b) == [0, 1, 3]  # shared full blocks, then a block of its own (the lowest free)
    assert [pool.refcount(x) for x in (0, 1, 2, 3, 4)] == [2, 2, 1, 1, 0] and pool.free_blocks == 4
    t.release(a)
    assert [pool.refcount(x) for x in (0, 1, 2)] == [1, 1, 0] and pool.free_blocks == 5
    t.release(a)  # releasing twice (or a sequence never acquired) changes nothing
    assert pool.free_blocks == 5
    t.release(b)
    assert pool.free_blocks == pool.max_blocks == 8
    assert t.acquire() == 0  # the lowest free id again


def test_adopt_without_a_tail_takes_no_block_and_clear_keeps_the_sequence() -> None:
    t = _tables()
    a, b = t.acquire(), t.acquire()
    t.reserve(a, 8)
    assert t.adopt(b, t.table(a)) == HOLE and t.table(b) == t.table(a) and t.pool.free_blocks == 6
    t.clear(b)
    assert t.table(b) == [] and t.held_blocks(b) == 0 and [t.pool.refcount(x) for x in t.table(a)] == [1, 1]
    t.reserve(b, 1)  # still acquired: it can grow again
    assert t.table(b) == [2]


def test_table_is_a_copy_and_view_is_the_table_itself() -> None:
    t = _tables()
    a = t.acquire()
    t.reserve(a, 4)
    copy = t.table(a)
    copy.append(99)
    assert t.table(a) == [0] and t.view(a) is t.view(a)
    t.reserve(a, 8)
    assert t.view(a) == [0, 1]


def test_the_sequence_bound_and_the_pool_bound_hold() -> None:
    t = _tables(2 * BS, max_seqs=2)
    a, _ = t.acquire(), t.acquire()
    with pytest.raises(RuntimeError, match="all 2 sequence tables are in use"):
        t.acquire()
    t.reserve(a, 2 * BS)
    with pytest.raises(OutOfBlocks):
        t.reserve(a, 2 * BS + 1)
    with pytest.raises(ValueError, match="max_seqs must be at least 1"):
        _tables(max_seqs=0)


def test_shared_blocks_counts_only_full_blocks() -> None:
    t = _tables()
    a = t.acquire()
    t.reserve(a, 10)
    assert [t.shared_blocks(a, n) for n in (3, 4, 7, 8, 10)] == [0, 1, 1, 2, 2]
    assert t.can_share(a, 10) and t.live_prefix(a) == 3 * BS  # no window: everything is live


# ------------------------------------------------------------------------ a sliding window's released blocks


def _windowed(cached: int = 40) -> BlockTables:
    """Window 8, 2 sinks (one sink block of 4), a sequence 0 holding ``cached`` positions."""
    t = _tables(32 * BS, window=8, sinks=2)
    seq = t.acquire()
    t.reserve(seq, cached)
    return t


def test_without_a_window_nothing_is_released() -> None:
    t = _tables(16 * BS)
    a = t.acquire()
    t.reserve(a, 40)
    assert t.release_outside_window(a, 40) == 0 and HOLE not in t.table(a) and t.held_blocks(a) == 10


def test_window_release_frees_only_blocks_wholly_outside_the_window() -> None:
    t = _windowed(40)
    seq, pool = 0, t.pool
    assert t.sink_blocks == 1
    before = t.table(seq)
    free = pool.free_blocks
    released = t.release_outside_window(seq, 40)
    after = t.table(seq)
    gone = [b for b, entry in enumerate(after) if entry == HOLE]
    # position 40 reads 33..40 and the sinks; blocks 1..6 (positions 4..27) lie a whole block before that
    assert released == 6 and gone == [1, 2, 3, 4, 5, 6] and pool.free_blocks == free + 6
    assert all((b + 1) * BS <= 40 - 8 + 1 - BS for b in gone)  # every released position is outside the window
    assert after[0] == before[0] and after[7:] == before[7:]  # the sinks' block and the recent ones are kept
    assert t.held_blocks(seq) == 4
    assert t.release_outside_window(seq, 40) == 0  # nothing twice
    assert t.release_outside_window(seq, 42) == 0  # block 7 (28..31): the one-block margin before the window 35..42
    assert t.release_outside_window(seq, 43) == 1 and t.table(seq)[7] == HOLE and t.held_blocks(seq) == 3


def test_a_released_block_another_sequence_shares_stays_held() -> None:
    t = _windowed(40)
    pool = t.pool
    other = t.acquire()
    t.adopt(other, t.table(0)[:3])  # blocks 0..2: the sinks' block and two the window will release
    t.release_outside_window(0, 40)
    assert [pool.refcount(b) for b in t.table(other)] == [2, 1, 1]
    t.release(other)
    assert [pool.refcount(b) for b in (1, 2)] == [0, 0]


def test_can_share_shared_blocks_and_live_prefix_see_the_holes() -> None:
    t = _windowed(40)
    assert t.live_prefix(0) == 40 and t.can_share(0, 20)
    t.release_outside_window(0, 40)  # holes at blocks 1..6: positions 4..27
    # position n reads n - 7 .. n: no hole may lie in there (28 <= n - 7)
    assert not t.can_share(0, 34) and t.can_share(0, 35)
    assert t.shared_blocks(0, 40) == 10 - 6  # the full blocks less the released ones
    assert t.live_prefix(0) == 1 * BS  # only what comes before the first hole can be retained


def test_adopting_a_prefix_with_holes_holds_only_the_live_blocks() -> None:
    t = _windowed(40)
    pool = t.pool
    t.release_outside_window(0, 40)
    prefix = t.table(0)[:9]  # sinks' block, 6 holes, blocks 7 and 8
    free = pool.free_blocks
    other = t.acquire()
    assert t.adopt(other, prefix) == HOLE
    assert t.table(other) == prefix and t.held_blocks(other) == 3 and pool.free_blocks == free
    assert [pool.refcount(b) for b in prefix if b != HOLE] == [2, 2, 2]
    assert t.shared_blocks(other, 36) == 9 - 6 and t.live_prefix(other) == BS
    t.release(other)
    t.release(0)
    assert pool.free_blocks == pool.max_blocks
