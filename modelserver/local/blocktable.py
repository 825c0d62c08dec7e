"""The paged KV store's block tables: which pool blocks each sequence holds, in order, and what it may share.

A sequence's *block table* lists the pool blocks (``local/blockpool.py``) holding its positions
``0..n-1``: position ``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``. Every
entry holds a reference on its block; :class:`BlockTables` takes and drops those references as tables
grow (:meth:`BlockTables.reserve`), adopt another's full blocks (:meth:`BlockTables.adopt`: shared, not
copied) and are let go (:meth:`BlockTables.release`), so a block is free again once no table and no node
of the prefix tree (``local/radix.py``) holds it.

With a sliding window, blocks no later query reads are released (:meth:`BlockTables.release_outside_window`)
and their entries become :data:`HOLE`; the leading blocks holding the attention sinks never are. The holes
of a table are always one run, ``table[sink_blocks : sink_blocks + holes]``, which is what
:meth:`BlockTables.can_share`, :meth:`BlockTables.shared_blocks` and :meth:`BlockTables.live_prefix` read.

Only bookkeeping lives here: the keys and values are the pool's, and the runner (``local/runner.py``)
reads and writes them through these tables (and copies a partly filled block when a prefix is adopted).
"""

from __future__ import annotations

from modelserver.local.blockpool import BlockPool

__all__ = ["HOLE", "BlockTables"]

HOLE = -1
"""A block-table entry whose block a sliding window released (no later query reads it)."""


class BlockTables:
    """Per-sequence block tables over one :class:`BlockPool`, with up to ``max_seqs`` sequences at once.

    ``window`` / ``sinks``: the attention window (None: full attention, nothing is ever released) and the
    number of leading positions every query reads (their blocks are never released).
    """

    def __init__(self, pool: BlockPool, *, max_seqs: int, window: int | None = None, sinks: int = 0) -> None:
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {max_seqs}")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_seqs = max_seqs
        self.window = window
        self.sink_blocks = pool.blocks_for(sinks) if window is not None else 0
        """With a window: the leading blocks that hold attention sinks, never released."""
        self._tables: dict[int, list[int]] = {}
        self._holes: dict[int, int] = {}
        """Per sequence: blocks released from its table (``HOLE``), ``table[sink_blocks : sink_blocks + holes]``."""
        self._free_ids = list(range(max_seqs))

    # -- sequences ---------------------------------------------------------------------------------
    def acquire(self) -> int:
        """A new sequence (the lowest free id) with an empty table."""
        if not self._free_ids:
            raise RuntimeError(f"all {self.max_seqs} sequence tables are in use")
        seq = min(self._free_ids)
        self._free_ids.remove(seq)
        self._tables[seq] = []
        return seq

    def release(self, seq: int) -> None:
        """Let go of ``seq``'s blocks and its id (a no-op for a sequence not acquired)."""
        if seq in self._tables:
            self.clear(seq)
            del self._tables[seq]
            self._free_ids.append(seq)

    def clear(self, seq: int) -> None:
        """Let go of every block ``seq`` holds; it stays acquired with an empty table."""
        for block in self._tables[seq]:
            if block != HOLE:
                self.pool.decref(block)
        self._tables[seq] = []  # a new list: a caller may still read the old one (see the runner's copy_prefix)
        self._holes.pop(seq, None)

    # -- tables ------------------------------------------------------------------------------------
    def table(self, seq: int) -> list[int]:
        """The blocks holding ``seq``'s positions, in order (a copy; ``HOLE`` where a window released one)."""
        return list(self._tables[seq])

    def view(self, seq: int) -> list[int]:
        """``seq``'s table itself, not a copy (the forward pass reads it every step; do not change it)."""
        return self._tables[seq]

    def held_blocks(self, seq: int) -> int:
        """How many blocks ``seq``'s table holds (no copy: admission asks this of every running sequence)."""
        return len(self._tables[seq]) - self._holes.get(seq, 0)

    def reserve(self, seq: int, end: int) -> None:
        """Append new blocks to ``seq``'s table until it covers positions ``< end``."""
        table = self._tables[seq]
        while len(table) * self.block_size < end:
            table.append(self.pool.alloc())

    def adopt(self, seq: int, blocks: list[int], *, own_tail: bool = False) -> int:
        """Make ``seq`` hold ``blocks`` (full blocks of a prefix, shared: one more reference each; ``HOLE``
        entries carried over) in place of its own; with ``own_tail``, then one new block of its own, returned
        for the caller to copy a partly filled block into (copy on write). Returns ``HOLE`` otherwise."""
        self.clear(seq)
        for block in blocks:
            if block != HOLE:
                self.pool.incref(block)
        self._tables[seq] = list(blocks)
        if HOLE in blocks:  # a prefix of a sequence whose window released blocks (see can_share)
            self._holes[seq] = blocks.count(HOLE)
        if not own_tail:
            return HOLE
        block = self.pool.alloc()
        self._tables[seq].append(block)
        return block

    # -- a sliding window's released blocks --------------------------------------------------------
    def release_outside_window(self, seq: int, cached: int) -> int:
        """With a window, release the blocks of ``seq`` (holding ``cached`` positions) that no later query
        reads: past the sinks' blocks and wholly older than one block before the next position's window (the
        margin lets a group's other samples still share a prompt its first sample has just computed). Their
        table entries become ``HOLE``; returns how many were released."""
        if self.window is None:
            return 0
        table = self._tables[seq]
        start = self.sink_blocks + self._holes.get(seq, 0)
        end = min(len(table), (cached - self.window + 1) // self.block_size - 1)
        released = 0
        for b in range(start, end):
            if table[b] != HOLE:
                self.pool.decref(table[b])
                table[b] = HOLE
                released += 1
        if end > start:
            self._holes[seq] = end - self.sink_blocks
        return released

    def can_share(self, seq: int, n: int) -> bool:
        """Whether another sequence may take the first ``n`` positions of ``seq`` and go on from there: its
        next window (the keys position ``n`` reads) holds no released block."""
        holes = self._holes.get(seq, 0)
        return not holes or self.window is None or (self.sink_blocks + holes) * self.block_size <= n - self.window + 1

    def shared_blocks(self, seq: int, n: int) -> int:
        """Blocks another sequence holds by taking the first ``n`` positions of ``seq`` (see :meth:`can_share`):
        the full ones, less the released ones among them."""
        return n // self.block_size - self._holes.get(seq, 0)

    def live_prefix(self, seq: int) -> int:
        """Positions of ``seq`` before its first released block (what may be retained for reuse)."""
        table = self._tables[seq]
        return (self.sink_blocks if self._holes.get(seq, 0) else len(table)) * self.block_size
