"""Forward passes of a Llama-family causal LM over a slot KV cache (CPU, no grad).

The local engine keeps every running sequence's keys and values in one preallocated tensor per layer,
``(slots, kv_heads, capacity, head_dim)``: a sequence owns a *slot* (a row) for its whole life, and its
``n`` cached tokens are that row's first ``n`` positions. Nothing is restacked or re-padded between
steps, which is what made the earlier per-sequence cache (one tensor per sequence, padded into a batch
at every step) slower than plain ``transformers`` ``generate`` on a real model.

- :meth:`SlotRunner.decode` runs one new token for each of many sequences in ONE batched pass: each
  row writes its key/value at its own position and attends to its own slot under a length mask. When
  the rows are slots ``0..B-1`` in order (the common case: the engine hands out the lowest free slots)
  the keys are a view of the cache, not a copy.
- :meth:`SlotRunner.prefill` runs a chunk of new tokens of one sequence against what its slot already
  holds (chunked prefill: peak attention memory ~ chunk x context, not context squared).
- :meth:`SlotRunner.copy_prefix` copies the first ``n`` cached positions of one slot into another:
  the engine's prefix sharing (a GRPO group's ``G`` samples share a prompt: it is computed once).

The math is the model's own: embeddings, norms, MLPs, rotary embedding and projections are the Hugging
Face modules themselves, called here; only attention against the slot cache is written out. So a
weight update that loads new tensors into the model (``load_state_dict``) takes effect on the next
pass, and the logits agree with the Hugging Face forward to float rounding (tested). Supported
families: Llama, Qwen2 (q/k/v biases come with its Linear modules) and Mistral (without its sliding
window: contexts longer than the window are attended in full).

- :meth:`SlotRunner.export_prefix` / :meth:`SlotRunner.import_prefix` copy a slot's first ``n`` positions
  out to a tensor and back: the engine's retained prefix cache (``local/prefix_cache.py``).

Sliding-window attention (``attention_window``, ``attention_sinks``; default off): the token at position
``p`` attends to positions ``p - window + 1 .. p`` and to the first ``sinks`` positions. Keys older than
every query's window are not read at all (the saving at long contexts); while no position reaches past
the window the full-attention code path runs, so a window longer than the context is full attention
exactly (tested). It changes the model's outputs: the long-context load test measures by how much.

The cache grows on demand: slots and capacity double when needed, up to ``max_slots`` and the
model's context length. Memory per cached token is ``2 x layers x kv_heads x head_dim x 4`` bytes in
fp32 (46 KB for SmolLM2-135M), times slots x capacity allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

if TYPE_CHECKING:  # the layout the runner drives (SmolLM2 is a Llama)
    from transformers.models.llama.modeling_llama import LlamaAttention

__all__ = ["SUPPORTED_MODEL_TYPES", "SlotRunner", "UnsupportedModel"]

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


class UnsupportedModel(ValueError):
    """The local backend cannot serve this architecture."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotRunner:
    """Runs one model over sequences that each own a slot of a shared KV cache; see the module docstring."""

    def __init__(self, model: PreTrainedModel, *, max_slots: int = 64, initial_capacity: int = 128,
                 attention_window: int | None = None, attention_sinks: int = 0) -> None:
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
        self.max_slots = max_slots
        if attention_window is not None and attention_window < 1:
            raise ValueError(f"attention_window must be at least 1 (or None for full attention), got {attention_window}")
        if attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {attention_sinks}")
        self.window = attention_window
        self.sinks = attention_sinks if attention_window is not None else 0
        self.dtype = next(model.parameters()).dtype
        self._capacity = max(1, min(initial_capacity, self.context_length))
        self._slots = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._free: list[int] = []
        self._grow(slots=min(8, max_slots), capacity=self._capacity)

    # -- slots -------------------------------------------------------------------------------------
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

    def bytes_per_token(self) -> int:
        """KV bytes one cached token takes in the serving dtype (keys + values, every layer)."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize

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

    def _ensure_capacity(self, length: int) -> None:
        if length > self.context_length:
            raise ValueError(f"{length} tokens exceed the model's context length {self.context_length}")
        if length > self._capacity:
            cap = self._capacity
            while cap < length:
                cap *= 2
            self._grow(slots=self._slots, capacity=min(cap, self.context_length))

    @torch.inference_mode()
    def copy_prefix(self, dst: int, src: int, n: int) -> None:
        """Make slot ``dst`` hold the first ``n`` cached positions of slot ``src``."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]

    def export_prefix(self, slot: int, n: int) -> torch.Tensor:
        """A copy of the first ``n`` cached positions of ``slot``: ``(layers, 2, kv_heads, n, head_dim)``."""
        return torch.stack([torch.stack((k[slot, :, :n], v[slot, :, :n])) for k, v in zip(self.k, self.v)])

    @torch.inference_mode()
    def import_prefix(self, slot: int, kv: torch.Tensor, n: int) -> None:
        """Make ``slot`` hold the first ``n`` positions of ``kv`` (an :meth:`export_prefix` result)."""
        self._ensure_capacity(n)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[slot, :, :n] = kv[layer, 0, :, :n]
            v[slot, :, :n] = kv[layer, 1, :, :n]

    # -- sliding window ------------------------------------------------------------------------------
    def _windowed(self, end: int) -> bool:
        """Whether any query below position ``end`` has keys outside its window (else: full attention, exactly)."""
        return self.window is not None and end > self.window

    def _window_keys(self, lo_query: int, end: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
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

    def _chunk_mask(self, start: int, end: int) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
        """Mask (None: plain causal) and key ranges of a prefill chunk at positions ``start..end-1``."""
        n = end - start
        if self._windowed(end):
            ranges, key_pos = self._window_keys(start, end)
            return self._window_mask(torch.arange(start, end), key_pos).view(1, 1, n, -1), ranges
        if start == 0:
            return None, [(0, end)]
        # causal with an offset: query t sees keys 0..start+t
        return (torch.arange(end).view(1, end) <= torch.arange(start, end).view(n, 1)).view(1, 1, n, end), [(0, end)]

    @staticmethod
    def _gather(cache: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Positions ``ranges`` of a ``(..., capacity, head_dim)`` cache view, concatenated (a view for one range)."""
        if len(ranges) == 1:
            return cache[..., ranges[0][0]:ranges[0][1], :]
        return torch.cat([cache[..., a:b, :] for a, b in ranges], dim=-2)

    # -- forward passes ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, slots: list[int], positions: list[int], token_ids: list[int]) -> torch.Tensor:
        """One new token per row: ``token_ids[i]`` at ``positions[i]`` of ``slots[i]``; returns logits (B, vocab)."""
        if not slots:
            raise ValueError("decode() needs at least one row")
        batch = len(slots)
        longest = max(positions) + 1
        self._ensure_capacity(longest)
        pos = torch.tensor(positions, dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long)
        contiguous = slots == list(range(batch))
        # key j of row i is visible when j <= positions[i] (and, with a window, within it or a sink)
        ranges: list[tuple[int, int]] | None = None
        if self._windowed(longest):
            ranges, key_pos = self._window_keys(min(positions), longest)
            mask = self._window_mask(pos, key_pos).view(batch, 1, 1, -1)
        else:
            mask = (torch.arange(longest).view(1, longest) <= pos.view(batch, 1)).view(batch, 1, 1, longest)
        hidden = self.body.embed_tokens(torch.tensor(token_ids, dtype=torch.long).view(batch, 1))
        cos, sin = self._rotary(hidden, pos.view(batch, 1))
        for layer, module in enumerate(self.layers):
            attn = module.self_attn
            x = module.input_layernorm(hidden)
            q, k, v = self._qkv(attn, x, batch, 1, cos, sin)
            cache_k, cache_v = self.k[layer], self.v[layer]
            cache_k[slot_t, :, pos] = k[:, :, 0]
            cache_v[slot_t, :, pos] = v[:, :, 0]
            if ranges is not None:
                src_k, src_v = (cache_k[:batch], cache_v[:batch]) if contiguous else (cache_k, cache_v)
                keys, values = self._gather(src_k, ranges), self._gather(src_v, ranges)
                if not contiguous:
                    keys, values = keys.index_select(0, slot_t), values.index_select(0, slot_t)
            elif contiguous:
                keys, values = cache_k[:batch, :, :longest], cache_v[:batch, :, :longest]
            else:
                keys = cache_k[:, :, :longest].index_select(0, slot_t)
                values = cache_v[:, :, :longest].index_select(0, slot_t)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=self.kv_heads != self.heads)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
            hidden = hidden + module.mlp(module.post_attention_layernorm(hidden))
        return self._logits(hidden[:, -1])

    @torch.inference_mode()
    def prefill(self, slot: int, start: int, token_ids: list[int], *, logits: bool = True) -> torch.Tensor | None:
        """Run ``token_ids`` at positions ``start..`` of ``slot`` (which holds ``start`` tokens); logits of the last."""
        n = len(token_ids)
        if n < 1:
            raise ValueError("prefill() needs at least one token")
        end = start + n
        self._ensure_capacity(end)
        pos = torch.arange(start, end).view(1, n)
        hidden = self.body.embed_tokens(torch.tensor(token_ids, dtype=torch.long).view(1, n))
        cos, sin = self._rotary(hidden, pos)
        mask, ranges = self._chunk_mask(start, end)
        for layer, module in enumerate(self.layers):
            attn = module.self_attn
            x = module.input_layernorm(hidden)
            q, k, v = self._qkv(attn, x, 1, n, cos, sin)
            cache_k, cache_v = self.k[layer], self.v[layer]
            cache_k[slot, :, start:end] = k[0]
            cache_v[slot, :, start:end] = v[0]
            keys, values = self._gather(cache_k[slot : slot + 1], ranges), self._gather(cache_v[slot : slot + 1], ranges)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=self.kv_heads != self.heads)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
            hidden = hidden + module.mlp(module.post_attention_layernorm(hidden))
        return self._logits(hidden[:, -1])[0] if logits else None

    @torch.inference_mode()
    def step(self, prefill: list[tuple[int, int, list[int]]], decode_slots: list[int], decode_positions: list[int],
             decode_tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Prefill chunks of several sequences and one decode token per running row in ONE forward pass.

        ``prefill`` holds ``(slot, start, token_ids)`` chunks. All tokens are packed into one row, so the
        projections and MLPs (the cost on CPU) run as one GEMM over every token of the step; only the
        attention is split: each prefill chunk attends to its own slot, the decode rows attend as one
        batch like :meth:`decode`. Returns the last-token logits of each prefill chunk and the decode
        rows' logits (``None`` when there are none).
        """
        if not prefill and not decode_slots:
            raise ValueError("step() needs at least one prefill chunk or decode row")
        ids: list[int] = []
        positions: list[int] = []
        for slot, start, chunk in prefill:
            if not chunk:
                raise ValueError("step() got an empty prefill chunk")
            self._ensure_capacity(start + len(chunk))
            ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
        n_pre = len(ids)
        batch = len(decode_slots)
        if batch:
            self._ensure_capacity(max(decode_positions) + 1)
            ids.extend(decode_tokens)
            positions.extend(decode_positions)
        total = len(ids)
        pos = torch.tensor(positions, dtype=torch.long).view(1, total)
        hidden = self.body.embed_tokens(torch.tensor(ids, dtype=torch.long).view(1, total))
        cos, sin = self._rotary(hidden, pos)
        dec_mask = dec_slot = dec_pos = None
        dec_ranges: list[tuple[int, int]] = []
        if batch:
            longest = max(decode_positions) + 1
            dec_pos = torch.tensor(decode_positions, dtype=torch.long)
            dec_slot = torch.tensor(decode_slots, dtype=torch.long)
            if self._windowed(longest):
                dec_ranges, key_pos = self._window_keys(min(decode_positions), longest)
                dec_mask = self._window_mask(dec_pos, key_pos).view(batch, 1, 1, -1)
            else:
                dec_ranges = [(0, longest)]
                dec_mask = (torch.arange(longest).view(1, longest) <= dec_pos.view(batch, 1)).view(batch, 1, 1, longest)
        masks = [self._chunk_mask(start, start + len(chunk)) for _, start, chunk in prefill]
        gqa = self.kv_heads != self.heads
        last_rows: list[int] = []
        for layer, module in enumerate(self.layers):
            attn = module.self_attn
            x = module.input_layernorm(hidden)
            q, k, v = self._qkv(attn, x, 1, total, cos, sin)  # (1, heads, total, d)
            cache_k, cache_v = self.k[layer], self.v[layer]
            outs = []
            offset = 0
            for (slot, start, chunk), (mask, ranges) in zip(prefill, masks):
                n, end = len(chunk), start + len(chunk)
                cache_k[slot, :, start:end] = k[0, :, offset:offset + n]
                cache_v[slot, :, start:end] = v[0, :, offset:offset + n]
                out = F.scaled_dot_product_attention(
                    q[:, :, offset:offset + n], self._gather(cache_k[slot:slot + 1], ranges),
                    self._gather(cache_v[slot:slot + 1], ranges), attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
                outs.append(out[0].transpose(0, 1))  # (n, heads, d)
                offset += n
                if layer == 0:
                    last_rows.append(offset - 1)
            if dec_slot is not None:
                dk, dv = k[0, :, n_pre:].transpose(0, 1), v[0, :, n_pre:].transpose(0, 1)  # (B, kv_heads, d)
                cache_k[dec_slot, :, dec_pos] = dk
                cache_v[dec_slot, :, dec_pos] = dv
                if decode_slots == list(range(batch)):  # slots 0..B-1 (lowest-free allocation): a view, no copy
                    keys, values = self._gather(cache_k[:batch], dec_ranges), self._gather(cache_v[:batch], dec_ranges)
                else:
                    assert dec_slot is not None
                    keys = self._gather(cache_k, dec_ranges).index_select(0, dec_slot)
                    values = self._gather(cache_v, dec_ranges).index_select(0, dec_slot)
                dq = q[0, :, n_pre:].transpose(0, 1).unsqueeze(2)  # (B, heads, 1, d)
                out = F.scaled_dot_product_attention(dq, keys, values, attn_mask=dec_mask, enable_gqa=gqa)
                outs.append(out[:, :, 0])  # (B, heads, d)
            merged = torch.cat(outs, dim=0).reshape(1, total, -1)
            hidden = hidden + attn.o_proj(merged)
            hidden = hidden + module.mlp(module.post_attention_layernorm(hidden))
        pick = last_rows + list(range(n_pre, total))
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
