"""Error-free transformations in float64, vectorised with torch: they keep the fp64 oracle within about one
fp64 ulp even where a sum's terms cancel (W nearly cancelling s·B·A), where a plain float64 sum errs by
u·Σ|terms|, not u·|Σ terms|. Float64 only; no code shared with the implementations under test.

- ``two_sum(a, b)``  -> (s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth).
- ``two_prod(a, b)`` -> (p, e) with p = fl(a·b) and a·b = p + e exactly (Dekker/Veltkamp, |a|, |b| < 2**996).
- ``CompensatedSum`` accumulates terms with ``two_sum`` and sums the rounding errors apart (Ogita-Rump-Oishi
  Sum2): |result - Σ| <= u·|Σ| + γ²_n·Σ|terms|."""

from __future__ import annotations

import torch

_SPLITTER = 134217729.0  # 2**27 + 1 (Veltkamp split of a 53-bit significand)


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (s, e) with s = fl(a + b) and s + e == a + b exactly."""
    s = a + b
    b_virtual = s - a
    a_virtual = s - b_virtual
    e = (a - a_virtual) + (b - b_virtual)
    return s, e


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = _SPLITTER * a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (p, e) with p = fl(a·b) and p + e == a·b exactly (no FMA needed)."""
    p = a * b
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    e = a_lo * b_lo - (((p - a_hi * b_hi) - a_lo * b_hi) - a_hi * b_lo)
    return p, e


class CompensatedSum:
    """Running Sum2: ``add`` terms (one shape), then ``value()``: the sum within about one ulp plus
    γ²_n·Σ|terms|, as if summed in twice the working precision."""

    def __init__(self, like: torch.Tensor):
        self.total = torch.zeros_like(like, dtype=torch.float64)
        self.errors = torch.zeros_like(like, dtype=torch.float64)

    def add(self, term: torch.Tensor) -> None:
        self.total, e = two_sum(self.total, term)
        self.errors = self.errors + e

    def add_product(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add a·b exactly (its product error goes into the error sum)."""
        p, e = two_prod(a, b)
        self.add(p)
        self.errors = self.errors + e

    def double_double(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hi, lo) with hi = fl(hi + lo), carrying about 106 bits of the sum."""
        return two_sum(self.total, self.errors)

    def value(self) -> torch.Tensor:
        return self.total + self.errors


def accurate_sum_last_dim(hi_terms: torch.Tensor, lo_terms: torch.Tensor | None = None) -> tuple[
    torch.Tensor, torch.Tensor]:
    """Double-double (hi, lo) sum of float64 terms along the last dim: a pairwise ``two_sum`` tree (log2(K)
    levels, no loop over K); optional ``lo_terms`` (same shape, small corrections) join the error sum."""
    errors = torch.zeros(hi_terms.shape[:-1], dtype=torch.float64, device=hi_terms.device)
    if lo_terms is not None:
        errors = errors + lo_terms.sum(dim=-1)
    level = hi_terms
    while level.shape[-1] > 1:
        if level.shape[-1] % 2:
            pad = torch.zeros(level.shape[:-1] + (1,), dtype=level.dtype, device=level.device)
            level = torch.cat([level, pad], dim=-1)
        s, e = two_sum(level[..., 0::2], level[..., 1::2])
        errors = errors + e.sum(dim=-1)
        level = s
    total = level[..., 0] if level.shape[-1] == 1 else torch.zeros_like(errors)
    return two_sum(total, errors)


def square_terms(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi + lo)² as an exact leading product plus a small correction (hi·lo·2 + lo²)."""
    p, e = two_prod(hi, hi)
    return p, e + 2.0 * hi * lo + lo * lo


def product_terms(
    a_hi: torch.Tensor, a_lo: torch.Tensor, b_hi: torch.Tensor, b_lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_hi + a_lo)·(b_hi + b_lo) as an exact leading product plus a small correction."""
    p, e = two_prod(a_hi, b_hi)
    return p, e + a_hi * b_lo + a_lo * b_hi + a_lo * b_lo


def sqrt_double_double(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt(hi + lo) as a double-double: a Newton step from sqrt(hi), exact residual hi + lo - root²."""
    root = torch.sqrt(hi)
    safe = torch.where(root > 0, root, torch.ones_like(root))
    p, e = two_prod(root, root)
    residual = ((hi - p) - e) + lo
    correction = torch.where(root > 0, residual / (2.0 * safe), torch.zeros_like(root))
    return two_sum(root, correction)


def divide_double_double(num: torch.Tensor, den_hi: torch.Tensor, den_lo: torch.Tensor) -> tuple[
    torch.Tensor, torch.Tensor]:
    """num / (den_hi + den_lo) as a double-double (q, correction), den_hi != 0."""
    q = num / den_hi
    p, e = two_prod(q, den_hi)
    residual = ((num - p) - e) - q * den_lo
    return two_sum(q, residual / den_hi)
