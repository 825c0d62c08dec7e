"""Configuration: pydantic models declared once, loaded from TOML with environment overrides.

Every field has its type, default, bounds and a docstring in one place. Environment variables
override the file: ``ROLLOUT__<SECTION>__<FIELD>`` (double underscores separate levels), e.g.
``ROLLOUT__KAFKA__BOOTSTRAP=10.0.0.5:9092`` or ``ROLLOUT__LEARNER__BATCH_SIZE=64``. Values from the
environment are parsed as TOML values when they parse (numbers, booleans, arrays), else as strings.

Errors name the file and the field: ``ConfigError: run.toml: learner.batch_size: Input should be
greater than or equal to 1``. Files a config names (TLS CA, certificate and key, NATS credentials) are
checked by :func:`check_files` before anything connects, and their errors name the field and the path:
``ConfigError: run.toml: kafka.ssl_cafile: /etc/ca.pem: no such file``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import ssl
import tomllib
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

ENV_PREFIX = "ROLLOUT__"
ROLES: tuple[Literal["scheduler", "inference", "sandbox", "reward", "learner"], ...] = (
    "scheduler", "inference", "sandbox", "reward", "learner")
INFERENCE_API_KEY_ENV = ENV_PREFIX + "INFERENCE__API_KEY"
"""The variable of `inference.api_key`, which `rollout inference serve` reads too: one secret, both sides."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and the field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class KafkaConfig(Section):
    bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, comma separated host:port."""
    partitions: dict[str, int] = Field(default_factory=dict)
    """Partition count per topic suffix (e.g. {"tasks" = 6, "sandbox.requests" = 12}); others get `default_partitions`."""
    default_partitions: int = Field(3, ge=1, le=10000)
    """Partition count of topics not named in `partitions`."""
    replication_factor: int = Field(1, ge=1, le=16)
    """Replication factor of topics the engine creates."""
    compression: Literal["none", "gzip", "lz4", "zstd", "snappy"] = "lz4"
    """Producer compression codec."""
    max_record_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest record the engine produces or accepts; larger ones go to the dead-letter topic."""
    session_timeout_ms: int = Field(15000, ge=6000, le=300000)
    """Consumer-group session timeout: a member silent this long is replaced (its partitions re-delivered).
    Shorter recovers faster from a killed process; too short drops live members of a loaded host whose
    heartbeat thread starves for the GIL."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka security protocol."""
    sasl_mechanism: str | None = None
    """SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) when the protocol uses SASL."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: str | None = None
    """SASL password (prefer the environment override over writing it in a file)."""
    ssl_cafile: str | None = None
    """PEM CA bundle the broker's certificate is verified with (SSL / SASL_SSL); None: the system's CAs."""
    ssl_certfile: str | None = None
    """PEM client certificate (chain) for brokers that require mutual TLS; may hold the key too."""
    ssl_keyfile: str | None = None
    """PEM private key (unencrypted) of `ssl_certfile`, when not in that file."""


class TransportConfig(Section):
    """Which transport carries the event log and the control store (streams/transports.py)."""

    type: str = Field("kafka", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """A registered transport: `kafka` (Kafka event log, NATS control store; sections kafka and nats) or
    `memory` (both in this process, for one-process deployments and tests); plugins may add others."""


class NatsConfig(Section):
    url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma separated."""
    weights_bucket: str = "weights"
    """JetStream object store bucket holding weight files (prefixed by the namespace)."""
    kv_bucket: str = "control"
    """JetStream KV bucket holding the weight manifest and other small state (prefixed by the namespace)."""
    credentials: str | None = None
    """Path of a NATS .creds file."""
    user: str | None = None
    """NATS user name."""
    password: str | None = None
    """NATS password."""
    token: str | None = None
    """NATS auth token."""
    timeout_s: float = Field(30.0, gt=0)
    """Hard timeout for any single NATS operation (connect, put, get of one chunk)."""


class LengthCurriculumConfig(Section):
    """Context-length curriculum of long-document domains (engine/curriculum.py)."""

    domains: list[str] = Field(default_factory=lambda: ["longdoc"])
    """Domains whose document length it steers (each must map lengths to difficulty; today: longdoc)."""
    lengths: list[int] = Field(default_factory=lambda: [1000, 2000, 4000, 8000])
    """Context lengths in tokens, shortest first."""
    threshold: float = Field(0.6, gt=0, le=1)
    """Success rate at the current length that moves a domain to the next length."""
    window: int = Field(64, ge=1)
    """Samples drawn at a length before its success rate is judged."""


class BalanceConfig(Section):
    """How the scheduler moves sampling shares between sources as the run goes (``actors/scheduler.py``
    ``DomainMixer``; docs/domains.md "Balancing several domains").

    ``static``: the configured weights. ``zero_variance``: each weight times ``max(0.1, 1 - the domain's
    share of tied groups since the reward actors started)`` (the engine's behaviour before this section).
    ``signal``: each weight times the domain's learning signal over its last ``window`` groups: the share of
    groups whose rewards are not all equal, times a solve-rate band factor (1 inside ``band``, falling
    linearly to ``band_min`` at solve rate 0 or 1), plus ``progress`` times the absolute change of the solve
    rate between the window's older and newer half. Every policy applies ``floor`` and ``cap`` to the shares
    and pauses a domain whose verifier fails on every sample of its last ``pause_after`` samples."""

    policy: Literal["static", "zero_variance", "signal"] | None = None
    """None: ``zero_variance`` when ``scheduler.rebalance`` is on (the default), else ``static``."""
    window: int = Field(64, ge=2)
    """Groups per domain the ``signal`` policy looks at (the most recent ones)."""
    min_groups: int = Field(4, ge=1)
    """Groups a domain needs in its window before its signal counts (before: full weight)."""
    floor: float = Field(0.0, ge=0, le=1)
    """Least sampling share of every source with a positive weight (0: none)."""
    cap: float = Field(1.0, gt=0, le=1)
    """Largest sampling share of any source (1: none)."""
    floors: dict[str, float] = Field(default_factory=dict)
    """Per-source floor overriding ``floor`` (a name of ``scheduler.domains``)."""
    caps: dict[str, float] = Field(default_factory=dict)
    """Per-source cap overriding ``cap`` (a name of ``scheduler.domains``)."""
    band: tuple[float, float] = (0.1, 0.9)
    """Solve rates that get the full band factor under ``signal``."""
    band_min: float = Field(0.1, ge=0, le=1)
    """Band factor at solve rate 0 and 1 (a domain never solved or always solved)."""
    progress: float = Field(1.0, ge=0)
    """Weight of learning progress (|newer-half minus older-half solve rate|) in the ``signal`` score."""
    pause_after: int = Field(16, ge=0)
    """Pause a domain once its last this-many samples all failed in the verifier (0: never pause)."""
    pause_s: float = Field(120.0, gt=0)
    """A paused domain is tried again (a probe) after this long."""
    regression_boost: float = Field(2.0, ge=1)
    """``signal``: factor on a domain whose held-out accuracy regressed (the eval role's
    ``eval.regression_threshold``), until its evaluation recovers; 1: evaluations do not steer."""

    @model_validator(mode="after")
    def _check(self) -> "BalanceConfig":
        lo, hi = self.band
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"scheduler.balance.band = [{lo}, {hi}]: need 0 <= low < high <= 1")
        for field, values in (("floors", self.floors), ("caps", self.caps)):
            for name, v in values.items():
                if not 0 <= v <= 1:
                    raise ValueError(f"scheduler.balance.{field}.{name} = {v}: a share in [0, 1]")
        for name in set(self.floors) | set(self.caps) | {""}:
            floor, cap = self.floors.get(name, self.floor), self.caps.get(name, self.cap)
            if floor > cap:
                where = f" of {name!r}" if name else ""
                raise ValueError(f"scheduler.balance: floor{where} {floor} is above its cap {cap}")
        return self


class SamplingOverrides(Section):
    """Sampling parameters the scheduler puts on every task it issues, over its domain's (load tests)."""

    ignore_eos: bool = False
    """Generate every sample to its budget whatever the model says (fixed-length generations: throughput
    and fault-injection runs, e.g. ``loadtests/chaos.py --long``). Off for training: an answer past its end
    is noise."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Every task's token budget, over its domain's (None: the domain's, else ``inference.max_new_tokens``)."""
    stop: list[str] | None = None
    """Every task's stop strings, over its domain's (None: the domain's; ``[]``: none, so ``ignore_eos``
    generations run to the budget)."""


class SchedulerConfig(Section):
    domains: dict[str, float] = Field(default_factory=lambda: {"arith": 1.0})
    """Domain name -> sampling weight (normalised)."""
    group_size: int = Field(4, ge=1, le=1024)
    """Samples generated per task (the GRPO group)."""
    max_staleness: int = Field(2, ge=0)
    """Off-policy bound: samples more than this many versions behind the learner are not admitted or trained."""
    max_tasks: int | None = Field(None, ge=1)
    """Stop admitting after this many tasks (None: run until stopped)."""
    seed: int = 0
    """Seed of the task generators and domain sampling."""
    rebalance: bool = True
    """Re-weight domains from observed statistics: shorthand for ``balance.policy = "zero_variance"``
    (off: ``"static"``); ``balance.policy``, when set, wins."""
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    """Dynamic balancing of the sampling shares (policy, window, floor and cap; see ``BalanceConfig``)."""
    curriculum: bool = True
    """Admit short/easy tasks first and lengthen with the observed success rate."""
    length_curriculum: LengthCurriculumConfig | None = None
    """Context-length curriculum for long-document domains (None: off; they follow `curriculum`)."""
    task_files: dict[str, float] = Field(default_factory=dict)
    """Users' task files (JSONL, Parquet or saved HF dataset dir; see docs/tasks.md) -> mixing weight.
    When set, the scheduler issues these tasks (each once) instead of the ``domains`` generators."""
    task_fields: dict[str, str] = Field(default_factory=dict)
    """Field mapping for ``task_files``: task field (prompt, answer, ...) -> the files' column name."""
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)
    """Sampling parameters put on every task issued, over its domain's (see ``SamplingOverrides``)."""
    published_tasks: bool = False
    """Also issue the tasks published with `rollout tasks publish` (topic ``rollout.tasks.published``), each
    once, ahead of the other sources as they arrive; with ``domains = {}`` and no ``task_files``, only those.
    The scheduler then runs until stopped, waiting for more. Replicas share the topic as one consumer group."""
    replica: int = Field(0, ge=0)
    """This scheduler's index among ``replicas``: it issues task-file rows replica, replica+n, ..."""
    replicas: int = Field(1, ge=1)
    """How many scheduler replicas share the ``task_files``."""

    @property
    def balance_policy(self) -> str:
        """The balancing policy in force (``balance.policy``, else what ``rebalance`` says)."""
        if self.balance.policy is not None:
            return self.balance.policy
        return "zero_variance" if self.rebalance else "static"

    @model_validator(mode="after")
    def _check_weights(self) -> "SchedulerConfig":
        for field, weights in (("domains", self.domains), ("task_files", self.task_files)):
            for name, w in weights.items():
                if not w >= 0:
                    raise ValueError(f"scheduler.{field}.{name} = {w}: a weight must be non-negative")
            if weights and sum(weights.values()) <= 0:
                raise ValueError(f"scheduler.{field}: every weight is 0 (nothing would be sampled)")
        sources = set(self.domains) if not self.task_files else {f"file:{Path(p).name}" for p in self.task_files}
        for field in ("floors", "caps"):
            for name in getattr(self.balance, field):
                if name not in sources:
                    raise ValueError(f"scheduler.balance.{field}.{name}: not a source of this scheduler "
                                     f"(sources: {sorted(sources)})")
        live = [n for n, w in (self.domains if not self.task_files else
                               {f"file:{Path(p).name}": w for p, w in self.task_files.items()}).items() if w > 0]
        if live:
            floors = sum(self.balance.floors.get(n, self.balance.floor) for n in live)
            caps = sum(self.balance.caps.get(n, self.balance.cap) for n in live)
            if floors > 1 + 1e-9:
                raise ValueError(f"scheduler.balance: the floors of {len(live)} sources sum to {floors:g} > 1")
            if caps < 1 - 1e-9:
                raise ValueError(f"scheduler.balance: the caps of {len(live)} sources sum to {caps:g} < 1")
        return self


class InferenceConfig(Section):
    backend: str = "local"
    """A name registered in modelserver.backends (checked where the deployment is wired: ops/deployment.py's
    `load_deployment_config`). `local`: the embedded torch server of this project; `sglang`: an external
    SGLang server or router."""
    urls: list[str] = Field(default_factory=list)
    """SGLang server or router URLs (backend=sglang), or a running local server; empty: start one embedded."""
    model_dir: str | None = None
    """The Hugging Face model directory this deployment serves and trains: the local backend loads it,
    the learner starts from it, the inference actor reads its tokenizer. With backend `sglang` it is
    required and must be the model the SGLang servers were started with (their `--model-path`, as this
    host sees it). None (local backend only): a tiny model built from a config."""
    api_key: SecretStr | None = None
    """Key of the inference servers (SGLang's `--api-key`; `rollout inference serve --api-key-file`): the
    client sends `Authorization: Bearer <key>` on every request, and the embedded local server requires
    it. Never logged. Set it in the environment (ROLLOUT__INFERENCE__API_KEY) or use `api_key_file`
    rather than writing it here."""
    api_key_file: str | None = None
    """A file holding the api key (surrounding whitespace ignored), e.g. a mounted Secret; not both
    this and `api_key`. Read when the inference role starts."""
    max_new_tokens: int = Field(64, ge=1)
    """Default generation length when the task does not say."""
    temperature: float = Field(1.0, gt=0)
    """Default sampling temperature of the training samples; > 0, since the learner scores their tokens at
    ``logits / temperature`` as the server sampled them. Greedy decoding for a task: ``top_k = 1`` in its
    ``sampling`` (the reported logprobs are then of ``softmax(logits / temperature)``)."""
    concurrency: int = Field(32, ge=1)
    """Generations in flight per actor."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Hard timeout of one generate call."""
    weight_sync_timeout_s: float = Field(60.0, gt=0)
    """Hard timeout for fetching and applying one weight version."""
    partial_rollouts: bool = True
    """True: a weight update interrupts generations in flight (``abort_all_requests``) and they resume on
    the new weights from the tokens kept (each token tagged with its version). False: the update waits
    until every generation this actor has in flight ends (no new one starts meanwhile), then applies; each
    model turn is generated by one version (multi-turn episodes may change version between turns)."""
    resume_window_s: float = Field(600.0, ge=0)
    """A task that comes to this actor after another actor died in it continues each single-turn sample from
    the tokens already on ``rollout.tokens`` (actors/inference/resume.py): the read looks back this far
    before the actor started (the longest a generation may have been running). 0: generate from scratch."""
    reply_partition: int = Field(0, ge=0)
    """Partition of rollout.sandbox.results this instance reads its sandbox replies from (unique per instance)."""
    max_batch: int = Field(64, ge=1)
    """Local backend: most sequences decoded together."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Local backend: serving dtype of weights and KV cache (`rollout inference serve --dtype`); bf16 is
    faster on CPUs with avx512_bf16; logprobs are computed in fp32 from the logits either way."""
    prefix_cache_tokens: int = Field(8192, ge=0)
    """Local backend: tokens of finished sequences' KV kept so a prompt sent again (or a multi-turn
    episode's next turn) reuses its prefix (`rollout inference serve --prefix-cache-tokens`); 0 disables.
    Memory: this many tokens x the KV bytes per token (46 KB fp32, 23 KB bf16 for SmolLM2-135M)."""
    kv_cache: Literal["paged", "slot"] = "paged"
    """Local backend: the KV store (`rollout inference serve --kv-cache`): `paged` (fixed-size blocks, a
    block table per sequence, a group's prompt blocks shared, retained prefixes in a radix tree over
    blocks, admission control on free blocks) or `slot` (a preallocated row per sequence)."""
    kv_cache_tokens: int = Field(65536, ge=16)
    """Local backend, paged store: the KV pool's bound in tokens (memory: this x the KV bytes per token,
    allocated as needed); a request waits in the queue until its worst case (input + max_new_tokens) fits,
    and one that can never fit is refused with a 400 (`--kv-cache-tokens`)."""
    prefix_cache_int8_tokens: int = Field(0, ge=0)
    """Local backend: a second tier of the prefix cache holding this many more tokens, int8-quantised
    (entries evicted from the first tier; restored on a hit, close to but not bit-equal with the computed
    KV); 0 (default): none (`rollout inference serve --prefix-cache-int8-tokens`)."""
    prefix_cache_disk_tokens: int = Field(0, ge=0)
    """Local backend: a third tier below the int8 one holding this many more tokens on disk (entries the
    int8 tier evicts, still int8, a file each; read back on a hit); 0 (default): none. Needs the int8 tier
    (`--prefix-cache-disk-tokens`)."""
    prefix_cache_disk_dir: str | None = None
    """Local backend: where the disk tier makes its private directory (default: the system's temporary
    directory); removed when the server stops (`--prefix-cache-disk-dir`)."""
    attention_window: int | None = Field(None, ge=1)
    """Local backend: sliding-window attention over the last N positions (plus `attention_sinks`) for
    long inputs; None (default) is full attention. Changes the model's outputs: measure it first
    (`loadtests/long_context.py`)."""
    attention_sinks: int = Field(0, ge=0)
    """Local backend, with `attention_window`: the first positions every token keeps attending to."""
    rescore: bool = False
    """Local backend: re-score each finished sample with one full-sequence forward, the learner's own
    computation, so its same-version logprobs equal the learner's in fp32 (`rollout inference serve
    --rescore`). Off by default: it cost 45% of the throughput on a 2-core CPU (SmolLM2, 16 samples of 32
    tokens); docs/learner.md, "Train/serve mismatch", gives the cost and the gap without it."""
    stream_interval: int = Field(1, ge=1)
    """Tokens per ``rollout.tokens`` record: new tokens are sent once this many have come (the rest when
    the generation ends). 1 sends every chunk the server streams; larger values cut Kafka records (and
    broker CPU) per sample at the cost of a consumer seeing tokens a few decode steps later."""

    @model_validator(mode="after")
    def _one_api_key_source(self) -> "InferenceConfig":
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("api_key and api_key_file are both set; give one")
        return self

    @model_validator(mode="after")
    def _disk_tier_below_int8(self) -> "InferenceConfig":
        if self.prefix_cache_disk_tokens and not self.prefix_cache_int8_tokens:
            raise ValueError("prefix_cache_disk_tokens needs prefix_cache_int8_tokens: the disk tier holds what "
                             "the int8 tier evicts")
        return self

    def resolved_api_key(self) -> str | None:
        """The api key from `api_key` or `api_key_file`, or None; raises ConfigError if the file cannot
        be read or is empty."""
        if self.api_key is not None:
            return self.api_key.get_secret_value() or None
        if self.api_key_file is None:
            return None
        return read_key_file(self.api_key_file, "inference.api_key_file")


def read_key_file(path: str | Path, field: str) -> str:
    """The stripped contents of a secret file; ConfigError naming ``field`` if it cannot be read or is empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from None
    if not key:
        raise ConfigError(f"{field}: {path} is empty")
    return key


class SandboxConfig(Section):
    backend: str = "bwrap"
    """Sandbox backend: a name registered in sandboxes.registry (built in: `bwrap`, `docker`; checked where the
    deployment is wired, like `inference.backend`)."""
    pool_size: int = Field(8, ge=0)
    """Pre-warmed sandboxes."""
    max_sandboxes: int = Field(64, ge=1)
    """Most sandboxes open at once in this process (the pool raises the process's soft RLIMIT_NOFILE to fit
    about 4 descriptors per sandbox, up to the hard limit)."""
    start_concurrency: int = Field(8, ge=1)
    """Sandboxes started at once while the pool grows; more starts wait their turn, so a burst of thousands on a
    small host does not run every start past the backend's start timeout."""
    idle_ttl_s: float = Field(60.0, gt=0)
    """Idle sandboxes beyond `pool_size` (left from a burst) are closed after this long unused."""
    memory_mb: int = Field(256, ge=16)
    """Memory limit per sandbox."""
    pids: int = Field(64, ge=4)
    """Process limit per sandbox."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one command."""


class RewardConfig(Section):
    group_timeout_s: float = Field(120.0, gt=0)
    """A group still incomplete after this long is emitted with what arrived (stragglers dropped)."""
    drop_zero_variance: bool = True
    """Drop groups whose rewards are all equal (no learning signal)."""
    normalize: Literal["group", "group_std", "domain"] = "group_std"
    """Advantage: reward minus group mean (`group`), divided by group std too (`group_std`), or by the domain's running std (`domain`)."""
    format_weight: float = 0.0
    """Weight of the domain's format term added to the reward."""
    length_penalty: float = 0.0
    """Penalty per generated token (encourages concise answers)."""


class LearnerSimulateConfig(Section):
    """A SIMULATED learner step (``actors/learner_sim.py``): everything but the optimizer step is real.

    The step waits ``6 * model_params * tokens / (gpus * peak_flops * mfu)`` seconds (times
    ``time_scale``) instead of running torch; a weight publication writes a tiny model's files but first
    waits ``model_params * bytes_per_param / transfer_bytes_per_s`` (times ``time_scale``), the time the
    stated model's weights would take to move. Logs, step lines and status say ``simulated``."""

    gpu: str = "H100 SXM"
    """The accelerator assumed (named in logs and results; ``peak_flops`` is its figure)."""
    gpus: int = Field(8, ge=1, le=100000)
    """Training accelerators the step is spread over."""
    model_params: float = Field(7.6e9, ge=1e6, le=1e13)
    """Parameters of the trained model (default Qwen2.5-7B's 7.6e9; a count, e.g. 7e9, not billions)."""
    peak_flops: float = Field(989e12, gt=0)
    """Peak dense FLOP/s of one accelerator (H100 SXM bf16: 989e12, NVIDIA datasheet)."""
    mfu: float = Field(0.4, gt=0, le=1)
    """Model FLOPs utilisation assumed for the step (a fraction of ``peak_flops``)."""
    bytes_per_param: int = Field(2, ge=1, le=8)
    """Bytes of one published parameter (bf16: 2)."""
    transfer_bytes_per_s: float = Field(25e9, gt=0)
    """Bandwidth of a weight publication (learner to inference fleet), bytes/s."""
    time_scale: float = Field(1.0, ge=0)
    """Wall seconds per simulated second (0.01: a 100x faster-than-real run; match the sim servers')."""
    response_token_scale: float = Field(1.0, ge=1)
    """Real tokens each response token stands for: a simulated fleet may emit one synthetic token per k
    real ones to keep the engine's per-token work small (loadtests/fleet.py); the step counts k x the
    response tokens. 1: a token is a token."""


class LearnerConfig(Section):
    batch_size: int = Field(16, ge=1)
    """Samples per optimizer step."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    objective: Literal["tis", "decoupled_ppo"] = "tis"
    """Off-policy correction: truncated importance sampling or the decoupled PPO objective."""
    tis_cap: float = Field(2.0, gt=0)
    """Truncation of the importance ratio for `tis`."""
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range for `decoupled_ppo`."""
    off_policy: Literal["token_tis", "icepop", "seq_mis", "geo_mask", "off"] = "token_tis"
    """How the behaviour ratio exp(p_t - b_t) weighs each token (docs/learner.md, "Off-policy corrections"):
    ``token_tis`` truncated at ``tis_cap``; ``icepop`` masks tokens whose ratio is outside ``off_policy_band``;
    ``seq_mis`` weighs a sample by its sequence ratio, masking the whole sample above ``tis_cap``;
    ``geo_mask`` masks a whole sample whose geometric-mean ratio is outside the band (kept tokens: token_tis);
    ``off``: weight 1."""
    off_policy_band: tuple[float, float] | None = None
    """[low, high] of ``icepop`` (token ratio) and ``geo_mask`` (sequence geometric-mean ratio); None: the
    preset's default, (0.5, 2.0) for icepop and (0.99, 1.01) for geo_mask."""
    staleness_policy: Literal["drop", "downweight"] = "drop"
    """What happens to a finished sample staler than ``scheduler.max_staleness``: ``drop`` (counted under
    ``dropped_stale``, never trained) or ``downweight`` (trained, its loss weight multiplied by
    ``stale_decay`` per version beyond the bound: no finished sample is discarded for its age)."""
    stale_decay: float = Field(0.5, gt=0, le=1)
    """Loss-weight factor per version beyond the staleness bound under ``staleness_policy = "downweight"``."""

    @field_validator("canary_weights")
    @classmethod
    def _canary_weights_named(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("an empty list compares nothing: leave canary_weights unset for the defaults "
                             "(or set canary_every = 0 to turn the canary off)")
        if value is not None and not all(name.strip() for name in value):
            raise ValueError(f"parameter names must not be blank, got {value}")
        return value

    @field_validator("off_policy_band")
    @classmethod
    def _band_low_below_high(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(f"the band [low, high] needs 0 <= low < high, got [{value[0]}, {value[1]}]")
        return value
    publish_every: int = Field(1, ge=1)
    """Publish weights every k optimizer steps."""
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the floating tensors written for a weight publication (the wire format). ``bfloat16``
    halves what goes through NATS; servers cast to the dtype they serve in when they load it, so a
    float32 server then runs on bf16-rounded weights."""
    checkpoint_every: int = Field(5, ge=1)
    """Checkpoint model, optimizer and offsets every k steps."""
    checkpoint_dir: str = "runs/checkpoints"
    """Where checkpoints are written."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (None: run until stopped)."""
    seed: int = 0
    """Torch seed."""
    torch_threads: int = Field(1, ge=0)
    """Intra-op threads of the learner's torch (0: torch's default). On small hosts shared with the
    inference server, one thread avoids oversubscription that makes every step several times slower."""
    micro_batch_tokens: int = Field(2048, ge=1)
    """Token budget of one forward/backward pass (rows x padded row length); a step is split into
    micro-batches under it and their gradients accumulated, the loss still a mean over the whole
    step's tokens. Bounds the learner's activation memory (a row longer than the budget runs alone)."""
    share_prefix: bool = True
    """Pack the samples of a step that share one prompt into one row, prompt computed once (4-D
    attention mask: each response sees the prompt and its own earlier tokens only)."""
    packing: Literal["rows", "per_sample"] = "rows"
    """How a step's samples are laid out for the forward pass: ``rows`` packs them into padded rows under
    ``micro_batch_tokens`` (prompts shared under ``share_prefix``); ``per_sample`` gives each sample its own
    unpadded forward pass with its own prompt (``share_prefix`` does not apply): the shapes of
    ``learning.core.score_tokens``, so same-version log-probs of a re-scoring server (``inference.rescore``)
    equal the learner's training forward bit for bit in fp32. Slower (docs/learner.md, "Train/serve mismatch")."""
    logprob_chunk: int = Field(512, ge=1)
    """Response positions per chunk of the output projection and log-softmax (memory ~ chunk x vocab)."""
    autocast: Literal["off", "bf16"] = "off"
    """Run the transformer body under bf16 autocast (the output projection and log-softmax stay fp32)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~1/3 more compute)."""
    loss_weighting: Literal["token_mean", "sequence_mean", "domain_mean"] = "token_mean"
    """How a step's tokens weigh in its loss: ``token_mean`` (every trained token alike: a domain's share of
    the update follows its token count), ``sequence_mean`` (each sample's tokens averaged, then samples
    alike), ``domain_mean`` (each domain's tokens averaged within the domain, the domains weighted by their
    share of the step's samples: a domain's share of the update follows its sampling share)."""
    domain_grad_norms: bool = False
    """Debug: measure each domain's gradient norm exactly (one extra forward and backward pass per domain
    in the step); off, the per-domain ``grad_share`` is the share of sum |A| x loss weight (an estimate)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL estimator to the reference policy (the initial weights) added to the loss;
    0 disables it (and the reference model's memory and forward pass)."""
    lora_rank: int = Field(0, ge=0)
    """Rank of LoRA adapters on the attention projections (q, k, v, o); 0 trains every weight. The
    adapters are merged into published weights and checkpoints."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank."""
    export_dir: str | None = None
    """When set, the learner saves its final weights there as a Hugging Face directory (model and
    tokenizer, loadable with ``from_pretrained``) when it stops (drain or ``max_steps``)."""
    canary_every: int = Field(1, ge=0)
    """Probe the inference servers after every k-th weight publication (docs/learner.md, "Train/serve
    mismatch"): a fixed prompt's log-probs from each server against the learner's under the version the
    server claims; 0: no canary. Needs the servers' URLs (``inference.urls``, or the embedded server)."""
    canary_threshold: float = Field(1e-3, gt=0)
    """Largest probe gap |server - learner| / max(1, |logp|) at the same version before the canary trips."""
    canary_max_lag_s: float = Field(300.0, gt=0)
    """A server still claiming an older version this long after the next one was published trips the canary."""
    canary_weights: list[str] | None = None
    """Against bf16 servers (``inference.dtype = "bf16"``) the canary compares weights, not log-probs: these
    parameters' leading values (Hugging Face names) as the server answers ``/get_weights_by_name``, bit for bit
    against the learner's cast as the server loaded them. None: layer 0's and the last layer's
    ``mlp.down_proj.weight`` and ``model.norm.weight``. A name the model lacks stops the learner at start-up."""
    canary_action: Literal["warn", "stop"] = "warn"
    """On a trip: ``warn`` (error log, ``canary_trips`` metric, status) or ``stop`` (that, then the learner
    fails: no more training on samples from weights nobody can vouch for)."""
    simulate: LearnerSimulateConfig | None = None
    """SIMULATED step time instead of a torch step (see ``LearnerSimulateConfig``); None: train for real.
    E.g. ``simulate = {gpus = 8, model_params = 7e9, mfu = 0.4}``."""


class EvalConfig(Section):
    """Held-out evaluation during training (the ``eval`` actor, run beside the inference role):
    the policy being served is evaluated on the weight version it starts with and on every
    ``every_versions``-th version after; each domain's result goes to the ``rollout.eval`` topic
    and the dashboard plots it beside the training reward. Same episodes and verifiers as `rollout eval`."""

    every_versions: int = Field(0, ge=0)
    """Evaluate every Nth weight version (0: no evaluation during training)."""
    domains: dict[str, int] = Field(default_factory=dict)
    """Built-in domain -> held-out tasks to evaluate (tasks the scheduler never issues). Empty: every domain
    the scheduler trains (``scheduler.domains`` with a positive weight), ``tasks_per_domain`` tasks each."""
    tasks_per_domain: int = Field(32, ge=1)
    """Held-out tasks per trained domain when ``domains`` is empty."""
    regression_threshold: float = Field(0.1, ge=0, le=1)
    """A domain whose held-out accuracy falls more than this below its best of the run is flagged: a
    warning, the ``eval_alerts`` statistic (metric ``rollout_eval_<domain>_regressed``), and under the
    ``signal`` balancing policy a sampling boost (``scheduler.balance.regression_boost``)."""
    task_file: str | None = None
    """Also evaluate the rows of this task file (JSONL / Parquet / HF dataset dir), e.g. a user's held-out set."""
    samples: int = Field(1, ge=1, le=64)
    """Generations per task (pass@k with k = samples)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; judge at the training temperature (greedy: 0, samples must then be 1)."""
    seed: int = 0
    max_new_tokens: int = Field(32, ge=1)
    concurrency: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        if self.samples > 1 and self.temperature <= 0:
            raise ValueError(f"eval.samples = {self.samples} needs eval.temperature > 0 (greedy samples are identical)")
        for name, n in self.domains.items():
            if n < 1:
                raise ValueError(f"eval.domains.{name} = {n}: evaluate at least 1 task")
        return self


class DomainsConfig(Section):
    """Where domains come from besides the built-in ones and installed ``rollout_engine.domains`` entry points."""

    plugins: list[str] = Field(default_factory=list)
    """``package.module:attr`` names (a Domain, a list of them, a domain family, or a factory returning one)
    or bare ``package.module`` names (modules that register domains when imported). Every role of the
    deployment loads the same list before it starts, so all agree on the set of domains."""

    @field_validator("plugins")
    @classmethod
    def _well_formed(cls, value: list[str]) -> list[str]:
        for spec in value:
            module, sep, attr = spec.partition(":")
            parts = module.split(".") + (attr.split(".") if sep else [])
            if not all(p.isidentifier() for p in parts):
                raise ValueError(f"{spec!r}: expected 'package.module:attribute' or 'package.module'")
        return value


class TelemetryConfig(Section):
    tracing: bool = False
    """Export OpenTelemetry traces (OTEL_* variables configure the exporter)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP traces endpoint; None: OTEL_EXPORTER_OTLP_ENDPOINT or the SDK default."""
    tracer: Literal["sdk", "lean"] = "sdk"
    """What records the spans: ``sdk``, the OpenTelemetry SDK's ``TracerProvider`` (the only recorder).
    ``lean`` named a recorder built on the SDK's private internals, now removed: it is still accepted, means
    ``sdk`` and warns (FutureWarning) so old configs keep working."""
    http_host: str = "127.0.0.1"
    """Host the health/metrics/dashboard server binds (loopback by default)."""
    http_port: int = Field(0, ge=0, le=65535)
    """Port of the health/metrics/dashboard server (0: pick a free one)."""
    control_token: str | None = None
    """Token required by state-changing HTTP endpoints."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Heartbeat interval over NATS."""

    @field_validator("tracer")
    @classmethod
    def _lean_means_sdk(cls, value: str) -> str:
        if value == "lean":
            import warnings
            warnings.warn('telemetry.tracer = "lean" is deprecated and now means "sdk" (the lean recorder was '
                          'removed); set telemetry.tracer = "sdk" or drop the line', FutureWarning, stacklevel=2)
            return "sdk"
        return value


class SupervisionConfig(Section):
    max_restarts: int = Field(5, ge=0)
    """Restarts of one actor within `restart_window_s` before the supervisor gives up."""
    restart_window_s: float = Field(60.0, gt=0)
    """Window over which restarts are counted."""
    backoff_initial_s: float = Field(0.2, gt=0)
    """First restart delay; doubles each restart."""
    backoff_max_s: float = Field(10.0, gt=0)
    """Largest restart delay."""
    drain_timeout_s: float = Field(30.0, gt=0)
    """How long SIGTERM waits for in-flight work before cancelling."""
    gc_freeze: bool = True
    """Once started, move the start-up heap out of the cyclic garbage collector's reach (``gc.freeze``,
    see engine/process.py): full collections then walk only what the daemon allocated since."""


class EngineConfig(Section):
    """A whole deployment: one file configures every role."""

    namespace: str = Field("default", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Prefix of every topic, bucket and subject, so several runs can share a cluster."""
    roles: list[Literal["scheduler", "inference", "sandbox", "reward", "learner"]] = Field(
        default_factory=lambda: list(ROLES))
    """Roles this process runs (the CLI's --role overrides)."""
    transport: TransportConfig = Field(default_factory=TransportConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    nats: NatsConfig = Field(default_factory=NatsConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    domains: DomainsConfig = Field(default_factory=DomainsConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)

    @model_validator(mode="after")
    def _check_roles(self) -> "EngineConfig":
        if len(set(self.roles)) != len(self.roles):
            raise ValueError(f"roles listed twice: {self.roles}")
        ev = self.eval
        if ev.every_versions and not (ev.domains or ev.task_file or self.trained_domains()):
            raise ValueError("eval.every_versions is set but eval.domains and eval.task_file name no tasks and "
                             "scheduler.domains trains none (with task_files only, name eval.domains)")
        return self

    def trained_domains(self) -> list[str]:
        """The domains the scheduler's generators train (positive weight; none when it issues task files)."""
        if self.scheduler.task_files:
            return []
        return [d for d, w in self.scheduler.domains.items() if w > 0]


# -- files a config names ------------------------------------------------------------------------------

_MAX_FILE_BYTES = 4 * 1024 * 1024
"""Certificates, keys and .creds files are a few KiB; a CA bundle a few hundred."""


def _read(field: str, path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise ValueError("no such file")
    if not p.is_file():
        raise ValueError("not a regular file")
    try:
        with p.open("rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"larger than {_MAX_FILE_BYTES // (1024 * 1024)} MiB: not a {field} file")
    return data.decode("utf-8", errors="replace")


def _pem_certificates(path: str, text: str) -> None:
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError("holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"not a valid PEM certificate file: {exc.reason or exc}") from None


def _no_password() -> bytes:
    raise ValueError("the private key is encrypted: give an unencrypted key")


def _client_certificate(cfg: "KafkaConfig") -> None:
    """``ssl_certfile`` (with ``ssl_keyfile`` or a key inside it) loads as a certificate and its key."""
    assert cfg.ssl_certfile is not None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile,
                                                                password=_no_password)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if cfg.ssl_keyfile is None:
            raise ValueError(f"holds no private key for its certificate and kafka.ssl_keyfile is not set "
                             f"({reason})") from None
        if "KEY_VALUES_MISMATCH" in reason.upper():
            raise ValueError(f"does not match the certificate in kafka.ssl_certfile={cfg.ssl_certfile}") from None
        raise ValueError(f"cannot be loaded as the key of kafka.ssl_certfile={cfg.ssl_certfile}: {reason}") from None


def _nats_creds(text: str) -> None:
    """A .creds file: a user JWT block and a user nkey seed block (what nats-py reads: it loops forever on
    a file without the JWT marker, so this must hold before it gets the path)."""
    lines = [line.strip() for line in text.splitlines()]

    def after(marker: str) -> str:
        for i, line in enumerate(lines):
            if marker in line and i + 1 < len(lines):
                return lines[i + 1]
        raise ValueError(f"not a NATS .creds file: no -----{marker}----- block")

    jwt = after("BEGIN NATS USER JWT")
    parts = jwt.split(".")
    try:
        header, claims = (json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))) for part in parts[:2])
    except (binascii.Error, ValueError):
        header = claims = None
    if len(parts) != 3 or not isinstance(header, dict) or not isinstance(claims, dict):
        raise ValueError("not a NATS .creds file: the line after -----BEGIN NATS USER JWT----- is not a JWT")
    kind = (claims.get("nats") or {}).get("type") if isinstance(claims.get("nats"), dict) else None
    if kind not in (None, "user"):
        raise ValueError(f"holds a JWT of type {kind!r}, not a user's")
    if not after("BEGIN USER NKEY SEED").startswith("SU"):
        raise ValueError("not a NATS .creds file: the user nkey seed (SU...) is missing after -----BEGIN USER NKEY SEED-----")


def check_files(cfg: "EngineConfig | KafkaConfig | NatsConfig", source: str | None = None) -> None:
    """Check every file ``cfg`` names (exists, is readable, parses as what it should be) before anything
    connects. Raises ConfigError naming the source, the field and the path."""
    checks: list[tuple[str, str, Any]] = []  # (field, path, check(path, text))
    sections = [("kafka", cfg.kafka), ("nats", cfg.nats)] if isinstance(cfg, EngineConfig) else \
               [("kafka" if isinstance(cfg, KafkaConfig) else "nats", cfg)]
    for name, section in sections:
        if isinstance(section, KafkaConfig):
            if section.ssl_keyfile and not section.ssl_certfile:
                raise ConfigError(f"{source + ': ' if source else ''}kafka.ssl_keyfile: set without kafka.ssl_certfile")
            for field in ("ssl_cafile", "ssl_certfile"):
                if path := getattr(section, field):
                    checks.append((f"{name}.{field}", path, _pem_certificates))
            if section.ssl_keyfile:
                checks.append((f"{name}.ssl_keyfile", section.ssl_keyfile, lambda _p, text: _private_key(text)))
            if section.ssl_certfile:  # the pair: reported against the key when there is one
                pair = ("ssl_keyfile", section.ssl_keyfile) if section.ssl_keyfile else ("ssl_certfile", section.ssl_certfile)
                checks.append((f"{name}.{pair[0]}", pair[1], lambda _p, _t, kafka=section: _client_certificate(kafka)))
        elif isinstance(section, NatsConfig) and section.credentials:
            checks.append((f"{name}.credentials", section.credentials, lambda _p, text: _nats_creds(text)))
    for field, path, check in checks:
        try:
            check(path, _read(field, path))
        except ValueError as exc:
            raise ConfigError(f"{source + ': ' if source else ''}{field}: {path}: {exc}") from None


def _private_key(text: str) -> None:
    if "PRIVATE KEY-----" not in text:
        raise ValueError("holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)")


# Secrets stay the exact string the variable holds: a random key may happen to parse as a TOML number
# (`123e4567`), which would change it.
_RAW_ENV_FIELDS = frozenset({"password", "sasl_password", "token", "control_token", "api_key"})


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Nested dict of overrides from ``ROLLOUT__SECTION__FIELD`` variables."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__") if p]
        if not path:
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment: {key} conflicts with another override")
        node[path[-1]] = raw if path[-1] in _RAW_ENV_FIELDS else _parse_env_value(raw)
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _format_error(source: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        lines.append(f"{source}: {loc}: {msg}")
    return "\n".join(lines)


ConfigCheck = Callable[[EngineConfig], list[tuple[str, str]]]
"""A check of a validated config by a package above the engine: ``(field, message)`` per problem found."""


def load_config(path: str | Path | None = None, *, environ: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None, files: bool = False,
                checks: Sequence[ConfigCheck] = ()) -> EngineConfig:
    """Load a TOML file (or defaults), apply environment overrides, validate; with ``files``, also
    check the files it names (:func:`check_files`: what a process that connects wants, not a tool that
    only reads a deployment's config elsewhere). ``checks`` run on the validated config and report like
    the validation (ops/deployment.py passes the backend-name checks: the registries live above the engine).

    Raises ConfigError naming the file and the field.
    """
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{source}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    env = env_overrides(environ)
    if env:
        source += " (+ROLLOUT__* environment)"
    data = _merge(_merge(data, env), overrides or {})
    try:
        cfg = EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(source, exc)) from None
    problems = [f"{source}: {field}: {message}" for check in checks for field, message in check(cfg)]
    if problems:
        raise ConfigError("\n".join(problems))
    if files:
        check_files(cfg, source)
    return cfg
