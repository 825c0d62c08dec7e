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

Against bf16 servers log-probs cannot tell one missed update from bf16 rounding (``BF16_SERVING_FLOOR``), so
there, at the learner's version, :func:`judge_weights` compares weights instead, exactly: the leading values
of a few parameters as the server answers ``/get_weights_by_name`` (SGLang's native endpoint; the local
server has it too) against the learner's own, cast the way the server got them (:func:`served_values`:
fp32 -> ``learner.publish_dtype`` on the wire -> the serving dtype). Any difference is a trip. Detection is
per value: an update changes a bf16 value only when it crosses a rounding boundary, so the probe compares a
few thousand values (whole leading rows of MLP weights, :data:`WEIGHT_VALUES`); a server without the
endpoint gets the log-prob probe instead (``actors/learner.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

PROBE_TEXT = "The capital of France is"
"""The probe prompt (any fixed text: only the agreement of the two sides matters)."""
PROBE_TOKENS = 8
"""Tokens the server generates for the probe (temperature 1, fixed seed)."""
BF16_SERVING_FLOOR = 1.0
"""The least threshold of the log-prob probe against a bf16 server: its rounding alone moves log-probs by up
to 0.19 x max(1, |logp|) against the fp32 learner (SmolLM2, docs/learner.md's table), so the probe can then
catch only gross failures (a wrong or far older model), not one missed update. It still applies where a bf16
server cannot answer ``/get_weights_by_name`` (the exact check, :func:`judge_weights`, is used otherwise)."""
WEIGHT_VALUES = 256
"""Values the exact check asks of each parameter, at least: a 1-D weight's first ``WEIGHT_VALUES``, a 2-D
weight's first rows (whole: SGLang's ``truncate_size`` slices the first dimension), at least one."""
SERVING_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``inference.dtype`` -> the dtype the servers hold the weights in (as ``modelserver.local.engine``'s)."""


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
    """The claimed version was the learner's: log-probs (or, with ``exact``, weights) were compared."""
    exact: bool = False
    """Weights were compared value for value (:func:`judge_weights`), not log-probs."""


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


# -- the exact check against bf16 servers ------------------------------------------------------------------

def default_weight_names(num_layers: int) -> list[str]:
    """The parameters compared when ``learner.canary_weights`` is unset: the first and the last layer's MLP
    output projection and the final norm (Llama / Qwen2 / Mistral names). ``down_proj`` and ``norm`` are
    single tensors in SGLang too (it fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` and
    answers those names by slicing the fused tensor), and ``down_proj`` is gathered whole across
    tensor-parallel ranks."""
    last = max(num_layers - 1, 0)
    return ["model.layers.0.mlp.down_proj.weight", f"model.layers.{last}.mlp.down_proj.weight", "model.norm.weight"]


def weight_plan(names: Sequence[str], shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """``name -> truncate_size`` for each parameter to compare (see :data:`WEIGHT_VALUES`); ``shapes`` are the
    learner's (its published state dict). Raises ``ValueError`` naming every name the model lacks."""
    unknown = [n for n in names if n not in shapes]
    if unknown:
        examples = [n for n in shapes if n.endswith(("down_proj.weight", "norm.weight"))][:4] or list(shapes)[:4]
        raise ValueError(f"learner.canary_weights: {unknown} not parameters of the learner's model "
                         f"(Hugging Face names, e.g. {examples})")
    plan: dict[str, int] = {}
    for name in names:
        shape = tuple(int(d) for d in shapes[name])
        if not shape or shape[0] == 0:
            raise ValueError(f"learner.canary_weights: {name} has shape {list(shape)}: no leading rows to compare")
        row = max(math.prod(shape[1:]), 1)  # values per leading entry (1 for a 1-D weight)
        plan[name] = max(1, min(shape[0], WEIGHT_VALUES // row))
    return plan


def served_values(tensor: torch.Tensor, truncate_size: int, publish_dtype: str, serving_dtype: str) -> list[Any]:
    """``tensor[:truncate_size]`` as a server holds it after loading the learner's publication: cast to the wire
    dtype (``learner.publish_dtype``, a torch dtype name), then to the serving dtype (``inference.dtype``), as
    a nested list of Python floats. Exact: every float32 and bf16 value is a double. The casts round to
    nearest even, as torch's do on CPU and CUDA (where SGLang copies a loaded tensor into its parameter)."""
    lead = tensor.detach()[:truncate_size]
    wire = lead.to(getattr(torch, publish_dtype))
    return wire.to(SERVING_DTYPES[serving_dtype]).to(torch.float32).tolist()  # type: ignore[no-any-return]


def _shape(values: Any, where: str) -> tuple[int, ...]:
    """The shape of a nested list of numbers; ``ValueError`` when ragged or not numbers."""
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        return ()
    if not isinstance(values, list):
        raise ValueError(f"{where}: {type(values).__name__} where a number or a list was expected")
    inner = {_shape(v, where) for v in values}
    if len(inner) > 1:
        raise ValueError(f"{where}: a ragged list")
    return (len(values), *(inner.pop() if inner else ()))


def _flat(values: Any) -> list[float]:
    if isinstance(values, list):
        return [x for v in values for x in _flat(v)]
    return [float(values)]


def _index(i: int, shape: tuple[int, ...]) -> str:
    """Flat index ``i`` of a C-ordered array of ``shape`` as ``[a, b]``."""
    out = []
    for d in reversed(shape):
        out.append(i % d)
        i //= d
    return "[" + ", ".join(str(x) for x in reversed(out)) + "]"


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def judge_weights(*, url: str, claimed: int, expected: Mapping[str, Any], served: Mapping[str, Any],
                  cast: str = "") -> Verdict:
    """The exact check of a server that claims the learner's version: every value the server answered for
    each parameter (``/get_weights_by_name``; a server with several data-parallel ranks answers one list per
    rank, each compared) must equal the learner's (:func:`served_values`) bit for bit. The first difference
    trips, named by parameter, index and both values; ``cast`` says how the learner's values were cast."""
    how = f" (cast {cast} as the server loaded it)" if cast else ""
    for name, want in expected.items():
        if name not in served:
            return Verdict(False, f"server {url}: no answer for {name} from /get_weights_by_name", compared=True,
                           exact=True)
        want_shape = _shape(want, name)
        try:
            got_shape = _shape(served[name], name)
        except ValueError as exc:
            return Verdict(False, f"server {url} answers /get_weights_by_name for {name} with no array of numbers: "
                                  f"{exc}", compared=True, exact=True)
        if got_shape == want_shape:
            ranks = [served[name]]
        elif got_shape[1:] == want_shape:
            ranks = list(served[name])
        else:
            return Verdict(False, f"server {url} claims weight version {claimed} but answers {name} with shape "
                                  f"{list(got_shape)} where the learner's leading values have {list(want_shape)}: "
                                  "it is not serving that model", compared=True, exact=True)
        ours = _flat(want)
        for rank, values in enumerate(ranks):
            for i, (theirs, mine) in enumerate(zip(_flat(values), ours)):
                if not _same(theirs, mine):
                    where = f" (data-parallel rank {rank})" if len(ranks) > 1 else ""
                    return Verdict(False, f"server {url} claims weight version {claimed} but serves "
                                          f"{name}{_index(i, want_shape)} = {theirs!r}{where} where the learner's "
                                          f"value{how} is {mine!r}: it is not serving those weights",
                                   compared=True, exact=True)
    n = sum(len(_flat(v)) for v in expected.values())
    return Verdict(True, f"server {url} serves version {claimed}: {n} values of {len(expected)} parameters equal "
                         "the learner's bit for bit", compared=True, exact=True)
