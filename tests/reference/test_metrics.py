"""The error metrics of ``doracheck.reference`` measure what they claim to measure.

Proves, on hand-built bit patterns (so no metric is checked against itself):
- ``ulp_distance`` counts representable numbers for float32, float16 and bfloat16:
  neighbours are 1 apart (including across an exponent boundary), +0 and -0 are the same
  point, the two smallest subnormals of opposite sign are 2 apart, NaN vs NaN is 0, NaN vs
  a number is inf, Inf is one step after the largest finite value; mixed dtypes are refused.
- ``ulp_error`` is exactly 0.5 half an ulp away (normal and subnormal range, both sides of
  a power of two) and is NaN/Inf aware.
- ``rel_l2``, ``gamma`` and ``dot_error_bound``: the bound holds for real fp32 matmuls
  against fp64 over several seeds and is not vacuous.
- The naive bf16 compose (g rounded to bf16) visibly misses the 0.5-ulp property near
  g ≈ 1 while ``doracheck.compose`` (fp32 math, one rounding) keeps it: the witness that
  the stable compose of docs/design.md section 2 matters, and that the metric can tell.
"""

from __future__ import annotations

import math

import pytest
import torch

import doracheck
from doracheck.reference import (
    UNIT_ROUNDOFF,
    dot_error_bound,
    gamma,
    max_ulp,
    mp_compose,
    naive_compose,
    rel_l2,
    ulp_distance,
    ulp_error,
)

F64 = torch.float64
LOW_DTYPES = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INF = float("inf")
NAN = float("nan")


def _from_bits16(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    """16-bit floats from raw bit patterns (given as unsigned 0..0xFFFF)."""
    signed = [b - 0x10000 if b >= 0x8000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int16).view(dtype)


def _from_bits32(bits: list[int]) -> torch.Tensor:
    signed = [b - 0x1_0000_0000 if b >= 0x8000_0000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    return _from_bits32(bits) if dtype == torch.float32 else _from_bits16(bits, dtype)


# Per dtype: (smallest positive subnormal, largest finite, +inf, +1.0, the float just below 1.0) as bits.
BITS = {
    torch.float32: dict(
        tiny=0x0000_0001, max=0x7F7F_FFFF, inf=0x7F80_0000, one=0x3F80_0000, below_one=0x3F7F_FFFF
    ),
    torch.float16: dict(tiny=0x0001, max=0x7BFF, inf=0x7C00, one=0x3C00, below_one=0x3BFF),
    torch.bfloat16: dict(tiny=0x0001, max=0x7F7F, inf=0x7F80, one=0x3F80, below_one=0x3F7F),
}
SIGN = {torch.float32: 0x8000_0000, torch.float16: 0x8000, torch.bfloat16: 0x8000}


def test_bit_tables_are_right():
    """The hand-written bit patterns are the numbers they claim to be (guards the other tests)."""
    for dt in ALL_DTYPES:
        b = BITS[dt]
        info = torch.finfo(dt)
        vals = _from_bits([b["tiny"], b["max"], b["inf"], b["one"]], dt).to(F64).tolist()
        assert vals[0] == info.smallest_normal * info.eps  # smallest subnormal = 2^(emin - mantissa bits)
        assert vals[1] == info.max
        assert vals[2] == INF
        assert vals[3] == 1.0


# --------------------------------------------------------------------------- ulp_distance


def _random_finite(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mags = torch.exp(torch.empty(n, dtype=F64).uniform_(-20, 20, generator=gen))
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(F64)
    return (signs * mags).to(dtype)


@pytest.mark.parametrize("seed", [0, 1])
def test_adjacent_float32_are_one_apart(seed):
    a = _random_finite(torch.float32, 4096, seed)
    up = torch.nextafter(a, torch.full_like(a, INF))
    down = torch.nextafter(a, torch.full_like(a, -INF))
    assert torch.equal(ulp_distance(a, up), torch.ones(a.shape, dtype=F64))
    assert torch.equal(ulp_distance(down, a), torch.ones(a.shape, dtype=F64))
    assert torch.equal(ulp_distance(down, up), torch.full(a.shape, 2.0, dtype=F64))
    # k steps apart is k.
    far = a.clone()
    for _ in range(5):
        far = torch.nextafter(far, torch.full_like(far, INF))
    assert torch.equal(ulp_distance(a, far), torch.full(a.shape, 5.0, dtype=F64))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_adjacent_16bit_are_one_apart(dtype, seed):
    a = _random_finite(dtype, 4096, seed)
    a = a[torch.isfinite(a) & (a != 0)]
    bits = a.view(torch.int16)
    # +1 on the bit pattern is the next float away from zero (for either sign), +3 is three away.
    neighbour = (bits + 1).view(dtype)
    assert bool(torch.isfinite(neighbour).all())
    assert torch.equal(ulp_distance(a, neighbour), torch.ones(a.shape, dtype=F64))
    assert torch.equal(ulp_distance(neighbour, a), torch.ones(a.shape, dtype=F64))
    assert torch.equal(ulp_distance(a, (bits + 3).view(dtype)), torch.full(a.shape, 3.0, dtype=F64))
    # The value is the same tensor in a different dtype: float16 and bfloat16 neighbours are
    # genuinely adjacent (the midpoint rounds to one of them, nothing lies strictly between).
    lo, hi = a.to(F64), neighbour.to(F64)
    mid = ((lo + hi) / 2).to(dtype).to(F64)
    assert bool(((mid == lo) | (mid == hi)).all())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_special_points(dtype):
    b = BITS[dtype]
    sign = SIGN[dtype]
    pos_zero, neg_zero = _from_bits([0], dtype), _from_bits([sign], dtype)
    tiny, neg_tiny = _from_bits([b["tiny"]], dtype), _from_bits([sign | b["tiny"]], dtype)
    big, inf = _from_bits([b["max"]], dtype), _from_bits([b["inf"]], dtype)
    neg_big, neg_inf = _from_bits([sign | b["max"]], dtype), _from_bits([sign | b["inf"]], dtype)
    one, below_one = _from_bits([b["one"]], dtype), _from_bits([b["below_one"]], dtype)
    nan = torch.tensor([NAN], dtype=dtype)

    def d(x, y):
        return float(ulp_distance(x, y).item())

    assert d(pos_zero, neg_zero) == 0.0
    assert d(neg_zero, pos_zero) == 0.0
    assert d(tiny, pos_zero) == 1.0
    assert d(neg_tiny, neg_zero) == 1.0
    assert d(neg_tiny, tiny) == 2.0
    assert d(tiny, neg_tiny) == 2.0
    assert d(below_one, one) == 1.0  # across an exponent boundary
    assert d(inf, big) == 1.0
    assert d(neg_inf, neg_big) == 1.0
    assert d(inf, inf) == 0.0
    assert d(nan, nan) == 0.0
    assert d(nan, one) == INF
    assert d(one, nan) == INF
    assert d(nan, inf) == INF
    assert d(nan, pos_zero) == INF
    # A NaN with another payload is still "the same" NaN.
    other_nan = _from_bits([b["inf"] | 1], dtype)
    assert bool(torch.isnan(other_nan).all())
    assert d(other_nan, nan) == 0.0
    # The whole finite range: -max to +max is 2·(bit pattern of max) steps (zero counted once).
    assert d(neg_big, big) == 2.0 * b["max"]


def test_ulp_distance_broadcasts_and_returns_float64():
    a = torch.tensor([[1.0], [2.0]], dtype=torch.float32)
    b = torch.nextafter(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(INF))
    out = ulp_distance(a, b)
    assert out.dtype == F64 and out.shape == (2, 3)
    assert out[0, 0].item() == 1.0 and out[1, 1].item() == 1.0


@pytest.mark.parametrize(
    "da, db",
    [(torch.float32, torch.float16), (torch.float16, torch.bfloat16), (torch.float32, torch.float64)],
)
def test_ulp_distance_rejects_mixed_dtypes(da, db):
    with pytest.raises(ValueError, match="dtype"):
        ulp_distance(torch.ones(3, dtype=da), torch.ones(3, dtype=db))


# --------------------------------------------------------------------------- ulp_error


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_ulp_error_half_ulp(dtype):
    info = torch.finfo(dtype)
    mant = round(-math.log2(info.eps))  # explicit mantissa bits: ulp(1) = 2**-mant
    half = 2.0 ** -(mant + 1)
    one = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=dtype)
    # 1 + half an ulp above, -(1 + half ulp), and just below 1 (where the spacing halves):
    # 1 - 2**-(mant+2) is half of the spacing 2**-(mant+1) of [0.5, 1).
    exact = torch.tensor([1.0 + half, -1.0 - half, 1.0 - half / 2, 1.0 + half / 2], dtype=F64)
    err = ulp_error(one, exact)
    assert err.dtype == F64
    assert err.tolist() == [0.5, 0.5, 0.5, 0.25]
    # Subnormal range: the spacing is the smallest subnormal.
    tiny = info.smallest_normal * info.eps
    sub = torch.tensor([tiny, 0.0], dtype=F64).to(dtype)
    assert ulp_error(sub, torch.tensor([1.5 * tiny, 0.5 * tiny], dtype=F64)).tolist() == [0.5, 0.5]
    # A float exactly representable is 0 away; one neighbour is 1 away.
    assert ulp_error(one[:1], torch.tensor([1.0], dtype=F64)).item() == 0.0
    assert ulp_error(one[:1], torch.tensor([1.0 + 2 * half], dtype=F64)).item() == 1.0


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_ulp_error_nan_and_inf(dtype):
    act = torch.tensor([NAN, INF, -INF, NAN, 1.0, INF, -INF], dtype=dtype)
    exact = torch.tensor([NAN, INF, -INF, 1.0, NAN, -INF, 2.0], dtype=F64)
    assert ulp_error(act, exact).tolist() == [0.0, 0.0, 0.0, INF, INF, INF, INF]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_ulp_error_finite_result_for_infinite_exact_is_inf(dtype):
    """A finite result where the exact value is ±Inf is an infinite error, never NaN
    (NaN would make a check like ``not (err > 0.5)`` pass silently)."""
    act = torch.tensor([3.0, -3.0, 0.0], dtype=dtype)
    exact = torch.tensor([INF, -INF, INF], dtype=F64)
    err = ulp_error(act, exact)
    assert not bool(torch.isnan(err).any()), (
        f"ulp_error gave NaN for a finite vs infinite value: {err.tolist()}"
    )
    assert err.tolist() == [INF, INF, INF]


def test_max_ulp_empty_is_zero():
    assert max_ulp(torch.empty(0), torch.empty(0, dtype=F64)) == 0.0


# --------------------------------------------------------------------------- rel_l2, gamma


def test_rel_l2():
    exact = torch.tensor([3.0, 4.0], dtype=F64)
    assert rel_l2(exact.clone(), exact) == 0.0
    assert rel_l2(torch.tensor([3.0, 4.5]), exact) == pytest.approx(0.1, rel=1e-12)  # ||(0, .5)|| / 5
    assert rel_l2(torch.tensor([0.0, 0.0]), exact) == pytest.approx(1.0, rel=1e-15)
    assert rel_l2(torch.empty(0), torch.empty(0, dtype=F64)) == 0.0
    assert rel_l2(torch.zeros(3), torch.zeros(3, dtype=F64)) == 0.0
    assert rel_l2(torch.tensor([1e-30, 0.0]), torch.zeros(2, dtype=F64)) == INF
    # NaN in the same places is ignored; NaN in different places is an infinite error.
    assert rel_l2(torch.tensor([NAN, 3.0, 4.0]), torch.tensor([NAN, 3.0, 4.0], dtype=F64)) == 0.0
    assert rel_l2(torch.tensor([NAN, 3.0]), torch.tensor([1.0, 3.0], dtype=F64)) == INF
    assert rel_l2(torch.tensor([1.0, 3.0]), torch.tensor([NAN, 3.0], dtype=F64)) == INF
    # Works across dtypes (bf16 vs fp64) and detaches.
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    assert rel_l2(a, torch.tensor([1.0, 2.0], dtype=F64)) == 0.0


def test_gamma():
    u = UNIT_ROUNDOFF[torch.float32]
    assert u == 2.0**-24
    assert gamma(0) == 0.0
    assert gamma(1) == pytest.approx(u / (1 - u), rel=1e-15)
    assert gamma(64) == pytest.approx(64 * u / (1 - 64 * u), rel=1e-15)
    assert gamma(10, 0.01) == pytest.approx(0.1 / 0.9, rel=1e-15)
    assert gamma(100, 0.01) == INF
    assert gamma(1000, 0.01) == INF
    assert UNIT_ROUNDOFF[torch.bfloat16] == 2.0**-8 and UNIT_ROUNDOFF[torch.float16] == 2.0**-11


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("K", [64, 1000])
def test_dot_error_bound_holds_for_fp32_matmul(seed, K):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(48, K, generator=gen, dtype=F64).to(torch.float32)
    b = torch.randn(K, 40, generator=gen, dtype=F64).to(torch.float32)
    # Mixed magnitudes and a row that cancels: the bound is relative to |a|·|b|, not to |a·b|.
    a[0] = a[1]
    b[:, 0] = -b[:, 1]
    exact = a.to(F64) @ b.to(
        F64
    )  # K·24-bit products: fp64 error ~1e-16 relative to |a|·|b|, far below the bound
    err = ((a @ b).to(F64) - exact).abs()
    bound = dot_error_bound(a, b)
    assert bound.shape == exact.shape and bound.dtype == F64
    worst = float((err / bound).max())
    assert worst <= 1.0, f"fp32 matmul error exceeds gamma_K bound: worst err/bound = {worst}"
    assert float(err.max()) > 0.0  # the matmul did round somewhere: the check is not against 0
    # Not vacuous: gamma_K·|a|·|b| is a tiny fraction of |a|·|b|.
    absprod = a.abs().to(F64) @ b.abs().to(F64)
    assert float((bound / absprod).max()) == pytest.approx(gamma(K), rel=1e-12)
    if K == 64:
        assert float((bound / absprod).max()) < 1e-3
    # The same bound with bf16's u holds for a bf16 matmul on the same (quantized) inputs.
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    exact16 = a16.to(F64) @ b16.to(F64)
    err16 = ((a16 @ b16).to(F64) - exact16).abs()
    assert bool((err16 <= dot_error_bound(a16, b16, UNIT_ROUNDOFF[torch.bfloat16])).all())


# --------------------------------------------------------------------------- naive vs stable compose


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_naive_bf16_compose_loses_magnitude_near_one_stable_compose_does_not(seed):
    gen = torch.Generator().manual_seed(seed)
    T, d_out, s = 32, 48, 2.0
    base = torch.randn(T, d_out, generator=gen).to(torch.bfloat16)
    lora = (0.1 * torch.randn(T, d_out, generator=gen)).to(torch.bfloat16)
    g = torch.full((d_out,), 1.0 + 1e-3, dtype=torch.float32)  # rounds to exactly 1.0 in bf16
    assert float(g.to(torch.bfloat16)[0]) == 1.0
    exact = mp_compose(base, lora, g, s)  # b + g·(base + s·lora) on these inputs, correctly rounded to fp64

    naive = naive_compose(base, lora, g, s)
    stable = doracheck.compose(base, lora, g, s)
    assert naive.dtype == torch.bfloat16 and stable.dtype == torch.bfloat16
    naive_err = float(ulp_error(naive, exact).max())
    stable_err = float(ulp_error(stable, exact).max())
    # fp32 math then one rounding: 0.5 ulp plus a few fp32 roundings (~2**-16 bf16 ulps); 1e-3 is ample.
    assert stable_err <= 0.5 + 1e-3, f"stable compose: max ulp error {stable_err}"
    assert naive_err > 0.5, f"naive compose unexpectedly within 0.5 ulp (max {naive_err})"

    # And the magnitude is visibly lost: the naive result is shrunk toward zero by about
    # 1e-3 relative (g dropped), a bias, not just rounding noise.
    def shrink(y):
        return float(((y.to(F64) - exact) * exact.sign()).sum() / exact.abs().sum())

    assert shrink(naive) < -5e-4
    assert abs(shrink(stable)) < 1e-4
