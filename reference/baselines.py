"""Naive same-precision baselines: what an eager implementation computes in the input dtype. The other
half of the baseline-ratio check (docs/design.md section 3), and witnesses that the stable compose matters:
near g ≈ 1 the naive 16-bit compose loses the magnitude (g rounds to 1 in bf16 when |g - 1| < 2**-9)."""

from __future__ import annotations

import torch


def _rows(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    return weight.t() if fan_in_fan_out else weight


def peft_style_dora(
    x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    magnitude: torch.Tensor, scaling: float, bias: torch.Tensor | None = None, *, dropout_p: float = 0.0,
    training: bool = False, detach_norm: bool = True, fan_in_fan_out: bool = False,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """PEFT 0.21's DoRA forward with every tensor first cast to x.dtype (``dora_linear``'s signature):
    the dense ``||W + s·B·A||`` and ``(x·Wᵀ + b) + (g - 1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ``, every step
    rounded to x.dtype; differentiable (norm detached unless ``detach_norm=False``)."""
    dt = x.dtype
    W = _rows(weight, fan_in_fan_out).to(dt)
    A, B, m = lora_A.to(dt), lora_B.to(dt), magnitude.to(dt)
    x_d = x
    dropout_active = bool(training) and dropout_p > 0.0
    if dropout_active:
        if dropout_mask is None:
            raise ValueError("peft_style_dora: dropout is active: pass dropout_mask")
        x_d = x * dropout_mask.to(dt) / (1.0 - dropout_p)
    lora_weight = B @ A
    norm = torch.linalg.norm(W + scaling * (lora_weight.detach() if detach_norm else lora_weight), dim=1).to(dt)
    if detach_norm:
        norm = norm.detach()
    g = m / norm
    base = x @ W.t()
    if bias is not None:
        base = base + bias.to(dt)
    base_d = base - (bias.to(dt) if bias is not None else 0) if not dropout_active else x_d @ W.t()
    lora = (x_d @ A.t()) @ B.t()
    return base + (g - 1) * base_d + g * lora * scaling


def naive_compose(
    base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, scaling: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``b + g·(base + s·lora)`` with g rounded to base.dtype and every step in that dtype: the form
    docs/design.md section 2 forbids (near g ≈ 1 it cancels and rounds the magnitude away)."""
    dt = base.dtype
    out = g.to(dt) * (base + scaling * lora.to(dt))
    return out + bias.to(dt) if bias is not None else out
