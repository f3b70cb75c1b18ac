"""The public functions: ``dora_linear``, ``factored_norm``, ``compose``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .autograd import dora_linear_autograd
from .dispatch import compose as _compose
from .dispatch import factored_norm_full
from .validation import FLOAT_DTYPES, check_dora_inputs, check_scaling, check_weights


class NormTerms(NamedTuple):
    """fp32 (d_out,) each, with ``norm**2 == base + 2*s*cross + s*s*lora`` (up to rounding)."""

    base: torch.Tensor  # ||W_i||²
    cross: torch.Tensor  # <W_i, (B·A)_i>
    lora: torch.Tensor  # ||(B·A)_i||²
    norm: torch.Tensor  # ||W_i + s·(B·A)_i||


def factored_norm(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    fan_in_fan_out: bool = False,
    return_terms: bool = False,
) -> torch.Tensor | NormTerms:
    """Row norms ``n_i = ||W_i + s·(B·A)_i||`` in fp32, never forming a d_out × d_in product.

    ``n_i² = ||W_i||² + 2s·⟨W_i, (BA)_i⟩ + s²·||(BA)_i||²``, evaluated as ``base + 2s·Σ_k
    B_ik·(W·Aᵀ)_ik + s²·Σ_k (B·A·Aᵀ)_ik·B_ik`` with fp32 accumulation. The result is detached (no
    autograd): DoRA treats the norm as a constant.

    Args:
        weight: (d_out, d_in), or (d_in, d_out) with ``fan_in_fan_out=True``.
        lora_A: (r, d_in).  lora_B: (d_out, r).  scaling: lora_alpha / r (or / sqrt(r)).
        return_terms: return ``NormTerms(base, cross, lora, norm)`` instead of the norm.
    """
    check_weights(weight, lora_A, lora_B, fan_in_fan_out=fan_in_fan_out)
    s = check_scaling(scaling)
    with torch.no_grad():
        result = factored_norm_full(weight, lora_A, lora_B, s, fan_in_fan_out=fan_in_fan_out)
    if return_terms:
        return NormTerms(result.base, result.cross, result.lora, result.norm)
    return result.norm


def compose(
    base: torch.Tensor,
    lora: torch.Tensor,
    g: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    base_dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stable DoRA compose ``y = base + b + (g-1)⊙base_d + g⊙s⊙lora`` (base_d = base without
    dropout), evaluated in fp32 and rounded once to ``base.dtype``. ``base`` = x·Wᵀ and ``lora`` =
    (x_d·Aᵀ)·Bᵀ are (..., d_out); ``g`` = m / max(n, eps) is (d_out,) and should be fp32: rounding g
    to bf16 loses the magnitude near g ≈ 1."""
    for name, t in (("base", base), ("lora", lora), ("g", g)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    d_out = base.shape[-1]
    if lora.shape != base.shape:
        raise ValueError(f"lora: expected shape {tuple(base.shape)} (the shape of base), got {tuple(lora.shape)}")
    if base_dropped is not None and base_dropped.shape != base.shape:
        raise ValueError(f"base_dropped: expected shape {tuple(base.shape)}, got {tuple(base_dropped.shape)}")
    if tuple(g.shape) != (d_out,):
        raise ValueError(f"g: expected shape ({d_out},), got {tuple(g.shape)}")
    if bias is not None and tuple(bias.shape) != (d_out,):
        raise ValueError(f"bias: expected shape ({d_out},), got {tuple(bias.shape)}")
    s = check_scaling(scaling)
    flat = base.reshape(-1, d_out)
    y = _compose(
        flat,
        lora.reshape(-1, d_out),
        g,
        s,
        bias,
        base_dropped=None if base_dropped is None else base_dropped.reshape(-1, d_out),
    )
    return y.reshape(base.shape)


def dora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
    detach_norm: bool = True,
    fan_in_fan_out: bool = False,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DoRA linear layer, PEFT semantics, with a hand-written backward.

    ``y = x·Wᵀ + b + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ``, ``g = m / max(||W + s·B·A||, 1e-12)``,
    where x_d = dropout(x) in training with ``dropout_p > 0`` and x otherwise (then
    ``y = b + g⊙(x·Wᵀ + s·(x·Aᵀ)·Bᵀ)``). The norm is detached unless ``detach_norm=False``.
    A zero row of W + s·B·A gives 0 for that feature (PEFT gives NaN there).

    Args:
        x: (..., d_in), the activation dtype; GEMMs run in it and y is returned in it.
        weight: (d_out, d_in), or (d_in, d_out) with ``fan_in_fan_out=True``.
        lora_A: (r, d_in). lora_B: (d_out, r). magnitude: (d_out,). bias: (d_out,) or None.
        scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.
        dropout_p, training: LoRA dropout, active only when ``training and dropout_p > 0``.
        dropout_mask: optional 0/1 keep-mask broadcastable to x for the dropout path
            (x_d = x·mask/(1-p)); drawn with torch's RNG when omitted.

    Raises:
        ValueError: a tensor with the wrong shape, dtype or device (the message names it).
    """
    check_dora_inputs(
        x,
        weight,
        lora_A,
        lora_B,
        magnitude,
        scaling,
        bias,
        dropout_p=dropout_p,
        fan_in_fan_out=fan_in_fan_out,
        dropout_mask=dropout_mask,
    )
    s = float(scaling)
    keep = None
    if training and dropout_p > 0.0:
        if dropout_mask is not None:
            keep = dropout_mask.to(torch.bool)
        else:
            keep = torch.empty(x.shape, device=x.device, dtype=torch.float32).bernoulli_(1.0 - dropout_p).to(torch.bool)
    return dora_linear_autograd(x, weight, lora_A, lora_B, magnitude, s, bias, keep, float(dropout_p), detach_norm, fan_in_fan_out)
