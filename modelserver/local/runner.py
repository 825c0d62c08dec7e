"""Forward passes of a Llama-family causal LM over the local engine's KV cache (CPU, no grad).

Two KV stores run the same forward pass (:meth:`Runner.step`); only where keys and values live differs.

- :class:`PagedRunner` (the default, ``kv_cache = "paged"``): one pool of fixed-size *blocks* per layer,
  ``(blocks x block_size, kv_heads, head_dim)``, bounded by ``max_tokens`` (``local/blockpool.py``). A
  sequence owns a *block table* (the pool blocks holding its positions ``0..n-1`` in order; the tables,
  their references on the pool, a window's released blocks and what may be shared are kept by
  ``PagedRunner.tables``, ``local/blocktable.py``); a new token is written in place at
  ``table[p // block_size] * block_size + p % block_size`` and nothing is copied between steps. Blocks are
  reference counted: a GRPO group's samples and the retained prefix cache (a radix tree over blocks,
  ``local/radix.py``) *share* the blocks of a common prefix instead of copying them; only a partly
  filled last block is copied (copy on write). Attention gathers each row's key positions from the
  pool through its table (one ``index_select`` per layer), or reads a group's shared blocks once (cascade).
- :class:`SlotRunner` (``kv_cache = "slot"``): one preallocated tensor per layer, ``(slots, kv_heads,
  capacity, head_dim)``: a sequence owns a *slot* (a row) for its whole life and its ``n`` cached tokens
  are that row's first ``n`` positions. When the decode rows are slots ``0..B-1`` the keys are a view of
  the cache, not a copy; memory is slots x the longest context, and a prefix is shared by copying it.

Both replace the earlier per-sequence cache (one tensor per sequence, re-padded into a batch at every
step) that made the engine slower than plain ``transformers`` ``generate``.

- :meth:`Runner.step` packs prefill chunks of several sequences (chunked prefill: peak attention memory
  ~ chunk x context, not context squared) and one decode token per running row into ONE forward pass.
- :meth:`Runner.copy_prefix` makes one sequence hold the first ``n`` cached positions of another.
- :meth:`Runner.export_prefix` / :meth:`Runner.import_prefix` copy a sequence's first ``n`` positions
  out to a tensor and back (the int8 tier of ``local/prefix_cache.py``).

The math is the model's own: embeddings, norms, MLPs, rotary embedding and projections are the Hugging
Face modules themselves, called here; only attention against the cache is written out. So a weight
update that loads new tensors into the model (``load_state_dict``) takes effect on the next pass, and
the logits agree with the Hugging Face forward to float rounding (tested). Supported families: Llama,
Qwen2 (q/k/v biases come with its Linear modules) and Mistral (without its sliding window: contexts
longer than the window are attended in full).

Sliding-window attention (``attention_window``, ``attention_sinks``; default off): the token at position
``p`` attends to positions ``p - window + 1 .. p`` and to the first ``sinks`` positions. Keys older than
every query's window are not read at all (the saving at long contexts); while no position reaches past
the window the full-attention code path runs, so a window longer than the context is full attention
exactly (tested). It changes the model's outputs: the long-context load test measures by how much.

Memory per cached token is ``2 x layers x kv_heads x head_dim x itemsize`` bytes (46 KB fp32, 23 KB
bf16 for SmolLM2-135M). Both stores grow on demand (doubling) up to their bound.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from modelserver.local.blockpool import BlockPool, OutOfBlocks
from modelserver.local.blocktable import BlockTables
from modelserver.local.prefix_cache import common_prefix

if TYPE_CHECKING:  # the layout the runner drives (SmolLM2 is a Llama)
    from transformers.models.llama.modeling_llama import LlamaAttention

__all__ = ["KV_CACHES", "OutOfBlocks", "PagedRunner", "Runner", "SUPPORTED_MODEL_TYPES", "SlotRunner", "UnsupportedModel",
           "build_runner"]

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
KV_CACHES = ("paged", "slot")
"""The local engine's KV stores (``inference.kv_cache`` / ``--kv-cache``); paged is the default."""

Ranges = list[tuple[int, int]]
Writer = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``(layer, keys, values)`` with keys/values ``(rows, kv_heads, head_dim)``: store them."""
Reader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""``layer -> (keys, values)`` shaped ``(batch, kv_heads, key_positions, head_dim)`` for attention."""
Attend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer, queries (B, heads, 1, head_dim), mask (B, 1, 1, K)) -> (B, heads, 1, head_dim)``: decode rows' attention."""


class UnsupportedModel(ValueError):
    """The local backend cannot serve this architecture."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Runner:
    """The forward pass shared by both KV stores; subclasses say where keys and values live."""

    def __init__(self, model: PreTrainedModel, *, attention_window: int | None = None, attention_sinks: int = 0) -> None:
        config = model.config
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"the local backend serves {sorted(SUPPORTED_MODEL_TYPES)} models, "
                                   f"not model_type {model_type!r}; serve it with the sglang backend")
        self.model = model
        self.body = model.get_decoder()
        self.layers = list(self.body.layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.context_length = int(getattr(config, "max_position_embeddings", 4096))
        if attention_window is not None and attention_window < 1:
            raise ValueError(f"attention_window must be at least 1 (or None for full attention), got {attention_window}")
        if attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {attention_sinks}")
        self.window = attention_window
        self.sinks = attention_sinks if attention_window is not None else 0
        self.dtype = next(model.parameters()).dtype

    def bytes_per_token(self) -> int:
        """KV bytes one cached token takes in the serving dtype (keys + values, every layer)."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize

    def _check_length(self, length: int) -> None:
        if length > self.context_length:
            raise ValueError(f"{length} tokens exceed the model's context length {self.context_length}")

    # -- the store's part (subclasses) --------------------------------------------------------------
    def acquire(self) -> int:
        raise NotImplementedError

    def release(self, seq: int) -> None:
        raise NotImplementedError

    def cache_bytes(self) -> int:
        raise NotImplementedError

    def copy_prefix(self, dst: int, src: int, n: int) -> None:
        raise NotImplementedError

    def export_prefix(self, seq: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def import_prefix(self, seq: int, kv: torch.Tensor, n: int) -> None:
        raise NotImplementedError

    def _reserve(self, seq: int, end: int) -> None:
        """Make room for positions ``< end`` of ``seq``."""
        raise NotImplementedError

    def _chunk_io(self, seq: int, start: int, end: int, ranges: Ranges) -> tuple[Writer, Reader]:
        """Store positions ``start..end-1`` of ``seq``; read its keys at ``ranges``."""
        raise NotImplementedError

    def _rows_io(self, seqs: list[int], positions: list[int], ranges: Ranges) -> tuple[Writer, Attend]:
        """Store one position per row; attend every row to its keys at ``ranges`` (masked per row)."""
        raise NotImplementedError

    def _sdpa(self, read: Reader) -> Attend:
        gqa = self.kv_heads != self.heads

        def attend(layer: int, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            keys, values = read(layer)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)

        return attend

    # -- sliding window ------------------------------------------------------------------------------
    def _windowed(self, end: int) -> bool:
        """Whether any query below position ``end`` has keys outside its window (else: full attention, exactly)."""
        return self.window is not None and end > self.window

    def _window_keys(self, lo_query: int, end: int) -> tuple[Ranges, torch.Tensor]:
        """Key ranges that queries at positions >= ``lo_query`` (below ``end``) can see, and their positions.

        The attention sinks (positions ``< sinks``) and ``[lo_query - window + 1, end)``; nothing older
        is read, which is where the window saves time at long contexts.
        """
        assert self.window is not None
        lo = max(0, lo_query - self.window + 1)
        if lo <= self.sinks:
            ranges = [(0, end)]
        else:
            ranges = [(0, self.sinks), (lo, end)] if self.sinks else [(lo, end)]
        positions = torch.cat([torch.arange(a, b) for a, b in ranges])
        return ranges, positions

    def _window_mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``(Q, K)`` visibility: causal, within the window, or a sink."""
        assert self.window is not None
        q, k = query_pos.view(-1, 1), key_pos.view(1, -1)
        return (k <= q) & ((k > q - self.window) | (k < self.sinks))

    def _chunk_mask(self, start: int, end: int) -> tuple[torch.Tensor | None, Ranges]:
        """Mask (None: plain causal) and key ranges of a prefill chunk at positions ``start..end-1``."""
        n = end - start
        if self._windowed(end):
            ranges, key_pos = self._window_keys(start, end)
            return self._window_mask(torch.arange(start, end), key_pos).view(1, 1, n, -1), ranges
        if start == 0:
            return None, [(0, end)]
        # causal with an offset: query t sees keys 0..start+t
        return (torch.arange(end).view(1, end) <= torch.arange(start, end).view(n, 1)).view(1, 1, n, end), [(0, end)]

    def _rows_mask(self, positions: list[int]) -> tuple[torch.Tensor, Ranges]:
        """Mask ``(B, 1, 1, K)`` and key ranges of decode rows: key j of row i is visible when j <= positions[i]."""
        batch, longest = len(positions), max(positions) + 1
        pos = torch.tensor(positions, dtype=torch.long)
        if self._windowed(longest):
            ranges, key_pos = self._window_keys(min(positions), longest)
            return self._window_mask(pos, key_pos).view(batch, 1, 1, -1), ranges
        return (torch.arange(longest).view(1, longest) <= pos.view(batch, 1)).view(batch, 1, 1, longest), [(0, longest)]

    # -- forward passes ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[int], positions: list[int], token_ids: list[int]) -> torch.Tensor:
        """One new token per row: ``token_ids[i]`` at ``positions[i]`` of ``seqs[i]``; returns logits (B, vocab)."""
        if not seqs:
            raise ValueError("decode() needs at least one row")
        logits = self.step([], seqs, positions, token_ids)[1]
        assert logits is not None
        return logits

    @torch.inference_mode()
    def prefill(self, seq: int, start: int, token_ids: list[int], *, logits: bool = True) -> torch.Tensor | None:
        """Run ``token_ids`` at positions ``start..`` of ``seq`` (which holds ``start`` tokens); logits of the last."""
        if not token_ids:
            raise ValueError("prefill() needs at least one token")
        out = self.step([(seq, start, token_ids)], [], [], [])[0][0]
        return out if logits else None

    @torch.inference_mode()
    def step(self, prefill: list[tuple[int, int, list[int]]], decode_seqs: list[int], decode_positions: list[int],
             decode_tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Prefill chunks of several sequences and one decode token per running row in ONE forward pass.

        ``prefill`` holds ``(seq, start, token_ids)`` chunks. All tokens are packed into one row, so the
        projections and MLPs (the cost on CPU) run as one GEMM over every token of the step; only the
        attention is split: each prefill chunk attends to its own sequence's keys, the decode rows attend
        as one batch. Returns the last-token logits of each prefill chunk and the decode rows' logits
        (``None`` when there are none).
        """
        if not prefill and not decode_seqs:
            raise ValueError("step() needs at least one prefill chunk or decode row")
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[tuple[torch.Tensor | None, Writer, Reader]] = []
        for seq, start, chunk in prefill:
            if not chunk:
                raise ValueError("step() got an empty prefill chunk")
            end = start + len(chunk)
            self._check_length(end)
            self._reserve(seq, end)
            ids.extend(chunk)
            positions.extend(range(start, end))
        # the store may have grown while reserving: the io closures are made after every reservation
        for seq, start, chunk in prefill:
            end = start + len(chunk)
            mask, ranges = self._chunk_mask(start, end)
            chunks.append((mask, *self._chunk_io(seq, start, end, ranges)))
        n_pre = len(ids)
        batch = len(decode_seqs)
        rows: tuple[torch.Tensor, Writer, Attend] | None = None
        if batch:
            self._check_length(max(decode_positions) + 1)
            for seq, p in zip(decode_seqs, decode_positions):
                self._reserve(seq, p + 1)
            ids.extend(decode_tokens)
            positions.extend(decode_positions)
            dec_mask, dec_ranges = self._rows_mask(decode_positions)
            rows = (dec_mask, *self._rows_io(decode_seqs, decode_positions, dec_ranges))
        total = len(ids)
        pos = torch.tensor(positions, dtype=torch.long).view(1, total)
        hidden = self.body.embed_tokens(torch.tensor(ids, dtype=torch.long).view(1, total))
        cos, sin = self._rotary(hidden, pos)
        gqa = self.kv_heads != self.heads
        last_rows = list(accumulate(len(chunk) for _, _, chunk in prefill))
        for layer, module in enumerate(self.layers):
            attn = module.self_attn
            x = module.input_layernorm(hidden)
            q, k, v = self._qkv(attn, x, 1, total, cos, sin)  # (1, heads, total, d)
            kt, vt = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (total, kv_heads, d)
            outs = []
            offset = 0
            for (seq, start, chunk), (mask, write, read) in zip(prefill, chunks):
                n = len(chunk)
                write(layer, kt[offset:offset + n], vt[offset:offset + n])
                keys, values = read(layer)
                out = F.scaled_dot_product_attention(q[:, :, offset:offset + n], keys, values, attn_mask=mask,
                                                     is_causal=mask is None, enable_gqa=gqa)
                outs.append(out[0].transpose(0, 1))  # (n, heads, d)
                offset += n
            if rows is not None:
                mask, write, attend = rows
                write(layer, kt[n_pre:], vt[n_pre:])
                dq = q[0, :, n_pre:].transpose(0, 1).unsqueeze(2)  # (B, heads, 1, d)
                outs.append(attend(layer, dq, mask)[:, :, 0])  # (B, heads, d)
            merged = torch.cat(outs, dim=0).reshape(1, total, -1)
            hidden = hidden + attn.o_proj(merged)
            hidden = hidden + module.mlp(module.post_attention_layernorm(hidden))
        pick = [r - 1 for r in last_rows] + list(range(n_pre, total))
        logits = self._logits(hidden[0, pick])
        return list(logits[: len(prefill)]), (logits[len(prefill):] if batch else None)

    # -- pieces ------------------------------------------------------------------------------------
    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.body.rotary_emb(hidden, position_ids)  # (B, T, head_dim)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _qkv(self, attn: LlamaAttention, x: torch.Tensor, batch: int, n: int, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = attn.q_proj(x).view(batch, n, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.body.norm(last_hidden)).float()



class SlotRunner(Runner):
    """Every sequence owns a row (a *slot*) of one ``(slots, kv_heads, capacity, head_dim)`` tensor per layer."""

    def __init__(self, model: PreTrainedModel, *, max_slots: int = 64, initial_capacity: int = 128,
                 attention_window: int | None = None, attention_sinks: int = 0) -> None:
        super().__init__(model, attention_window=attention_window, attention_sinks=attention_sinks)
        self.max_slots = max_slots
        self._capacity = max(1, min(initial_capacity, self.context_length))
        self._slots = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._free: list[int] = []
        self._grow(slots=min(8, max_slots), capacity=self._capacity)

    def acquire(self) -> int:
        """A free slot (the lowest one, so decode batches stay contiguous)."""
        if not self._free:
            if self._slots >= self.max_slots:
                raise RuntimeError(f"all {self.max_slots} KV slots are in use")
            self._grow(slots=min(self.max_slots, 2 * self._slots), capacity=self._capacity)
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    @property
    def capacity(self) -> int:
        return self._capacity

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _grow(self, *, slots: int, capacity: int) -> None:
        if slots == self._slots and capacity == self._capacity and self.k:
            return
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        new_k, new_v = [], []
        for layer in range(len(self.layers)):
            k = torch.zeros(shape, dtype=self.dtype)
            v = torch.zeros(shape, dtype=self.dtype)
            if self.k:
                old_slots, old_cap = self.k[layer].shape[0], self.k[layer].shape[2]
                k[:old_slots, :, :old_cap] = self.k[layer]
                v[:old_slots, :, :old_cap] = self.v[layer]
            new_k.append(k)
            new_v.append(v)
        self._free.extend(range(self._slots, slots))
        self.k, self.v, self._slots, self._capacity = new_k, new_v, slots, capacity

    def _reserve(self, seq: int, end: int) -> None:
        self._check_length(end)
        if end > self._capacity:
            cap = self._capacity
            while cap < end:
                cap *= 2
            self._grow(slots=self._slots, capacity=min(cap, self.context_length))

    @torch.inference_mode()
    def copy_prefix(self, dst: int, src: int, n: int) -> None:
        """Make slot ``dst`` hold the first ``n`` cached positions of slot ``src``."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]

    def export_prefix(self, seq: int, n: int) -> torch.Tensor:
        """A copy of the first ``n`` cached positions of ``seq``: ``(layers, 2, kv_heads, n, head_dim)``."""
        return torch.stack([torch.stack((k[seq, :, :n], v[seq, :, :n])) for k, v in zip(self.k, self.v)])

    @torch.inference_mode()
    def import_prefix(self, seq: int, kv: torch.Tensor, n: int) -> None:
        """Make ``seq`` hold the first ``n`` positions of ``kv`` (an :meth:`export_prefix` result)."""
        self._reserve(seq, n)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[seq, :, :n] = kv[layer, 0, :, :n]
            v[seq, :, :n] = kv[layer, 1, :, :n]

    @staticmethod
    def _gather(cache: torch.Tensor, ranges: Ranges) -> torch.Tensor:
        """Positions ``ranges`` of a ``(..., capacity, head_dim)`` cache view, concatenated (a view for one range)."""
        if len(ranges) == 1:
            return cache[..., ranges[0][0]:ranges[0][1], :]
        return torch.cat([cache[..., a:b, :] for a, b in ranges], dim=-2)

    def _chunk_io(self, seq: int, start: int, end: int, ranges: Ranges) -> tuple[Writer, Reader]:
        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer][seq, :, start:end] = k.transpose(0, 1)
            self.v[layer][seq, :, start:end] = v.transpose(0, 1)

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (self._gather(self.k[layer][seq:seq + 1], ranges), self._gather(self.v[layer][seq:seq + 1], ranges))

        return write, read

    def _rows_io(self, seqs: list[int], positions: list[int], ranges: Ranges) -> tuple[Writer, Attend]:
        batch = len(seqs)
        slot_t = torch.tensor(seqs, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        contiguous = seqs == list(range(batch))  # slots 0..B-1 (lowest-free allocation): a view, no copy

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer][slot_t, :, pos_t] = k
            self.v[layer][slot_t, :, pos_t] = v

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            cache_k, cache_v = self.k[layer], self.v[layer]
            if contiguous:
                return self._gather(cache_k[:batch], ranges), self._gather(cache_v[:batch], ranges)
            return (self._gather(cache_k, ranges).index_select(0, slot_t),
                    self._gather(cache_v, ranges).index_select(0, slot_t))

        return write, self._sdpa(read)


class PagedRunner(Runner):
    """Keys and values in one pool of fixed-size blocks per layer, read and written through the sequences'
    block tables (``tables``, ``local/blocktable.py``); see the module docstring."""

    def __init__(self, model: PreTrainedModel, *, max_seqs: int = 64, max_tokens: int = 65536, block_size: int = 16,
                 initial_tokens: int = 4096, attention_window: int | None = None, attention_sinks: int = 0) -> None:
        super().__init__(model, attention_window=attention_window, attention_sinks=attention_sinks)
        self.pool = BlockPool(layers=len(self.layers), kv_heads=self.kv_heads, head_dim=self.head_dim,
                              dtype=self.dtype, max_tokens=max_tokens, block_size=block_size,
                              initial_tokens=initial_tokens)
        """The blocks themselves: which are free, who holds them (``local/blockpool.py``)."""
        self.tables = BlockTables(self.pool, max_seqs=max_seqs, window=self.window, sinks=self.sinks)
        """Which blocks each sequence holds, a window's released ones, what may be shared (``local/blocktable.py``)."""
        self.block_size = block_size
        self.max_blocks = self.pool.max_blocks
        """The pool's bound in blocks (``max_tokens // block_size``)."""

    @property
    def max_seqs(self) -> int:
        """Sequences that may hold tables at once (the tables' bound)."""
        return self.tables.max_seqs

    @property
    def k(self) -> list[torch.Tensor]:
        return self.pool.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.pool.v

    def blocks_for(self, tokens: int) -> int:
        return self.pool.blocks_for(tokens)

    def cache_bytes(self) -> int:
        return self.pool.cache_bytes()

    # -- sequences (their tables) ------------------------------------------------------------------
    def acquire(self) -> int:
        return self.tables.acquire()

    def release(self, seq: int) -> None:
        self.tables.release(seq)

    def _reserve(self, seq: int, end: int) -> None:
        self.tables.reserve(seq, end)

    # -- prefixes: shared blocks, copied keys and values ---------------------------------------------
    @torch.inference_mode()
    def adopt(self, seq: int, blocks: list[int], tail_block: int = -1, tail: int = 0) -> None:
        """Make ``seq`` hold ``blocks`` (full blocks of a prefix, shared) then the first ``tail`` positions
        of ``tail_block`` (copied into a block of its own: copy on write)."""
        block = self.tables.adopt(seq, blocks, own_tail=bool(tail))
        if tail:
            a, b = tail_block * self.block_size, block * self.block_size
            for k, v in zip(self.k, self.v):
                k[b:b + tail] = k[a:a + tail]
                v[b:b + tail] = v[a:a + tail]

    def copy_prefix(self, dst: int, src: int, n: int) -> None:
        """Make ``dst`` hold the first ``n`` positions of ``src``: its full blocks shared, a partial one copied."""
        source = self.tables.view(src)
        full, rest = divmod(n, self.block_size)
        self.adopt(dst, source[:full], source[full] if rest else -1, rest)

    def _flat(self, table: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Pool rows of ``positions`` of a sequence whose blocks are ``table``."""
        blocks = torch.tensor(table, dtype=torch.long).clamp_min(0)  # a HOLE reads block 0: behind the mask
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def export_blocks(self, blocks: list[int], n: int) -> torch.Tensor:
        """A copy of positions ``0..n-1`` held by ``blocks``: ``(layers, 2, kv_heads, n, head_dim)``."""
        idx = self._flat(blocks, torch.arange(n))
        return torch.stack([torch.stack((k.index_select(0, idx).transpose(0, 1), v.index_select(0, idx).transpose(0, 1)))
                            for k, v in zip(self.k, self.v)])

    def export_prefix(self, seq: int, n: int) -> torch.Tensor:
        """A copy of the first ``n`` cached positions of ``seq``: ``(layers, 2, kv_heads, n, head_dim)``."""
        return self.export_blocks(self.tables.view(seq), n)

    @torch.inference_mode()
    def import_prefix(self, seq: int, kv: torch.Tensor, n: int) -> None:
        """Make ``seq`` hold the first ``n`` positions of ``kv`` (an :meth:`export_prefix` result) in new blocks."""
        self.tables.clear(seq)
        self.tables.reserve(seq, n)
        idx = self._flat(self.tables.view(seq), torch.arange(n))
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k.index_copy_(0, idx, kv[layer, 0, :, :n].transpose(0, 1).to(k.dtype))
            v.index_copy_(0, idx, kv[layer, 1, :, :n].transpose(0, 1).to(v.dtype))

    # -- the forward pass's reads and writes ---------------------------------------------------------
    @staticmethod
    def _key_positions(ranges: Ranges) -> torch.Tensor:
        if len(ranges) == 1:
            return torch.arange(ranges[0][0], ranges[0][1])
        return torch.cat([torch.arange(a, b) for a, b in ranges])

    def _chunk_io(self, seq: int, start: int, end: int, ranges: Ranges) -> tuple[Writer, Reader]:
        table = self.tables.view(seq)
        widx = self._flat(table, torch.arange(start, end))
        ridx = self._flat(table, self._key_positions(ranges))

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer].index_copy_(0, widx, k)
            self.v[layer].index_copy_(0, widx, v)

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (self.k[layer].index_select(0, ridx).transpose(0, 1).unsqueeze(0),
                    self.v[layer].index_select(0, ridx).transpose(0, 1).unsqueeze(0))

        return write, read

    def _rows_io(self, seqs: list[int], positions: list[int], ranges: Ranges) -> tuple[Writer, Attend]:
        bs = self.block_size
        tables = [self.tables.view(s) for s in seqs]
        pos = torch.tensor(positions, dtype=torch.long)
        last = torch.tensor([t[p // bs] for t, p in zip(tables, positions)], dtype=torch.long)
        widx = last * bs + pos % bs

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer].index_copy_(0, widx, k)
            self.v[layer].index_copy_(0, widx, v)

        # the cascade reads a group's shared keys unmasked: only where every row sees all of them (no window)
        full = len(ranges) == 1 and ranges[0][0] == 0 and not self._windowed(max(positions) + 1)
        groups = self._cascade_groups(tables) if full else []
        grouped = {i for rows, _ in groups for i in rows}
        rest = [i for i in range(len(seqs)) if i not in grouped]
        gathered = self._gather_rows([tables[i] for i in rest], self._key_positions(ranges)) if rest else None
        suffixes = [self._suffix_io([tables[i] for i in rows], [positions[i] for i in rows], shared)
                    for rows, shared in groups]

        dense = self._sdpa(gathered) if gathered is not None else None
        if not groups:
            assert dense is not None
            return write, dense
        rest_index = torch.tensor(rest, dtype=torch.long)
        group_index = [torch.tensor(rows, dtype=torch.long) for rows, _ in groups]

        def attend(layer: int, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(q)
            if dense is not None:
                out[rest_index] = dense(layer, q[rest_index], mask[rest_index])
            for index, (_, shared), suffix in zip(group_index, groups, suffixes):
                out[index] = self._cascade(layer, q[index], shared, *suffix)
            return out

        return write, attend

    # -- decode attention: gathered rows, and the cascade over a group's shared prefix -----------------
    @staticmethod
    def _padded(tables: list[list[int]], width: int = 0) -> torch.Tensor:
        """Block tables as one ``(rows, max(longest, width))`` tensor; padding is block 0, behind every row's mask."""
        padded = torch.zeros(len(tables), max([width, *map(len, tables)]), dtype=torch.long)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.long).clamp_min(0)  # HOLE: block 0, masked
        return padded

    def _gather_rows(self, tables: list[list[int]], key_pos: torch.Tensor) -> Reader:
        """Every row's keys at ``key_pos``, gathered through its table (one ``index_select`` per layer)."""
        bs, batch = self.block_size, len(tables)
        # the keys span the whole batch's longest row; these rows (a cascade group's left out) may all be shorter
        padded = self._padded(tables, int(key_pos.max()) // bs + 1)
        ridx = (padded[:, key_pos // bs] * bs + key_pos % bs).view(-1)
        shape = (batch, key_pos.numel(), self.kv_heads, self.head_dim)

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (self.k[layer].index_select(0, ridx).view(shape).transpose(1, 2),
                    self.v[layer].index_select(0, ridx).view(shape).transpose(1, 2))

        return read

    CASCADE_MIN_TOKENS = 64
    """Decode rows whose block tables start with the same blocks for at least this many tokens attend to
    that shared prefix together (one read of its keys for the whole group)."""

    def _cascade_groups(self, tables: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """Rows (two or more) whose tables share their first blocks, and those shared blocks."""
        by_first: dict[int, list[int]] = {}
        for i, t in enumerate(tables):
            if t:
                by_first.setdefault(t[0], []).append(i)
        groups = []
        for rows in by_first.values():
            if len(rows) < 2:
                continue
            shared = tables[rows[0]]
            for i in rows[1:]:
                shared = shared[:common_prefix(shared, tables[i])]
            # the block a row writes now is its own (copy on write), so every shared key is behind each row
            shared = shared[: min(len(tables[i]) for i in rows) - 1]
            if len(shared) * self.block_size >= self.CASCADE_MIN_TOKENS:
                groups.append((rows, shared))
        return groups

    def _suffix_io(self, tables: list[list[int]], positions: list[int], shared: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows of each row's keys past the shared blocks (padded) and their validity ``(R, T)``."""
        start = len(shared) * self.block_size
        lengths = [p + 1 - start for p in positions]
        width = max(lengths)
        key_pos = start + torch.arange(width)
        padded = self._padded(tables)
        valid = torch.arange(width).view(1, -1) < torch.tensor(lengths).view(-1, 1)
        cols = torch.where(valid, key_pos.view(1, -1), torch.full_like(key_pos.view(1, -1), start))
        ridx = padded.gather(1, cols // self.block_size) * self.block_size + cols % self.block_size
        return ridx, valid

    def _cascade(self, layer: int, q: torch.Tensor, shared: list[int], ridx: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
        """Attention of ``R`` decode rows ``(R, heads, 1, d)`` over a shared prefix read once plus their own keys.

        The softmax is split in two (FlashInfer's cascade attention): the shared blocks' keys are read once
        (a view when the blocks are consecutive) for all ``R x heads`` queries as one matrix product; each
        row's own keys after them are gathered; the two partial softmaxes merge through their maxima and sums.
        """
        rows, kvh, d = q.shape[0], self.kv_heads, self.head_dim
        group = self.heads // kvh
        scale = d ** -0.5
        bs, pool_k, pool_v = self.block_size, self.k[layer], self.v[layer]
        if shared == list(range(shared[0], shared[0] + len(shared))):
            span = slice(shared[0] * bs, (shared[-1] + 1) * bs)
            ks, vs = pool_k[span], pool_v[span]  # (S, kvh, d) views
        else:
            idx = self._flat(shared, torch.arange(len(shared) * bs))
            ks, vs = pool_k.index_select(0, idx), pool_v.index_select(0, idx)
        qg = q.view(rows, kvh, group, d).permute(1, 0, 2, 3).reshape(kvh, rows * group, d)
        s1 = torch.matmul(qg, ks.permute(1, 2, 0)).float() * scale  # (kvh, R*g, S)
        m1 = s1.amax(-1, keepdim=True)
        p1 = torch.exp(s1 - m1)
        l1 = p1.sum(-1, keepdim=True)
        o1 = torch.matmul(p1.to(vs.dtype), vs.transpose(0, 1)).float()  # (kvh, R*g, d)

        def per_row(t: torch.Tensor) -> torch.Tensor:  # (kvh, R*g, x) -> (R, kvh, g, x)
            return t.view(kvh, rows, group, -1).permute(1, 0, 2, 3)

        m1, l1, o1 = per_row(m1), per_row(l1), per_row(o1)
        width = ridx.shape[1]
        k2 = pool_k.index_select(0, ridx.view(-1)).view(rows, width, kvh, d).permute(0, 2, 3, 1)  # (R, kvh, d, T)
        v2 = pool_v.index_select(0, ridx.view(-1)).view(rows, width, kvh, d).transpose(1, 2)  # (R, kvh, T, d)
        s2 = torch.matmul(q.view(rows, kvh, group, d), k2).float() * scale  # (R, kvh, g, T)
        s2 = s2.masked_fill(~valid.view(rows, 1, 1, width), float("-inf"))
        m2 = s2.amax(-1, keepdim=True)
        p2 = torch.exp(s2 - m2)
        l2 = p2.sum(-1, keepdim=True)
        o2 = torch.matmul(p2.to(v2.dtype), v2).float()  # (R, kvh, g, d)
        m = torch.maximum(m1, m2)
        a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
        out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
        return out.reshape(rows, self.heads, 1, d).to(q.dtype)

def build_runner(model: PreTrainedModel, kind: str, *, max_seqs: int, kv_tokens: int, block_size: int = 16,
                 attention_window: int | None = None, attention_sinks: int = 0) -> PagedRunner | SlotRunner:
    """The runner of ``kind`` (one of :data:`KV_CACHES`)."""
    if kind == "paged":
        return PagedRunner(model, max_seqs=max_seqs, max_tokens=kv_tokens, block_size=block_size,
                           attention_window=attention_window, attention_sinks=attention_sinks)
    if kind == "slot":
        return SlotRunner(model, max_slots=max_seqs, attention_window=attention_window, attention_sinks=attention_sinks)
    raise ValueError(f"kv_cache must be one of {list(KV_CACHES)}, not {kind!r}")
