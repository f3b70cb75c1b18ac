"""The torch path of doracheck (CPU) against the fp64 oracle: accuracy, memory, errors, module.

Proves:
- ``doracheck.factored_norm`` (and ``doracheck.kernels.factored_norm_torch`` with a small
  chunk) is within the a-priori fp32 accumulation bound of ``norm_terms_ref`` for float32,
  bfloat16 and float16 weights with fp32 or same-dtype adapters, in both layouts, including a
  row where W cancels s·B·A; ``return_terms=True`` gives fp32 ``NormTerms``.
- Its peak extra memory, MEASURED op by op (``doracheck.properties.memory``), stays within
  ``norm_memory_bound`` and far below one dense d_out × d_in fp32 temporary; the tracker
  itself is shown to see such a temporary.
- ``dora_linear`` forward and backward (detached and exact norm, with and without dropout)
  are within per-dtype relative-L2 budgets of ``dora_forward_ref`` on the same quantized
  inputs; 3-D x, T = 0 and T = 1 work; a zero row of V gives bias (0 without bias), not NaN,
  in the forward and finite gradients in the backward; NaN in x propagates.
- Bad arguments raise ValueError naming the argument and saying expected vs got.
- ``DoRALinear.from_linear`` matches the wrapped linear at init; merge/unmerge round-trip.
"""

from __future__ import annotations

import math

import pytest
import torch

import doracheck
import doracheck.dispatch
from doracheck.kernels import factored_norm_torch, norm_memory_bound
from doracheck.properties.memory import peak_tensor_bytes
from doracheck.reference import UNIT_ROUNDOFF, dora_forward_ref, gamma, norm_terms_ref, rel_l2

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def _torch_path():
    """These tests are about the torch path: force it even if DORACHECK_PATH asks otherwise."""
    use_path = getattr(doracheck.dispatch, "use_path", None)
    if use_path is None:
        yield
        return
    with use_path("torch"):
        yield


U32 = UNIT_ROUNDOFF[F32]
MiB = 1 << 20
RSLORA_SCALING = 16 / math.sqrt(8)  # lora_alpha = 16, r = 8 with rsLoRA: not a binary fraction

# Relative-L2 budgets of dora_linear (forward y and every gradient) against the fp64 oracle
# evaluated on the same quantized inputs, per compute dtype (= x.dtype).
# fp32: each element is an fp32-accumulated sum of K = d_in + r <= 62 products plus a few
#   roundings; rounding errors add like a random walk, ~sqrt(K)·u = 5e-7 (the worst case
#   gamma_K·|x||W| = 3.7e-6 is never approached). Measured worst over 5 seeds: 2.3e-7.
RTOL_FP32 = 1e-6
# bf16 (u = 2**-8 = 3.9e-3): y and the gradients pass through about four bf16 roundings
#   (x·Wᵀ, x·Aᵀ, (x·Aᵀ)·Bᵀ and the compose's single output rounding; backward likewise
#   dz, dz·B and the output GEMM), each <= u relative, rms about u/sqrt(3) per element:
#   ~sqrt(4)·u/sqrt(3) = 4.5e-3; budget 2.56·u. Measured worst: 4.3e-3 (fp32 adapters, dx).
RTOL_BF16 = 1e-2
# fp16 (u = 2**-11 = 4.9e-4): the same count of roundings, budget 4·u. Measured worst: 5.2e-4.
RTOL_FP16 = 2e-3
RTOL = {F32: RTOL_FP32, BF16: RTOL_BF16, F16: RTOL_FP16}


# =========================================================================== factored norm


def _norm_problem(seed, w_dtype, a_dtype, *, d_out=33, d_in=70, r=5, scaling=RSLORA_SCALING):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen).to(w_dtype)
    A = (0.2 * torch.randn(r, d_in, generator=gen)).to(a_dtype)
    B = (0.2 * torch.randn(d_out, r, generator=gen)).to(a_dtype)
    # Row 1: W cancels s·B·A up to W's rounding (||V_1|| ≈ u_w·||W_1||).
    W[1] = (-scaling * (B.to(F64) @ A.to(F64))[1]).to(w_dtype)
    # Row 2: all zero (V_2 = 0).
    W[2] = 0
    B[2] = 0
    return W, A, B, scaling


def _norm_error_bounds(W, A, B, s, ref):
    """Componentwise a-priori bounds (Higham, gamma_k = k·u/(1-k·u), u = 2**-24) for fp32 accumulation.

    Every input is upcast to fp32 exactly (bf16/fp16 ⊂ fp32), so only the fp32 sums round:
    - base_i = Σ_j W_ij²: a sum of d_in exact-ish squares (each rounded once) -> gamma_{d_in}·base_i.
      Chunking sums chunk sums: the depth is (c - 1) + ceil(d_in / c) <= d_in, same bound.
    - cross_i = Σ_k B_ik·U_ik, U = W·Aᵀ: U_ik is within gamma_{d_in}·(|W||A|ᵀ)_ik, then r more
      products and sums -> gamma_{d_in + r}·Σ_j |W_ij|·(|B||A|)_ij.
    - lora_i = Σ_k (B·G)_ik·B_ik, G = A·Aᵀ: gamma_{d_in + 2r}·||(|B||A|)_i||².
    - norm² = base + 2s·cross + s²·lora: three more roundings (the combination, s·s), so
      E_i = gamma_{d_in + 2r + 3}·(base + 2|s|·cross_abs + s²·lora_abs); then the fp32 sqrt
      rounds once (relative u on n, <= 2.01u on n²).
    Bounds are relative to |terms|, not to the result: where W cancels s·B·A (row 1) the
    norm can only be right to about sqrt(E), which is all fp32 accumulation promises.
    """
    d_out, d_in = W.shape
    r = A.shape[0]
    Wd, Ad, Bd = W.to(F64), A.to(F64), B.to(F64)
    absP = Bd.abs() @ Ad.abs()
    cross_abs = (Wd.abs() * absP).sum(1)
    lora_abs = (absP * absP).sum(1)
    E = gamma(d_in + 2 * r + 3) * (ref.base + 2 * abs(s) * cross_abs + s * s * lora_abs)
    return {
        "base": gamma(d_in) * ref.base,
        "cross": gamma(d_in + r) * cross_abs,
        "lora": gamma(d_in + 2 * r) * lora_abs,
        "norm_sq": E + 2.01 * U32 * (ref.norm**2 + E),
    }


def _check_norm_terms(terms, W, A, B, s, label):
    """Assert each term and n² within its bound; return the worst (error / bound) ratio."""
    ref = norm_terms_ref(W, A, B, s)
    bounds = _norm_error_bounds(W, A, B, s, ref)
    worst = 0.0
    for name, got, exact in (
        ("base", terms.base, ref.base),
        ("cross", terms.cross, ref.cross),
        ("lora", terms.lora, ref.lora),
        ("norm_sq", terms.norm.to(F64) ** 2, ref.norm**2),  # fp32² is exact in fp64
    ):
        assert got.shape == exact.shape, (label, name, got.shape)
        assert not bool(torch.isnan(got).any()), f"{label}: NaN in {name}"
        err = (got.to(F64) - exact).abs()
        ratio = torch.where(err == 0, torch.zeros_like(err), err / bounds[name])
        i = int(ratio.argmax())
        assert float(ratio[i]) <= 1.0, (
            f"{label}: {name}[{i}] = {got[i].item()!r}, oracle {exact[i].item()!r}, "
            f"error {err[i].item():.3e} > a-priori bound {bounds[name][i].item():.3e}"
        )
        worst = max(worst, float(ratio[i]))
    assert terms.norm[2].item() == 0.0  # the zero row
    return worst


DTYPE_PAIRS = [(F32, F32), (BF16, F32), (BF16, BF16), (F16, F32), (F16, F16)]


@pytest.mark.parametrize("w_dtype, a_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("seed", [0, 1])
def test_factored_norm_matches_oracle(seed, w_dtype, a_dtype):
    W, A, B, s = _norm_problem(seed, w_dtype, a_dtype)
    terms = doracheck.factored_norm(W, A, B, s, return_terms=True)
    assert isinstance(terms, doracheck.NormTerms)
    assert terms._fields == ("base", "cross", "lora", "norm")
    for t in terms:
        assert t.dtype == F32 and t.shape == (W.shape[0],) and not t.requires_grad
    _check_norm_terms(terms, W, A, B, s, f"factored_norm {w_dtype}/{a_dtype}")
    n = doracheck.factored_norm(W, A, B, s)
    assert n.dtype == F32 and torch.equal(n, terms.norm)
    # The terms obey the identity they define, to fp32 rounding of the combination: the three
    # roundings of base + (2s)·cross + (s·s)·lora (<= 3u·D, s·s in fp64 first) and the sqrt
    # (n² within 2u·n² <= 2u·D) give 5u·D; 6u leaves a little room.
    combined = terms.base.to(F64) + 2 * s * terms.cross.to(F64) + s * s * terms.lora.to(F64)
    D = terms.base.to(F64) + 2 * abs(s) * terms.cross.to(F64).abs() + s * s * terms.lora.to(F64)
    assert bool(((terms.norm.to(F64) ** 2 - combined).abs() <= 6 * U32 * D).all())


@pytest.mark.parametrize("w_dtype, a_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_factored_norm_fan_in_fan_out(w_dtype, a_dtype):
    W, A, B, s = _norm_problem(3, w_dtype, a_dtype)
    Wt = W.t().contiguous()
    plain = doracheck.factored_norm(W, A, B, s, return_terms=True)
    fan = doracheck.factored_norm(Wt, A, B, s, fan_in_fan_out=True, return_terms=True)
    _check_norm_terms(fan, W, A, B, s, f"fan_in_fan_out {w_dtype}/{a_dtype}")
    # Same numbers up to summation order: the two results differ by at most both bounds.
    ref = norm_terms_ref(W, A, B, s)
    b = _norm_error_bounds(W, A, B, s, ref)
    assert bool(((plain.norm.to(F64) ** 2 - fan.norm.to(F64) ** 2).abs() <= 2 * b["norm_sq"]).all())
    # The oracle reads the transposed layout the same way.
    assert torch.equal(norm_terms_ref(Wt, A, B, s, fan_in_fan_out=True).norm, ref.norm)


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("w_dtype, a_dtype", [(F32, F32), (BF16, BF16), (F16, F32)], ids=str)
def test_factored_norm_chunking(w_dtype, a_dtype, fan_in_fan_out):
    W, A, B, s = _norm_problem(4, w_dtype, a_dtype)
    Wl = W.t().contiguous() if fan_in_fan_out else W
    whole = factored_norm_torch(Wl, A, B, s, fan_in_fan_out=fan_in_fan_out)
    for chunk in (3, 1, 64, 1000):
        chunked = factored_norm_torch(Wl, A, B, s, fan_in_fan_out=fan_in_fan_out, chunk=chunk)
        _check_norm_terms(chunked, W, A, B, s, f"chunk={chunk}")
        assert chunked.U.shape == (W.shape[0], A.shape[0]) and chunked.G.shape == (A.shape[0],) * 2
        # U and G: fp32 GEMMs of depth d_in, gamma_{d_in} relative to |W||A|ᵀ and |A||A|ᵀ.
        U_exact = W.to(F64) @ A.to(F64).t()
        G_exact = A.to(F64) @ A.to(F64).t()
        assert bool(
            (
                (chunked.U.to(F64) - U_exact).abs()
                <= gamma(W.shape[1]) * (W.to(F64).abs() @ A.to(F64).abs().t())
            ).all()
        )
        assert bool(
            (
                (chunked.G.to(F64) - G_exact).abs()
                <= gamma(W.shape[1]) * (A.to(F64).abs() @ A.to(F64).abs().t())
            ).all()
        )
        # Chunked and unchunked agree to fp32 rounding (both within the bound of the oracle).
        ref = norm_terms_ref(W, A, B, s)
        b = _norm_error_bounds(W, A, B, s, ref)
        assert bool(((chunked.norm.to(F64) ** 2 - whole.norm.to(F64) ** 2).abs() <= 2 * b["norm_sq"]).all())


def test_factored_norm_worst_ratio_is_far_inside_the_bound():
    """Not a loose bound test only: on a benign problem the measured error is far below the
    worst case (it would be ~1 if the implementation accumulated in bf16)."""
    W, A, B, s = _norm_problem(7, BF16, BF16)
    worst = _check_norm_terms(doracheck.factored_norm(W, A, B, s, return_terms=True), W, A, B, s, "bf16")
    assert worst < 0.25
    # The bound is not vacuous: it is a small fraction of the fp32 ulp scale times K.
    ref = norm_terms_ref(W, A, B, s)
    b = _norm_error_bounds(W, A, B, s, ref)
    benign = torch.ones(W.shape[0], dtype=torch.bool)
    benign[1] = benign[2] = False
    assert float((b["norm_sq"][benign] / ref.norm[benign] ** 2).max()) < 1e-4


# =========================================================================== memory


def test_tracker_sees_a_dense_temporary():
    rep = peak_tensor_bytes(lambda: torch.zeros(1024, 2048).sum())
    assert rep.peak_bytes >= 8 * MiB
    assert rep.largest_allocation == 8 * MiB
    assert rep.final_bytes < 1024  # the temporary died; only the scalar result lives


def test_tracker_notices_frees_views_and_inplace():
    def alloc_free_loop():
        total = torch.zeros(())
        for _ in range(4):
            t = torch.empty(1024, 2048)
            t.fill_(1.0)  # in place: no new storage
            total = total + t[:1, :1].sum()  # a view: same storage, counted once
            del t
        return total

    rep = peak_tensor_bytes(alloc_free_loop)
    assert 8 * MiB <= rep.peak_bytes < 9 * MiB  # one buffer at a time, not four
    assert rep.largest_allocation == 8 * MiB

    def view_keeps_alive():
        t = torch.ones(1024, 2048)
        v = t[:1]  # keeps the whole storage alive after t is gone
        del t
        u = torch.ones(1024, 2048)
        return v, u.sum()

    rep = peak_tensor_bytes(view_keeps_alive)
    assert rep.peak_bytes >= 16 * MiB
    assert rep.final_bytes >= 8 * MiB  # the view's storage is still live at the end


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("w_dtype, a_dtype", [(F32, F32), (BF16, BF16), (BF16, F32)], ids=str)
def test_factored_norm_peak_memory_is_within_bound(w_dtype, a_dtype, fan_in_fan_out):
    d_out, d_in, r, chunk = 1024, 2048, 8, 64
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(d_out, d_in, generator=gen).to(w_dtype)
    if fan_in_fan_out:
        W = W.t().contiguous()
    A = torch.randn(r, d_in, generator=gen).to(a_dtype)
    B = torch.randn(d_out, r, generator=gen).to(a_dtype)
    bound = norm_memory_bound(d_out, d_in, r, chunk)
    dense = 4 * d_out * d_in  # one fp32 d_out × d_in temporary: 8 MiB
    assert dense == 8 * MiB
    assert bound <= dense / 8, f"the stated bound ({bound} B) is not far below a dense temporary ({dense} B)"
    # Measured here (torch 2.13 CPU): 303 360 B for fp32 inputs (W chunks are views), 567 552 B
    # for bf16 (upcast chunks), against a bound of 608 512 B and a dense 8 MiB.
    rep = peak_tensor_bytes(factored_norm_torch, W, A, B, 2.0, fan_in_fan_out=fan_in_fan_out, chunk=chunk)
    assert rep.allocations > 0
    assert rep.peak_bytes <= bound, f"measured peak {rep.peak_bytes} B exceeds norm_memory_bound {bound} B"
    assert rep.largest_allocation < dense / 16
    # And it computed the right thing (spot check against the unchunked torch path).
    ref = factored_norm_torch(W, A, B, 2.0, fan_in_fan_out=fan_in_fan_out)
    assert torch.allclose(rep.result.norm, ref.norm, rtol=1e-5, atol=0)


# =========================================================================== dora_linear vs oracle


def _linear_problem(seed, dtype, adapter_dtype=None, *, T=16, d_out=40, d_in=56, r=6, scaling=RSLORA_SCALING):
    adt = adapter_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=gen).to(dtype)
    W = (torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)).to(dtype)
    A = (torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)).to(adt)
    B = (0.1 * torch.randn(d_out, r, generator=gen)).to(adt)
    n = torch.linalg.norm(W.to(F64) + scaling * (B.to(F64) @ A.to(F64)), dim=1)
    m = (n * (1 + 0.1 * torch.randn(d_out, generator=gen, dtype=F64))).to(adt)  # g near 1, as trained
    b = (0.1 * torch.randn(d_out, generator=gen)).to(adt)
    dy = torch.randn(T, d_out, generator=gen).to(dtype)
    return x, W, A, B, m, b, scaling, dy


def _compare_fwd_bwd(x, W, A, B, m, b, s, dy, budget, *, fan_in_fan_out=False, **kw):
    """Run dora_linear and the fp64 oracle on the same inputs; assert y and all grads within budget."""
    Wl = W.t().contiguous() if fan_in_fan_out else W
    mine = [t.clone().requires_grad_(True) for t in (x, Wl, A, B, m, b)]
    ref = [t.detach().to(F64).requires_grad_(True) for t in (x, Wl, A, B, m, b)]
    y = doracheck.dora_linear(*mine[:5], s, mine[5], fan_in_fan_out=fan_in_fan_out, **kw)
    y_ref = dora_forward_ref(*ref[:5], s, ref[5], fan_in_fan_out=fan_in_fan_out, **kw)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    y.backward(dy)
    y_ref.backward(dy.to(F64))
    errors = {"y": rel_l2(y, y_ref)}
    for name, t, tr in zip(("dx", "dW", "dA", "dB", "dm", "db"), mine, ref, strict=True):
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        errors[name] = rel_l2(t.grad, tr.grad)
    bad = {k: v for k, v in errors.items() if not v <= budget}
    assert not bad, f"over budget {budget}: {bad} (all: {errors})"
    return errors


@pytest.mark.parametrize(
    "dtype, adapter_dtype",
    [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)],
    ids=lambda d: str(d).replace("torch.", ""),
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dora_linear_forward_backward(seed, dtype, adapter_dtype):
    x, W, A, B, m, b, s, dy = _linear_problem(seed, dtype, adapter_dtype)
    _compare_fwd_bwd(x, W, A, B, m, b, s, dy, RTOL[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_dora_linear_exact_norm_gradient(dtype):
    x, W, A, B, m, b, s, dy = _linear_problem(5, dtype)
    _compare_fwd_bwd(x, W, A, B, m, b, s, dy, RTOL[dtype], detach_norm=False)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_dora_linear_fan_in_fan_out(dtype):
    x, W, A, B, m, b, s, dy = _linear_problem(6, dtype)
    _compare_fwd_bwd(x, W, A, B, m, b, s, dy, RTOL[dtype], fan_in_fan_out=True)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_dora_linear_dropout_with_shared_mask(dtype):
    x, W, A, B, m, b, s, dy = _linear_problem(7, dtype)
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(70)) > 0.3
    _compare_fwd_bwd(x, W, A, B, m, b, s, dy, RTOL[dtype], dropout_p=0.3, training=True, dropout_mask=mask)


def test_dora_linear_shapes():
    x, W, A, B, m, b, s, dy = _linear_problem(8, F32, T=6)
    x3 = x.reshape(2, 3, -1)
    _compare_fwd_bwd(x3, W, A, B, m, b, s, dy.reshape(2, 3, -1), RTOL_FP32)
    _compare_fwd_bwd(x[:1], W, A, B, m, b, s, dy[:1], RTOL_FP32)  # T = 1 (decode)
    for dtype in (F32, BF16, F16):
        xs, Ws, As, Bs, ms, bs = (t.to(dtype) for t in (x, W, A, B, m, b))
        x0 = torch.empty(0, xs.shape[1], dtype=dtype, requires_grad=True)
        A0 = As.clone().requires_grad_(True)
        m0 = ms.clone().requires_grad_(True)
        y0 = doracheck.dora_linear(x0, Ws, A0, Bs, m0, s, bs)
        assert y0.shape == (0, W.shape[0]) and y0.dtype == dtype
        y0.sum().backward()
        assert x0.grad.shape == x0.shape
        assert torch.equal(A0.grad, torch.zeros_like(As)) and torch.equal(m0.grad, torch.zeros_like(ms))
        assert doracheck.dora_linear(
            torch.empty(2, 0, xs.shape[1], dtype=dtype), Ws, As, Bs, ms, s, bs
        ).shape == (2, 0, W.shape[0])


def _zero_row_problem(dtype, with_bias=True):
    x, W, A, B, m, b, s, dy = _linear_problem(9, dtype, T=5, d_out=12, d_in=10, r=3)
    W = W.clone()
    B = B.clone()
    W[4] = 0
    B[4] = 0  # V_4 = 0: n_4 = 0, g_4 = m_4 / 1e-12
    m = m.clone()
    m[4] = 0.75
    return x, W, A, B, m, (b if with_bias else None), s, dy


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_zero_row_forward_is_bias_not_nan(dtype):
    x, W, A, B, m, b, s, dy = _zero_row_problem(dtype)
    y = doracheck.dora_linear(x, W, A, B, m, s, b)
    assert not bool(torch.isnan(y).any())
    assert torch.equal(y[:, 4], b[4].to(dtype).expand(x.shape[0]))
    y_nobias = doracheck.dora_linear(x, W, A, B, m, s)
    assert torch.equal(y_nobias[:, 4], torch.zeros(x.shape[0], dtype=dtype))
    assert doracheck.factored_norm(W, A, B, s)[4].item() == 0.0
    # The other rows are unaffected and right.
    y_ref = dora_forward_ref(x, W, A, B, m, s, b)
    assert rel_l2(y, y_ref) <= RTOL[dtype]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_zero_row_backward_is_finite(dtype):
    """dx, dA, dm and db have finite, representable exact values (the zero row of W and B
    contributes 0·g to them); they must not turn into NaN. (dW_4 and dB_4 are ~g_4 = 7.5e11,
    which overflows fp16 to inf legitimately, so they are not checked here.)"""
    x, W, A, B, m, b, s, dy = _zero_row_problem(dtype)
    mine = [t.clone().requires_grad_(True) for t in (x, W, A, B, m, b)]
    ref = [t.detach().to(F64).requires_grad_(True) for t in (x, W, A, B, m, b)]
    doracheck.dora_linear(*mine[:5], s, mine[5]).backward(dy)
    dora_forward_ref(*ref[:5], s, ref[5]).backward(dy.to(F64))
    for name, i in (("dx", 0), ("dA", 2), ("dm", 4), ("db", 5)):
        assert torch.isfinite(ref[i].grad).all()
        g = mine[i].grad
        assert bool(torch.isfinite(g).all()), f"{dtype}: {name} has non-finite entries: {g}"
        assert rel_l2(g, ref[i].grad) <= RTOL[dtype], (name, rel_l2(g, ref[i].grad))


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_nan_in_x_propagates(dtype):
    x, W, A, B, m, b, s, dy = _linear_problem(10, dtype, T=4)
    x = x.clone()
    x[2, 3] = float("nan")
    y = doracheck.dora_linear(x, W, A, B, m, s, b)
    assert bool(torch.isnan(y[2]).all())
    assert bool(torch.isfinite(y[[0, 1, 3]]).all())
    x[1, 0] = float("inf")
    y = doracheck.dora_linear(x, W, A, B, m, s, b)
    assert not bool(torch.isfinite(y[1]).any())  # inf·w terms: ±inf or NaN, never finite


# =========================================================================== argument errors


def _small_args():
    T, d_out, d_in, r = 3, 4, 6, 2
    gen = torch.Generator().manual_seed(11)
    return dict(
        x=torch.randn(T, d_in, generator=gen),
        weight=torch.randn(d_out, d_in, generator=gen),
        lora_A=torch.randn(r, d_in, generator=gen),
        lora_B=torch.randn(d_out, r, generator=gen),
        magnitude=torch.rand(d_out, generator=gen) + 0.5,
        scaling=2.0,
        bias=torch.randn(d_out, generator=gen),
    )


def _call(**overrides):
    kw = _small_args()
    extra = {k: overrides.pop(k) for k in ("dropout_p", "training", "fan_in_fan_out") if k in overrides}
    kw.update(overrides)
    return doracheck.dora_linear(**kw, **extra)


# Shapes and types only: the values do not matter (ones, so nothing draws from the RNG at import).
BAD_ARGUMENTS = [
    ({"lora_A": torch.ones(2, 7)}, r"lora_A: expected shape \(2, 6\), got \(2, 7\)"),
    ({"lora_A": torch.ones(6)}, r"lora_A: expected a 2-D tensor .*d_in=6.*got shape \(6,\)"),
    ({"lora_B": torch.ones(4, 3)}, r"lora_B: expected shape \(4, 2\), got \(4, 3\)"),
    ({"lora_B": torch.ones(2, 4)}, r"lora_B: expected shape \(4, 2\), got \(2, 4\)"),
    ({"magnitude": torch.ones(5)}, r"magnitude: expected shape \(4,\), got \(5,\)"),
    ({"magnitude": torch.ones(4, 1)}, r"magnitude: expected shape \(4,\), got \(4, 1\)"),
    ({"bias": torch.ones(3)}, r"bias: expected shape \(4,\), got \(3,\)"),
    ({"x": torch.ones(3, 5)}, r"x: expected shape \(\.\.\., 6\).*got \(3, 5\)"),
    ({"x": torch.ones(2, 3, 7)}, r"x: expected shape \(\.\.\., 6\).*got \(2, 3, 7\)"),
    ({"x": torch.ones(3, 6, dtype=torch.int64)}, r"x: expected a floating dtype.*got torch\.int64"),
    ({"weight": torch.ones(4, 6, dtype=torch.int32)}, r"weight: expected a floating dtype.*got torch\.int32"),
    (
        {"magnitude": torch.ones(4, dtype=torch.int64)},
        r"magnitude: expected a floating dtype.*got torch\.int64",
    ),
    ({"lora_B": torch.ones(4, 2, dtype=torch.bool)}, r"lora_B: expected a floating dtype.*got torch\.bool"),
    ({"scaling": "2.0"}, r"scaling: expected a real number.*got str"),
    ({"scaling": None}, r"scaling: expected a real number.*got NoneType"),
    ({"scaling": True}, r"scaling: expected a real number.*got bool"),
    ({"scaling": float("nan")}, r"scaling: expected a finite number, got nan"),
    ({"scaling": float("inf")}, r"scaling: expected a finite number, got inf"),
    ({"scaling": -float("inf")}, r"scaling: expected a finite number, got -inf"),
    # an int past fp64's range: the fast path's bound check must send it to the full check
    ({"scaling": 10**400}, r"scaling: expected a finite number, got a value beyond float64's range"),
    ({"scaling": torch.tensor([1.0, 2.0])}, r"scaling: expected a real number.*got Tensor"),
    ({"dropout_p": 1.0}, r"dropout_p: expected 0 <= p < 1, got 1\.0"),
    ({"dropout_p": -0.1}, r"dropout_p: expected 0 <= p < 1, got -0\.1"),
    ({"dropout_p": 1.5, "training": True}, r"dropout_p: expected 0 <= p < 1, got 1\.5"),
    ({"weight": torch.ones(4, 6), "fan_in_fan_out": True}, r"lora_A: expected shape \(2, 4\), got \(2, 6\)"),
]


@pytest.mark.parametrize(
    "overrides, pattern",
    BAD_ARGUMENTS,
    ids=[f"{i}-" + "-".join(o) for i, (o, _) in enumerate(BAD_ARGUMENTS)],
)
def test_bad_arguments_raise_value_error(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        _call(**overrides)


@pytest.mark.parametrize("name", ["magnitude", "bias", "lora_A", "lora_B"])
def test_device_mismatch_raises(name):
    kw = _small_args()
    kw[name] = kw[name].to("meta")
    with pytest.raises(ValueError, match=rf"{name}: expected device cpu.*got meta") as info:
        doracheck.dora_linear(**kw)
    assert "device" in str(info.value)


def test_factored_norm_bad_arguments():
    kw = _small_args()
    W, A, B = kw["weight"], kw["lora_A"], kw["lora_B"]
    with pytest.raises(ValueError, match=r"lora_B: expected shape \(4, 2\), got \(4, 3\)"):
        doracheck.factored_norm(W, A, torch.randn(4, 3), 2.0)
    with pytest.raises(ValueError, match=r"lora_A: expected shape \(2, 6\), got \(2, 5\)"):
        doracheck.factored_norm(W, torch.randn(2, 5), B, 2.0)
    with pytest.raises(ValueError, match=r"scaling: expected a real number.*got str"):
        doracheck.factored_norm(W, A, B, "2")
    with pytest.raises(ValueError, match=r"weight: expected a 2-D tensor.*got shape \(24,\)"):
        doracheck.factored_norm(W.reshape(-1), A, B, 2.0)


# =========================================================================== DoRALinear


def _wrapped(seed=0, d_in=48, d_out=24, bias=True):
    torch.manual_seed(seed)  # nn.Linear and the adapter init draw from the global RNG
    lin = torch.nn.Linear(d_in, d_out, bias=bias)
    layer = doracheck.DoRALinear.from_linear(lin, r=4, lora_alpha=8)
    return lin, layer


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_equals_linear_at_init(bias):
    lin, layer = _wrapped(bias=bias)
    assert layer.scaling == 2.0 and layer.r == 4
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert not layer.weight.requires_grad
    assert torch.equal(layer.lora_B, torch.zeros_like(layer.lora_B))
    assert float(layer.lora_A.detach().abs().max()) > 0
    W = lin.weight.detach().to(F64)
    # magnitude = fp32 row norms of W: fp32 accumulation over d_in, gamma_{d_in + 1}.
    row_norms = torch.linalg.norm(W, dim=1)
    assert bool(
        ((layer.magnitude.detach().to(F64) - row_norms).abs() <= gamma(W.shape[1] + 1) * row_norms).all()
    )
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    y, y_lin = layer(x).detach(), lin(x).detach()
    # g = m / n = 1 exactly (same fp32 norm twice), so y = x·Wᵀ + b up to fp32 GEMM rounding:
    # |Δ| <= 2·gamma_{d_in + 2}·(|x||W|ᵀ + |b|) (two fp32 evaluations, each within one gamma).
    scale = x.abs().to(F64) @ W.abs().t() + (lin.bias.detach().abs().to(F64) if bias else 0)
    assert bool(((y.to(F64) - y_lin.to(F64)).abs() <= 2 * gamma(W.shape[1] + 2) * scale).all())


def test_merge_unmerge_round_trip():
    lin, layer = _wrapped(seed=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.lora_B.copy_(0.1 * torch.randn(layer.lora_B.shape, generator=gen))
        layer.magnitude.mul_(1 + 0.1 * torch.randn(layer.magnitude.shape, generator=gen))
    layer.eval()
    W0 = layer.weight.detach().clone()
    x = torch.randn(7, 48, generator=gen)
    y_unmerged = layer(x).detach()
    y_ref = dora_forward_ref(x, W0, layer.lora_A, layer.lora_B, layer.magnitude, layer.scaling, layer.bias)
    assert rel_l2(y_unmerged, y_ref) <= RTOL_FP32
    layer.merge()
    assert layer.merged
    assert layer.weight.data_ptr() == lin.weight.data_ptr()  # merged in place into the shared weight
    y_merged = layer(x).detach()
    assert rel_l2(y_merged, y_unmerged) <= 1e-5
    assert rel_l2(y_merged, y_ref) <= 1e-5
    with pytest.raises(RuntimeError):
        layer.merge()
    layer.unmerge()
    assert not layer.merged
    assert rel_l2(layer.weight, W0) <= 1e-6
    assert rel_l2(layer(x).detach(), y_unmerged) <= 1e-5
    with pytest.raises(RuntimeError):
        layer.unmerge()
