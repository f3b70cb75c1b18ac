"""The two oracles of ``doracheck.reference`` agree, and the fp64 one is differentiable correctly.

Proves:
- The float64 oracle (``norm_terms_ref``, ``dora_forward_ref``, ``magnitude_scale_ref``) is
  within 2 fp64 ulps of the mpmath oracle (exact, then correctly rounded) on small odd shapes,
  several seeds and scalings (0.5, 2.0, 16/sqrt(8)), with bias, both ``fan_in_fan_out``
  layouts, float32 and bfloat16 inputs (both oracles upcast), and in the hard rows:
  rows where W nearly cancels s·B·A (||V_i|| about 1e-6·||W_i||) and all-zero rows
  (norm 0, y = bias, no NaN).
- A hand-computable case anchors both oracles to exact numbers.
- The three-term identity norm² = base + 2s·cross + s²·lora holds for the fp64 oracle within
  a few fp64 ulps of (base + 2s|cross| + s²·lora), checked in exact rational arithmetic.
- ``precision`` (the mpmath context) restores ``mpmath.mp.prec``, also on exceptions.
- ``dora_forward_ref`` passes ``gradcheck`` with ``detach_norm=False`` (all inputs), and with
  ``detach_norm=True`` for magnitude, bias and x.
- Its dropout path needs a mask and equals x·Wᵀ + b + (g-1)(x_d·Wᵀ) + g·s·(x_d·Aᵀ)·Bᵀ by hand.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import pytest
import torch

from doracheck.reference import (
    EPS,
    dora_forward_ref,
    magnitude_scale_ref,
    mp_dora_forward,
    mp_magnitude_scale,
    mp_norm_terms,
    norm_terms_ref,
    precision,
    ulp_distance,
)

F64 = torch.float64
U64 = 2.0**-53
MAX_ULPS = 2.0  # the brief's contract between the two oracles
SCALINGS = (0.5, 2.0, 16 / math.sqrt(8))
CANCEL_ROW, STRUCTURED_CANCEL_ROW, ZERO_ROW = 1, 2, 3


def make_problem(
    seed: int, *, d_out=5, d_in=9, r=3, T=4, scaling=2.0, dtype=torch.float32, bias=True, hard_rows=True
):
    """Random DoRA inputs in ``dtype`` (everything quantized once, so both oracles see the same numbers).

    With ``hard_rows``:
    - row CANCEL_ROW: W_i = fp32(-s·(B·A)_i) + a perturbation of relative size 1e-6
      (in bf16 the perturbation is lost and the rounding residual, ~1e-3 relative, remains);
    - row STRUCTURED_CANCEL_ROW: B_i = e_0, A_{0,j0} = 0, W_ij = -s·A_0j rounded to dtype for
      j != j0 and W_{i,j0} = 1e-6·||W_i||: for a power-of-two s the cancellation is exact in any
      dtype and ||V_i|| = 1e-6·||W_i||;
    - row ZERO_ROW: W_i = 0 and B_i = 0, so V_i = 0.
    """
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen, dtype=F64)
    A = (0.3 * torch.randn(r, d_in, generator=gen, dtype=F64)).to(dtype).to(F64)
    B = (0.3 * torch.randn(d_out, r, generator=gen, dtype=F64)).to(dtype).to(F64)
    m = torch.rand(d_out, generator=gen, dtype=F64) + 0.5
    b = torch.randn(d_out, generator=gen, dtype=F64)
    x = torch.randn(T, d_in, generator=gen, dtype=F64)
    s = float(scaling)
    if hard_rows:
        i, j0 = STRUCTURED_CANCEL_ROW, d_in // 2
        A[0, j0] = 0.0
        B[i] = 0.0
        B[i, 0] = 1.0
        W[i] = (-s * A[0]).to(dtype).to(F64)
        W[i, j0] = 1e-6 * float(W[i].norm())
        P = B @ A  # after A changed
        i = CANCEL_ROW
        pert = torch.randn(d_in, generator=gen, dtype=F64)
        W[i] = (-s * P[i]).to(torch.float32).to(F64) + pert * (
            1e-6 * s * float(P[i].norm()) / float(pert.norm())
        )
        W[ZERO_ROW] = 0.0
        B[ZERO_ROW] = 0.0
    return tuple(t.to(dtype) for t in (x, W, A, B, m)) + (b.to(dtype) if bias else None,)


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, what: str, limit: float = MAX_ULPS):
    assert actual.dtype == F64 and expected.dtype == F64, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert not bool(torch.isnan(actual).any()), f"{what}: NaN in the fp64 oracle: {actual}"
    dist = ulp_distance(actual, expected)
    worst = float(dist.max()) if dist.numel() else 0.0
    if worst > limit:
        k = int(dist.argmax())
        got, want = actual.reshape(-1)[k].item(), expected.reshape(-1)[k].item()
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(k), dist.shape))
        raise AssertionError(f"{what}: fp64 oracle {worst} ulps from mpmath at {where}: {got!r} vs {want!r}")
    return worst


# ------------------------------------------------------------------------ hand-computable anchor


def test_hand_computed_case():
    # W = [3, 4], A = [1, 0], B = [2], s = 0.5: V = [4, 4], base 25, cross 6, lora 4, norm 4·sqrt(2).
    W = torch.tensor([[3.0, 4.0]])
    A = torch.tensor([[1.0, 0.0]])
    B = torch.tensor([[2.0]])
    for terms in (norm_terms_ref(W, A, B, 0.5), mp_norm_terms(W, A, B, 0.5)):
        assert terms.base.item() == 25.0 and terms.cross.item() == 6.0 and terms.lora.item() == 4.0
        assert terms.norm.item() == 4.0 * math.sqrt(2.0)  # sqrt(32) correctly rounded
    m = torch.tensor([2.0])
    x = torch.tensor([[1.0, 1.0]])
    # y = b + (m/n)·(x·V) = 1 + (2/(4√2))·8 = 1 + 2√2.
    expected = 1.0 + 2.0 * math.sqrt(2.0)
    for y in (
        dora_forward_ref(x, W, A, B, m, 0.5, torch.tensor([1.0])),
        mp_dora_forward(x, W, A, B, m, 0.5, torch.tensor([1.0])),
    ):
        assert y.shape == (1, 1) and y.item() == pytest.approx(expected, rel=2 * U64)


# ------------------------------------------------------------------------ fp64 vs mpmath


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"s={s:.4g}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_terms_fp64_matches_mpmath(seed, scaling, dtype):
    x, W, A, B, m, b = make_problem(seed, scaling=scaling, dtype=dtype)
    assert W.dtype == dtype and A.dtype == dtype and B.dtype == dtype
    exact = mp_norm_terms(W, A, B, scaling)
    ref = norm_terms_ref(W, A, B, scaling)
    for name in ("base", "cross", "lora", "norm"):
        assert_ulps(getattr(ref, name), getattr(exact, name), f"{name} ({dtype}, s={scaling}, seed={seed})")
    # The hard rows are as hard as intended.
    rel = exact.norm / exact.base.sqrt()
    if dtype == torch.float32:
        assert float(rel[CANCEL_ROW]) < 1e-5
    if scaling in (0.5, 2.0):  # exact structured cancellation for power-of-two s
        assert float(rel[STRUCTURED_CANCEL_ROW]) == pytest.approx(1e-6, rel=1e-2)
    assert exact.norm[ZERO_ROW].item() == 0.0 and ref.norm[ZERO_ROW].item() == 0.0
    assert (
        ref.base[ZERO_ROW].item() == 0.0
        and ref.cross[ZERO_ROW].item() == 0.0
        and ref.lora[ZERO_ROW].item() == 0.0
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"s={s:.4g}")
def test_fan_in_fan_out_layout(seed, scaling):
    """Both oracles read the (d_in, d_out) layout: same numbers as the (d_out, d_in) one."""
    x, W, A, B, m, b = make_problem(seed, scaling=scaling)
    Wt = W.t().contiguous()
    exact = mp_norm_terms(Wt, A, B, scaling, fan_in_fan_out=True)
    ref = norm_terms_ref(Wt, A, B, scaling, fan_in_fan_out=True)
    for name in ("base", "cross", "lora", "norm"):
        assert_ulps(getattr(ref, name), getattr(exact, name), f"{name} (fan_in_fan_out)")
        assert torch.equal(getattr(ref, name), getattr(norm_terms_ref(W, A, B, scaling), name))
    y_exact = mp_dora_forward(x, Wt, A, B, m, scaling, b, fan_in_fan_out=True)
    y_ref = dora_forward_ref(x, Wt, A, B, m, scaling, b, fan_in_fan_out=True)
    assert_ulps(y_ref, y_exact, "y (fan_in_fan_out)")
    assert torch.equal(y_ref, dora_forward_ref(x, W, A, B, m, scaling, b))
    g_exact, gm1_exact = mp_magnitude_scale(Wt, A, B, m, scaling, fan_in_fan_out=True)
    g_ref, _ = magnitude_scale_ref(m, ref.norm)
    assert_ulps(g_ref, g_exact, "g (fan_in_fan_out)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"s={s:.4g}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_fp64_matches_mpmath(seed, scaling, dtype):
    x, W, A, B, m, b = make_problem(seed, scaling=scaling, dtype=dtype)
    y_exact = mp_dora_forward(x, W, A, B, m, scaling, b)
    y_ref = dora_forward_ref(x, W, A, B, m, scaling, b)
    assert y_ref.shape == (4, 5)
    assert_ulps(y_ref, y_exact, f"y ({dtype}, s={scaling}, seed={seed})")
    # Zero row: y = bias exactly, no NaN (g = m / eps multiplies an exact 0).
    assert torch.equal(y_ref[:, ZERO_ROW], b.to(F64)[ZERO_ROW].expand(4))
    # Without bias too.
    assert_ulps(
        dora_forward_ref(x, W, A, B, m, scaling), mp_dora_forward(x, W, A, B, m, scaling), "y (no bias)"
    )


def test_forward_other_shapes():
    x, W, A, B, m, b = make_problem(5, d_out=7, d_in=6, r=1, T=6, scaling=16 / math.sqrt(8))
    x3 = x.reshape(2, 3, 6)
    y = dora_forward_ref(x3, W, A, B, m, 16 / math.sqrt(8), b)
    assert y.shape == (2, 3, 7)
    assert_ulps(y, mp_dora_forward(x3, W, A, B, m, 16 / math.sqrt(8), b), "y (3-D x)")
    x1 = x[:1]
    assert_ulps(dora_forward_ref(x1, W, A, B, m, 0.5, b), mp_dora_forward(x1, W, A, B, m, 0.5, b), "y (T=1)")
    x0 = x[:0]
    assert dora_forward_ref(x0, W, A, B, m, 0.5, b).shape == (0, 7)
    assert mp_dora_forward(x0, W, A, B, m, 0.5, b).shape == (0, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"s={s:.4g}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_magnitude_scale_fp64_matches_mpmath(seed, scaling, dtype):
    x, W, A, B, m, b = make_problem(seed, scaling=scaling, dtype=dtype)
    g_exact, gm1_exact = mp_magnitude_scale(W, A, B, m, scaling)
    g_ref, gm1_ref = magnitude_scale_ref(m, norm_terms_ref(W, A, B, scaling).norm)
    assert_ulps(g_ref, g_exact, "g")
    # g - 1 is within 2 ulps of itself where it is not near 0 (m is drawn away from n here);
    # the zero row has g = m / eps, and g - 1 = (m - eps)/eps there.
    assert_ulps(gm1_ref, gm1_exact, "g - 1")
    assert g_ref[ZERO_ROW].item() == pytest.approx(m[ZERO_ROW].item() / EPS, rel=2 * U64)


@pytest.mark.parametrize("seed", [0, 1])
def test_magnitude_scale_near_one(seed):
    """m = fp32(n) (DoRA's init): g - 1 is ~1e-8. The fp64 oracle gets n rounded to fp64, so
    g - 1 = (m - n')/n' can be right only to about one ulp of g (absolute), not of g - 1:
    check that absolute bound, and g itself to 2 ulps."""
    x, W, A, B, m, b = make_problem(seed, scaling=2.0, hard_rows=False)
    n = norm_terms_ref(W, A, B, 2.0).norm
    m = n.to(torch.float32)
    g_exact, gm1_exact = mp_magnitude_scale(W, A, B, m, 2.0)
    g_ref, gm1_ref = magnitude_scale_ref(m, n)
    assert_ulps(g_ref, g_exact, "g near 1")
    assert float(gm1_exact.abs().max()) < 1e-7 and float(gm1_exact.abs().max()) > 0
    assert float((gm1_ref - gm1_exact).abs().max()) <= 2 * 2 * U64  # 2 ulps of g ≈ 1


# ------------------------------------------------------------------------ three-term identity


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"s={s:.4g}")
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_three_term_identity(seed, scaling):
    """|norm² - (base + 2s·cross + s²·lora)| <= 8u·(base + 2|s·cross| + s²·lora), u = 2**-53.

    Derivation: each of base, cross, lora is within one ulp (<= 2u relative) of its exact
    value and norm within one ulp, so norm² within 4u·norm² <= 4u·D; the terms contribute
    <= 2u·D; total 6u·D. 8u leaves room for a second ulp in norm. Evaluated in exact
    rationals so the check itself adds no rounding."""
    x, W, A, B, m, b = make_problem(seed, d_out=6, d_in=11, r=4, scaling=scaling)
    t = norm_terms_ref(W, A, B, scaling)
    s = Fraction(scaling)
    for i in range(W.shape[0]):
        base, cross, lora, norm = (
            Fraction(float(getattr(t, k)[i])) for k in ("base", "cross", "lora", "norm")
        )
        combined = base + 2 * s * cross + s * s * lora
        D = base + 2 * abs(s * cross) + s * s * lora
        err = abs(norm * norm - combined)
        assert err <= 8 * Fraction(U64) * D, (
            f"row {i}: |n² - terms| / D = {float(err / D) if D else float(err)}"
        )
    # The hard rows make the check meaningful: there D ≫ norm² (cancellation by ~1e12).
    D_cancel = float(
        t.base[CANCEL_ROW] + 2 * abs(scaling * t.cross[CANCEL_ROW]) + scaling**2 * t.lora[CANCEL_ROW]
    )
    assert float(t.norm[CANCEL_ROW]) ** 2 < 1e-9 * D_cancel


# ------------------------------------------------------------------------ mpmath precision context


def test_precision_context_restores_prec():
    old = mpmath.mp.prec
    try:
        mpmath.mp.prec = 77
        with precision(300):
            assert mpmath.mp.prec == 300
            with precision(1000):
                assert mpmath.mp.prec == 1000
            assert mpmath.mp.prec == 300
        assert mpmath.mp.prec == 77
        with pytest.raises(ZeroDivisionError):
            with precision(500):
                assert mpmath.mp.prec == 500
                raise ZeroDivisionError("inside")
        assert mpmath.mp.prec == 77
        # The oracles leave the global precision alone, also when they refuse a shape.
        W, A, B = torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 2)
        mp_norm_terms(W, A, B, 2.0)
        mp_magnitude_scale(W, A, B, torch.ones(3), 2.0)
        mp_dora_forward(torch.randn(2, 4), W, A, B, torch.ones(3), 2.0)
        assert mpmath.mp.prec == 77
        with pytest.raises(ValueError):
            mp_norm_terms(torch.zeros(256, 256), torch.zeros(1, 256), torch.zeros(256, 1), 1.0)
        assert mpmath.mp.prec == 77
    finally:
        mpmath.mp.prec = old


# ------------------------------------------------------------------------ gradients


def _grad_inputs(seed: int, fan_in_fan_out: bool):
    x, W, A, B, m, b = make_problem(seed, d_out=4, d_in=5, r=2, T=3, scaling=2.0, dtype=F64, hard_rows=False)
    if fan_in_fan_out:
        W = W.t().contiguous()
    return x, W, A, B, m, b


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck_full_norm_gradient(seed, fan_in_fan_out):
    tensors = [t.clone().requires_grad_(True) for t in _grad_inputs(seed, fan_in_fan_out)]

    def f(x, W, A, B, m, b):
        return dora_forward_ref(
            x, W, A, B, m, 16 / math.sqrt(8), b, detach_norm=False, fan_in_fan_out=fan_in_fan_out
        )

    assert torch.autograd.gradcheck(f, tuple(tensors), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck_detached_norm(seed):
    """With the norm detached, y is linear in x, m and b: their gradients are exact derivatives."""
    x, W, A, B, m, b = _grad_inputs(seed, False)
    x, m, b = (t.clone().requires_grad_(True) for t in (x, m, b))

    def f(x, m, b):
        return dora_forward_ref(x, W, A, B, m, 0.5, b, detach_norm=True)

    assert torch.autograd.gradcheck(f, (x, m, b), eps=1e-6, atol=1e-7, rtol=1e-5)
    # And the detached norm really is detached: W's gradient differs from the full one.
    Wg = W.clone().requires_grad_(True)
    dora_forward_ref(x, Wg, A, B, m, 0.5, b, detach_norm=True).sum().backward()
    Wf = W.clone().requires_grad_(True)
    dora_forward_ref(x, Wf, A, B, m, 0.5, b, detach_norm=False).sum().backward()
    assert not torch.allclose(Wg.grad, Wf.grad)


# ------------------------------------------------------------------------ dropout path


def test_dropout_requires_mask():
    x, W, A, B, m, b = make_problem(0)
    with pytest.raises(ValueError, match="dropout_mask"):
        dora_forward_ref(x, W, A, B, m, 2.0, b, dropout_p=0.25, training=True)
    # Not active (eval, or p = 0): no mask needed, and the result is the no-dropout one.
    y = dora_forward_ref(x, W, A, B, m, 2.0, b)
    assert torch.equal(dora_forward_ref(x, W, A, B, m, 2.0, b, dropout_p=0.25, training=False), y)
    assert torch.equal(dora_forward_ref(x, W, A, B, m, 2.0, b, dropout_p=0.0, training=True), y)


@pytest.mark.parametrize("mask_shape", ["full", "broadcast"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dropout_matches_hand_formula(seed, mask_shape):
    p, s = 0.3, 16 / math.sqrt(8)
    x, W, A, B, m, b = (t.to(F64) for t in make_problem(seed, T=6, scaling=s, hard_rows=False))
    gen = torch.Generator().manual_seed(100 + seed)
    shape = x.shape if mask_shape == "full" else (1, x.shape[1])
    mask = (torch.rand(shape, generator=gen) > p).to(torch.float32)
    y = dora_forward_ref(x, W, A, B, m, s, b, dropout_p=p, training=True, dropout_mask=mask)
    # By hand, plain fp64: x·Wᵀ + b + (g-1)(x_d·Wᵀ) + g·s·(x_d·Aᵀ)·Bᵀ.
    x_d = x * mask.to(F64) / (1 - p)
    n = torch.linalg.norm(W + s * (B @ A), dim=1)
    g = m / n
    expected = x @ W.t() + b + (g - 1) * (x_d @ W.t()) + g * s * ((x_d @ A.t()) @ B.t())
    # Both are fp64 evaluations of the same formula in a different order: ~K·u relative to Σ|terms|.
    scale = (
        (x.abs() @ W.abs().t()) * (1 + g.abs())
        + b.abs()
        + (g * s).abs() * ((x_d.abs() @ A.abs().t()) @ B.abs().t())
    )
    assert float(((y - expected).abs() / scale).max()) < 64 * U64
    # Dropout changed something (the mask is not all ones).
    assert not torch.allclose(y, dora_forward_ref(x, W, A, B, m, s, b))
