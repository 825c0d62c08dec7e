"""SimEngine: LocalEngine's public API with roofline timing instead of a model (SIMULATED).

Why: plugged into the local server's HTTP layer it speaks the same SGLang protocol, so every real
part of the engine (clients, scheduler, Kafka/NATS) runs unchanged against it. Tokens are synthetic,
logprobs are synthetic (labelled in ``/model_info``), and each step sleeps its simulated duration
scaled by ``time_scale``.

``token_scale`` k: each synthetic output token stands for k real ones (a fleet benchmark's way to keep the
HTTP and Kafka work per sample small). A step then takes the time of k real decode steps at the real KV
length (prompt + k x output tokens of every running sequence, at the middle of those k steps), a
re-prefill counts k x the output tokens, and the sampled response length is divided by k (rounded up).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from modelserver.local.engine import EngineStatistics, PauseMode, Sequence, _abort_reason
from modelserver.local.protocol import BadRequest, SamplingParams
from modelserver.sim.roofline import LengthModel, Roofline

log = logging.getLogger(__name__)

SYNTHETIC_LOGPROB = -1.0
"""Every synthetic token's logprob (SIMULATED; no model computed it)."""


class ByteTokenizer:
    """A stand-in tokenizer (one token per byte) for when no real model directory is given."""

    bos_token_id = 1
    eos_token_id = 2
    all_special_ids = [0, 1, 2]

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes((i - 3) % 256 for i in ids if i >= 3).decode(errors="replace")


@dataclass
class _SimConfig:
    model_type: str = "simulated"
    architectures: tuple[str, ...] = ("SimulatedRoofline",)


class _SimModel:
    """What the server reads from ``engine.model`` (``config``)."""

    def __init__(self) -> None:
        self.config = _SimConfig()


class SimEngine:
    """Continuous batching over simulated time: a step serves every running sequence."""

    def __init__(
        self,
        roofline: Roofline | None = None,
        lengths: LengthModel | None = None,
        tokenizer: Any = None,
        *,
        max_batch: int = 256,
        time_scale: float = 1.0,
        seed: int = 0,
        weight_version: str = "default",
        vocab_size: int = 49152,
        context_length: int = 32768,
        token_scale: int = 1,
    ) -> None:
        if max_batch < 1 or time_scale < 0 or token_scale < 1:
            raise ValueError("max_batch must be >= 1, time_scale >= 0 and token_scale >= 1")
        self.token_scale = token_scale
        self.roofline = roofline or Roofline()
        self.lengths = lengths or LengthModel()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.model = _SimModel()
        self.max_batch = max_batch
        self.time_scale = time_scale
        self.weight_version = weight_version
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_id = int(getattr(self.tokenizer, "eos_token_id", 2) or 2)
        self.simulated_seconds = 0.0
        self._rng = random.Random(seed)
        self._targets: dict[int, int] = {}
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._paused = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._steps = self._decode_tokens = self._prefill_tokens = self._finished = 0

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._scheduler(), name="sim-engine-scheduler")

    async def aclose(self) -> None:
        self._closed = True
        self.abort_all("server shutting down")
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            running=len(self._running), waiting=len(self._waiting), paused=self._paused,
            weight_version=self.weight_version, steps=self._steps, decode_tokens=self._decode_tokens,
            prefill_tokens=self._prefill_tokens, finished=self._finished,
        )

    def flush_cache(self) -> bool:
        """``/flush_cache``: no KV cache is simulated; refused (False) while requests run or wait, as SGLang does."""
        return not (self._running or self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, rid: str | None = None, top_logprobs_num: int = 0) -> Sequence:
        if self._closed:
            raise RuntimeError("engine is closed")
        if len(prompt_ids) >= self.context_length:
            raise BadRequest(f"The input ({len(prompt_ids)} tokens) is longer than the model's context length ({self.context_length} tokens).")
        seq = Sequence(rid=rid or secrets.token_hex(16), prompt_ids=list(prompt_ids), params=params,
                       top_logprobs_num=top_logprobs_num, weight_version=self.weight_version)
        # The response length this sequence will reach unless max_new_tokens cuts it (long-tailed).
        self._targets[id(seq)] = -(-self.lengths.sample(self._rng) // self.token_scale)
        if params.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return seq
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, rid: str, message: str = "Aborted by /abort_request.") -> int:
        return self._abort_where(lambda s: s.rid.startswith(rid), message)

    def abort_all(self, message: str = "Aborted by abort_all.") -> int:
        return self._abort_where(lambda s: True, message)

    def _abort_where(self, match: Any, message: str) -> int:
        hit = [s for s in list(self._waiting) + self._running if match(s)]
        for seq in hit:
            if seq in self._waiting:
                self._waiting.remove(seq)
            else:
                self._running.remove(seq)
            self._finish(seq, _abort_reason(message))
        return len(hit)

    async def pause(self, mode: PauseMode = "abort") -> None:
        self._paused = True
        async with self._step_lock:
            if mode == "abort":
                self.abort_all("Aborted by /pause_generation (mode=abort).")
            elif mode == "retract":
                for seq in reversed(self._running):
                    seq.cached = 0  # re-prefilled (prompt + output so far) after continue
                    self._waiting.appendleft(seq)
                self._running.clear()

    def continue_(self) -> None:
        self._paused = False
        self._wake.set()

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None, abort_all: bool = False) -> int:
        """Take as long as moving the full-size weights would (SIMULATED); nothing is loaded."""
        if abort_all:
            self.abort_all("Aborted by a weight update (abort_all_requests).")
        async with self._step_lock:
            in_flight = len(self._running)
            await self._sleep(self.roofline.weight_update_s())
            if weight_version is not None:
                self.weight_version = weight_version
        return in_flight

    def output_text(self, seq: Sequence) -> str:
        ids = [t for t in seq.output_ids if t != self.eos_id]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _sleep(self, simulated_s: float) -> None:
        self.simulated_seconds += simulated_s
        await asyncio.sleep(simulated_s * self.time_scale)

    async def _scheduler(self) -> None:
        while True:
            while self._paused or not (self._waiting or self._running):
                self._wake.clear()
                await self._wake.wait()
            async with self._step_lock:
                if self._paused:
                    continue
                while self._waiting and len(self._running) < self.max_batch:
                    self._running.append(self._waiting.popleft())
                prefill = sum(self._real(s, len(s.tokens())) - self._real(s, s.cached) for s in self._running)
                k = self.token_scale
                # k real decode steps; the KV length (summed over the batch) taken at their middle
                cache = sum(self._real(s, len(s.tokens())) for s in self._running) + len(self._running) * (k - 1) // 2
                await self._sleep(self.roofline.prefill_s(prefill) + k * self.roofline.decode_step_s(cache))
                self._steps += 1
                self._prefill_tokens += prefill
                version = self.weight_version
                for seq in list(self._running):
                    self._step_one(seq, version)

    def _real(self, seq: Sequence, n: int) -> int:
        """Real tokens the first ``n`` tokens of ``seq`` stand for (output tokens count ``token_scale``)."""
        prompt = len(seq.prompt_ids)
        return min(n, prompt) + self.token_scale * max(0, n - prompt)

    def _step_one(self, seq: Sequence, version: str) -> None:
        """Append one synthetic token; finish at the sampled length (stop) or max_new_tokens (length)."""
        target = self._targets.get(id(seq), 1)
        n = len(seq.output_ids) + 1
        token = self.eos_id if n >= target and not seq.params.ignore_eos else 3 + (n % 26) + 94
        seq.output_ids.append(token)
        seq.logprobs.append(SYNTHETIC_LOGPROB)
        if seq.top_logprobs_num:
            seq.top_logprobs.append([(SYNTHETIC_LOGPROB, token)])
        seq.token_versions.append(version)
        seq.cached = len(seq.tokens())
        self._decode_tokens += 1
        if token == self.eos_id and n >= seq.params.min_new_tokens:
            self._running.remove(seq)
            self._finish(seq, {"type": "stop", "matched": token})
        elif n >= seq.params.max_new_tokens:
            self._running.remove(seq)
            self._finish(seq, {"type": "length", "length": n})
        else:
            seq.changed.set()

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        seq.weight_version = self.weight_version
        seq.finished_at = time.monotonic()
        self._targets.pop(id(seq), None)
        self._finished += 1
        seq.changed.set()
