"""How much rounding each DoRA output can amplify: its condition ρ (float64, independent of what it judges).

An output's oracle-distance budget is (number of roundings)·u·ρ: a rounding to the activation dtype costs an
intermediate at most u of its magnitude, and that error reaches the output through the products that follow.
Two kinds of magnitude enter ρ: the rounded intermediates (|x·Wᵀ|, |s·(x·Aᵀ)·Bᵀ|, |dz·W|, ...; a GEMM output
is rounded once), and the products carrying a rounded operand on: an error δ_k ≤ u·|a_k| in each of K terms
a_k·b_k sums, under independent rounding errors (Higham & Mary 2019, probabilistic rounding error analysis),
to about u·sqrt(Σ_k a_k²·b_k²) (``rss``); the worst case u·Σ|a_k||b_k| grows with K, void at K = 8192.

    ρ(out) = || Σ of those magnitudes || / || out ||     (>= 1)

ρ = 1 where nothing cancels; it grows where terms of opposite sign cancel (base against s·lora when the
adapter is large, the token sums of the magnitude gradient under a zero-mean dy). Without dropout, detached
norm (PEFT's default), for upstream dy, with z = x·Wᵀ + s·(x·Aᵀ)·Bᵀ:

    y  = g⊙z + b            |g|⊙(|x·Wᵀ| + |s·lora| + rss(x, Wᵀ) + |s|·rss(x·Aᵀ, Bᵀ)) + |b|
    dx = dz·W + s·(dz·B)·A   |dz·W| + |s·(dz·B)·A| + rss(dz, W) + |s|·rss(dz·B, A)
    dA = s·(dz·B)ᵀ·x         |dA| + |s|·rss((dz·B)ᵀ, x)
    dB = s·dzᵀ·(x·Aᵀ)        |dB| + |s|·rss(dzᵀ, x·Aᵀ)
    dm = Σ_t dy⊙z / n        (|dm| + rss_t(dy, z)) / n
    db = Σ_t dy              |db| + rss_t(dy, 1)
"""

from __future__ import annotations

import torch

from .oracle_fp64 import EPS, norm_terms_ref


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    d = float(torch.linalg.vector_norm(den))
    n = float(torch.linalg.vector_norm(num))
    if d == 0.0:
        return 1.0  # an exactly zero output: any error is judged against 0 by rel_l2 itself
    return max(1.0, n / d)


def _rss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sqrt(Σ_k a_ik²·b_kj²): the root-sum-square size of the terms of a·b."""
    return torch.sqrt((a * a) @ (b * b))


def output_conditions(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, dy=None, *, fan_in_fan_out=False) -> dict[str, float]:
    """{"y", "dx", "dA", "dB", "dm", "db"} -> ρ (>= 1) for these inputs and upstream ``dy`` (for grads)."""
    with torch.no_grad():
        W = (weight.t() if fan_in_fan_out else weight).double()
        A, B, m = lora_A.double(), lora_B.double(), magnitude.double()
        s = float(scaling)
        x2 = x.reshape(-1, x.shape[-1]).double()
        n = norm_terms_ref(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out).norm.double()
        g = m / n.clamp_min(EPS)
        base, xa = x2 @ W.t(), x2 @ A.t()
        lora = s * (xa @ B.t())
        z = base + lora
        b = bias.double() if bias is not None else torch.zeros_like(g)
        y = g * z + b
        size_z = base.abs() + lora.abs() + _rss(x2, W.t()) + abs(s) * _rss(xa, B.t())
        out = {"y": _ratio(g.abs() * size_z + b.abs(), y)}
        if dy is None:
            return out
        dy2 = dy.reshape(-1, W.shape[0]).double()
        dz = g * dy2
        dzB = dz @ B
        dx = dz @ W + s * (dzB @ A)
        out["dx"] = _ratio((dz @ W).abs() + (s * (dzB @ A)).abs() + _rss(dz, W) + abs(s) * _rss(dzB, A), dx)
        dA = s * (dzB.t() @ x2)
        out["dA"] = _ratio(dA.abs() + abs(s) * _rss(dzB.t(), x2), dA)
        dB = s * (dz.t() @ xa)
        out["dB"] = _ratio(dB.abs() + abs(s) * _rss(dz.t(), xa), dB)
        n_safe = n.clamp_min(EPS)
        S = (dy2 * z).sum(0)
        out["dm"] = _ratio((S.abs() + torch.sqrt((dy2 * dy2 * z * z).sum(0))) / n_safe, S / n_safe)
        db = dy2.sum(0)
        out["db"] = _ratio(db.abs() + torch.sqrt((dy2 * dy2).sum(0)), db)
        return out
