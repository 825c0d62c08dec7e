"""The paged KV store's pool: fixed-size blocks of keys and values per layer, which are free, and who holds them.

One tensor per layer for keys and one for values, ``(blocks x block_size, kv_heads, head_dim)``, grown
by doubling up to ``max_blocks`` as blocks are taken. A block is *held* by every block table (a running
sequence) and every node of the prefix tree that points at it: :meth:`BlockPool.incref` /
:meth:`BlockPool.decref` count the holders and a block whose count falls to 0 is free again (the
lowest free block is taken first, so the pool's used part stays compact). What a block holds, and in
which order a sequence reads blocks, is the block tables' business (``local/blocktable.py``).
"""

from __future__ import annotations

import heapq

import torch

__all__ = ["BlockPool", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """The paged KV pool has no free block (the engine's admission control keeps this from happening)."""


class BlockPool:
    """Keys and values in blocks of ``block_size`` positions, reference counted; see the module docstring."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_tokens: int,
                 block_size: int = 16, initial_tokens: int = 4096) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if max_tokens < block_size:
            raise ValueError(f"the KV pool must hold at least one block: max_tokens {max_tokens} < block_size {block_size}")
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.block_size = block_size
        self.max_blocks = max_tokens // block_size
        """The pool's bound in blocks (``max_tokens // block_size``)."""
        self.k: list[torch.Tensor] = []
        """Per layer: the keys of every block, ``(blocks x block_size, kv_heads, head_dim)``."""
        self.v: list[torch.Tensor] = []
        self._blocks = 0  # allocated so far
        self._ref: list[int] = []
        self._free: list[int] = []  # a heap: the lowest free block first
        self._grow(max(1, min(self.max_blocks, self.blocks_for(initial_tokens))))

    def _grow(self, blocks: int) -> None:
        shape = (blocks * self.block_size, self.kv_heads, self.head_dim)
        new_k, new_v = [], []
        for layer in range(self.layers):
            k = torch.zeros(shape, dtype=self.dtype)
            v = torch.zeros(shape, dtype=self.dtype)
            if self.k:
                rows = self.k[layer].shape[0]
                k[:rows] = self.k[layer]
                v[:rows] = self.v[layer]
            new_k.append(k)
            new_v.append(v)
        for block in range(self._blocks, blocks):
            heapq.heappush(self._free, block)
        self._ref.extend([0] * (blocks - self._blocks))
        self.k, self.v, self._blocks = new_k, new_v, blocks

    def alloc(self) -> int:
        """A free block, now held once (the pool grows first when every allocated block is held)."""
        if not self._free and self._blocks < self.max_blocks:
            self._grow(min(self.max_blocks, 2 * self._blocks))
        if not self._free:
            raise OutOfBlocks(f"all {self.max_blocks} KV blocks ({self.max_blocks * self.block_size} tokens) are in use")
        block = heapq.heappop(self._free)
        self._ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            heapq.heappush(self._free, block)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any sequence or the prefix tree (including those not allocated yet)."""
        return len(self._free) + self.max_blocks - self._blocks

    @property
    def used_blocks(self) -> int:
        return self.max_blocks - self.free_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cache_bytes(self) -> int:
        """Bytes the pool has allocated (its bound: ``max_blocks x block_size x bytes_per_token``)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
