"""A SIMULATED learner step: the real learner role around a step that only waits (``learner.simulate``).

Why: to ask what asynchrony buys and what the engine costs at fleet scale without a training cluster.
Everything around the step stays real: the consumption of ``rollout.experience``, de-duplication,
staleness, the ledger, batching, checkpoints, the status in KV, and the weight publication over NATS.
Only two durations are simulated, from ``engine.config.LearnerSimulateConfig``:

- step (s) = 6 * model_params * tokens / (gpus * peak_flops * mfu), tokens = prompt + response tokens of
  the step's trained samples, response tokens times ``response_token_scale`` (6 = forward 2 + backward 4
  FLOPs per parameter per token);
- publication (s) = model_params * bytes_per_param / transfer_bytes_per_s, waited before a (tiny) real
  publication is announced, so the announcement comes when the stated model's bytes would have moved.

Both are multiplied by ``time_scale`` (wall seconds per simulated second). The model that is published and
checkpointed is the tiny built-in one, so the bytes that really move are small. Defaults: H100 SXM
(989e12 bf16 dense FLOP/s, NVIDIA datasheet), MFU 0.4 (assumed), 8 GPUs, Qwen2.5-7B (7.6e9 parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from learning.core import Learner
from engine.config import LearnerConfig, LearnerSimulateConfig
from engine.schemas import Experience

FLOPS_PER_PARAM_TOKEN = 6
"""Training FLOPs per parameter per token: 2 forward + 4 backward (Kaplan et al. 2020)."""


def step_seconds(sim: LearnerSimulateConfig, tokens: int) -> float:
    """Simulated seconds of one optimizer step over ``tokens`` tokens (unscaled)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return FLOPS_PER_PARAM_TOKEN * sim.model_params * tokens / (sim.gpus * sim.peak_flops * sim.mfu)


def publish_seconds(sim: LearnerSimulateConfig) -> float:
    """Simulated seconds to move one version of the stated model's weights (unscaled)."""
    return sim.model_params * sim.bytes_per_param / sim.transfer_bytes_per_s


def describe(sim: LearnerSimulateConfig) -> dict[str, Any]:
    """The assumptions, for logs and results JSON."""
    return {"simulated": True, "gpu": sim.gpu, "gpus": sim.gpus, "model_params": sim.model_params,
            "peak_flops": sim.peak_flops, "mfu": sim.mfu, "bytes_per_param": sim.bytes_per_param,
            "transfer_bytes_per_s": sim.transfer_bytes_per_s, "time_scale": sim.time_scale,
            "publish_seconds": publish_seconds(sim)}


def sample_tokens(samples: Sequence[Experience], response_token_scale: float = 1.0) -> int:
    """Prompt plus response tokens of ``samples`` (what a real step would run forward and backward), each
    response token counted as ``response_token_scale`` real ones."""
    return sum(len(s.prompt_ids) + round(len(s.response_ids) * response_token_scale) for s in samples)


class SimulatedLearner(Learner):
    """``Learner`` whose ``train_on`` waits the simulated step time instead of training (SIMULATED).

    Offer, staleness, de-duplication, the ledger and checkpoints' progress are the real ``Learner``'s.
    ``step()`` runs in a worker thread (``LearnerActor._step``), so the wait is a blocking sleep there.
    """

    def __init__(self, model: Any, cfg: LearnerConfig, *, max_staleness: int, pad_id: int = 0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if cfg.simulate is None:
            raise ValueError("SimulatedLearner needs learner.simulate to be set")
        super().__init__(model, cfg, max_staleness=max_staleness, pad_id=pad_id)
        self.sim = cfg.simulate
        self._sleep = sleep
        self.simulated_seconds = 0.0

    def train_on(self, samples: Sequence[Experience]) -> dict[str, float]:
        tokens = sample_tokens(samples, self.sim.response_token_scale)
        seconds = step_seconds(self.sim, tokens)
        self.simulated_seconds += seconds
        self._sleep(seconds * self.sim.time_scale)
        return {"simulated": 1.0, "tokens": float(tokens), "samples": float(len(samples)),
                "simulated_step_s": seconds,
                "advantage_mean": sum(s.advantage for s in samples) / len(samples) if samples else 0.0}

    def statistics(self) -> dict[str, Any]:
        return {**super().statistics(), "simulated": True, "simulated_seconds": round(self.simulated_seconds, 3)}
