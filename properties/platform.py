"""What a permutation of the output features may move, on this platform, and no more.

Bitwise equivariance is not a property of BLAS: on an AMD EPYC (AVX2) with torch's CPU build,
``x @ W.t()`` in fp32 gives other bits when the rows of W are permuted (docs/design.md section 3),
so a permutation check may not demand bitwise-permuted outputs. ``permutation_slack`` allows, per
element of y = b + g⊙z (z = x·Wᵀ + s·(x·Aᵀ)·Bᵀ, g = m/n):

- what the platform's own activation GEMMs move under the same permutation on the same inputs
  (measured: ``torch.matmul`` in the activation dtype, as ``nn.Linear`` runs them):
  |g|·(|Δbase| + |s|·|Δlora|);
- what reordering the norm's fp32 reductions may move (a priori: an implementation may sum a row
  in an order that depends on its position, e.g. by tile): two orders of a K-term fp32 sum differ
  by at most 2·γ_K·Σ|terms|, so with n² = ||W_i||² + 2s·⟨B_i, (W·Aᵀ)_i⟩ + s²·⟨B_i, (B·A·Aᵀ)_i⟩,
      |Δn²| <= 2·(γ_{d_in}·Σ W² + 2|s|·γ_{d_in+r}·Σ|B|·(|W|·|A|ᵀ) + s²·γ_{d_in+2r}·Σ|B|·(|B|·|A|·|A|ᵀ))
      |Δn| <= |Δn²| / (2n) + 2u·n (the combination and the square root),
  |Δg| = |g|·|Δn|/n, contributing |Δg|·|z|.

On a platform whose GEMMs are bitwise equivariant the measured part is 0 and the allowance is a few
fp32 ulps of g. A wrong axis (column norms used as row norms, say) moves y by O(|y|), far above
either part.
"""

from __future__ import annotations

import torch

from doracheck.reference import gamma


def _moved(full: torch.Tensor, permuted: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """|permuted - full[:, perm]| in float64: how far a product moved under the permutation."""
    return (permuted.double() - full[:, perm].double()).abs()


def permutation_slack(x, weight_rows, lora_A, lora_B, magnitude, scaling, perm) -> torch.Tensor:
    """Per-element |Δy| (float64, y's shape, permuted order) allowed when the output features are
    permuted by ``perm`` (derived in the module docstring)."""
    d_in = x.shape[-1]
    cd = x.dtype
    x2 = x.reshape(-1, d_in)
    W, A, B = weight_rows.to(cd), lora_A.to(cd), lora_B.to(cd)
    s = float(scaling)
    with torch.no_grad():
        d_base = _moved(x2 @ W.t(), x2 @ W[perm].t(), perm)
        xa = x2 @ A.t()
        lora = xa @ B.t()
        d_lora = _moved(lora, xa @ B[perm].t(), perm)
        Wa, Aa, Ba = weight_rows.double().abs()[perm], lora_A.double().abs(), lora_B.double().abs()[perm]
        d_in, r = Wa.shape[1], Aa.shape[0]
        WA = Wa @ Aa.t()  # |W|·|A|ᵀ, (d_out, r)
        BAA = Ba @ (Aa @ Aa.t())  # |B|·|A|·|A|ᵀ
        d_n2 = 2 * (gamma(d_in) * (Wa * Wa).sum(1) + 2 * abs(s) * gamma(d_in + r) * (Ba * WA).sum(1)
                    + s * s * gamma(d_in + 2 * r) * (Ba * BAA).sum(1))
        V = weight_rows.double() + s * (lora_B.double() @ lora_A.double())
        n = torch.linalg.vector_norm(V, dim=1)[perm]
        u32 = 2.0 ** -24
        d_n = d_n2 / (2 * n).clamp_min(1e-300) + 2 * u32 * n
        g = magnitude[perm].double() / n.clamp_min(1e-12)
        d_g = torch.where(n > 0, g.abs() * d_n / n.clamp_min(1e-300), torch.zeros_like(n))
        z = (x2 @ W[perm].t()).double() + s * (xa @ B[perm].t()).double()
        slack = g.abs() * (d_base + abs(s) * d_lora) + d_g * z.abs()
    return slack.reshape(*x.shape[:-1], weight_rows.shape[0])
