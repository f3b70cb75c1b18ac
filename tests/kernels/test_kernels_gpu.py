"""The Triton path on a CUDA GPU at real shapes (marked ``gpu``; skipped without CUDA).

Judged by the fp64 oracle (computed on the GPU in float64) within the budgets of this GPU's
family; plus determinism, edge inputs, the norm cache and torch.compile.
"""

from __future__ import annotations

import pytest
import torch

import doracheck
from doracheck.kernels.settings import HAS_MM_DTYPE
from doracheck.norm_rule import clear_norm_cache, norm_cache_stats
from doracheck.properties import budget_for, device_family
from doracheck.properties.props import a_priori_bound, conditioning
from doracheck.reference import dora_forward_ref, gamma, norm_terms_ref, output_conditions, rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from kernel_cases import check_against_oracle, inference_is_training_forward, make_case, run_case  # noqa: E402

DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32)]
SHAPES = [(4096, 4096, 16, 512), (1000, 3000, 100, (3, 77)), (4099, 1031, 384, 257), (64, 8192, 1024, 1), (1031, 4099, 384, 16)]
# The compose's 16-row tile (T <= 16) at odd sizes: d_out below and across one 64-column tile,
# r of 1 and across a 16-wide step, T not a power of two.
SMALL_T_SHAPES = [(17, 33, 1, 2), (65, 129, 17, 3), (17, 4099, 8, 7), (65, 1031, 17, 15)]


def ids(v):
    return str(v).replace("torch.", "")


@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES + SMALL_T_SHAPES, ids=str)
def test_forward_backward_within_budget(shape, dtype, adapter_dtype):
    d_out, d_in, r, t = shape
    case = make_case(d_out, d_in, r, t, dtype, adapter_dtype=adapter_dtype, seed=r, device="cuda")
    check_against_oracle(case, dtype)


# The persistent TMA compose (kernels/compose_triton.py) at rows and columns that end mid-tile:
# T 2055 = 16 × 128 + 7, d_out 4104 = 16 × 256 + 8 (289 tiles, so it is taken on Hopper).
TMA_SHAPE = (4104, 1000, 384, 2055)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=ids)
def test_forward_backward_within_budget_through_the_tma_compose(dtype, monkeypatch):
    """Without a bias the training forward composes in place through the TMA kernel (no z kept)."""
    from doracheck.kernels import compose_triton

    d_out, d_in, r, t = TMA_SHAPE
    case = make_case(d_out, d_in, r, t, dtype, seed=r, device="cuda", with_bias=False)
    launched = []
    tma = compose_triton._compose_tma
    monkeypatch.setattr(compose_triton, "_compose_tma", lambda *a: launched.append(1) or tma(*a))
    check_against_oracle(case, dtype)
    assert bool(launched) == compose_triton.tma_compose_available(0)  # Hopper: the training forward took it


def _tma_compose_here() -> bool:
    from doracheck.kernels import compose_triton

    return torch.cuda.is_available() and compose_triton.tma_compose_available(0)


@pytest.mark.skipif(not _tma_compose_here(), reason="the TMA compose is taken on Hopper (compute capability 9.x) only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=ids)
@pytest.mark.parametrize("T,d_out", [(2055, 4104), (4096, 8192)], ids=str)
@pytest.mark.parametrize("bias,base_has_bias,g_from_m,in_place", [
    (False, False, False, True), (True, False, False, False), (True, True, True, True), (False, False, True, False),
], ids=str)
def test_tma_compose_is_the_pointer_kernel_bitwise(T, d_out, dtype, bias, base_has_bias, g_from_m, in_place, monkeypatch):
    """The persistent TMA compose gives the pointer kernel's y bitwise at real shapes (the GEMM's
    summation order is the same: 64-wide K steps; the epilogue the same fp32 expression, fused the
    same way: s = 0.3 makes s·acc inexact, so a different fusion of base + s·acc would show), in
    place or not, with g formed in the kernel, at r = 384 and at r = 200 (not a multiple of 64)."""
    from doracheck.kernels import compose_triton

    gen = torch.Generator(device="cuda").manual_seed(T)
    r = 384 if T == 4096 else 200
    base = torch.randn(T, d_out, device="cuda", generator=gen).to(dtype)
    xa = torch.randn(T, r, device="cuda", generator=gen).to(dtype)
    B = (0.05 * torch.randn(d_out, r, device="cuda", generator=gen)).to(dtype)
    m = torch.rand(d_out, device="cuda", generator=gen) + 0.5
    n_safe = torch.rand(d_out, device="cuda", generator=gen) + 0.5
    b = torch.randn(d_out, device="cuda", generator=gen).to(dtype) if bias else None
    g = m if g_from_m else torch.div(m, n_safe)
    launched = []
    tma = compose_triton._compose_tma
    monkeypatch.setattr(compose_triton, "_compose_tma", lambda *a: launched.append(1) or tma(*a))

    def run():
        b2 = base.clone()
        return compose_triton.lora_up_compose_triton(b2, xa, B, g, 0.3, b, out=b2 if in_place else None,
                                                     base_has_bias=base_has_bias, n_safe=n_safe if g_from_m else None)

    got = [run() for _ in range(3)]
    assert launched == [1, 1, 1]
    monkeypatch.setattr(compose_triton, "_tma_config", lambda *a: None)
    want = run()
    assert launched == [1, 1, 1] and all(torch.equal(y, want) for y in got)


@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=ids)
def test_token_chunked_backward_within_budget(dtype, adapter_dtype):
    """T·d_out large enough for the backward to run over token chunks (dz·B, dB and the LoRA
    half of dx then come from dy and g over all tokens; dB from an fp32 cuBLAS output)."""
    from doracheck.kernels.settings import backward_token_chunk

    d_out, d_in, r, t = 4096, 2048, 64, 4608
    assert backward_token_chunk(t, d_out, dtype.itemsize) < t
    case = make_case(d_out, d_in, r, t, dtype, adapter_dtype=adapter_dtype, seed=5, device="cuda")
    check_against_oracle(case, dtype)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=ids)
def test_inference_forward_is_bitwise_the_training_forward(monkeypatch, dtype, adapter_dtype, with_bias):
    case = make_case(4099, 1031, 96, 67, dtype, adapter_dtype=adapter_dtype, seed=8, device="cuda", with_bias=with_bias)
    inference_is_training_forward(case, monkeypatch)


@pytest.mark.parametrize("shape", SMALL_T_SHAPES, ids=str)
@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=ids)
def test_small_t_inference_forward_is_bitwise_the_training_forward(monkeypatch, dtype, adapter_dtype, shape):
    d_out, d_in, r, t = shape
    case = make_case(d_out, d_in, r, t, dtype, adapter_dtype=adapter_dtype, seed=d_out + r, device="cuda", with_bias=True)
    inference_is_training_forward(case, monkeypatch)


@pytest.mark.parametrize("r", [200, 384], ids=["r200", "r384_three_subtiles"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=ids)
def test_factored_norm_within_budget(dtype, adapter_dtype, fan_in_fan_out, r):
    gen = torch.Generator().manual_seed(1)
    d_out, d_in = 2051, 4093
    W = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to("cuda", dtype)
    A = (torch.randn(r, d_in, generator=gen) / d_in**0.5).to("cuda", adapter_dtype)
    B = (torch.randn(d_out, r, generator=gen) / r**0.5).to("cuda", adapter_dtype)
    stored = W.t().contiguous() if fan_in_fan_out else W
    n = doracheck.factored_norm(stored, A, B, 2.0, fan_in_fan_out=fan_in_fan_out)
    ref = norm_terms_ref(W, A, B, 2.0).norm
    budget = budget_for("norm", "norm", {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], device_family("cuda")).rel_l2
    assert rel_l2(n, ref) <= budget


def test_kernels_bitwise_deterministic():
    """Our kernels: norm (all three paths: fp32 W through the row-dot kernel, bf16 adapters on
    bf16 W through cuBLAS's U = W·Aᵀ and the reduction, fp32 adapters on bf16 W through cuBLAS
    on A's two pieces), compose, dz/dm are bitwise reproducible."""
    from doracheck.kernels import compose_triton, norm_triton

    gen = torch.Generator().manual_seed(4)
    W = torch.randn(4099, 4096, generator=gen).to("cuda", torch.bfloat16)
    A = (torch.randn(384, 4096, generator=gen) / 64).to("cuda")
    B = (torch.randn(4099, 384, generator=gen) / 20).to("cuda")
    n1 = norm_triton.factored_norm_triton(W, A, B, 2.0)
    n2 = norm_triton.factored_norm_triton(W, A, B, 2.0)
    for a, b in zip((n1.base, n1.cross, n1.lora, n1.norm), (n2.base, n2.cross, n2.lora, n2.norm)):
        assert torch.equal(a, b)
    A16, B16, W32 = A.bfloat16(), B.bfloat16(), W.float()
    for args in ((W, A16, B16), (W32, A, B)):
        u1 = norm_triton.factored_norm_triton(*args, 2.0)
        u2 = norm_triton.factored_norm_triton(*args, 2.0)
        for a, b in zip((u1.base, u1.cross, u1.lora, u1.norm), (u2.base, u2.cross, u2.lora, u2.norm)):
            assert torch.equal(a, b)
    base = torch.randn(2048, 4099, generator=gen).to("cuda", torch.bfloat16)
    xa = torch.randn(2048, 384, generator=gen).to("cuda", torch.bfloat16)
    g = n1.norm / n1.norm.mean()
    y1 = compose_triton.lora_up_compose_triton(base, xa, B, g, 2.0)
    y2 = compose_triton.lora_up_compose_triton(base, xa, B, g, 2.0)
    assert torch.equal(y1, y2)
    dz1, s1 = compose_triton.grad_scale_dm_triton(base, y1, g, n1.norm, None, from_output=True)
    dz2, s2 = compose_triton.grad_scale_dm_triton(base, y1, g, n1.norm, None, from_output=True)
    assert torch.equal(dz1, dz2) and torch.equal(s1, s2)


def test_bitwise_deterministic():
    """Whole layer, forward and backward (cuBLAS GEMMs included, with CUBLAS_WORKSPACE_CONFIG set):
    the torch path (cuBLAS alone) is bitwise repeatable, and so must the norm's kernels be (a
    128-wide cross-term tile was not)."""
    torch.use_deterministic_algorithms(True)
    case = make_case(4096, 4096, 128, 1024, torch.bfloat16, seed=3, device="cuda")
    dy = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    y1, g1 = run_case(case, dy)
    clear_norm_cache()
    y2, g2 = run_case(case, dy)
    torch.use_deterministic_algorithms(False)
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_edge_inputs():
    case = make_case(512, 768, 16, (4, 33), torch.bfloat16, seed=5, device="cuda")
    W = case.weight.clone()
    B = case.lora_B.clone()
    W[7] = 0
    B[7] = 0
    x = case.x.clone()
    x[1, 2, 5] = float("nan")
    y = doracheck.dora_linear(x, W, case.lora_A, B, case.magnitude, case.scaling)
    finite_rows = ~torch.isnan(x).any(-1)
    assert torch.all(y[..., 7][finite_rows] == 0)
    assert torch.isnan(y[1, 2]).all() and not torch.isnan(y[finite_rows]).any()
    assert doracheck.dora_linear(x[:, :0], W, case.lora_A, B, case.magnitude, case.scaling).shape == (4, 0, 512)
    one = doracheck.dora_linear(case.x[0, :1], W, case.lora_A, B, case.magnitude, case.scaling)
    ref = doracheck.dora_linear(case.x[0, :2], W, case.lora_A, B, case.magnitude, case.scaling)[:1]
    assert rel_l2(one, ref) < 1e-2
    nc = case.x.transpose(0, 1)
    assert torch.equal(
        doracheck.dora_linear(nc, W, case.lora_A, B, case.magnitude, case.scaling),
        doracheck.dora_linear(nc.contiguous(), W, case.lora_A, B, case.magnitude, case.scaling),
    )


def test_norm_cache_hits_and_never_goes_stale():
    case = make_case(1024, 2048, 32, 64, torch.bfloat16, seed=9, device="cuda")
    W, A, B = case.weight.clone(), case.lora_A.clone(), case.lora_B.clone()
    x, m = case.x, case.magnitude.clone()

    def y_now():
        return doracheck.dora_linear(x, W, A, B, m, case.scaling)

    def y_fresh():
        clear_norm_cache()
        return doracheck.dora_linear(x, W, A, B, m, case.scaling)

    clear_norm_cache()
    y_now()
    before = norm_cache_stats()["hits"]
    y_now()
    assert norm_cache_stats()["hits"] == before + 1
    for tensor in (A, B, W, m):
        with torch.no_grad():
            tensor.mul_(1.25)
        served = y_now()
        # A stale norm or g would be off by several percent; run-to-run GEMM noise is far below 1e-3.
        assert rel_l2(served, y_fresh()) < 1e-3, "the cache served a norm computed before an in-place update"


@pytest.mark.parametrize("with_bias", [True, False])
def test_torch_compile_fullgraph_within_the_oracle_budget(with_bias):
    """fullgraph=True (no graph break) training and inference, each held to the same a-priori
    budgets against the fp64 oracle as eager. Without a bias the compose kernel's functional op
    is traced with every unused pointer a buffer of its own (none passed twice)."""
    case = make_case(1024, 768, 64, (2, 128), torch.bfloat16, seed=2, device="cuda", with_bias=with_bias)
    compiled = torch.compile(doracheck.dora_linear, fullgraph=True)
    check_against_oracle(case, torch.bfloat16, impl=compiled)
    with torch.no_grad():
        args = (case.x, case.weight, case.lora_A, case.lora_B, case.magnitude, case.scaling, case.bias)
        y_infer, y_eager = compiled(*args), doracheck.dora_linear(*args)
    y_ref = dora_forward_ref(*(t.double() if isinstance(t, torch.Tensor) else t for t in args))
    family = device_family(case.x.device)
    rho = output_conditions(case.x, case.weight, case.lora_A, case.lora_B, case.magnitude, case.scaling, case.bias,
                            torch.ones_like(y_eager))["y"]
    budget = a_priori_bound(budget_for("forward", "y", "bf16", family), rho, conditioning(case))
    assert rel_l2(y_infer, y_ref) <= budget and rel_l2(y_eager, y_ref) <= budget


def test_training_peak_memory_near_linear():
    """fwd+bwd peak above resident <= 1.25 x nn.Linear's + 32 MiB (8192², r 384, T 4096, bf16)."""
    d, r, T = 8192, 384, 4096
    layer = doracheck.DoRALinear(d, d, r, 2 * r, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.02)
    lin = torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)

    def peak(fn):
        fn()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        result = torch.cuda.max_memory_allocated() - start
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        return result / 2**20

    linear_mib = peak(lambda: lin(x).backward(dy))
    dora_mib = peak(lambda: layer(x).backward(dy))
    assert dora_mib <= 1.25 * linear_mib + 32, (dora_mib, linear_mib)


def test_timed_planning_on_the_gpu_measures_once_and_stays_within_budget():
    """set_mode("timed") on the GPU: the first training call of a shape measures its candidates
    (from inside the forward: the measurement runs its own forward + backward), later calls reuse
    the choice, and forward and gradients stay within the oracle budgets."""
    from doracheck import planner

    case = make_case(2048, 1024, 16, (3, 700), torch.bfloat16, seed=21, device="cuda")
    planner.set_mode("timed")
    try:
        before = len(planner._TIMED)
        check_against_oracle(case, torch.bfloat16)
        measured = len(planner._TIMED)
        check_against_oracle(case, torch.bfloat16)
        assert measured == before + 1 and len(planner._TIMED) == measured
    finally:
        planner.set_mode("cost")


def test_our_gemms_reduce_in_fp32_and_the_callers_setting_is_restored():
    """docs/design.md section 2: cuBLAS may reduce split-K partials in 16 bits while torch's
    allow_fp16/bf16_reduced_precision_reduction are True (their default); every GEMM doracheck
    issues runs with them off, and the caller's setting is back afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmul = torch.backends.cuda.matmul
    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out}
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in gemms:
                seen.append((matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction))
            return func(*args, **(kwargs or {}))

    case = make_case(64, 8192, 32, 1, torch.float16, seed=3, device="cuda")
    before = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = True
    try:
        with Spy():
            y, _ = run_case(case, torch.randn(1, 64, device="cuda", dtype=torch.float16))
        assert seen and all(flags == (False, False) for flags in seen), seen
        assert (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction) == (True, True)
    finally:
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize("r", [8, 16, 24, 32, 48, 64, 100, 128, 192, 384, 1024])
def test_norm_cross_term_at_every_rank_is_right_and_repeatable(r):
    """The row-dot kernel with 128- and 256-wide tiles got the cross term 3-53% wrong, and
    differently on each call, for every r > 64 on the H200 (triton 3.6), and with 32-wide tiles
    0.4-1.3% wrong at r = 32; y hid it under bf16 budgets because s·cross is small next to
    ||W||². Judged here term by term, fp32-level."""
    case = make_case(2048, 4096, r, 4, torch.bfloat16, seed=r, device="cuda")
    W, A, B, s = case.weight, case.lora_A, case.lora_B, case.scaling
    ref = norm_terms_ref(W, A, B, s)
    first = doracheck.factored_norm(W, A, B, s, return_terms=True)
    again = doracheck.factored_norm(W, A, B, s, return_terms=True)
    for name in ("base", "cross", "lora", "norm"):
        got, exact = getattr(first, name), getattr(ref, name)
        assert rel_l2(got, exact) <= gamma(4096), f"{name}: {rel_l2(got, exact):.3e}"  # a priori: fp32 sums over K = d_in
        assert torch.equal(got, getattr(again, name)), f"{name} not bitwise repeatable"


@pytest.mark.skipif(not HAS_MM_DTYPE, reason="this torch has no fp32-output GEMM (aten::mm.dtype): the row-dot path runs")
@pytest.mark.parametrize(
    "dtype,adapter_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
     (torch.float16, torch.bfloat16)],
    ids=["bf16_adapters", "fp32_adapters_in_two_pieces", "fp16_W_fp32_adapters_in_two_pieces", "fp16_W_bf16_adapters_in_two_pieces"],
)
def test_cublas_norm_path_is_right_repeatable_and_within_its_memory_bound(dtype, adapter_dtype):
    """The cuBLAS path of the norm (U = W·Aᵀ, then one reduction) on 16-bit W: with adapters of
    W's dtype, and with adapters of another dtype (fp32, PEFT's default, or the other 16-bit
    one) split into two pieces of W's dtype, U of 2r columns. Terms against fp64 (a priori:
    fp32 sums over d_in; two pieces keep at least 16 significant bits of A, so 2^-16 there),
    bitwise repeatable, and one eager call's scratch within what
    ``settings.triton_norm_memory_bound`` declares (``split_adapters`` for the pieces)."""
    from doracheck.kernels import norm_triton
    from doracheck.kernels.settings import cublas_cross_pieces, triton_norm_memory_bound

    d_out, d_in, r = 8192, 4096, 384
    case = make_case(d_out, d_in, r, 4, dtype, adapter_dtype=adapter_dtype, seed=r, device="cuda")
    W, A, B, s = case.weight, case.lora_A, case.lora_B, case.scaling
    split = adapter_dtype != W.dtype
    assert cublas_cross_pieces(W.dtype, A.dtype) == (2 if split else 1)
    first = norm_triton.norm_terms(W, A, B, s, False)  # also compiles and sets up cuBLAS's workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    again = norm_triton.norm_terms(W, A, B, s, False)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - before
    bound = triton_norm_memory_bound(d_out, d_in, r, B.dtype, split_adapters=split)
    assert scratch <= bound, f"scratch {scratch / 2**20:.1f} MiB > declared {bound / 2**20:.1f} MiB"
    assert torch.equal(first, again), "not bitwise repeatable"
    ref = norm_terms_ref(W, A, B, s)
    tol = 2.0**-16 if split else gamma(d_in)
    for row, name in enumerate(("base", "cross", "lora", "norm")):
        err = rel_l2(first[row], getattr(ref, name))
        assert err <= tol, f"{name}: {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("variant", ["factored", "factored+whole", "factored+recompute_xa", "merged", "merged+whole+recompute_xa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_planner_variant_forced_on_the_gpu(variant, dtype, monkeypatch):
    """Each computation order the planner may pick (merged too in bf16, which it never picks
    there but which must still be correct), forced, on the Triton path, against the fp64 oracle
    within the a-priori budgets; a small backward chunk makes the chunked variants chunk."""
    from doracheck.kernels import settings
    from doracheck.planner import use_variant

    monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", 1024 * 2 * 64)
    case = make_case(1024, 768, 64, (3, 100), dtype, seed=17, device="cuda")
    with use_variant(variant):
        check_against_oracle(case, dtype)


@pytest.mark.parametrize("with_bias", [True, False])
def test_inference_is_capturable_in_a_cuda_graph_and_replays_the_parameters_of_the_moment(with_bias):
    """The no-grad forward (the decode path) captured in a CUDA graph: no host sync, nothing read
    from Python-side state inside it. Replays are bitwise the eager forward on new inputs, and
    after an in-place update of the adapter (the norm is recomputed inside the graph, not taken
    from the norm cache at capture time)."""
    case = make_case(512, 384, 16, 8, torch.bfloat16, seed=4, device="cuda", with_bias=with_bias)
    W, A, B, m, s, b = case.weight, case.lora_A, case.lora_B, case.magnitude, case.scaling, case.bias
    static_x = case.x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):  # warm-up outside the capture (kernel compilation, cuBLAS handles)
            doracheck.dora_linear(static_x, W, A, B, m, s, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = doracheck.dora_linear(static_x, W, A, B, m, s, b)
    for seed in (1, 2):
        static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator().manual_seed(seed)).to(static_x))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert torch.equal(static_y, doracheck.dora_linear(static_x, W, A, B, m, s, b))
    with torch.no_grad():
        B.mul_(1.5)  # an update the graph must see: its norm is computed inside it
    graph.replay()
    clear_norm_cache()
    with torch.no_grad():
        assert torch.equal(static_y, doracheck.dora_linear(static_x, W, A, B, m, s, b))
