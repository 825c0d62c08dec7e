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
from dataclasses import dataclass
from typing import Any

from modelserver.local.batching import BatchingEngine, EngineStatistics, Sequence
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


class SimEngine(BatchingEngine):
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
        super().__init__(max_batch=max_batch, weight_version=weight_version, context_length=context_length)
        self.token_scale = token_scale
        self.roofline = roofline or Roofline()
        self.lengths = lengths or LengthModel()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.model = _SimModel()
        self.time_scale = time_scale
        self.vocab_size = vocab_size
        self.eos_id = int(getattr(self.tokenizer, "eos_token_id", 2) or 2)
        self.simulated_seconds = 0.0
        self._rng = random.Random(seed)
        self._targets: dict[int, int] = {}

    task_name = "sim-engine-scheduler"

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(**self._counters())

    def _prepare(self, seq: Sequence) -> None:
        # The response length this sequence will reach unless max_new_tokens cuts it (long-tailed).
        self._targets[id(seq)] = -(-self.lengths.sample(self._rng) // self.token_scale)

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

    async def _step(self) -> None:
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
        self._targets.pop(id(seq), None)
        super()._finish(seq, reason)
