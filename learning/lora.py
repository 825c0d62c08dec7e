"""LoRA adapters on the attention projections, built in (no peft): attach, disable, merge.

``attach(model, rank, alpha)`` replaces every ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linear of the
model with a :class:`LoRALinear` (frozen base + trainable ``B @ A``, ``B`` zero at start so the
model's function is unchanged) and freezes every other parameter. ``merged(model)`` is a context in
which the model is a plain Hugging Face model again, its projections' weights ``W + scale * B @ A``,
for ``save_pretrained`` (publications, checkpoints); on exit the exact base weights come back.
``disabled(model)`` runs the base model (the reference policy of a KL term).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRALinear(nn.Module):
    """``base(x) + scale * (x @ A.T) @ B.T``; ``base`` is frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        bound = 1.0 / math.sqrt(base.in_features)  # nn.Linear's (and peft's) initialisation of A
        with torch.no_grad():
            self.lora_a.uniform_(-bound, bound, generator=generator)
        self.scale = alpha / rank
        self.enabled = True

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def delta(self) -> torch.Tensor:
        return (self.lora_b @ self.lora_a) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.enabled:
            return y
        return y + (x.to(self.lora_a.dtype) @ self.lora_a.T @ self.lora_b.T * self.scale).to(y.dtype)


def _targets(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in TARGETS:
                yield parent, name, child


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """The attached adapters by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def attach(model: nn.Module, rank: int, alpha: float, *, seed: int = 0) -> dict[str, LoRALinear]:
    """Wrap every attention projection in an adapter and freeze all other parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for parent, name, child in _targets(model):
        if not isinstance(child, nn.Linear):
            raise TypeError(f"LoRA target {name} is a {type(child).__name__}, not nn.Linear")
        setattr(parent, name, LoRALinear(child, rank, alpha, gen))
    found = adapters(model)
    if not found:
        raise ValueError(f"LoRA: the model has none of the projections {', '.join(TARGETS)}")
    return found


@contextlib.contextmanager
def merged(model: nn.Module) -> Iterator[nn.Module]:
    """The model with adapters folded into plain ``nn.Linear`` weights; restored exactly on exit."""
    saved: list[tuple[nn.Module, str, LoRALinear, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for parent, name, child in _targets(model):
                if isinstance(child, LoRALinear):
                    original = child.base.weight.detach().clone()
                    child.base.weight.add_(child.delta())
                    setattr(parent, name, child.base)
                    saved.append((parent, name, child, original))
        yield model
    finally:
        with torch.no_grad():
            for parent, name, adapter, original in saved:
                adapter.base.weight.copy_(original)
                setattr(parent, name, adapter)


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every adapter off."""
    found = list(adapters(model).values())
    for a in found:
        a.enabled = False
    try:
        yield model
    finally:
        for a in found:
            a.enabled = True


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors by name (what a checkpoint keeps besides the merged weights)."""
    out: dict[str, torch.Tensor] = {}
    for name, a in adapters(model).items():
        out[f"{name}.lora_a"] = a.lora_a.detach().clone()
        out[f"{name}.lora_b"] = a.lora_b.detach().clone()
    return out


def load_into_merged(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Restore adapters saved by ``state`` into a model whose base weights were loaded *merged*
    (a checkpoint): the adapters get their tensors and the bases get the merge taken back out."""
    with torch.no_grad():
        for name, a in adapters(model).items():
            a.lora_a.copy_(tensors[f"{name}.lora_a"])
            a.lora_b.copy_(tensors[f"{name}.lora_b"])
            a.base.weight.sub_(a.delta())


def load_merged_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load Hugging Face-named (merged) weights into a model with adapters: ``X.weight`` of an adapted
    projection goes to ``X.base.weight``; follow with ``load_into_merged`` to restore the adapters."""
    names = set(adapters(model))
    mapped = {}
    for key, value in state_dict.items():
        prefix, _, leaf = key.rpartition(".")
        mapped[f"{prefix}.base.{leaf}" if prefix in names else key] = value
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if not k.endswith((".lora_a", ".lora_b"))]
    if missing or unexpected:
        raise KeyError(f"LoRA model weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
