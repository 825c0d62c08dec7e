"""Typed messages for every topic of the design, independent of the wire codec.

Invariants (the codec in ``streams/codec.py`` relies on them):

- Every message class is a frozen dataclass with class attributes ``SCHEMA`` (a stable name) and
  ``VERSION`` (bumped on an incompatible change); ``SCHEMAS`` maps names to classes.
- Token ids, logprobs, loss masks and per-token weight versions are numpy arrays of a fixed dtype
  (``TOKEN_DTYPE``, ``LOGPROB_DTYPE``, ``MASK_DTYPE``, ``VERSION_DTYPE``) and travel as packed
  little-endian bytes, never as lists of Python objects.
- ``validate()`` raises ``SchemaError`` naming the field; a message that decodes is a valid message.
- Per-token arrays of one sample have one length: response tokens = logprobs = loss mask = versions.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar

import numpy as np

from engine.tools import is_function_tool

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
VERSION_DTYPE = np.dtype("<i4")


class SchemaError(ValueError):
    """A message that does not match its schema; ``field`` names what was wrong."""

    def __init__(self, schema: str, field: str, problem: str) -> None:
        super().__init__(f"{schema}.{field}: {problem}")
        self.schema = schema
        self.field = field
        self.problem = problem


if typing.TYPE_CHECKING:
    # To the type checker a marker is any array: messages convert what they are given (``as_array``),
    # and numpy's own functions return plain ndarrays, never a marker subclass.
    TokenArray: typing.TypeAlias = np.ndarray[Any, Any]
    LogprobArray: typing.TypeAlias = np.ndarray[Any, Any]
    MaskArray: typing.TypeAlias = np.ndarray[Any, Any]
    VersionArray: typing.TypeAlias = np.ndarray[Any, Any]
else:
    class TokenArray(np.ndarray):
        """Marker type for an int32 array field (packed on the wire)."""

    class LogprobArray(np.ndarray):
        """Marker type for a float32 array field (packed on the wire)."""

    class MaskArray(np.ndarray):
        """Marker type for a uint8 array field (packed on the wire)."""

    class VersionArray(np.ndarray):
        """Marker type for an int32 per-token weight-version array (packed on the wire)."""


ARRAY_DTYPES: dict[type, np.dtype] = {
    TokenArray: TOKEN_DTYPE,
    LogprobArray: LOGPROB_DTYPE,
    MaskArray: MASK_DTYPE,
    VersionArray: VERSION_DTYPE,
}


def as_array(value: Any, kind: type) -> np.ndarray:
    """Convert a list, array or packed bytes to the numpy array of ``kind``."""
    dtype = ARRAY_DTYPES[kind]
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % dtype.itemsize:
            raise ValueError(f"{len(value)} bytes is not a whole number of {dtype} items")
        return np.frombuffer(value, dtype=dtype)
    return np.asarray(value, dtype=dtype)


class Message:
    """Base of all wire messages: schema identity, validation and body conversion."""

    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    MAX_TEXT: ClassVar[int] = 4 * 1024 * 1024
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset()
    """Fields added after a schema's version, left out of the body while empty (equal to their default): a
    consumer that predates them (and rejects unknown fields) still reads every record that does not use them."""

    def validate(self) -> None:
        """Check field types and invariants; raise SchemaError naming the field."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_field(self.SCHEMA, f.name, getattr(self, f.name), hints[f.name])
        self._check()

    def _check(self) -> None:
        """Cross-field invariants; subclasses override."""

    def to_body(self) -> dict[str, Any]:
        """A dict of plain values for the codec: arrays become packed bytes."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.name in self.OMIT_WHEN_EMPTY and _is_default(f, v):
                continue
            if isinstance(v, np.ndarray):
                v = np.ascontiguousarray(v).tobytes()
            out[f.name] = v
        return out

    @classmethod
    def from_body(cls, body: Any) -> "Message":
        """Build and validate a message from a decoded body; SchemaError on any mismatch."""
        if not isinstance(body, dict):
            raise SchemaError(cls.SCHEMA, "<body>", f"expected a map, got {type(body).__name__}")
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in body:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise SchemaError(cls.SCHEMA, f.name, "missing")
                continue
            value = body[f.name]
            kind = _array_kind(hints[f.name])
            if kind is not None and value is not None:
                try:
                    value = as_array(value, kind)
                except (ValueError, TypeError) as exc:
                    raise SchemaError(cls.SCHEMA, f.name, str(exc)) from None
            kwargs[f.name] = value
        unknown = set(body) - set(kwargs) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise SchemaError(cls.SCHEMA, sorted(unknown)[0], "unknown field")
        msg = cls(**kwargs)
        msg.validate()
        return msg


def _is_default(f: dataclasses.Field[Any], value: Any) -> bool:
    """``value`` is the field's default (or, with a default factory, what the factory makes)."""
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    if isinstance(value, np.ndarray) or isinstance(default, np.ndarray):
        return False
    return bool(type(value) is type(default) and value == default)


def _check_temperature(schema: str, temperature: float) -> None:
    """A sample's sampling temperature must be > 0: the learner divides the logits by it, as the server did."""
    if not 0 < temperature < float("inf"):  # NaN fails too
        raise SchemaError(schema, "temperature", f"must be a finite number > 0 (the learner scores tokens at "
                                                 f"logits / temperature, as the server sampled them), got {temperature!r}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _array_kind(hint: Any) -> type | None:
    if hint in ARRAY_DTYPES:
        return typing.cast(type, hint)
    for arg in typing.get_args(hint):
        if arg in ARRAY_DTYPES:
            return typing.cast(type, arg)
    return None


def _check_field(schema: str, name: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for a in non_none:
            try:
                _check_field(schema, name, value, a)
                return
            except SchemaError as exc:
                errors.append(exc.problem)
        raise SchemaError(schema, name, "; ".join(errors))
    if hint in ARRAY_DTYPES:
        if not isinstance(value, np.ndarray) or value.dtype != ARRAY_DTYPES[hint] or value.ndim != 1:
            raise SchemaError(schema, name, f"expected a 1-d {ARRAY_DTYPES[hint]} array")
        return
    if hint is Any:
        return
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(schema, name, f"expected a number, got {type(value).__name__}")
        return
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(schema, name, f"expected an integer, got {type(value).__name__}")
        return
    if hint is str:
        if not isinstance(value, str):
            raise SchemaError(schema, name, f"expected a string, got {type(value).__name__}")
        if len(value) > Message.MAX_TEXT:
            raise SchemaError(schema, name, f"string of {len(value)} chars exceeds {Message.MAX_TEXT}")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise SchemaError(schema, name, f"expected a bool, got {type(value).__name__}")
        return
    if hint is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise SchemaError(schema, name, f"expected bytes, got {type(value).__name__}")
        return
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise SchemaError(schema, name, f"expected a map, got {type(value).__name__}")
        return
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise SchemaError(schema, name, f"expected a list, got {type(value).__name__}")
        if args:
            for i, item in enumerate(value):
                _check_field(schema, f"{name}[{i}]", item, args[0])
        return
    raise TypeError(f"{schema}.{name}: unsupported annotation {hint!r}")  # a bug in this module


def _nonneg(schema: str, **values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise SchemaError(schema, name, f"must be >= 0, got {v}")


def _same_length(schema: str, **arrays: np.ndarray | None) -> None:
    lengths = {k: len(v) for k, v in arrays.items() if v is not None}
    if len(set(lengths.values())) > 1:
        raise SchemaError(schema, next(iter(lengths)), f"per-token arrays differ in length: {lengths}")


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters carried by a task (SGLang's names)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class Task(Message):
    """rollout.tasks, key task_id: one prompt, to be sampled ``group_size`` times.

    ``spec`` is the domain's verifier input (e.g. ``{"answer": "42"}`` for arith, ``{"tests": [...]}``
    for code, ``{"setup_files": ..., "checks": [...]}`` for terminal). ``prompt_ids`` may be given
    instead of ``prompt`` (token-in-token-out clients); if both are set, ``prompt_ids`` wins.
    ``tools`` (function schemas) are declared to the model when its prompt is rendered.
    """

    SCHEMA: ClassVar[str] = "task"
    VERSION: ClassVar[int] = 1
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset({"tools"})

    task_id: str
    domain: str
    prompt: str
    spec: dict[str, Any]
    group_size: int = 4
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int = 1
    admitted_version: int = 0
    prompt_ids: TokenArray | None = None
    difficulty: float = 0.0
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Tools declared to the model, OpenAI / Hugging Face function schemas (``{"type": "function", "function":
    {"name", "description", "parameters"}}``); the prompt is rendered with them (the chat template's ``tools=``,
    else a Hermes block). Empty: none (a record without the field, from an older producer, too)."""

    def _check(self) -> None:
        if not self.task_id:
            raise SchemaError(self.SCHEMA, "task_id", "must not be empty")
        for i, tool in enumerate(self.tools):
            if not is_function_tool(tool):
                raise SchemaError(self.SCHEMA, f"tools[{i}].function.name", "a non-empty string is required")
        if not 1 <= self.group_size <= 1024:
            raise SchemaError(self.SCHEMA, "group_size", f"must be in 1..1024, got {self.group_size}")
        if not 1 <= self.max_turns <= 64:
            raise SchemaError(self.SCHEMA, "max_turns", f"must be in 1..64, got {self.max_turns}")
        mnt = self.sampling.get("max_new_tokens", 64)
        if isinstance(mnt, bool) or not isinstance(mnt, int) or not 1 <= mnt <= 131072:
            raise SchemaError(self.SCHEMA, "sampling.max_new_tokens", f"must be an int in 1..131072, got {mnt!r}")
        _nonneg(self.SCHEMA, admitted_version=self.admitted_version)


@dataclasses.dataclass(frozen=True, slots=True)
class PublishedTask(Message):
    """rollout.tasks.published, key id: a user's task published by `rollout tasks publish` (a validated row of
    a task file, :mod:`engine.tasks`); a scheduler with ``published_tasks`` issues each once as a :class:`Task`."""

    SCHEMA: ClassVar[str] = "published_task"
    VERSION: ClassVar[int] = 1

    id: str
    domain: str
    prompt: str
    spec: dict[str, Any]
    max_turns: int = 0
    """0: the domain's own turn count for ``spec``."""
    source: str = ""
    """The file it was published from (informational)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def _check(self) -> None:
        if not self.id:
            raise SchemaError(self.SCHEMA, "id", "must not be empty")
        if not 0 <= self.max_turns <= 64:
            raise SchemaError(self.SCHEMA, "max_turns", f"must be in 0..64, got {self.max_turns}")


@dataclasses.dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """rollout.tokens, key sample_id: new tokens of one generation, in order (``seq`` counts chunks).

    The chunks of a sample, ``seq`` 0, 1, ..., concatenated, are its model tokens so far: an inference actor
    that takes over a task whose generation was cut off (its actor died) continues from them, numbering its
    own chunks on (:mod:`actors.inference.resume`). ``done`` marks the last chunk of a finished generation.
    """

    SCHEMA: ClassVar[str] = "token_chunk"
    VERSION: ClassVar[int] = 1
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset({"weight_versions", "finish_reason"})

    sample_id: str
    task_id: str
    seq: int
    token_ids: TokenArray
    logprobs: LogprobArray
    weight_version: int
    done: bool = False
    weight_versions: TokenArray | None = None
    """Each token's policy version, when they differ within the chunk (else all are ``weight_version``)."""
    finish_reason: str = ""
    """On the ``done`` chunk: why the generation ended (``stop``, ``length``)."""

    def _check(self) -> None:
        _nonneg(self.SCHEMA, seq=self.seq)
        _same_length(self.SCHEMA, token_ids=self.token_ids, logprobs=self.logprobs,
                     weight_versions=self.weight_versions)

    def versions(self) -> list[int]:
        """Each token's policy version."""
        if self.weight_versions is not None:
            return [int(v) for v in self.weight_versions]
        return [self.weight_version] * len(self.token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxRequest(Message):
    """rollout.sandbox.requests, key episode_id: one step of a multi-turn episode.

    ``action`` is ``open`` (spec and domain set), ``step`` (``command`` set) or ``close``. The reply goes
    to partition ``reply_partition`` of rollout.sandbox.results.
    """

    SCHEMA: ClassVar[str] = "sandbox_request"
    VERSION: ClassVar[int] = 1
    ACTIONS: ClassVar[tuple[str, ...]] = ("open", "step", "close")
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset({"attempt"})

    episode_id: str
    step: int
    action: str
    reply_partition: int
    domain: str = ""
    command: str = ""
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)
    attempt: str = ""
    """A nonce of this generation of the episode: a group generated again (its inference actor died) reuses
    the episode id, never the attempt, so it gets a fresh sandbox and none of the old attempt's replies."""

    def _check(self) -> None:
        if self.action not in self.ACTIONS:
            raise SchemaError(self.SCHEMA, "action", f"must be one of {self.ACTIONS}, got {self.action!r}")
        _nonneg(self.SCHEMA, step=self.step, reply_partition=self.reply_partition)


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxResult(Message):
    """rollout.sandbox.results, explicit partition: the observation for one episode step."""

    SCHEMA: ClassVar[str] = "sandbox_result"
    VERSION: ClassVar[int] = 1
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset({"messages", "attempt"})

    episode_id: str
    step: int
    observation: str
    exit_code: int | None = None
    timed_out: bool = False
    error: str = ""
    """Empty on success; ``EPISODES_FULL`` is backpressure (open again later), anything else ends the episode."""
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    """On ``close``: the final-state facts of the episode (what its domain's reward reads)."""
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """On ``step`` of a ``tools`` episode: the chat messages handing the results back (``{"role": "tool",
    "name", "content"}`` per call, or a ``user`` hint), rendered whole as the template's turns; ``observation``
    is then their contents joined. Empty for a shell episode (its ``observation`` is the shell output)."""
    attempt: str = ""
    """The request's ``attempt``: a reply is matched by (episode_id, attempt, step)."""


EPISODES_FULL = "too_many_episodes"
"""``SandboxResult.error`` of an ``open`` refused because the sandbox host holds all the episodes it may."""

SANDBOX_ERROR = "sandbox_error"
"""``Completion.finish_reason`` of a multi-turn sample whose episode lost its sandbox or never got one
(a host died, the episode idled out, no reply in time, an unusable spec): not the model's doing, so
the verify actor reports it as an error and the sample is accounted for but never trained on."""


@dataclasses.dataclass(frozen=True, slots=True)
class Completion(Message):
    """rollout.completions, key task_id: one finished sample with everything the learner needs.

    ``response_ids`` are all tokens after the prompt as produced, model tokens and observation tokens
    alike; ``loss_mask`` is 1 on model tokens; ``logprobs`` are the behaviour logprobs (0 on
    observation tokens); ``weight_versions`` the policy version that produced each token (-1 on
    observation tokens).
    """

    SCHEMA: ClassVar[str] = "completion"
    VERSION: ClassVar[int] = 1
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset({"temperature"})

    sample_id: str
    task_id: str
    domain: str
    group_index: int
    group_size: int
    prompt_ids: TokenArray
    response_ids: TokenArray
    logprobs: LogprobArray
    loss_mask: MaskArray
    weight_versions: VersionArray
    text: str
    finish_reason: str
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)
    turns: int = 1
    admitted_version: int = 0
    transcript: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    episode_facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Multi-turn episodes: the facts the sandbox actor returned when the episode closed."""
    temperature: float = 1.0
    """The sampling temperature the server applied (``logprobs`` are of ``softmax(logits / temperature)``);
    must be > 0. Left out of the body while 1."""

    def _check(self) -> None:
        _check_temperature(self.SCHEMA, self.temperature)
        _nonneg(self.SCHEMA, group_index=self.group_index, turns=self.turns)
        if not 0 <= self.group_index < self.group_size:
            raise SchemaError(self.SCHEMA, "group_index", f"must be in 0..{self.group_size - 1}")
        _same_length(
            self.SCHEMA,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            loss_mask=self.loss_mask,
            weight_versions=self.weight_versions,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome(Message):
    """rollout.outcomes, key task_id: a completion plus its verifiable facts (not yet a reward)."""

    SCHEMA: ClassVar[str] = "outcome"
    VERSION: ClassVar[int] = 1

    completion: dict[str, Any]
    facts: dict[str, Any]
    verifier: str
    verify_s: float = 0.0
    error: str = ""

    def completion_msg(self) -> Completion:
        return Completion.from_body(self.completion)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, slots=True)
class Experience(Message):
    """rollout.experience, key task_id: one trainable sample with its reward and advantage."""

    SCHEMA: ClassVar[str] = "experience"
    VERSION: ClassVar[int] = 1
    OMIT_WHEN_EMPTY: ClassVar[frozenset[str]] = frozenset({"temperature"})

    sample_id: str
    task_id: str
    domain: str
    prompt_ids: TokenArray
    response_ids: TokenArray
    logprobs: LogprobArray
    loss_mask: MaskArray
    weight_versions: VersionArray
    reward: float
    advantage: float
    group_size: int
    admitted_version: int = 0
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    filtered: str = ""
    """Non-empty when the sample must be counted but not trained (e.g. ``zero_variance``, ``straggler``)."""
    temperature: float = 1.0
    """The sampling temperature of the behaviour policy: the learner scores the tokens at ``logits /
    temperature`` as the server sampled them; must be > 0. Left out of the body while 1."""

    def _check(self) -> None:
        _check_temperature(self.SCHEMA, self.temperature)
        _same_length(
            self.SCHEMA,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            loss_mask=self.loss_mask,
            weight_versions=self.weight_versions,
        )

    def min_version(self) -> int:
        """The oldest policy version that produced a model token of this sample."""
        v = self.weight_versions[self.loss_mask.astype(bool)]
        return int(v.min()) if len(v) else self.admitted_version


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter(Message):
    """rollout.dlq, original key: a record no consumer could handle, with why and where it came from."""

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1

    topic: str
    partition: int
    offset: int
    reason: str
    error: str
    value: bytes
    consumer_group: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class WeightManifest(Message):
    """NATS KV value announcing a weight version whose objects are in the object store."""

    SCHEMA: ClassVar[str] = "weight_manifest"
    VERSION: ClassVar[int] = 1

    version: int
    objects: list[dict[str, Any]]
    tensors: dict[str, Any]
    step: int = 0
    format: str = "safetensors"
    wire_dtype: str = "float32"
    """Dtype of the floating tensors as stored (``float32``, ``bfloat16``, ...; ``mixed`` if several);
    a server casts them to the dtype it serves in."""


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """NATS subject ``<ns>.heartbeat.<role>``: an actor instance's live statistics."""

    SCHEMA: ClassVar[str] = "heartbeat"
    VERSION: ClassVar[int] = 1

    role: str
    instance: str
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class EvalResult(Message):
    """rollout.eval, key ``<domain>/<weight_version>``: one domain's held-out evaluation of one served
    weight version by the ``eval`` actor (the figures of `rollout eval`; tasks the scheduler never issues)."""

    SCHEMA: ClassVar[str] = "eval_result"
    VERSION: ClassVar[int] = 1

    domain: str
    weight_version: int
    """The version the server reported serving when the evaluation started."""
    tasks: int
    samples: int
    """Generations per task."""
    completion_rate: float
    """Fraction of generations fully solved."""
    completion_ci95: list[float]
    """Wilson 95% interval [low, high] of ``completion_rate``."""
    mean_correctness: float
    pass_at_1: float
    pass_at_k: float
    mean_turns: float
    mean_tokens: float
    temperature: float
    elapsed_s: float
    instance: str = ""

    def _check(self) -> None:
        if not self.domain:
            raise SchemaError(self.SCHEMA, "domain", "must not be empty")
        _nonneg(self.SCHEMA, weight_version=self.weight_version, tasks=self.tasks, samples=self.samples)
        for name in ("completion_rate", "mean_correctness", "pass_at_1", "pass_at_k"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SchemaError(self.SCHEMA, name, f"must be in [0, 1], got {value}")


SCHEMAS: dict[str, type[Message]] = {
    cls.SCHEMA: cls
    for cls in (Task, PublishedTask, TokenChunk, SandboxRequest, SandboxResult, Completion, Outcome, Experience, DeadLetter,
                WeightManifest, Heartbeat, EvalResult)
}
