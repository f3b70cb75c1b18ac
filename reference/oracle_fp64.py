"""The float64 oracles: the functions every implementation in doracheck is judged by.

Math (docs/design.md section 1), with ``W`` (d_out, d_in), ``A`` (r, d_in), ``B`` (d_out, r):

    V   = W + s·B·A                      n_i = ||V_i||_2
    g   = m / max(n, eps)                eps = 1e-12
    y   = x·Wᵀ + b + (g - 1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ      (x_d = x without dropout)

Small problems: float64 with error-free transformations (``accurate_sum``), within about one fp64 ulp of exact
even where W nearly cancels s·B·A; large ones (above ``ACCURATE_LIMIT``): plain float64, error about K·2⁻⁵³ of
Σ|terms|, far below fp32's ulp. Gradients: plain float64 autograd, ``_with_value`` putting exact values in."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .accurate_sum import (
    CompensatedSum,
    accurate_sum_last_dim,
    divide_double_double,
    product_terms,
    sqrt_double_double,
    square_terms,
)

EPS = 1e-12
# Above this many elementary products the oracle uses plain float64 (memory and time).
ACCURATE_LIMIT = 1 << 22


class NormTermsRef(NamedTuple):
    """float64 (d_out,) each: norm**2 == base + 2*s*cross + s*s*lora (exactly, in real numbers)."""

    base: torch.Tensor  # ||W_i||²
    cross: torch.Tensor  # <W_i, (B·A)_i>
    lora: torch.Tensor  # ||(B·A)_i||²
    norm: torch.Tensor  # ||W_i + s·(B·A)_i||


def _as_rows(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """W as (d_out, d_in) float64 (PEFT stores it (d_in, d_out) when fan_in_fan_out)."""
    w = weight.to(torch.float64)
    return w.t() if fan_in_fan_out else w


def _accurate_lora_product(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B·A as a double-double (hi, lo), shape (d_out, d_in)."""
    acc = CompensatedSum(torch.empty(B.shape[0], A.shape[1], dtype=torch.float64, device=A.device))
    for k in range(A.shape[0]):
        acc.add_product(B[:, k : k + 1], A[k : k + 1, :])
    return acc.double_double()


def _accurate_v(W: torch.Tensor, P_hi: torch.Tensor, P_lo: torch.Tensor, s: float):
    """V = W + s·P as a double-double, with P = P_hi + P_lo."""
    acc = CompensatedSum(W)
    acc.add(W)
    acc.add_product(torch.full_like(P_hi, s), P_hi)
    acc.errors = acc.errors + s * P_lo
    return acc.double_double()


def _accurate_norm(V_hi: torch.Tensor, V_lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row norms of V = V_hi + V_lo as a double-double."""
    return sqrt_double_double(*accurate_sum_last_dim(*square_terms(V_hi, V_lo)))


def _small(*sizes: int) -> bool:
    total = 1
    for size in sizes:
        total *= max(int(size), 1)
    return total <= ACCURATE_LIMIT


def norm_terms_ref(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, *,
    fan_in_fan_out: bool = False,
) -> NormTermsRef:
    """The three norm terms and the row norm of V = W + s·B·A in float64, detached: ``base_i = ||W_i||²``,
    ``cross_i = <W_i, (BA)_i>``, ``lora_i = ||(BA)_i||²``, ``norm_i = ||V_i||`` from V itself (not the
    terms), so ``norm² = base + 2s·cross + s²·lora`` is a check, not a tautology."""
    with torch.no_grad():
        W = _as_rows(weight, fan_in_fan_out)
        A = lora_A.to(torch.float64)
        B = lora_B.to(torch.float64)
        s = float(scaling)
        d_out, d_in = W.shape
        if not _small(d_out, d_in, A.shape[0] + 1):
            P = B @ A
            V = W + s * P
            return NormTermsRef(
                base=(W * W).sum(1), cross=(W * P).sum(1), lora=(P * P).sum(1), norm=torch.linalg.norm(V, dim=1)
            )
        P_hi, P_lo = _accurate_lora_product(A, B)
        V_hi, V_lo = _accurate_v(W, P_hi, P_lo, s)
        zero = torch.zeros_like(W)

        def rounded(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

        base = rounded(accurate_sum_last_dim(*square_terms(W, zero)))
        cross = rounded(accurate_sum_last_dim(*product_terms(W, zero, P_hi, P_lo)))
        lora = rounded(accurate_sum_last_dim(*square_terms(P_hi, P_lo)))
        norm = rounded(_accurate_norm(V_hi, V_lo))
        return NormTermsRef(base=base, cross=cross, lora=lora, norm=norm)


def magnitude_scale_ref(magnitude: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, g - 1) in float64 with g = m / max(n, eps); g - 1 = (m - n')/n' without cancellation."""
    m = magnitude.to(torch.float64)
    n = torch.clamp_min(norm.to(torch.float64), EPS)
    return m / n, (m - n) / n


def _with_value(differentiable: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the forward, the gradient of ``differentiable`` in the backward; when the two
    agree within a factor of two the subtraction is exact (Sterbenz): the result is ``value`` bitwise."""
    return differentiable + (value - differentiable).detach()


def _accurate_compose(x2: torch.Tensor, V_hi, V_lo, m: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """y = b + g⊙(x·Vᵀ), g = m / max(||V||, eps), no dropout, float64 (T, d_out); x·Vᵀ, ||V|| and g
    are carried as double-doubles, so y is right to about one ulp even when b and g⊙z cancel."""
    xb = x2[:, None, :]
    z_hi, z_lo = accurate_sum_last_dim(*product_terms(xb, torch.zeros_like(xb), V_hi[None], V_lo[None]))
    n_hi, n_lo = _accurate_norm(V_hi, V_lo)
    small = n_hi < EPS
    n_hi = torch.where(small, torch.full_like(n_hi, EPS), n_hi)
    n_lo = torch.where(small, torch.zeros_like(n_lo), n_lo)
    g_hi, g_lo = divide_double_double(m, n_hi, n_lo)
    p, e = product_terms(g_hi.expand_as(z_hi), g_lo.expand_as(z_hi), z_hi, z_lo)
    acc = CompensatedSum(z_hi)
    if b is not None:
        acc.add(b.expand_as(z_hi))
    acc.add(p)
    acc.errors = acc.errors + e
    return acc.value()


def dora_forward_ref(
    x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    magnitude: torch.Tensor, scaling: float, bias: torch.Tensor | None = None, *, dropout_p: float = 0.0,
    training: bool = False, detach_norm: bool = True, fan_in_fan_out: bool = False,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float64 DoRA forward, PEFT semantics, ``doracheck.dora_linear``'s signature: float64
    (..., d_out), differentiable in every tensor argument by plain float64 autograd (through n too with
    ``detach_norm=False``). Dropout (``training and dropout_p > 0``) needs ``dropout_mask`` (0/1 keep-mask
    broadcastable to x): ``x_d = x·mask/(1-p)``, so a test can share its mask with PEFT or the code tested."""
    s = float(scaling)
    W = _as_rows(weight, fan_in_fan_out)
    A = lora_A.to(torch.float64)
    B = lora_B.to(torch.float64)
    m = magnitude.to(torch.float64)
    b = bias.to(torch.float64) if bias is not None else None
    x64 = x.to(torch.float64)
    lead_shape = x64.shape[:-1]
    x2 = x64.reshape(-1, x64.shape[-1])
    dropout_active = bool(training) and dropout_p > 0.0
    if dropout_active:
        if dropout_mask is None:
            raise ValueError("dora_forward_ref: dropout is active (training and dropout_p > 0): pass dropout_mask")
        keep = dropout_mask.to(torch.float64).expand_as(x64).reshape_as(x2)
        x_d = x2 * keep / (1.0 - dropout_p)
    else:
        x_d = x2
    terms = norm_terms_ref(weight, lora_A, lora_B, s, fan_in_fan_out=fan_in_fan_out)
    V = W + s * (B @ A)
    n = _with_value(torch.linalg.norm(V, dim=1), terms.norm)
    if detach_norm:
        n = n.detach()
    g = m / torch.clamp_min(n, EPS)
    base = x2 @ W.t()
    base_d = base if not dropout_active else x_d @ W.t()
    y = base + (g - 1.0) * base_d + g * s * ((x_d @ A.t()) @ B.t())
    if b is not None:
        y = y + b
    d_out = W.shape[0]
    if not dropout_active and _small(x2.shape[0], d_out, W.shape[1] + A.shape[0]):
        with torch.no_grad():
            V_hi, V_lo = _accurate_v(W.detach(), *_accurate_lora_product(A.detach(), B.detach()), s)
            exact = _accurate_compose(x2.detach(), V_hi, V_lo, m.detach(), None if b is None else b.detach())
        y = _with_value(y, exact)
    return y.reshape(*lead_shape, d_out)
