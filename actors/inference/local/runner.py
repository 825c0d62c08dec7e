"""Batched forward passes over sequences that each keep their own KV cache.

A sequence's cache is a tuple with one ``(keys, values)`` pair per layer, each of shape
``(1, kv_heads, length, head_dim)``. One call of :meth:`ModelRunner.forward` runs any number of
sequences, each with its own cached length ``L_i`` and ``n_i >= 1`` new tokens. Row ``i`` of the batch is
laid out as::

    [pad * (P - L_i)] [cached L_i] [pad * (N - n_i)] [new n_i]        P = max L_i, N = max n_i

so every row's last new token sits at the last position (only that position's logits are computed).
The attention mask is built here as a 4-D boolean tensor: query q may see key k when k is a real token
and k <= q, and every query sees itself. The self-edge keeps padding queries from having an all-masked
row (which gives NaN in SDPA, and a NaN value would poison real tokens through ``0 * NaN``); real
queries never see padding keys, so whatever the padding computes is never read. Positions (RoPE) are
the true per-sequence positions. After the pass each row's cache is cut back to ``[cached] [new]``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache, PreTrainedModel

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's part of a batched pass: its cache (``None`` when empty) and its new token ids."""

    cache: KVCache | None
    new_ids: list[int]

    @property
    def cached_len(self) -> int:
        return 0 if self.cache is None else int(self.cache[0][0].shape[-2])


class ModelRunner:
    """Runs a Hugging Face causal LM over ragged batches with per-sequence KV caches (CPU, no grad)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed the forward argument `past_key_values` to `cache`.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._eager = getattr(self.config, "_attn_implementation", "sdpa") == "eager"
        self.pad_id = int(getattr(self.config, "pad_token_id", None) or 0)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> tuple[torch.Tensor, list[KVCache]]:
        """Run one pass; return the logits of each row's last new token ``(B, vocab)`` and the new caches."""
        if not items:
            raise ValueError("forward() needs at least one item")
        batch = len(items)
        past_lens = [it.cached_len for it in items]
        new_lens = [len(it.new_ids) for it in items]
        if min(new_lens) < 1:
            raise ValueError("every item needs at least one new token")
        p_max, n_max = max(past_lens), max(new_lens)
        total = p_max + n_max

        input_ids = torch.full((batch, n_max), self.pad_id, dtype=torch.long)
        position_ids = torch.zeros((batch, n_max), dtype=torch.long)
        key_valid = torch.zeros((batch, total), dtype=torch.bool)
        for row, (it, past, new) in enumerate(zip(items, past_lens, new_lens)):
            input_ids[row, n_max - new :] = torch.tensor(it.new_ids, dtype=torch.long)
            position_ids[row, n_max - new :] = torch.arange(past, past + new)
            key_valid[row, p_max - past : p_max] = True
            key_valid[row, total - new :] = True

        q_pos = torch.arange(p_max, total).view(1, n_max, 1)
        k_pos = torch.arange(total).view(1, 1, total)
        allowed = key_valid.view(batch, 1, total) & (k_pos <= q_pos)
        allowed |= k_pos == q_pos
        mask = allowed.unsqueeze(1)  # (B, 1, N, P + N)
        if self._eager:
            # eager attention adds the mask to the scores instead of selecting with it.
            mask = torch.zeros(mask.shape, dtype=self.model.dtype).masked_fill(~mask, torch.finfo(self.model.dtype).min)

        cache = DynamicCache(ddp_cache_data=self._stack(items, past_lens, p_max)) if p_max > 0 else DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        logits = out.logits[:, -1, :].float()
        layers = [(k, v) for k, v, *_ in cache]
        new_caches: list[KVCache] = []
        for row, (past, new) in enumerate(zip(past_lens, new_lens)):
            new_caches.append(tuple((self._row_kv(k, row, p_max, past, total, new), self._row_kv(v, row, p_max, past, total, new)) for k, v in layers))
        return logits, new_caches

    @staticmethod
    def _row_kv(t: torch.Tensor, row: int, p_max: int, past: int, total: int, new: int) -> torch.Tensor:
        if new == total - p_max:
            # no padding between this row's cached and new tokens: a view, no copy (it keeps the
            # step's batched tensor alive until the row's next step replaces it)
            return t[row : row + 1, :, p_max - past :]
        cached = t[row : row + 1, :, p_max - past : p_max]
        fresh = t[row : row + 1, :, total - new :]
        return torch.cat([cached, fresh], dim=2)

    @staticmethod
    def _stack(items: list[ForwardItem], past_lens: list[int], p_max: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Left-pad every row's cache to ``p_max``: one ``(B, heads, p_max, dim)`` pair per layer."""
        ref = next(it.cache for it in items if it.cache is not None)
        empty = ref[0][0][0, :, :0]  # (heads, 0, dim)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(len(ref)):
            stacked = []
            for kv in (0, 1):
                rows = [(it.cache[layer][kv][0] if it.cache is not None else empty).transpose(0, 1) for it in items]
                padded = pad_sequence(rows, batch_first=True, padding_side="left")  # (B, p_max, heads, dim)
                stacked.append(padded.transpose(1, 2))
            layers.append((stacked[0], stacked[1]))
        return layers
