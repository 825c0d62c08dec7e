"""SGLang ``/generate`` request parsing and validation for the local backend.

Two error shapes, as SGLang answers them (both HTTP 400):

- :class:`ValidationFailed` -> ``{"object": "error", "message": ..., "type": "Bad Request", "param": null,
  "code": 400}``: the body is not JSON or a field has the wrong type (FastAPI's request validation in SGLang).
- :class:`BadRequest` -> ``{"error": {"message": ...}}``: well-typed but semantically invalid (SGLang's
  ``ValueError`` path): both or neither of text/input_ids, bad sampling values, token ids out of vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BadRequest",
    "GenerateRequest",
    "ProtocolError",
    "SamplingParams",
    "ValidationFailed",
    "parse_generate_request",
    "parse_sampling_params",
]


class ProtocolError(Exception):
    """A request the server answers with HTTP ``status`` and JSON ``body()``."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message}}


class BadRequest(ProtocolError):
    """Semantically invalid request: ``{"error": {"message": ...}}``."""


class ValidationFailed(ProtocolError):
    """Malformed body or wrongly typed field: SGLang's validation-error shape."""

    def body(self) -> dict[str, Any]:
        return {"object": "error", "message": self.message, "type": "Bad Request", "param": None, "code": 400}


# SGLang sampling parameters the local backend accepts but does not implement, with the value that
# means "off": a request may send them only with that value.
_NEUTRAL_PARAMS: dict[str, object] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
}
_IGNORED_PARAMS = frozenset({"spaces_between_special_tokens"})


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class GenerateRequest:
    """One ``/generate`` body normalised to a batch: exactly one of ``texts`` / ``input_ids`` is set."""

    texts: list[str] | None
    input_ids: list[list[int]] | None
    is_batch: bool
    rids: list[str | None]
    sampling: SamplingParams
    stream: bool
    return_logprob: bool
    top_logprobs_num: int

    @property
    def size(self) -> int:
        return len(self.texts) if self.texts is not None else len(self.input_ids or [])


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValidationFailed(f"{name}: Input should be a valid integer, got {value!r}")
    return value


def _float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationFailed(f"{name}: Input should be a valid number, got {value!r}")
    return float(value)


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValidationFailed(f"{name}: Input should be a valid boolean, got {value!r}")
    return value


def parse_sampling_params(raw: object, *, vocab_size: int) -> SamplingParams:
    """Validate a ``sampling_params`` object with SGLang's rules and messages."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValidationFailed(f"sampling_params: Input should be a valid dictionary, got {raw!r}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _IGNORED_PARAMS:
            continue
        if key in _NEUTRAL_PARAMS:
            if value is not None and value != _NEUTRAL_PARAMS[key] and value != {}:
                raise BadRequest(f"sampling_params.{key} is not supported by the local backend")
            continue
        if value is None:
            continue
        if key in ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed"):
            values[key] = _int(value, f"sampling_params.{key}")
        elif key in ("temperature", "top_p", "min_p"):
            values[key] = _float(value, f"sampling_params.{key}")
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            values[key] = _bool(value, f"sampling_params.{key}")
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ValidationFailed("sampling_params.stop: Input should be a string or a list of strings")
            values[key] = tuple(s for s in stops if s)
        elif key == "stop_token_ids":
            ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
            if not isinstance(ids, list):
                raise ValidationFailed("sampling_params.stop_token_ids: Input should be a list of integers")
            values[key] = tuple(_int(i, "sampling_params.stop_token_ids") for i in ids)
        else:
            raise BadRequest(f"sampling_params: unknown parameter {key!r}")
    params = SamplingParams(**values)
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise BadRequest(f"temperature must be non-negative, got {params.temperature}.")
    if not 0.0 < params.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {params.top_p}.")
    if not 0.0 <= params.min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {params.min_p}.")
    if params.top_k < 1 and params.top_k != -1:
        raise BadRequest(f"top_k must be -1 (disable), or at least 1, got {params.top_k}.")
    if params.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {params.max_new_tokens}.")
    if not 0 <= params.min_new_tokens <= params.max_new_tokens:
        raise BadRequest(
            f"min_new_tokens must be in [0, max_new_tokens({params.max_new_tokens})], got {params.min_new_tokens}."
        )
    if params.n < 1:
        raise BadRequest(f"n must be at least 1, got {params.n}.")
    bad = [i for i in params.stop_token_ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(f"stop_token_ids {bad} are out of the vocabulary range [0, {vocab_size}).")
    return params


def parse_generate_request(body: object, *, vocab_size: int) -> GenerateRequest:
    """Parse and validate a ``/generate`` JSON body (already decoded)."""
    if not isinstance(body, dict):
        raise ValidationFailed("Input should be a valid dictionary or object to extract fields from")
    if body.get("input_embeds") is not None:
        raise BadRequest("input_embeds is not supported by the local backend")
    for key in ("lora_path", "custom_logit_processor", "image_data", "audio_data", "video_data"):
        if body.get(key) is not None:
            raise BadRequest(f"{key} is not supported by the local backend")
    if body.get("return_hidden_states"):
        raise BadRequest("return_hidden_states is not supported by the local backend")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")

    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise ValidationFailed("text: Input should be a valid string or a list of strings")
        if not texts:
            raise BadRequest("text: the batch is empty")
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValidationFailed("input_ids: Input should be a non-empty list of integers or of lists of integers")
        is_batch = isinstance(input_ids[0], list)
        ids = input_ids if is_batch else [input_ids]
        for prompt in ids:
            if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValidationFailed("input_ids: Input should be a list of integers or a list of lists of integers")
            if not prompt:
                raise BadRequest("input_ids: a prompt is empty")
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"The input_ids {bad[:8]} are out of the vocabulary range [0, {vocab_size}).")

    size = len(texts) if texts is not None else len(ids or [])
    rid = body.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * size
    elif is_batch:
        if not isinstance(rid, list) or len(rid) != size or not all(isinstance(r, str) for r in rid):
            raise BadRequest("The rid should be a list of strings with one entry per prompt for batch inputs.")
        rids = list(rid)
    else:
        if not isinstance(rid, str):
            raise ValidationFailed("rid: Input should be a valid string")
        rids = [rid]

    sampling_raw = body.get("sampling_params")
    if isinstance(sampling_raw, list):
        raise BadRequest("per-prompt sampling_params lists are not supported by the local backend")
    sampling = parse_sampling_params(sampling_raw, vocab_size=vocab_size)

    return_logprob = _bool(body.get("return_logprob", False) or False, "return_logprob")
    logprob_start_len = _int(body.get("logprob_start_len", -1) if body.get("logprob_start_len") is not None else -1, "logprob_start_len")
    if return_logprob and logprob_start_len != -1:
        raise BadRequest(
            "input token logprobs (logprob_start_len >= 0) are not supported by the local backend; use -1 (output only)"
        )
    top_logprobs_num = _int(body.get("top_logprobs_num") or 0, "top_logprobs_num")
    if top_logprobs_num < 0:
        raise BadRequest(f"top_logprobs_num must be non-negative, got {top_logprobs_num}.")
    if body.get("token_ids_logprob") is not None:
        raise BadRequest("token_ids_logprob is not supported by the local backend")
    stream = _bool(body.get("stream", False) or False, "stream")
    return GenerateRequest(
        texts=texts,
        input_ids=ids,
        is_batch=is_batch,
        rids=rids,
        sampling=sampling,
        stream=stream,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num if return_logprob else 0,
    )
