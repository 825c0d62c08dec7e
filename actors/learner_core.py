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

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
    """Sampling temperature of the behaviour policy: ``facts["temperature"]`` if the sample says, else 1."""
    t = exp.facts.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        return 1.0
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


def response_logprobs(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Log-probabilities [B, R] of the response tokens under ``model`` at each sample's temperature."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # Token at position t is predicted by the logits at t - 1.
    pred_pos = (batch.target_pos - 1).clamp_min(0)
    idx = pred_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    pred_logits = logits.gather(1, idx).float() / batch.temperature
    targets = batch.input_ids.gather(1, batch.target_pos)
    picked = pred_logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(pred_logits, dim=-1)


def policy_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, objective: str, tis_cap: float,
                clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level policy-gradient loss, mean over loss-masked tokens.

    - ``tis``: ``-min(pi_prox / pi_behav, tis_cap) * A * log pi_theta``.
    - ``decoupled_ppo`` (AReaL): ``min(pi_prox / pi_behav, tis_cap) * max(-A * r, -A * clip(r, 1-eps, 1+eps))``
      with ``r = pi_theta / pi_prox``.

    ``prox_logp`` and ``behav_logp`` carry no gradient; ``advantages`` broadcasts over tokens.
    """
    m = mask.to(logp.dtype)
    n_tok = m.sum().clamp_min(1.0)
    prox = prox_logp.detach()
    # Padding and observation tokens have arbitrary logprobs: zero their log-ratios so exp() cannot overflow.
    behav_log_ratio = torch.where(mask, prox - behav_logp.detach(), torch.zeros_like(prox))
    raw_w = torch.exp(behav_log_ratio)
    behav_w = raw_w.clamp(max=tis_cap)
    adv = advantages.expand_as(logp)
    stats: dict[str, float] = {
        "behav_weight_mean": float((behav_w * m).sum() / n_tok),
        "behav_truncated_frac": float(((raw_w > tis_cap).to(m.dtype) * m).sum() / n_tok),
        "behav_kl": float((-behav_log_ratio * m).sum() / n_tok),
    }
    if objective == "tis":
        per_tok = -behav_w * adv * logp
    elif objective == "decoupled_ppo":
        ratio = torch.exp(torch.where(mask, logp - prox, torch.zeros_like(logp)))
        clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
        per_tok = behav_w * torch.maximum(-adv * ratio, -adv * clipped)
        stats["clip_frac"] = float((((ratio - clipped).abs() > 0).to(m.dtype) * m).sum() / n_tok)
        stats["ratio_mean"] = float((ratio.detach() * m).sum() / n_tok)
    else:
        raise ValueError(f"unknown objective {objective!r}; one of 'tis', 'decoupled_ppo'")
    loss = (per_tok * m).sum() / n_tok
    stats["tokens"] = float(m.sum())
    return loss, stats


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
                 max_seen_ids: int = DEFAULT_MAX_SEEN_IDS) -> None:
        self.model = model
        self.cfg = cfg
        self.max_staleness = max_staleness
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step_count = 0
        self.version = 0
        self.ledger = Ledger()
        self.seen = SeenIds(max_seen_ids)
        self.offsets: dict[Source, int] = {}
        self._pending = _Pending()

    # -- feeding -----------------------------------------------------------------------------------
    def staleness(self, exp: Experience) -> int:
        return self.version - exp.min_version()

    def offer(self, exp: Experience, source: Source | None = None, offset: int | None = None) -> Verdict:
        """Classify one record and hold it for the next step (see the module docstring)."""
        pending = self._pending
        reason = ""
        verdict: Verdict
        if exp.sample_id in self.seen or exp.sample_id in pending.ids:
            verdict = "duplicate"
        elif self.staleness(exp) > self.max_staleness:
            verdict, reason = "dropped_stale", "stale"
        elif exp.filtered:
            verdict, reason = "filtered", exp.filtered
        else:
            verdict = "train"
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
        """One optimizer step on ``samples`` (no bookkeeping); returns the step's metrics."""
        batch = collate(samples, self.pad_id)
        self.model.train()
        try:
            logp = response_logprobs(self.model, batch)
            # One optimizer update per batch: the proximal policy is the current one, so its no-grad
            # logprobs are exactly these values detached (no second forward pass needed).
            prox = logp.detach()
            loss, stats = policy_loss(logp, prox, batch.behav_logp, batch.advantages, batch.loss_mask,
                                      objective=self.cfg.objective, tis_cap=self.cfg.tis_cap,
                                      clip_eps=self.cfg.clip_eps)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.model.eval()
        stats.update(loss=float(loss.detach()), grad_norm=float(grad_norm),
                     advantage_mean=float(batch.advantages.mean()), samples=float(len(samples)))
        return stats

    def step(self) -> StepReport:
        """Train on the pending batch and fold the pending records into the learner's state."""
        if not self.ready:
            raise RuntimeError(f"step() needs {self.cfg.batch_size} trainable samples, "
                               f"{len(self._pending.train)} pending")
        pending, self._pending = self._pending, _Pending()
        judged_at = self.version
        try:
            metrics = self.train_on(pending.train)
        except BaseException:
            self._pending = pending
            raise
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
                          metrics=metrics)

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
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "progress": self.progress()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
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


def mean_logprob(model: PreTrainedModel, samples: Sequence[Experience], pad_id: int = 0) -> float:
    """Mean loss-masked response logprob of ``samples`` under ``model`` (evaluation helper)."""
    batch = collate(samples, pad_id)
    with torch.no_grad():
        logp = response_logprobs(model, batch)
    m = batch.loss_mask.to(logp.dtype)
    value = float((logp * m).sum() / m.sum().clamp_min(1.0))
    return value if math.isfinite(value) else float("-inf")
