"""Train/serve mismatch: the log-prob gap on same-version tokens, per step (p50, p99, max).

Two ways a sample's behaviour log-probs (what the server reported when it sampled) differ from the
learner's log-probs of the same tokens:

- *staleness*: the tokens came from an older weight version (``behav_kl`` measures it, mixed with the next);
- *mismatch*: same weights, different arithmetic (batched decode against a KV cache versus one
  full-sequence forward, bf16 versus fp32 serving, another engine's kernels).

:func:`same_version_gaps` isolates the second: ``|learner - server|`` on the tokens sampled under exactly
the weights the learner holds, and :func:`gap_stats` sums a step's gaps up (``mismatch_p50``, ``_p99``,
``_max``, ``_tokens``, in nats). ``learning.core.score_tokens`` is the learner's own forward for one sample
alone: a server that re-scores each finished sample with it (``modelserver.local``'s ``rescore``) reports
log-probs the learner reproduces exactly in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from engine.schemas import Experience


class Packed(Protocol):
    """The per-token tensors of a packed micro-batch (``learning.core.Packed``) this module reads."""

    @property
    def sample_index(self) -> torch.Tensor: ...
    @property
    def token_index(self) -> torch.Tensor: ...
    @property
    def loss_mask(self) -> torch.Tensor: ...
    @property
    def behav_logp(self) -> torch.Tensor: ...

GAP_KEYS = ("mismatch_p50", "mismatch_p99", "mismatch_max", "mismatch_tokens")
"""The step metrics :func:`gap_stats` returns."""


def token_versions(samples: Sequence[Experience], mb: Packed) -> torch.Tensor:
    """The weight version [N] of each token of a packed micro-batch (-1: an observation token)."""
    width = max(1, max(len(s.weight_versions) for s in samples))
    table = torch.full((len(samples), width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        table[i, :len(s.weight_versions)] = torch.from_numpy(np.asarray(s.weight_versions, dtype=np.int64))
    return table[mb.sample_index, mb.token_index]


def same_version_gaps(samples: Sequence[Experience], mb: Packed, logp: torch.Tensor, version: int) -> torch.Tensor:
    """``|learner logp - server logp|`` [M] of the micro-batch's trained tokens sampled under ``version``.

    ``logp`` is the learner's log-prob [N] of ``mb``'s tokens under the weights it published as
    ``version``; other tokens (older versions: staleness, not mismatch; observations) are left out.
    """
    same = mb.loss_mask & (token_versions(samples, mb) == version)
    return (logp.detach().float()[same] - mb.behav_logp[same]).abs()


def gap_stats(gaps: Sequence[torch.Tensor]) -> dict[str, float]:
    """A step's same-version gaps summed up: p50 / p99 / max (nats) and how many tokens they cover."""
    flat = torch.cat([g.reshape(-1).double() for g in gaps]) if gaps else torch.zeros(0, dtype=torch.float64)
    if not flat.numel():
        return {"mismatch_tokens": 0.0}
    q = torch.quantile(flat, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return {"mismatch_p50": q[0], "mismatch_p99": q[1], "mismatch_max": float(flat.max()),
            "mismatch_tokens": float(flat.numel())}


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b| / max(1, |b|)``: the agreement fp32 can promise (1e-6 x max(1, |logp|))."""
    if not a.numel():
        return 0.0
    return float(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1.0)).max())
