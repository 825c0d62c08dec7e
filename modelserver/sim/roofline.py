"""Roofline timing of one accelerator serving and training one model (SIMULATED).

Why: the fleet loadtest asks what asynchrony buys and what the engine costs at scale without owning
a fleet. Compute is the only simulated part; these formulas say how long it would take.

- prefill:  2 * params * tokens / (peak_flops * mfu)
- decode step (continuous batching, one step serves every running sequence):
  (weight_bytes + kv_bytes_per_token * tokens_in_batch_cache) / (hbm_bw * bw_efficiency) + step_overhead
- weight update: weight_bytes / update_bw
- learner step: 6 * params * tokens / (peak_flops * mfu * n_gpus)
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published peak figures plus the efficiencies assumed for them."""

    name: str = "H100 SXM (simulated)"
    peak_flops: float = 989e12
    """bf16 dense, NVIDIA H100 SXM datasheet."""
    hbm_bytes_per_s: float = 3.35e12
    """HBM3, NVIDIA H100 SXM datasheet."""
    mfu: float = 0.4
    bw_efficiency: float = 0.7
    step_overhead_s: float = 2e-3
    """Per decode step scheduling/launch overhead (assumed; fitted on CPU by calibration)."""
    update_bytes_per_s: float = 25e9
    """Weight-update bandwidth (assumed: ~PCIe5/NVLink-broadcast order of magnitude)."""


@dataclass(frozen=True)
class ModelShape:
    """The served model's size; defaults are Qwen2.5-7B (config.json: 28 layers, 4 KV heads x 128 dims)."""

    name: str = "Qwen2.5-7B"
    params: float = 7.6e9
    bytes_per_param: int = 2
    layers: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    kv_bytes_per_elem: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem


SMOLLM2_135M = ModelShape(name="SmolLM2-135M", params=1.35e8, layers=30, kv_heads=3, head_dim=64)


@dataclass(frozen=True)
class Roofline:
    """Timing formulas over one (hardware, model) pair; every result is simulated seconds."""

    hardware: Hardware = Hardware()
    model: ModelShape = ModelShape()

    def prefill_s(self, tokens: int) -> float:
        if tokens < 0:
            raise ValueError(f"prefill tokens must be >= 0, got {tokens}")
        return 2 * self.model.params * tokens / (self.hardware.peak_flops * self.hardware.mfu)

    def decode_step_s(self, cached_tokens: int) -> float:
        """One continuous-batching step; ``cached_tokens`` is the KV length summed over the batch."""
        if cached_tokens < 0:
            raise ValueError(f"cached tokens must be >= 0, got {cached_tokens}")
        moved = self.model.weight_bytes + self.model.kv_bytes_per_token * cached_tokens
        return moved / (self.hardware.hbm_bytes_per_s * self.hardware.bw_efficiency) + self.hardware.step_overhead_s

    def weight_update_s(self, nbytes: float | None = None) -> float:
        return (self.model.weight_bytes if nbytes is None else nbytes) / self.hardware.update_bytes_per_s

    def learner_step_s(self, tokens: int, n_gpus: int = 1) -> float:
        if n_gpus < 1:
            raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
        return 6 * self.model.params * tokens / (self.hardware.peak_flops * self.hardware.mfu * n_gpus)

    def describe(self) -> dict[str, Any]:
        """The assumptions, for logs and results JSON."""
        return {"simulated": True, "hardware": asdict(self.hardware), "model": asdict(self.model)}


@dataclass(frozen=True)
class LengthModel:
    """Long-tailed response lengths: a lognormal clipped to ``max_tokens``.

    Why lognormal: RL reasoning runs report a median well below the mean and a tail reaching the
    generation cap. The defaults (median ~1.5k tokens, sigma 0.9, cap 16k) are ASSUMED to resemble
    published long-CoT RL length curves; they are not a fit to a specific run (see docs/fleet.md).
    """

    median: float = 1500.0
    sigma: float = 0.9
    max_tokens: int = 16384

    def sample(self, rng: random.Random) -> int:
        return max(1, min(self.max_tokens, int(rng.lognormvariate(math.log(self.median), self.sigma))))
