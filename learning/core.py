"""The learner's core: loss math, staleness, de-duplication and the ledger. No Kafka, no NATS.

``Learner`` is driven by whoever feeds it experience (``actors/learner.py`` wraps it with Kafka and
NATS; the unit tests feed it by hand):

- ``offer(exp, source, offset)`` classifies one record at once: ``duplicate`` (its ``sample_id`` was
  already seen: not a new sample), ``dropped_stale`` (learner version - ``exp.min_version()`` exceeds
  ``max_staleness``), ``filtered`` (``exp.filtered`` is set upstream), or ``train``. Stale wins over
  filtered, so a very late duplicate whose id was evicted from the seen set (see ``SeenIds``) can
  only ever land in ``dropped_stale``, never in a trained batch.
- Offered records stay *pending* until the batch holds ``batch_size`` trainable samples; ``step()``
  then trains on them and *folds* the pending records in: the ledger, the seen ids and the consumed
  offsets advance only there. A crash before ``step()`` returns leaves no trace of the pending
  records, so replaying from the saved offsets neither loses nor double-counts one.
- Ledger invariant: ``trained + dropped_stale + filtered`` == distinct sample ids folded; duplicate
  records are counted apart (``duplicates``).
- The learner version counts weight publications: it starts at 0 (the initial weights) and goes up
  by one every ``publish_every`` steps, so it is the number inference actors stamp on tokens.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from learning import lora
from learning.mismatch import gap_stats, same_version_gaps
from engine.config import LearnerConfig
from engine.schemas import Experience

log = logging.getLogger("rollout.learner")

Verdict = Literal["train", "dropped_stale", "filtered", "duplicate"]
Source = tuple[str, int]
"""(topic, partition) a record came from."""

DEFAULT_MAX_SEEN_IDS = 1_000_000


# -- the ledger and the seen ids ---------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Ledger:
    """Where every consumed sample went; ``reasons`` counts filter reasons and ``stale``."""

    trained: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    duplicates: int = 0
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def consumed(self) -> int:
        """Distinct samples accounted for (duplicate records excluded)."""
        return self.trained + self.dropped_stale + self.filtered

    def count(self, verdict: Verdict, reason: str = "") -> None:
        if verdict == "train":
            self.trained += 1
        elif verdict == "dropped_stale":
            self.dropped_stale += 1
        elif verdict == "filtered":
            self.filtered += 1
        else:
            self.duplicates += 1
        if reason:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def merge(self, other: "Ledger") -> None:
        self.trained += other.trained
        self.dropped_stale += other.dropped_stale
        self.filtered += other.filtered
        self.duplicates += other.duplicates
        for k, v in other.reasons.items():
            self.reasons[k] = self.reasons.get(k, 0) + v

    def to_dict(self) -> dict[str, Any]:
        return {"trained": self.trained, "dropped_stale": self.dropped_stale, "filtered": self.filtered,
                "duplicates": self.duplicates, "consumed": self.consumed, "reasons": dict(self.reasons)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Ledger":
        return cls(trained=d["trained"], dropped_stale=d["dropped_stale"], filtered=d["filtered"],
                   duplicates=d["duplicates"], reasons=dict(d.get("reasons", {})))


class SeenIds:
    """Sample ids folded into the model's lineage, with their ``min_version``; bounded.

    Bound: ``max_ids`` ids; beyond it the oldest versions are evicted first, with a warning. Ids are
    NOT forgotten by age: a sample id can come back with *newer* weight versions (an inference actor
    killed after emitting part of a group regenerates the whole group under the same sample ids), and
    such a copy passes the staleness filter, so only the id set stops it from being trained twice.
    At 1,000,000 ids the set costs ~100 MB and covers far more samples than a run holds in flight.
    """

    def __init__(self, max_ids: int = DEFAULT_MAX_SEEN_IDS) -> None:
        self.max_ids = max_ids
        self._ids: dict[str, int] = {}

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, sample_id: str, min_version: int) -> None:
        self._ids[sample_id] = min_version

    def evict(self, version: int, max_staleness: int) -> int:
        """Enforce ``max_ids`` (oldest versions first); returns how many went."""
        before = len(self._ids)
        if len(self._ids) > self.max_ids:
            log.warning("seen-id set holds %d ids (cap %d): evicting the oldest; a duplicate of an "
                        "evicted id would not be recognised",
                        len(self._ids), self.max_ids)
            keep = sorted(self._ids.items(), key=lambda kv: kv[1])[-self.max_ids:]
            self._ids = dict(keep)
        return before - len(self._ids)

    def to_dict(self) -> dict[str, int]:
        return dict(self._ids)

    @classmethod
    def from_dict(cls, d: dict[str, int], max_ids: int = DEFAULT_MAX_SEEN_IDS) -> "SeenIds":
        s = cls(max_ids)
        s._ids = {str(k): int(v) for k, v in d.items()}
        return s


# -- loss math -------------------------------------------------------------------------------------

DEFAULT_LOGPROB_CHUNK = 512
"""Positions per chunk of the output projection + log-softmax: 512 x 49152 fp32 logits is ~100 MB."""


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """Padded tensors of a batch of samples; per-token tensors are [B, R] over response tokens."""

    input_ids: torch.Tensor  # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    target_pos: torch.Tensor  # [B, R] position in input_ids of each response token (0 on padding)
    behav_logp: torch.Tensor  # [B, R]
    loss_mask: torch.Tensor  # [B, R] bool: model tokens that are trained
    advantages: torch.Tensor  # [B, 1]
    temperature: torch.Tensor  # [B, 1, 1]


def sample_temperature(exp: Experience) -> float:
    """Sampling temperature of the behaviour policy (``Experience.temperature``, carried from the server).

    The learner divides the logits by it before the log-softmax, as the server did when it sampled; a
    temperature <= 0 is refused (the schema rejects it; this guards samples built in process).
    """
    t = exp.temperature
    if not 0 < t < math.inf:
        raise ValueError(f"sample {exp.sample_id}: temperature {t!r} is not > 0")
    return float(t)


def collate(samples: Sequence[Experience], pad_id: int = 0) -> Batch:
    """Right-pad a batch of variable-length samples (prompt + response) into tensors."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    t_max = max(lengths)
    r_max = max(1, max(len(s.response_ids) for s in samples))
    b = len(samples)
    input_ids = torch.full((b, t_max), pad_id, dtype=torch.long)
    attention = torch.zeros((b, t_max), dtype=torch.long)
    target_pos = torch.zeros((b, r_max), dtype=torch.long)
    behav = torch.zeros((b, r_max), dtype=torch.float32)
    mask = torch.zeros((b, r_max), dtype=torch.bool)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        seq = np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64)
        input_ids[i, : p + r] = torch.from_numpy(seq)
        attention[i, : p + r] = 1
        target_pos[i, :r] = torch.arange(p, p + r)
        behav[i, :r] = torch.from_numpy(s.logprobs.astype(np.float32))
        mask[i, :r] = torch.from_numpy(s.loss_mask.astype(bool))
        if p == 0 and r:
            mask[i, 0] = False  # nothing precedes the first token: there is no distribution to score
    advantages = torch.tensor([[s.advantage] for s in samples], dtype=torch.float32)
    temperature = torch.tensor([[[sample_temperature(s)]] for s in samples], dtype=torch.float32)
    return Batch(input_ids, attention, target_pos, behav, mask, advantages, temperature)


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                   temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` and the entropy (no grad) at ``hidden`` [N, H], in fp32."""
    logits = head(hidden.to(cast(torch.Tensor, head.weight).dtype)).float() / temperature.unsqueeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor | None, pred_index: torch.Tensor, targets: torch.Tensor,
                   temperature: torch.Tensor, *, chunk: int = DEFAULT_LOGPROB_CHUNK,
                   autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N] (and entropies [N], no grad) of ``targets`` predicted at rows of the flattened hidden states.

    Runs the transformer body once over ``input_ids`` [B, L], picks the hidden states at ``pred_index``
    (indices into the B * L flattened positions) and applies the output projection and the log-softmax
    only there, ``chunk`` positions at a time. Under autograd each chunk is checkpointed, so the
    full-vocabulary logits of a chunk live only while that chunk is computed (forward or backward):
    memory ~ chunk x vocab instead of batch x length x vocab.
    """
    body = model.get_decoder()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pred_index).float()
    head = model.get_output_embeddings()
    logps, entropies = [], []
    for s in range(0, len(pred_index), chunk):
        args = (picked[s:s + chunk], targets[s:s + chunk], temperature[s:s + chunk])
        if torch.is_grad_enabled() and picked.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_logprobs, head, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(head, *args)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = picked.new_zeros(0)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def response_logprobs(model: PreTrainedModel, batch: Batch, *, chunk: int = DEFAULT_LOGPROB_CHUNK) -> torch.Tensor:
    """Log-probabilities [B, R] of the response tokens under ``model`` at each sample's temperature."""
    b, r = batch.target_pos.shape
    t = batch.input_ids.shape[1]
    # Token at position t is predicted by the hidden state at t - 1.
    pred = (batch.target_pos - 1).clamp_min(0) + torch.arange(b).unsqueeze(1) * t
    targets = batch.input_ids.gather(1, batch.target_pos)
    temperature = batch.temperature.reshape(b, 1).expand(b, r)
    logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, None, pred.reshape(-1),
                             targets.reshape(-1), temperature.reshape(-1), chunk=chunk)
    return logp.reshape(b, r)


# -- shared-prefix packing ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Packed:
    """One forward pass worth of samples; per-token tensors are flat [N] over the response tokens.

    Rows are ``[prompt][resp_1]...[resp_k]`` for samples that share a prompt (or one sample each):
    ``attention_mask`` [B, 1, L, L] (True: may attend) lets each response see the prompt and its own
    earlier tokens only, and ``position_ids`` restart at len(prompt) for each response, so every
    response is computed exactly as if it followed the prompt alone, the prompt once.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, 1, L, L] bool
    position_ids: torch.Tensor  # [B, L]
    pred_index: torch.Tensor  # [N] index into the B * L positions of the hidden state predicting each token
    targets: torch.Tensor  # [N]
    temperature: torch.Tensor  # [N]
    behav_logp: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N] bool
    advantages: torch.Tensor  # [N]
    sample_index: torch.Tensor  # [N] index of the token's sample in the list given to ``pack``
    token_index: torch.Tensor  # [N] index of the token in its sample's response

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


def _rows(samples: Sequence[Experience], share_prefix: bool, budget: int) -> list[list[int]]:
    """Sample indices per row: samples with the identical prompt share a row while it fits ``budget``."""
    groups: dict[bytes, list[int]] = {}
    for i, s in enumerate(samples):
        key = np.asarray(s.prompt_ids, dtype=np.int64).tobytes() if share_prefix else i.to_bytes(8, "little")
        groups.setdefault(key, []).append(i)
    rows: list[list[int]] = []
    for idxs in groups.values():
        p = len(samples[idxs[0]].prompt_ids)
        row: list[int] = []
        length = p
        for i in idxs:
            r = len(samples[i].response_ids)
            if row and length + r > budget:
                rows.append(row)
                row, length = [], p
            row.append(i)
            length += r
        rows.append(row)
    return rows


def _row_length(samples: Sequence[Experience], row: list[int]) -> int:
    return len(samples[row[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in row)


def pack(samples: Sequence[Experience], *, micro_batch_tokens: int, share_prefix: bool = True,
         pad_id: int = 0, per_sample: bool = False) -> list[Packed]:
    """Split ``samples`` into micro-batches of rows, each under ``micro_batch_tokens`` padded tokens.

    A row longer than the budget (one long sample) forms a micro-batch alone. Rows are sorted by length
    so that rows of similar length share a micro-batch (less padding). ``per_sample``: one micro-batch per
    sample, its prompt and response alone (no padding, no shared prefix, the budget not used), in order.
    """
    if per_sample:
        return [_pack_rows(samples, [[i]], pad_id) for i in range(len(samples))]
    rows = sorted(_rows(samples, share_prefix, micro_batch_tokens), key=lambda r: -_row_length(samples, r))
    batches: list[list[list[int]]] = []
    for row in rows:
        length = _row_length(samples, row)
        if batches:
            cur = batches[-1]
            width = max(length, _row_length(samples, cur[0]))
            if (len(cur) + 1) * width <= micro_batch_tokens:
                cur.append(row)
                continue
        batches.append([row])
    return [_pack_rows(samples, rs, pad_id) for rs in batches]


def _pack_rows(samples: Sequence[Experience], rows: list[list[int]], pad_id: int) -> Packed:
    b = len(rows)
    width = max(_row_length(samples, r) for r in rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((b, width), dtype=torch.long)
    segment = torch.full((b, width), -2, dtype=torch.long)  # -1: prompt, k: the row's k-th response, -2: padding
    pred, targets, temp, behav, mask, adv, sidx, tidx = [], [], [], [], [], [], [], []
    for row_i, row in enumerate(rows):
        prompt = np.array(samples[row[0]].prompt_ids, dtype=np.int64)  # a copy: decoded arrays are read-only
        p = len(prompt)
        base = row_i * width
        input_ids[row_i, :p] = torch.from_numpy(prompt)
        position_ids[row_i, :p] = torch.arange(p)
        segment[row_i, :p] = -1
        start = p
        for k, i in enumerate(row):
            s = samples[i]
            r = len(s.response_ids)
            input_ids[row_i, start:start + r] = torch.from_numpy(np.array(s.response_ids, dtype=np.int64))
            position_ids[row_i, start:start + r] = torch.arange(p, p + r)
            segment[row_i, start:start + r] = k
            # token 0 is predicted by the prompt's last position (shared by the row), token t by start + t - 1
            where = torch.arange(start - 1, start + r - 1)
            if r:
                where[0] = p - 1 if p else start
            pred.append(base + where)
            targets.append(input_ids[row_i, start:start + r])
            temp.append(torch.full((r,), sample_temperature(s), dtype=torch.float32))
            behav.append(torch.from_numpy(np.array(s.logprobs, dtype=np.float32)))
            m = torch.from_numpy(np.array(s.loss_mask, dtype=bool))
            if p == 0 and r:
                m[0] = False  # nothing precedes the first token: there is no distribution to score
            mask.append(m)
            adv.append(torch.full((r,), float(s.advantage), dtype=torch.float32))
            sidx.append(torch.full((r,), i, dtype=torch.long))
            tidx.append(torch.arange(r))
            start += r
    q = torch.arange(width)
    causal = q.unsqueeze(1) >= q.unsqueeze(0)  # [L(query), L(key)]
    seg_q, seg_k = segment.unsqueeze(2), segment.unsqueeze(1)
    # Padding queries see the prompt and earlier padding: never an empty row (sdpa would give NaN).
    attention = causal & ((seg_k == -1) | (seg_k == seg_q))
    return Packed(input_ids, attention.unsqueeze(1), position_ids, torch.cat(pred), torch.cat(targets),
                  torch.cat(temp), torch.cat(behav), torch.cat(mask), torch.cat(adv), torch.cat(sidx),
                  torch.cat(tidx))


def _model_mask(model: PreTrainedModel, mask: torch.Tensor) -> torch.Tensor:
    """A boolean 4-D mask in the form the model's attention takes: sdpa/flex take booleans; eager adds it."""
    if getattr(model.config, "_attn_implementation", "sdpa") in ("sdpa", "flex_attention", None):
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def packed_logprobs(model: PreTrainedModel, mb: Packed, *, chunk: int = DEFAULT_LOGPROB_CHUNK,
                    autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N] and entropies [N] (no grad) of a packed micro-batch's response tokens."""
    # transformers (5.x) passes a 4-D mask through untouched (masking_utils._preprocess_mask_arguments)
    # and uses the explicit position_ids for the rotary embedding.
    return token_logprobs(model, mb.input_ids, _model_mask(model, mb.attention_mask), mb.position_ids,
                          mb.pred_index, mb.targets, mb.temperature, chunk=chunk, autocast=autocast)


def unpack(samples: Sequence[Experience], micro_batches: Sequence[Packed], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Scatter flat per-token ``values`` of ``micro_batches`` back to [len(samples), R] (0 on padding)."""
    r_max = max(1, max(len(s.response_ids) for s in samples))
    out = torch.zeros((len(samples), r_max), dtype=values[0].dtype if values else torch.float32)
    for mb, v in zip(micro_batches, values):
        out = out.index_put((mb.sample_index, mb.token_index), v)
    return out


@dataclasses.dataclass(slots=True)
class _Sums:
    """Token sums of a step's statistics, accumulated over micro-batches and divided once at the end."""

    tokens: float = 0.0
    loss: float = 0.0
    behav_weight: float = 0.0
    behav_truncated: float = 0.0
    behav_masked: float = 0.0
    behav_kl: float = 0.0
    clipped: float = 0.0
    ratio: float = 0.0
    entropy: float = 0.0
    kl_ref: float = 0.0


OFF_POLICY_PRESETS = ("token_tis", "icepop", "seq_mis", "geo_mask", "off")
"""The off-policy corrections of ``learner.off_policy`` (docs/learner.md, "Off-policy corrections")."""

DEFAULT_BANDS: dict[str, tuple[float, float]] = {"icepop": (0.5, 2.0), "geo_mask": (0.99, 1.01)}
"""``learner.off_policy_band`` when unset: icepop's token-ratio band, geo_mask's geometric-mean band."""


def _segment_sum(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token sum of ``values`` over the tokens sharing its ``index`` (a sequence), gathered back to [N]."""
    sums = torch.zeros(int(index.max()) + 1 if index.numel() else 0, dtype=values.dtype)
    return sums.index_add(0, index, values)[index]


def behaviour_weights(log_ratio: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor | None = None, *,
                      preset: str = "token_tis", tis_cap: float = 2.0,
                      band: tuple[float, float] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights (no grad) of the behaviour ratio ``exp(log_ratio)`` under an off-policy preset.

    ``log_ratio`` = proximal - behaviour logprob, 0 off ``mask``; ``seq_index`` names each token's sequence
    (default: the rows of a [B, R] tensor, or one sequence). Returns the weights (0 on masked tokens: no
    gradient) and boolean per-token flags ``masked`` (loss-masked tokens the preset zeroes) and
    ``truncated`` (tokens whose weight was capped at ``tis_cap``).
    """
    if preset not in OFF_POLICY_PRESETS:
        raise ValueError(f"learner.off_policy {preset!r} is not one of {', '.join(OFF_POLICY_PRESETS)}")
    low, high = band if band is not None else DEFAULT_BANDS.get(preset, (0.0, math.inf))
    if not 0 <= low < high:
        raise ValueError(f"learner.off_policy_band needs 0 <= low < high, got [{low}, {high}]")
    shape = log_ratio.shape
    lr = log_ratio.detach().reshape(-1)
    m = mask.reshape(-1)
    if seq_index is None:
        rows = shape[0] if len(shape) == 2 else 1
        seq_index = torch.arange(rows).repeat_interleave(lr.numel() // max(rows, 1))
    seq = seq_index.reshape(-1)
    raw = torch.exp(lr)
    tis = raw.clamp(max=tis_cap)
    no = torch.zeros_like(m)
    if preset == "token_tis":
        w, masked, truncated = tis, no, raw > tis_cap
    elif preset == "off":
        w, masked, truncated = torch.ones_like(lr), no, no
    elif preset == "icepop":
        keep = (raw >= low) & (raw <= high)  # the band's edges are inside it
        w, masked, truncated = torch.where(keep, raw, torch.zeros_like(raw)), ~keep, no
    elif preset == "seq_mis":
        # compare in log space: a long sequence's product of ratios overflows fp32 long before it matters
        seq_lr = _segment_sum(lr, seq)
        keep = seq_lr <= math.log(tis_cap)
        seq_w = torch.exp(seq_lr.clamp(max=math.log(tis_cap)))
        w, masked, truncated = torch.where(keep, seq_w, torch.zeros_like(seq_w)), ~keep, no
    else:  # geo_mask
        n = _segment_sum(m.to(lr.dtype), seq).clamp_min(1.0)
        geo = torch.exp(_segment_sum(lr, seq) / n)
        keep = (geo >= low) & (geo <= high)
        w, masked, truncated = torch.where(keep, tis, torch.zeros_like(tis)), ~keep, keep & (raw > tis_cap)
    w = torch.where(m, w, torch.zeros_like(w))
    return w.reshape(shape), {"masked": (masked & m).reshape(shape), "truncated": (truncated & m).reshape(shape)}


def _policy_terms(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                  advantages: torch.Tensor, mask: torch.Tensor, *, objective: str, tis_cap: float,
                  clip_eps: float, off_policy: str = "token_tis", band: tuple[float, float] | None = None,
                  seq_index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss (0 off the mask) and the token *sums* of the statistics; see ``policy_loss``."""
    m = mask.to(logp.dtype)
    prox = prox_logp.detach()
    # Padding and observation tokens have arbitrary logprobs: zero their log-ratios so exp() cannot overflow.
    behav_log_ratio = torch.where(mask, prox - behav_logp.detach(), torch.zeros_like(prox))
    behav_w, flags = behaviour_weights(behav_log_ratio, mask, seq_index, preset=off_policy, tis_cap=tis_cap,
                                       band=band)
    adv = advantages.expand_as(logp)
    sums: dict[str, float] = {
        "behav_weight": float((behav_w * m).sum()),
        "behav_truncated": float(flags["truncated"].sum()),
        "behav_masked": float(flags["masked"].sum()),
        "behav_kl": float((-behav_log_ratio * m).sum()),
        "tokens": float(m.sum()),
    }
    if objective == "tis":
        per_tok = -behav_w * adv * logp
    elif objective == "decoupled_ppo":
        ratio = torch.exp(torch.where(mask, logp - prox, torch.zeros_like(logp)))
        clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
        per_tok = behav_w * torch.maximum(-adv * ratio, -adv * clipped)
        sums["clipped"] = float((((ratio - clipped).abs() > 0).to(m.dtype) * m).sum())
        sums["ratio"] = float((ratio.detach() * m).sum())
    else:
        raise ValueError(f"unknown objective {objective!r}; one of 'tis', 'decoupled_ppo'")
    return per_tok * m, sums


def policy_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, objective: str, tis_cap: float,
                clip_eps: float, weights: torch.Tensor | None = None, off_policy: str = "token_tis",
                band: tuple[float, float] | None = None,
                seq_index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level policy-gradient loss, mean over loss-masked tokens (or, given per-token ``weights``
    such as :func:`token_weights` makes, the weighted sum ``sum(weights * per-token loss)``).

    - ``tis``: ``-w_t * A * log pi_theta``.
    - ``decoupled_ppo`` (AReaL): ``w_t * max(-A * r, -A * clip(r, 1-eps, 1+eps))`` with ``r = pi_theta / pi_prox``.

    ``w_t`` is the behaviour weight of the ``off_policy`` preset (:func:`behaviour_weights`; ``token_tis``:
    ``min(pi_prox / pi_behav, tis_cap)``). ``prox_logp`` and ``behav_logp`` carry no gradient;
    ``advantages`` broadcasts over tokens.
    """
    per_tok, sums = _policy_terms(logp, prox_logp, behav_logp, advantages, mask, objective=objective,
                                  tis_cap=tis_cap, clip_eps=clip_eps, off_policy=off_policy, band=band,
                                  seq_index=seq_index)
    n_tok = max(sums["tokens"], 1.0)
    stats: dict[str, float] = {"behav_weight_mean": sums["behav_weight"] / n_tok,
                               "behav_truncated_frac": sums["behav_truncated"] / n_tok,
                               "behav_masked_frac": sums["behav_masked"] / n_tok,
                               "behav_kl": sums["behav_kl"] / n_tok}
    if objective == "decoupled_ppo":
        stats["clip_frac"] = sums["clipped"] / n_tok
        stats["ratio_mean"] = sums["ratio"] / n_tok
    stats["tokens"] = sums["tokens"]
    if weights is not None:
        return (per_tok * weights).sum(), stats
    return per_tok.sum() / n_tok, stats


# -- loss weighting ----------------------------------------------------------------------------------

LOSS_WEIGHTINGS = ("token_mean", "sequence_mean", "domain_mean")
"""How a step's trained tokens weigh in its loss (``learner.loss_weighting``)."""


def sample_loss_weights(domains: Sequence[str], tokens: Sequence[float], weighting: str) -> list[float]:
    """The loss weight of each trained token of each sample, so that ``sum_i weight_i * tokens_i == 1``
    over the samples with tokens (0 for a sample without any).

    - ``token_mean``: ``1 / N`` (N: the step's trained tokens): a domain weighs by its tokens.
    - ``sequence_mean``: ``1 / (B * n_i)`` (B: samples with tokens): each sample weighs alike.
    - ``domain_mean``: ``(S_d / B) / T_d`` (S_d samples and T_d tokens of the sample's domain d): tokens are
      averaged within their domain, and each domain weighs by its share of the step's samples.
    """
    if weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"learner.loss_weighting {weighting!r} is not one of {', '.join(LOSS_WEIGHTINGS)}")
    live = [i for i, n in enumerate(tokens) if n > 0]
    out = [0.0] * len(tokens)
    if not live:
        return out
    if weighting == "token_mean":
        total = sum(tokens[i] for i in live)
        for i in live:
            out[i] = 1.0 / total
    elif weighting == "sequence_mean":
        for i in live:
            out[i] = 1.0 / (len(live) * tokens[i])
    else:
        samples: dict[str, int] = {}
        domain_tokens: dict[str, float] = {}
        for i in live:
            samples[domains[i]] = samples.get(domains[i], 0) + 1
            domain_tokens[domains[i]] = domain_tokens.get(domains[i], 0.0) + tokens[i]
        for i in live:
            d = domains[i]
            out[i] = samples[d] / len(live) / domain_tokens[d]
    return out


def trained_tokens(samples: Sequence[Experience], micro_batches: Sequence["Packed"]) -> list[float]:
    """Loss-masked (trained) tokens of each sample, as packed."""
    counts = torch.zeros(len(samples), dtype=torch.float64)
    for mb in micro_batches:
        counts.index_add_(0, mb.sample_index, mb.loss_mask.to(torch.float64))
    return [float(c) for c in counts]


def token_weights(micro_batch: "Packed", sample_weights: torch.Tensor) -> torch.Tensor:
    """Per-token loss weights [N] of a packed micro-batch from its samples' weights (0 off the loss mask)."""
    return sample_weights[micro_batch.sample_index] * micro_batch.loss_mask.to(sample_weights.dtype)


def domain_report(samples: Sequence[Experience], tokens: Sequence[float] | None = None,
                  weights: Sequence[float] | None = None) -> dict[str, dict[str, float]]:
    """Per domain of a step: ``samples``, ``tokens`` (trained), ``reward`` and ``adv_abs`` (means),
    ``loss_weight`` (the domain's share of the loss's total token weight: 1 over all domains) and
    ``grad_share`` (estimated: its share of ``sum |A| x weight x tokens``). Without ``tokens`` (a simulated
    step), the response lengths; without ``weights``, a token mean."""
    if tokens is None:
        tokens = [float(len(s.response_ids)) for s in samples]
    if weights is None:
        weights = sample_loss_weights([s.domain for s in samples], tokens, "token_mean")
    out: dict[str, dict[str, float]] = {}
    for s, n, w in zip(samples, tokens, weights):
        d = out.setdefault(s.domain, {"samples": 0.0, "tokens": 0.0, "reward": 0.0, "adv_abs": 0.0,
                                      "loss_weight": 0.0, "grad_share": 0.0})
        d["samples"] += 1
        d["tokens"] += n
        d["reward"] += float(s.reward)
        d["adv_abs"] += abs(float(s.advantage))
        d["loss_weight"] += w * n
        d["grad_share"] += abs(float(s.advantage)) * w * n
    grad_total = sum(d["grad_share"] for d in out.values())
    for d in out.values():
        d["reward"] /= d["samples"]
        d["adv_abs"] /= d["samples"]
        d["grad_share"] = d["grad_share"] / grad_total if grad_total > 0 else 0.0
    return out


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta: exp(d) - 1 - d,
    d = log pi_ref - log pi_theta (unbiased, always >= 0; Schulman's "Approximating KL divergence")."""
    d = ref_logp.detach() - logp
    return torch.exp(d) - 1.0 - d


def _fused() -> dict[str, Any]:
    """AdamW's fused kernel where torch has it for CPU tensors: one pass over the 134.5M parameters of a
    small model takes ~0.1 s instead of ~0.7 s with the default for-each implementation (2-core host)."""
    import inspect

    return {"fused": True} if "fused" in inspect.signature(torch.optim.AdamW).parameters else {}


# -- staleness ---------------------------------------------------------------------------------------

def stale_weight(staleness: Sequence[int], max_staleness: int, decay: float) -> list[float]:
    """Loss-weight factor per sample age: 1 within ``max_staleness``, ``decay`` per version beyond it."""
    return [decay ** max(0, a - max_staleness) for a in staleness]


def stale_metrics(staleness: Sequence[int], max_staleness: int, decay: float) -> dict[str, float]:
    """A step's ``stale_trained_frac`` (its samples trained beyond the bound, downweighted) and
    ``stale_weight_mean`` (mean age factor over its samples; 1 when none is beyond the bound)."""
    factors = stale_weight(staleness, max_staleness, decay)
    n = max(len(factors), 1)
    return {"stale_trained_frac": sum(1 for a in staleness if a > max_staleness) / n,
            "stale_weight_mean": sum(factors) / n if factors else 1.0}


# -- the learner -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class StepReport:
    """What one optimizer step folded in (a hook's view of the lineage)."""

    step: int
    version: int
    """The learner version the batch was judged against (before this step's publication)."""
    trained: tuple[str, ...]
    dropped_stale: tuple[str, ...]
    filtered: tuple[str, ...]
    duplicates: int
    offsets: dict[Source, int]
    """Next offset per (topic, partition) after this step: what a checkpoint of it resumes from."""
    publish: bool
    """Whether this step completes a publication interval (the version went up)."""
    metrics: dict[str, float]
    domains: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Per domain of the trained batch: samples, tokens, reward, adv_abs, loss_weight, grad_share (and
    grad_norm with ``learner.domain_grad_norms``); see :func:`domain_report`."""


@dataclasses.dataclass(slots=True)
class _Pending:
    train: list[Experience] = dataclasses.field(default_factory=list)
    ids: dict[str, Verdict] = dataclasses.field(default_factory=dict)
    min_versions: dict[str, int] = dataclasses.field(default_factory=dict)
    ledger: Ledger = dataclasses.field(default_factory=Ledger)
    offsets: dict[Source, int] = dataclasses.field(default_factory=dict)


class Learner:
    """Policy-gradient learner over a causal LM; see the module docstring for the protocol."""

    def __init__(self, model: PreTrainedModel, cfg: LearnerConfig, *, max_staleness: int, pad_id: int = 0,
                 max_seen_ids: int = DEFAULT_MAX_SEEN_IDS, reference: PreTrainedModel | None = None) -> None:
        """``reference``: the KL term's reference policy when ``cfg.kl_coef > 0`` (default: a frozen copy
        of ``model`` as given, i.e. the initial weights; with LoRA the base model with adapters off)."""
        self.model = model
        self.cfg = cfg
        self.max_staleness = max_staleness
        self.pad_id = pad_id
        if cfg.lora_rank:
            lora.attach(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.reference: PreTrainedModel | None = None
        if cfg.kl_coef > 0 and not cfg.lora_rank:
            self.reference = reference if reference is not None else copy.deepcopy(model)
            self.reference.eval().requires_grad_(False)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, **_fused())
        self.step_count = 0
        self.version = 0
        self.ledger = Ledger()
        self.seen = SeenIds(max_seen_ids)
        self.offsets: dict[Source, int] = {}
        self._pending = _Pending()
        self.last_domains: dict[str, dict[str, float]] = {}
        """Per-domain figures of the last step (:func:`domain_report`)."""

    # -- feeding -----------------------------------------------------------------------------------
    def staleness(self, exp: Experience) -> int:
        return self.version - exp.min_version()

    def stale_weights(self, samples: Sequence[Experience]) -> list[float]:
        """Each sample's loss-weight factor for its age: ``stale_decay ** (staleness - max_staleness)`` beyond
        the bound (only ``staleness_policy = "downweight"`` trains such samples), 1 within it."""
        return stale_weight([self.staleness(s) for s in samples], self.max_staleness, self.cfg.stale_decay)

    def offer(self, exp: Experience, source: Source | None = None, offset: int | None = None) -> Verdict:
        """Classify one record and hold it for the next step (see the module docstring)."""
        pending = self._pending
        reason = ""
        verdict: Verdict
        if exp.sample_id in self.seen or exp.sample_id in pending.ids:
            verdict = "duplicate"
        elif self.staleness(exp) > self.max_staleness and self.cfg.staleness_policy == "drop":
            verdict, reason = "dropped_stale", "stale"
        elif exp.filtered:
            verdict, reason = "filtered", exp.filtered
        else:
            verdict = "train"
            if self.staleness(exp) > self.max_staleness:  # staleness_policy "downweight": trained, weighing less
                reason = "stale_downweighted"
        pending.ledger.count(verdict, reason)
        if verdict != "duplicate":
            pending.ids[exp.sample_id] = verdict
            pending.min_versions[exp.sample_id] = exp.min_version()
        if verdict == "train":
            pending.train.append(exp)
        if source is not None and offset is not None:
            pending.offsets[source] = max(pending.offsets.get(source, 0), offset + 1)
        return verdict

    @property
    def ready(self) -> bool:
        """The pending records hold a full batch of trainable samples."""
        return len(self._pending.train) >= self.cfg.batch_size

    @property
    def never_trained(self) -> int:
        """Distinct samples judged filtered or too stale so far, including those not yet folded into a step.

        The scheduler's admission control subtracts them (they will never become accepted samples); it
        must see pending ones too, or a learner waiting for a full batch behind filtered samples and a
        scheduler waiting for the learner would wait on each other forever.
        """
        done, pending = self.ledger, self._pending.ledger
        return done.filtered + done.dropped_stale + pending.filtered + pending.dropped_stale

    @property
    def pending(self) -> int:
        """Records offered since the last step (not yet consumed)."""
        p = self._pending
        return len(p.ids) + p.ledger.duplicates

    # -- training ----------------------------------------------------------------------------------
    def train_on(self, samples: Sequence[Experience]) -> dict[str, float]:
        """One optimizer step on ``samples`` (no bookkeeping); returns the step's metrics.

        The samples are packed (``pack``) into micro-batches under ``micro_batch_tokens``; each token's
        loss is weighted by ``learner.loss_weighting`` (:func:`sample_loss_weights`: with ``token_mean``,
        divided by the whole step's loss-masked token count), so the accumulated gradient is exactly that
        of one big batch. Per-domain figures of the step are left in ``last_domains``.
        """
        cfg = self.cfg
        mbs = pack(samples, micro_batch_tokens=cfg.micro_batch_tokens, share_prefix=cfg.share_prefix,
                   pad_id=self.pad_id, per_sample=cfg.packing == "per_sample")
        tokens = trained_tokens(samples, mbs)
        weights = sample_loss_weights([s.domain for s in samples], tokens, cfg.loss_weighting)
        weights = [w * a for w, a in zip(weights, self.stale_weights(samples))]  # 1 unless downweighted
        sample_w = torch.tensor(weights, dtype=torch.float32)
        self.last_domains = domain_report(samples, tokens, weights)
        sums = _Sums()
        gaps: list[torch.Tensor] = []  # train/serve mismatch on same-version tokens (learning/mismatch.py)
        self.model.train()
        try:
            if cfg.domain_grad_norms and len(self.last_domains) > 1:
                for domain, norm in self._domain_grad_norms(samples, mbs, sample_w).items():
                    self.last_domains[domain]["grad_norm"] = norm
                total = sum(d["grad_norm"] for d in self.last_domains.values())
                for d in self.last_domains.values():
                    d["grad_share"] = d["grad_norm"] / total if total > 0 else 0.0
            self.optimizer.zero_grad(set_to_none=True)
            for mb in mbs:
                logp, entropy = packed_logprobs(self.model, mb, chunk=cfg.logprob_chunk,
                                                autocast=cfg.autocast == "bf16")
                # One optimizer update per batch: the proximal policy is the current one, so its no-grad
                # logprobs are exactly these values detached (no second forward pass needed).
                per_tok, terms = _policy_terms(logp, logp.detach(), mb.behav_logp, mb.advantages, mb.loss_mask,
                                               objective=cfg.objective, tis_cap=cfg.tis_cap, clip_eps=cfg.clip_eps,
                                               off_policy=cfg.off_policy, band=cfg.off_policy_band,
                                               seq_index=mb.sample_index)
                if self.serves_own_version:
                    gaps.append(same_version_gaps(samples, mb, logp, self.version))
                m = mb.loss_mask.to(logp.dtype)
                w_tok = token_weights(mb, sample_w).to(logp.dtype)
                loss = (per_tok * w_tok).sum()
                if cfg.kl_coef > 0:
                    kl = k3_kl(logp, self._reference_logprobs(mb)) * m
                    loss = loss + cfg.kl_coef * (kl * w_tok).sum()
                    sums.kl_ref += float(kl.detach().sum())
                if loss.requires_grad:
                    loss.backward()
                sums.loss += float(loss.detach())
                sums.entropy += float((entropy * m).sum())
                for k, v in terms.items():
                    setattr(sums, k, getattr(sums, k) + v)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.model.eval()
        n = max(sums.tokens, 1.0)
        stats = {"loss": sums.loss, "grad_norm": float(grad_norm), "tokens": sums.tokens,
                 "entropy": sums.entropy / n, "clip_frac": sums.clipped / n,
                 "behav_weight_mean": sums.behav_weight / n, "behav_truncated_frac": sums.behav_truncated / n,
                 "behav_masked_frac": sums.behav_masked / n,
                 "behav_kl": sums.behav_kl / n,
                 "advantage_mean": float(np.mean([s.advantage for s in samples])) if samples else 0.0,
                 "samples": float(len(samples)), "micro_batches": float(len(mbs)),
                 "padded_tokens": float(sum(mb.padded_tokens for mb in mbs))}
        if cfg.objective == "decoupled_ppo":
            stats["ratio_mean"] = sums.ratio / n
        if cfg.kl_coef > 0:
            stats["kl_ref"] = sums.kl_ref / n
        stats.update(gap_stats(gaps))
        return stats

    @property
    def serves_own_version(self) -> bool:
        """The weights held are exactly those published as ``version`` (no step since that publication), so
        a token sampled under ``version`` can be compared with the learner's log-prob for train/serve
        mismatch. With ``publish_every > 1`` only the steps that follow a publication measure it."""
        return self.step_count % self.cfg.publish_every == 0

    def _domain_grad_norms(self, samples: Sequence[Experience], mbs: Sequence[Packed],
                           sample_w: torch.Tensor) -> dict[str, float]:
        """Debug (``learner.domain_grad_norms``): the norm of each domain's part of the step's policy loss
        gradient, exactly: one extra forward and backward pass per domain (gradients discarded after)."""
        cfg = self.cfg
        norms: dict[str, float] = {}
        for domain in sorted({s.domain for s in samples}):
            in_domain = torch.tensor([s.domain == domain for s in samples], dtype=torch.float32)
            self.optimizer.zero_grad(set_to_none=True)
            for mb in mbs:
                w_tok = token_weights(mb, sample_w * in_domain)
                if not bool((w_tok > 0).any()):
                    continue
                logp, _ = packed_logprobs(self.model, mb, chunk=cfg.logprob_chunk, autocast=cfg.autocast == "bf16")
                per_tok, _ = _policy_terms(logp, logp.detach(), mb.behav_logp, mb.advantages, mb.loss_mask,
                                           objective=cfg.objective, tis_cap=cfg.tis_cap, clip_eps=cfg.clip_eps,
                                           off_policy=cfg.off_policy, band=cfg.off_policy_band,
                                           seq_index=mb.sample_index)
                loss = (per_tok * w_tok.to(logp.dtype)).sum()
                if loss.requires_grad:
                    loss.backward()
            grads = [p.grad.detach().float().norm() for p in self.params if p.grad is not None]
            norms[domain] = float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0
        self.optimizer.zero_grad(set_to_none=True)
        return norms

    def _reference_logprobs(self, mb: Packed) -> torch.Tensor:
        """Logprobs of a micro-batch's tokens under the reference policy (no grad)."""
        with torch.no_grad():
            if self.reference is not None:
                return packed_logprobs(self.reference, mb, chunk=self.cfg.logprob_chunk,
                                       autocast=self.cfg.autocast == "bf16")[0]
            with lora.disabled(self.model):
                return packed_logprobs(self.model, mb, chunk=self.cfg.logprob_chunk,
                                       autocast=self.cfg.autocast == "bf16")[0]

    @contextlib.contextmanager
    def export_model(self) -> Iterator[PreTrainedModel]:
        """The model as Hugging Face layout for ``save_pretrained`` (LoRA adapters merged in)."""
        if not self.cfg.lora_rank:
            yield self.model
            return
        with lora.merged(self.model) as m:
            yield cast(PreTrainedModel, m)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict, plus the LoRA adapters' tensors when there are adapters (a
        checkpoint's model holds the merged weights; the adapters are needed to take the merge back out)."""
        state = self.optimizer.state_dict()
        if self.cfg.lora_rank:
            state = {**state, "lora_adapters": lora.state(self.model)}
        return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Inverse of ``optimizer_state``; call after building the learner on a checkpoint's model."""
        state = dict(state)
        adapters = state.pop("lora_adapters", None)
        if self.cfg.lora_rank:
            if adapters is None:
                raise ValueError("a LoRA learner needs a checkpoint written with LoRA (no adapter tensors in it)")
            lora.load_into_merged(self.model, adapters)
        self.optimizer.load_state_dict(state)

    def step(self) -> StepReport:
        """Train on the pending batch and fold the pending records into the learner's state."""
        if not self.ready:
            raise RuntimeError(f"step() needs {self.cfg.batch_size} trainable samples, "
                               f"{len(self._pending.train)} pending")
        pending, self._pending = self._pending, _Pending()
        judged_at = self.version
        self.last_domains = {}
        try:
            metrics = self.train_on(pending.train)
        except BaseException:
            self._pending = pending
            raise
        if not self.last_domains:  # a train_on that does not measure them (the simulated step)
            self.last_domains = domain_report(pending.train)
        metrics.update(stale_metrics([self.staleness(s) for s in pending.train], self.max_staleness,
                                     self.cfg.stale_decay))
        self.step_count += 1
        publish = self.step_count % self.cfg.publish_every == 0
        if publish:
            self.version += 1
        self.ledger.merge(pending.ledger)
        for sid, mv in pending.min_versions.items():
            self.seen.add(sid, mv)
        self.seen.evict(self.version, self.max_staleness)
        self.offsets.update(pending.offsets)
        by_verdict: dict[str, list[str]] = {"train": [], "dropped_stale": [], "filtered": []}
        for sid, verdict in pending.ids.items():
            by_verdict[verdict].append(sid)
        return StepReport(step=self.step_count, version=judged_at, trained=tuple(by_verdict["train"]),
                          dropped_stale=tuple(by_verdict["dropped_stale"]), filtered=tuple(by_verdict["filtered"]),
                          duplicates=pending.ledger.duplicates, offsets=dict(self.offsets), publish=publish,
                          metrics=metrics, domains=self.last_domains)

    # -- state -------------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """The JSON-able bookkeeping of a checkpoint: step, version, offsets, ledger, seen ids."""
        return {
            "step": self.step_count,
            "version": self.version,
            "offsets": [[t, p, o] for (t, p), o in sorted(self.offsets.items())],
            "ledger": self.ledger.to_dict(),
            "seen": self.seen.to_dict(),
        }

    def restore_progress(self, progress: dict[str, Any]) -> None:
        """Inverse of ``progress()``; drops anything pending."""
        self.step_count = int(progress["step"])
        self.version = int(progress["version"])
        self.offsets = {(str(t), int(p)): int(o) for t, p, o in progress["offsets"]}
        self.ledger = Ledger.from_dict(progress["ledger"])
        self.seen = SeenIds.from_dict(progress["seen"], self.seen.max_ids)
        self._pending = _Pending()

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint holds: model and optimizer tensors plus ``progress()``."""
        with self.export_model() as m:
            model_state = {k: v.detach().clone() for k, v in m.state_dict().items()}
        return {"model": model_state, "optimizer": self.optimizer_state(), "progress": self.progress()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.cfg.lora_rank:
            lora.load_merged_weights(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.load_optimizer_state(state["optimizer"])
        self.restore_progress(state["progress"])

    def statistics(self) -> dict[str, Any]:
        return {"step": self.step_count, "version": self.version, **self.ledger.to_dict(),
                "pending": self.pending, "seen_ids": len(self.seen)}


# -- supervised warm start -------------------------------------------------------------------------

def sft_warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[tuple[str, str]],
                   steps: int, lr: float, seed: int, *, batch_size: int = 32) -> PreTrainedModel:
    """Supervised fine-tuning on (prompt, completion) pairs, loss on the completion (+ EOS) only.

    Each step draws ``batch_size`` examples with a generator seeded by ``seed``; trains ``model`` in
    place (AdamW, grad clip 1.0) and returns it in eval mode.
    """
    if not examples:
        raise ValueError("sft_warm_start needs at least one (prompt, completion) example")
    eos = tokenizer.eos_token_id
    encoded: list[tuple[list[int], list[int]]] = []
    for prompt, completion in examples:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(completion, add_special_tokens=False) + ([eos] if eos is not None else [])
        encoded.append((p, c))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    try:
        for _ in range(steps):
            pick = torch.randint(len(encoded), (min(batch_size, len(encoded)),), generator=gen).tolist()
            batch = collate([_demo_sample(*encoded[i]) for i in pick], pad_id)
            logp = response_logprobs(model, batch)
            m = batch.loss_mask.to(logp.dtype)
            loss = -(logp * m).sum() / m.sum().clamp_min(1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    finally:
        model.eval()
    return model


def _demo_sample(prompt_ids: list[int], completion_ids: list[int]) -> Experience:
    """A demonstration as an Experience, so SFT shares ``collate`` and ``response_logprobs``."""
    n = len(completion_ids)
    return Experience(sample_id="sft", task_id="sft", domain="sft",
                      prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                      response_ids=np.asarray(completion_ids, dtype=np.int32),
                      logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
                      weight_versions=np.zeros(n, dtype=np.int32), reward=0.0, advantage=1.0, group_size=1)


def score_tokens(model: PreTrainedModel, prompt_ids: Sequence[int], response_ids: Sequence[int],
                 temperature: float) -> list[float]:
    """The learner's log-probs of ``response_ids`` after ``prompt_ids`` at ``temperature``, one sample alone.

    Exactly the learner's computation (``pack`` + ``packed_logprobs``: the fp32 log-softmax of ``logits /
    temperature``) over the sample's whole sequence in one forward pass, without a shared prefix: a learner
    with ``learner.packing = "per_sample"`` gets bitwise these values in its training forward; packed rows of
    other widths differ in the last bits (docs/learner.md, "Train/serve mismatch"). The local server's
    ``rescore`` reports these for every finished sample.
    """
    n = len(response_ids)
    if n == 0:
        return []
    exp = Experience(sample_id="score", task_id="score", domain="score",
                     prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                     response_ids=np.asarray(response_ids, dtype=np.int32),
                     logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
                     weight_versions=np.zeros(n, dtype=np.int32), reward=0.0, advantage=0.0, group_size=1,
                     temperature=float(temperature))
    (mb,) = pack([exp], micro_batch_tokens=len(prompt_ids) + n, per_sample=True)
    with torch.no_grad():
        logp, _ = packed_logprobs(model, mb)
    return [float(x) for x in logp.tolist()]
