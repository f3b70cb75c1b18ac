"""Error metrics: ulp distances via integer bit views, relative L2, a-priori GEMM bounds.

- ``ulp_distance(a, b)``: how many numbers of their common dtype lie between a and b, from the bit patterns
  (NaN vs NaN 0, NaN vs a number ``NAN_DISTANCE``; +0 = -0; Inf follows the largest finite value).
- ``ulp_error(actual, exact)``: |actual - exact| in ulps of ``exact`` in actual's dtype, real valued, so
  "within 0.5 ulp" is checkable; ``rel_l2``; ``gamma(k, u) = k·u / (1 - k·u)`` and ``dot_error_bound``
  (Higham 3.1): |fl(x·y) - x·y| <= γ_K·Σ|x_i·y_i| for an fp32-accumulated dot of length K."""

from __future__ import annotations

import torch

NAN_DISTANCE = float("inf")

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}

# Per dtype: unit roundoff u = 2**-p (p significand bits incl. the implicit one), smallest normal exponent.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MIN_EXPONENT = {torch.float64: -1022, torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to int64 so that adjacent floats differ by 1 and -0 == +0."""
    bits = t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)
    width = torch.iinfo(_INT_VIEW[t.dtype]).bits
    sign_mask = 1 << (width - 1)
    magnitude = bits & (sign_mask - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ulp distance (float64 tensor) between two tensors of the same float dtype."""
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_distance: dtypes differ: a is {a.dtype}, b is {b.dtype}")
    if a.dtype not in _INT_VIEW:
        raise ValueError(f"ulp_distance: unsupported dtype {a.dtype}")
    a, b = torch.broadcast_tensors(a, b)
    dist = (_ordered(a) - _ordered(b)).abs().to(torch.float64)
    a_nan, b_nan = torch.isnan(a), torch.isnan(b)
    dist = torch.where(a_nan & b_nan, torch.zeros_like(dist), dist)
    return torch.where(a_nan ^ b_nan, torch.full_like(dist, NAN_DISTANCE), dist)


def ulp_of(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at |exact| (float64), subnormal spacing near zero."""
    e = exact.to(torch.float64).abs()
    exponent = torch.floor(torch.log2(torch.where(e > 0, e, torch.ones_like(e))))
    exponent = torch.clamp(exponent, min=_MIN_EXPONENT[dtype])
    return torch.pow(2.0, exponent - _MANTISSA_BITS[dtype])


def ulp_error(actual: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|actual - exact| / ulp(exact) in actual's dtype, as fp64; same NaN or equal infs give 0, others inf."""
    ref = exact.to(torch.float64)
    act = actual.to(torch.float64)
    err = (act - ref).abs() / ulp_of(ref, actual.dtype)
    same_special = (torch.isnan(act) & torch.isnan(ref)) | (torch.isinf(ref) & (act == ref))
    err = torch.where(same_special, torch.zeros_like(err), err)
    bad = (torch.isnan(act) ^ torch.isnan(ref)) | ((torch.isinf(act) | torch.isinf(ref)) & (act != ref))
    return torch.where(bad, torch.full_like(err, NAN_DISTANCE), err)


def max_ulp(actual: torch.Tensor, exact: torch.Tensor) -> float:
    err = ulp_error(actual, exact)
    return float(err.max()) if err.numel() else 0.0


def rel_l2(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """||actual - exact||_2 / ||exact||_2 in float64 (0 when both are empty or zero; inf if NaN differs)."""
    act = actual.detach().to(torch.float64)
    ref = exact.detach().to(torch.float64)
    if act.numel() == 0:
        return 0.0
    if bool((torch.isnan(act) != torch.isnan(ref)).any()):
        return float("inf")
    mask = ~torch.isnan(ref)
    diff = torch.linalg.vector_norm((act - ref)[mask])
    denom = torch.linalg.vector_norm(ref[mask])
    if float(denom) == 0.0:
        return 0.0 if float(diff) == 0.0 else float("inf")
    return float(diff / denom)


def gamma(k: int, u: float = UNIT_ROUNDOFF[torch.float32]) -> float:
    """γ_k = k·u / (1 - k·u), the classic bound on k rounded operations."""
    if k * u >= 1:
        return float("inf")
    return k * u / (1 - k * u)


def dot_error_bound(a: torch.Tensor, b: torch.Tensor, u: float = UNIT_ROUNDOFF[torch.float32]) -> torch.Tensor:
    """Elementwise bound γ_K·(|a|·|b|) for the product a @ b accumulated with unit roundoff u (K = a.shape[-1])."""
    k = a.shape[-1]
    return gamma(k, u) * (a.abs().to(torch.float64) @ b.abs().to(torch.float64))
