"""The retained prefix cache of the paged KV store: a radix tree whose edges are full blocks of token ids.

When a sequence leaves the engine, the blocks of what it computed are inserted into the tree: each node
is one block, keyed under its parent by that block's ``block_size`` token ids (a partly filled last block
is a leaf keyed by the tokens it holds), and holds a reference
on the pool block (``BlockPool.incref``), so the keys and values stay where they were computed, nothing
is copied. A new sequence walks the tree with its prompt and *adopts* the blocks of the longest
match, down to the token: the full blocks are shared and the first tokens of a partly matching block are
copied into a block of its own: a GRPO group's later samples, the next turn of a multi-turn episode (each turn extends the last)
and every prompt behind a shared system prompt skip those tokens' prefill.

Eviction is LRU over leaves. Under memory pressure (the engine needs free blocks to admit a request) only
leaves no running sequence shares are evicted, since dropping a shared block frees nothing; the tree's own
bound (``max_tokens``) evicts any leaf. An evicted leaf's prefix can move to the int8 tier
(``on_evict``) and come back from there on a later hit. A weight update clears the tree (KV computed under
old weights is never reused) and ``/flush_cache`` clears it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from modelserver.local.prefix_cache import PrefixCacheStatistics, common_prefix
from modelserver.local.runner import PagedRunner

__all__ = ["BlockRadix"]


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_access: int = 0

    def path(self) -> tuple[list[tuple[int, ...]], list[int]]:
        """The keys and blocks from the root down to this node."""
        keys: list[tuple[int, ...]] = []
        blocks: list[int] = []
        node: _Node | None = self
        while node is not None and node.parent is not None:
            keys.append(node.key)
            blocks.append(node.block)
            node = node.parent
        return keys[::-1], blocks[::-1]


class BlockRadix:
    """A radix tree over the full blocks of a :class:`PagedRunner`; see the module docstring."""

    def __init__(self, runner: PagedRunner, max_tokens: int, *,
                 on_evict: Callable[[list[int], list[int]], None] | None = None) -> None:
        if max_tokens < 0:
            raise ValueError(f"the prefix tree's max_tokens must be >= 0 (0 disables it), got {max_tokens}")
        self.runner = runner
        self.block_size = runner.block_size
        self.max_nodes = max_tokens // runner.block_size
        self.on_evict = on_evict
        """Called with ``(tokens, blocks)`` of an evicted leaf's whole prefix before its block is released."""
        self.root = _Node(key=(), block=-1, parent=None)
        self._nodes = self._tokens = 0
        self._clock = 0
        self._lookups = self._hits = self._hit_tokens = self._evicted = self._flushes = 0

    @property
    def enabled(self) -> bool:
        return self.max_nodes > 0

    @property
    def tokens(self) -> int:
        """Tokens whose keys and values the tree holds."""
        return self._tokens

    @property
    def blocks(self) -> int:
        """Pool blocks the tree holds (one per node)."""
        return self._nodes

    def _keys(self, tokens: list[int], blocks: int) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(blocks)]

    def match(self, tokens: list[int], limit: int) -> tuple[list[int], int, int]:
        """The longest prefix of ``tokens`` held (at most ``limit`` tokens): ``(blocks, tail_block, tail)``.

        ``blocks`` hold its full blocks; its last ``tail`` tokens (fewer than a block) are the first
        ``tail`` positions of ``tail_block``, a child whose key starts like the rest of ``tokens``
        (the caller copies those: the block itself goes on with other tokens). ``tail`` 0: none.
        """
        if not self._nodes or limit < 1:
            return [], -1, 0
        self._lookups += 1
        self._clock += 1
        node, blocks = self.root, []
        for key in self._keys(tokens, limit // self.block_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = self._clock
            blocks.append(child.block)
            node = child
        start = len(blocks) * self.block_size
        rest = tokens[start:min(limit, start + self.block_size)]
        tail_block, tail = -1, 0
        for child in node.children.values():
            n = common_prefix(list(child.key), rest)
            if n > tail:
                tail_block, tail = child.block, n
        return blocks, tail_block, tail

    def record_hit(self, tokens: int) -> None:
        """A match was adopted by a sequence: ``tokens`` not computed."""
        self._hits += 1
        self._hit_tokens += tokens

    def insert(self, tokens: list[int], table: list[int]) -> int:
        """Hold the blocks of ``tokens`` (whose KV is in ``table``; a partly filled last one as a leaf with a
        shorter key); returns how many blocks were new."""
        if not self.enabled:
            return 0
        self._clock += 1
        node, added = self.root, 0
        full, rest = divmod(len(tokens), self.block_size)
        keys = self._keys(tokens, full)
        if rest and len(table) > full:  # the partly filled last block: a leaf with a shorter key
            keys.append(tuple(tokens[full * self.block_size:]))
        for key, block in zip(keys, table):
            child = node.children.get(key)
            if child is None and len(key) < self.block_size and any(k[:len(key)] == key for k in node.children):
                break  # a partial block another child already holds (as its first tokens)
            if child is None:
                for other in [c for k, c in node.children.items() if len(k) < len(key) and key[:len(k)] == k]:
                    if not other.children:  # a shorter leaf this one holds: redundant
                        self._drop_leaf(other)
                child = _Node(key=key, block=block, parent=node)
                node.children[key] = child
                self.runner.pool.incref(block)
                self._nodes += 1
                self._tokens += len(key)
                added += 1
            child.last_access = self._clock
            if len(key) < self.block_size:
                break
            node = child
        if self._nodes > self.max_nodes:
            self.evict(self._nodes - self.max_nodes, free_only=False)
        return added

    def evict(self, blocks: int, *, free_only: bool = True) -> int:
        """Drop up to ``blocks`` least recently used leaves; returns how many were dropped.

        ``free_only``: only leaves whose block nothing else holds (each frees one block of the pool).
        """
        leaves = [(n.last_access, id(n), n) for n in self._iter_nodes() if not n.children]
        heapq.heapify(leaves)
        dropped = 0
        while leaves and dropped < blocks:
            _, _, node = heapq.heappop(leaves)
            if free_only and self.runner.pool.refcount(node.block) > 1:
                continue
            if self.on_evict is not None:
                keys, path_blocks = node.path()
                self.on_evict([t for key in keys for t in key], path_blocks)
            parent = node.parent
            assert parent is not None
            self._drop_leaf(node)
            self._evicted += len(node.key)
            dropped += 1
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return dropped

    def _drop_leaf(self, node: _Node) -> None:
        assert node.parent is not None and not node.children
        del node.parent.children[node.key]
        self.runner.pool.decref(node.block)
        self._nodes -= 1
        self._tokens -= len(node.key)

    def evictable(self) -> int:
        """Blocks :meth:`evict` could free now: nodes whose whole subtree the tree alone holds."""
        freeable: dict[int, bool] = {}
        total = 0
        for node in reversed(self._iter_nodes()):  # children before their parents
            ok = self.runner.pool.refcount(node.block) == 1 and all(freeable[id(c)] for c in node.children.values())
            freeable[id(node)] = ok
            total += ok
        return total

    def _iter_nodes(self) -> list[_Node]:
        """Every node, each before its children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> int:
        """Release every block the tree holds; returns how many tokens it held."""
        held = self.tokens
        for node in self._iter_nodes():
            self.runner.pool.decref(node.block)
        self.root.children.clear()
        self._nodes = self._tokens = 0
        self._flushes += 1
        return held

    def statistics(self) -> PrefixCacheStatistics:
        """The tree's counters; ``entries`` are its nodes, ``bytes`` the whole blocks they hold."""
        return PrefixCacheStatistics(
            entries=self._nodes, tokens=self.tokens,
            bytes=self._nodes * self.block_size * self.runner.bytes_per_token(),
            max_tokens=self.max_nodes * self.block_size, lookups=self._lookups, hits=self._hits,
            hit_tokens=self._hit_tokens, evicted_tokens=self._evicted, flushes=self._flushes)
