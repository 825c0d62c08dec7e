"""The weights canary's verdict: is the server really serving the weights it says it serves?

A server reports a weight version; a server that failed to apply an update (or applied it wrongly) can
still report the new number. The learner probes it (``actors/learner.py``): a fixed prompt generated on
the server, the tokens and log-probs it returns, and the version it claims. :func:`judge` compares them
with the learner's own log-probs of the same tokens under that version (``learning.core.score_tokens``):

- claimed == the learner's version: the probe's relative gap ``max |server - learner| / max(1, |learner|)``
  must stay under ``learner.canary_threshold`` (a re-scoring fp32 server matches to ~1e-7; weights not
  applied differ by far more than 1e-3);
- claimed < the learner's version: the server lags; past ``learner.canary_max_lag_s`` after the newer
  version's publication it counts as not applied;
- claimed > the learner's version: a version the learner never published.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

PROBE_TEXT = "The capital of France is"
"""The probe prompt (any fixed text: only the agreement of the two sides matters)."""
PROBE_TOKENS = 8
"""Tokens the server generates for the probe (temperature 1, fixed seed)."""
BF16_SERVING_FLOOR = 1.0
"""The least threshold used against a bf16 server: its rounding alone moves log-probs by up to 0.19 x
max(1, |logp|) against the fp32 learner (SmolLM2, docs/learner.md's table), so a probe can then catch only
gross failures (a wrong or far older model), not one missed update."""


def effective_threshold(threshold: float, serving_dtype: str) -> float:
    """``learner.canary_threshold``, raised to :data:`BF16_SERVING_FLOOR` when the servers serve bf16."""
    return max(threshold, BF16_SERVING_FLOOR) if serving_dtype == "bf16" else threshold


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """One probe of one server: ``ok`` false is a trip, ``reason`` says why."""

    ok: bool
    reason: str
    gap: float | None = None
    """The probe's relative gap (None when the versions differ: nothing to compare)."""
    compared: bool = False
    """The claimed version was the learner's: log-probs were compared."""


def relative_gap(server: Sequence[float], learner: Sequence[float]) -> float:
    """``max |server - learner| / max(1, |learner|)`` over the probe's tokens (inf on a length mismatch)."""
    if len(server) != len(learner):
        return float("inf")
    return max((abs(a - b) / max(1.0, abs(b)) for a, b in zip(server, learner)), default=0.0)


def judge(*, url: str, claimed: int, learner_version: int, comparable: bool, server_logprobs: Sequence[float],
          learner_logprobs: Sequence[float] | None, threshold: float, lag_s: float | None,
          max_lag_s: float) -> Verdict:
    """The verdict on one probe (see the module docstring).

    ``comparable``: the learner holds exactly the weights of ``learner_version`` (no step since its
    publication); ``learner_logprobs``: its scoring of the probe's tokens (None when not comparable);
    ``lag_s``: seconds since the version after ``claimed`` was published (None: unknown).
    """
    if claimed > learner_version:
        return Verdict(False, f"server {url} claims weight version {claimed}, newer than the learner's "
                              f"{learner_version}: a version this learner never published")
    if claimed < learner_version:
        if lag_s is not None and lag_s > max_lag_s:
            return Verdict(False, f"server {url} still serves weight version {claimed} {lag_s:.0f}s after "
                                  f"version {claimed + 1} was published (learner at {learner_version}): "
                                  "updates are not being applied")
        return Verdict(True, f"server {url} at version {claimed}, learner at {learner_version} (catching up)")
    if not comparable or learner_logprobs is None:
        return Verdict(True, f"server {url} at version {claimed}; learner stepped since: not compared")
    gap = relative_gap(server_logprobs, learner_logprobs)
    if not gap <= threshold:
        return Verdict(False, f"server {url} claims weight version {claimed} but its probe log-probs differ "
                              f"from the learner's by {gap:.3g} (x max(1, |logp|); threshold {threshold:g}): "
                              "it is not serving those weights", gap, True)
    return Verdict(True, f"server {url} serves version {claimed}: probe gap {gap:.3g}", gap, True)
