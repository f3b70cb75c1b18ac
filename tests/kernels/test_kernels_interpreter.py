"""Every Triton kernel, run on the CPU under TRITON_INTERPRET=1 at small odd shapes.

The Triton path is forced (``use_path("triton")``) so the kernels run in CI without a GPU;
results are judged by the fp64 oracle within the interpreter family's budgets, and the
kernel-level outputs against exact references (bitwise where the math allows it).
"""

from __future__ import annotations

import os

import pytest
import torch

import doracheck
from doracheck.dispatch import use_path
from doracheck.reference import norm_terms_ref, rel_l2

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests run on CPU-only machines (the GPU runs the gpu-marked tests)",
)
triton = pytest.importorskip("triton")

from kernel_cases import check_against_oracle, inference_is_training_forward, make_case  # noqa: E402

from doracheck.kernels import compose_triton, norm_triton  # noqa: E402

SHAPES = [(7, 13, 3, 5), (33, 17, 5, (2, 3)), (20, 37, 16, 1)]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]


@pytest.fixture(autouse=True)
def _triton_path():
    with use_path("triton"):
        yield


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dora_linear_triton_path_matches_oracle(shape, dtype, adapter_dtype):
    d_out, d_in, r, t = shape
    case = make_case(d_out, d_in, r, t, dtype, adapter_dtype=adapter_dtype, seed=d_out)
    check_against_oracle(case, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("dtype,adapter_dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("r", [19, 40], ids=["r19", "r40_three_subtiles"])
def test_factored_norm_kernel_terms(monkeypatch, dtype, adapter_dtype, fan_in_fan_out, r):
    """16-bit W takes the cuBLAS path (U = W·Aᵀ, then ``_norm_from_u_kernel``, several row and
    column tiles at these shapes; fp32 A on bf16 W split into two bf16 pieces, U of 2r columns);
    fp32 W the fused row-dot kernel, which r = 40 runs with three 16-wide sub-tiles per program
    (interpreter blocks)."""
    paths: list[str] = []
    from_u = norm_triton.norm_from_u
    monkeypatch.setattr(norm_triton, "norm_from_u", lambda *a, **k: paths.append("u") or from_u(*a, **k))
    gen = torch.Generator().manual_seed(3)
    d_out, d_in = 37, 45
    W = torch.randn(d_out, d_in, generator=gen).to(dtype)
    A = (torch.randn(r, d_in, generator=gen) * 0.1).to(adapter_dtype)
    B = torch.randn(d_out, r, generator=gen).to(adapter_dtype)
    stored = W.t().contiguous() if fan_in_fan_out else W
    got = norm_triton.factored_norm_triton(stored, A, B, 1.5, fan_in_fan_out=fan_in_fan_out)
    ref = norm_terms_ref(W, A, B, 1.5)
    # Under the interpreter every dot is fp32 (operands upcast): fp32 accumulation error only,
    # except fp32 A against 16-bit W, whose hi+lo split keeps 16 bits of A (budgets.py).
    tol = 1e-6 if not (dtype == torch.bfloat16 and adapter_dtype == torch.float32) else 2.0**-16
    assert paths == (["u"] if dtype != torch.float32 else [])
    for name, a, b in zip(("base", "cross", "lora", "norm"), (got.base, got.cross, got.lora, got.norm), ref):
        assert a.dtype == torch.float32
        assert rel_l2(a, b) <= tol, f"{name}: {rel_l2(a, b):.2e} > {tol:.1e}"


@pytest.mark.interpreter
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32], ids=["one_piece", "two_pieces"])
def test_the_cublas_norm_path_runs_under_forward_mode_ad_and_ignores_the_tangent(adapter_dtype):
    """A dual A (under ``fwAD.dual_level``) gives the norm's terms of its primal, bitwise: the
    norm carries no tangent (its Triton launches never did). The two-piece split's out= subtraction
    has no forward AD in torch and raised before the split ran with forward AD off."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(9)
    W = torch.randn(37, 45, generator=gen).bfloat16()
    A = (torch.randn(19, 45, generator=gen) * 0.1).to(adapter_dtype)
    B = torch.randn(37, 19, generator=gen).to(adapter_dtype)
    want = norm_triton.norm_terms(W, A, B, 2.0, False)
    with fwAD.dual_level():
        dual_A = fwAD.make_dual(A, torch.randn(A.shape, generator=gen).to(adapter_dtype))
        got = norm_triton.norm_terms(W, dual_A, B, 2.0, False)
        assert fwAD.unpack_dual(got).tangent is None
    assert torch.equal(fwAD.unpack_dual(got).primal, want)


@pytest.mark.interpreter
def test_compose_kernel_is_the_stable_compose_rounded_once():
    """The fused kernel equals b + g·(base + s·lora) evaluated in fp32 and rounded once (bitwise)."""
    gen = torch.Generator().manual_seed(5)
    T, d_out, r = 21, 37, 19
    base = torch.randn(T, d_out, generator=gen).bfloat16()
    xa = torch.randn(T, r, generator=gen).bfloat16()
    B = torch.randn(d_out, r, generator=gen).bfloat16()
    g = 1 + 1e-3 * torch.randn(d_out, generator=gen)
    b = torch.randn(d_out, generator=gen).bfloat16()
    y = compose_triton.lora_up_compose_triton(base, xa, B, g, 0.7, b)
    lora32 = xa.float() @ B.float().t()
    expected = (g * (base.float() + 0.7 * lora32) + b.float()).bfloat16()
    assert torch.equal(y, expected)
    inplace = base.clone()
    compose_triton.lora_up_compose_triton(inplace, xa, B, g, 0.7, b, out=inplace)
    assert torch.equal(inplace, expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("bias,base_has_bias,g_from_m,in_place", [
    (False, False, False, False), (True, False, False, True), (True, True, True, False), (False, False, True, True),
])
def test_tma_compose_is_the_pointer_kernel_bitwise(bias, base_has_bias, g_from_m, in_place, monkeypatch):
    """The persistent TMA compose (taken for TMA-addressable 16-bit operands at T > 16) gives the
    pointer kernel's y bitwise: b + g·(base - b·base_has_bias + s·lora) in fp32, rounded once;
    with g formed from m / max(n, eps) in the kernel, in place, and over several tiles per program."""
    gen = torch.Generator().manual_seed(7)
    T, d_out, r = 50, 72, 24  # 4 × 3 tiles of 16 × 32 walked by 3 programs; the last ones ragged
    base = torch.randn(T, d_out, generator=gen).bfloat16()
    xa = torch.randn(T, r, generator=gen).bfloat16()
    B = (0.2 * torch.randn(d_out, r, generator=gen)).bfloat16()
    m = torch.rand(d_out, generator=gen) + 0.5
    n_safe = torch.rand(d_out, generator=gen) + 0.5
    b = torch.randn(d_out, generator=gen).bfloat16() if bias else None
    g = m if g_from_m else torch.div(m, n_safe)
    assert compose_triton._tma_config(base, base, xa, B, T, d_out, r) is not None
    launched = []
    tma = compose_triton._compose_tma
    monkeypatch.setattr(compose_triton, "_compose_tma", lambda *a: launched.append(1) or tma(*a))

    def run(b2):
        return compose_triton.lora_up_compose_triton(b2, xa, B, g, 1.5, b, out=b2 if in_place else None,
                                                     base_has_bias=base_has_bias, n_safe=n_safe if g_from_m else None)

    y = run(base.clone())
    assert launched == [1]
    monkeypatch.setattr(compose_triton, "_tma_config", lambda *a: None)
    want = run(base.clone())
    assert launched == [1] and torch.equal(y, want)
    gf = torch.div(m, n_safe) if g_from_m else g
    bf = b.float() if b is not None else 0.0
    plain = base.float() - (bf if base_has_bias else 0.0)
    assert torch.equal(y, (gf * (plain + 1.5 * (xa.float() @ B.float().t())) + bf).bfloat16())


@pytest.mark.interpreter
def test_the_pointer_kernel_takes_what_tma_cannot_address():
    """Rows not 16-byte aligned, a base 2 bytes past an aligned address, a transposed B, fp32
    adapters, r = 0, T <= 16: the pointer kernel (no TMA config). A base that is a view of a wider
    tensor (aligned rows) is addressable, and the columns beside it stay untouched in place."""
    gen = torch.Generator().manual_seed(8)
    base, xa, B = torch.randn(40, 37, generator=gen).bfloat16(), torch.randn(40, 8).bfloat16(), torch.randn(37, 8).bfloat16()
    assert compose_triton._tma_config(base, base, xa, B, 40, 37, 8) is None  # 74-byte rows
    base = torch.randn(40, 48, generator=gen).bfloat16()
    B = torch.randn(48, 8).bfloat16()
    assert compose_triton._tma_config(base, base, xa, B, 40, 48, 8) is not None
    odd = torch.empty(40 * 48 + 1, dtype=torch.bfloat16)[1:].view(40, 48)
    assert compose_triton._tma_config(odd, odd, xa, B, 40, 48, 8) is None
    B_t = torch.randn(8, 48).bfloat16().t()
    assert compose_triton._tma_config(base, base, xa, B_t, 40, 48, 8) is None
    assert compose_triton._tma_config(base, base, xa.float(), B.float(), 40, 48, 8) is None
    assert compose_triton._tma_config(base, base, xa[:, :0], B[:, :0], 40, 48, 0) is None
    assert compose_triton._tma_config(base[:16], base[:16], xa[:16], B, 16, 48, 8) is None
    wide = torch.randn(40, 64, generator=gen).bfloat16()
    view = wide[:, 8:56]
    assert compose_triton._tma_config(view, view, xa, B, 40, 48, 8) is not None
    g = torch.rand(48, generator=gen) + 0.5
    want = (g * (view.float() + 0.3 * (xa.float() @ B.float().t()))).bfloat16()
    before = wide.clone()
    compose_triton.lora_up_compose_triton(view, xa, B, g, 0.3, out=view)
    assert torch.equal(view, want)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 56:], before[:, 56:])


@pytest.mark.interpreter
def test_grad_kernel_dz_and_dm_partials():
    gen = torch.Generator().manual_seed(6)
    T, d_out = 45, 37
    dy = torch.randn(T, d_out, generator=gen).bfloat16()
    y = torch.randn(T, d_out, generator=gen).bfloat16()
    g = torch.rand(d_out, generator=gen) + 0.5
    n = torch.rand(d_out, generator=gen) + 0.5
    b = torch.randn(d_out, generator=gen).bfloat16()
    dz, S = compose_triton.grad_scale_dm_triton(dy, y, g, n, b, from_output=True)
    assert torch.equal(dz, (dy.float() * g).bfloat16())
    expected = (dy.double() * (y.double() - b.double())).sum(0)
    assert rel_l2(S, expected) < 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize("from_output", [True, False])
def test_grad_kernel_finishes_dm_like_its_torch_twin(from_output):
    """final_dm: the kernel's dm equals the torch twin's, including a zero row (n < eps: 0)
    and, from the output, a row with g = 0 but n > eps (NaN: z is gone)."""
    from doracheck.kernels import grad_scale_dm_torch

    gen = torch.Generator().manual_seed(7)
    T, d_out = 70, 19  # several token blocks under the interpreter's 16-row blocks
    dy = torch.randn(T, d_out, generator=gen).bfloat16()
    h = torch.randn(T, d_out, generator=gen).bfloat16()
    g = torch.rand(d_out, generator=gen) + 0.5
    n = torch.rand(d_out, generator=gen) + 0.5
    n[3], g[3] = 0.0, 0.0  # zero row: m = 0 and n = 0
    h[:, 3] = 0
    g[5] = 0.0  # m = 0 on a non-zero row
    dz, dm = compose_triton.grad_scale_dm_triton(dy, h, g, n, None, from_output=from_output, final_dm=True)
    dz_t, dm_t = grad_scale_dm_torch(dy, h, g, n, None, from_output=from_output, final_dm=True)
    assert torch.equal(dz, dz_t)
    assert dm[3] == 0
    assert bool(dm[5].isnan()) == from_output and bool(dm_t[5].isnan()) == from_output
    ok = torch.ones(d_out, dtype=torch.bool)
    ok[[3, 5]] = False
    assert rel_l2(dm[ok], dm_t[ok]) < 1e-6


@pytest.mark.interpreter
def test_edge_inputs_on_triton_path():
    case = make_case(9, 11, 3, (2, 4), torch.float32, seed=4)
    W = case.weight.clone()
    W[2] = 0
    B = case.lora_B.clone()
    B[2] = 0
    x = case.x.clone()
    x[0, 1, 3] = float("nan")
    y = doracheck.dora_linear(x, W, case.lora_A, B, case.magnitude, case.scaling)
    assert torch.all(y[..., 2][~torch.isnan(x).any(-1)] == 0)
    assert torch.isnan(y[0, 1]).all() and not torch.isnan(y[1]).any()
    empty = doracheck.dora_linear(case.x[:, :0], W, case.lora_A, B, case.magnitude, case.scaling)
    assert empty.shape == (2, 0, 9)
    noncontig = case.x.transpose(0, 1)
    y_nc = doracheck.dora_linear(noncontig, W, case.lora_A, B, case.magnitude, case.scaling)
    y_c = doracheck.dora_linear(noncontig.contiguous(), W, case.lora_A, B, case.magnitude, case.scaling)
    assert torch.equal(y_nc, y_c)


@pytest.mark.interpreter
def test_triton_path_is_deterministic():
    case = make_case(17, 23, 5, 9, torch.bfloat16, seed=8)
    dy = torch.randn(9, 17, generator=torch.Generator().manual_seed(0)).bfloat16()
    from kernel_cases import run_case

    y1, g1 = run_case(case, dy)
    y2, g2 = run_case(case, dy)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_chunked_backward_equals_one_chunk(monkeypatch, path):
    """The token-chunked backward (used when dz would be large) gives the same gradients."""
    from kernel_cases import run_case

    from doracheck.kernels import settings

    case = make_case(19, 23, 4, 37, torch.float32, seed=11)
    dy = torch.randn(37, 19, generator=torch.Generator().manual_seed(2))
    with use_path(path):
        y1, g1 = run_case(case, dy)
        monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", 19 * 4 * 8)  # 8 tokens per chunk
        assert settings.backward_token_chunk(37, 19, 4) == 8
        y2, g2 = run_case(case, dy)
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert rel_l2(b, a) < 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "dtype,adapter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32", "bf16_fp32_adapters", "bf16"],
)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_inference_forward_is_bitwise_the_training_forward(monkeypatch, dtype, adapter_dtype, with_bias):
    """Without autograd the compose kernel forms g = m / max(n, eps) itself (one host op fewer);
    that must be bitwise the g that torch divides in training, through ``dora_linear`` and
    through ``dora_from_base`` (the PEFT integration's path, which rewrites the base output)."""
    case = make_case(21, 26, 5, 9, dtype, adapter_dtype=adapter_dtype, seed=17, with_bias=with_bias)
    with use_path("triton"):
        inference_is_training_forward(case, monkeypatch)
    check_against_oracle(case, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype,adapter_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_chunked_backward_within_budget_in_16_bit(monkeypatch, path, dtype, adapter_dtype, with_bias):
    """The token-chunked backward in 16-bit dtypes stays within the oracle budgets. On the CPU
    it accumulates dz·B and dB chunk by chunk (the products over all tokens from dy and g need
    cuBLAS's fp32-output GEMM in bf16, and are never used in fp16: autograd.py);
    tests/kernels/test_kernels_gpu.py::test_token_chunked_backward_within_budget covers bf16 on the GPU,
    test_chunked_backward_equals_one_chunk covers fp32 here."""
    from doracheck.kernels import settings

    monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", 29 * 2 * 8)  # 8 tokens per chunk: 5 chunks
    case = make_case(29, 31, 6, 37, dtype, adapter_dtype=adapter_dtype, seed=13, with_bias=with_bias)
    with use_path(path):
        check_against_oracle(case, dtype)


def props_budget(op, output):
    from doracheck.properties import budget_for

    return budget_for(op, output, "bf16", "interpreter")


@pytest.mark.interpreter
@pytest.mark.parametrize("with_bias,adapter_dtype", [(True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float32)],
                         ids=["bias", "no_bias", "no_bias_fp32_adapters"])
def test_torch_compile_matches_eager_on_the_triton_ops(with_bias, adapter_dtype):
    """torch.compile (Inductor, fullgraph) over the Triton ops gives eager's forward and gradients.

    Both compose variants are traced: with a bias (y and z from one kernel) and without (y
    saved as the output). The traced graph holds only functional ops (kernels/ops.py says why).
    fp32 adapters on bf16 W trace the norm's two-piece path (A split into bf16 pieces, U of 2r columns).
    """
    case = make_case(24, 20, 4, (2, 5), torch.bfloat16, adapter_dtype=adapter_dtype, seed=4, device="cpu")
    bias = case.bias if with_bias else None

    def f(x, A, B, m):
        return doracheck.dora_linear(x, case.weight, A, B, m, case.scaling, bias)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.lora_A, case.lora_B, case.magnitude)]
    y_c = compiled(*leaves)
    dy = torch.randn(y_c.shape, generator=torch.Generator().manual_seed(5)).to(y_c.dtype)
    g_c = torch.autograd.grad(y_c, leaves, dy)
    leaves_e = [t.detach().clone().requires_grad_() for t in leaves]
    y_e = f(*leaves_e)
    g_e = torch.autograd.grad(y_e, leaves_e, dy)
    # Compiled and eager may round differently (Inductor fuses the torch ops around the kernels):
    # each is judged against the fp64 oracle by the same a-priori bound (c·u(bf16)·ρ + κ term).
    from doracheck.properties.props import a_priori_bound, conditioning
    from doracheck.reference import dora_forward_ref, output_conditions

    leaves_r = [t.detach().double().requires_grad_() for t in leaves]
    y_r = dora_forward_ref(leaves_r[0], case.weight.double(), leaves_r[1], leaves_r[2], leaves_r[3], case.scaling,
                           None if bias is None else bias.double())
    g_r = torch.autograd.grad(y_r, leaves_r, dy.double())
    rho = output_conditions(case.x, case.weight, case.lora_A, case.lora_B, case.magnitude, case.scaling, bias, dy)
    kappa = conditioning(case)
    bound = a_priori_bound(props_budget("forward", "y"), rho["y"], kappa)
    assert rel_l2(y_c, y_r) <= bound and rel_l2(y_e, y_r) <= bound
    for name, a, b, r in zip(("dx", "dA", "dB", "dm"), g_c, g_e, g_r):
        bound = a_priori_bound(props_budget("backward", name), rho[name], kappa)
        assert rel_l2(a, r) <= bound and rel_l2(b, r) <= bound, name
    # Inference (no autograd: g formed in the compose kernel in eager; traced: the functional op).
    with torch.no_grad():
        torch._dynamo.reset()
        y_ci = torch.compile(f, fullgraph=True)(*(t.detach() for t in leaves))
        y_ei = f(*(t.detach() for t in leaves))
    assert torch.equal(y_ei, y_e.detach())
    assert rel_l2(y_ci, y_r) <= a_priori_bound(props_budget("forward", "y"), rho["y"], kappa)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("DORACHECK_TRACE_KERNELS") == "1", reason="DORACHECK_TRACE_KERNELS=1 traces the kernels "
                    "into the graph (triton_op), which the interpreter cannot run on fake tensors")
def test_compiled_graphs_keep_the_kernels_as_opaque_ops():
    """A compiled graph keeps each registered op as one node (after AOT functionalization, what
    Inductor receives): no traced Triton launch (``triton_kernel_wrapper_*``), whose mutation
    analysis ran Triton's front end at every launch and made compiling doracheck twice as long as
    PEFT DoRA (kernels/ops.py, ``_register``). The compiled call runs the same kernels: bitwise
    eager's. (The ops are called directly: on CPU tensors a compiled ``dora_linear`` takes the
    torch path; the GPU tests compile the layer.)"""
    from torch._dynamo.backends.common import aot_autograd

    import doracheck.kernels.ops  # noqa: F401  (registers torch.ops.doracheck)

    case = make_case(24, 20, 4, (2, 5), torch.bfloat16, seed=4, device="cpu")
    s = case.scaling
    base = case.x.reshape(-1, case.x.shape[-1]) @ case.weight.t()
    xa = case.x.reshape(-1, case.x.shape[-1]) @ case.lora_A.t()
    targets: list[str] = []

    def record(gm, _inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def f(W, A, B, base, xa, m):
        norm = torch.ops.doracheck.factored_norm(W, A, B, s, False)[3]
        g = m.float() / norm.clamp_min(1e-12)
        return norm, torch.ops.doracheck.lora_up_compose(base, xa, B, g, None, s)

    args = (case.weight, case.lora_A, case.lora_B, base, xa, case.magnitude)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=record))
    got = compiled(*args)
    want = f(*args)
    assert any("doracheck.factored_norm" in t for t in targets) and any("doracheck.lora_up_compose" in t for t in targets), targets
    assert not [t for t in targets if "triton_kernel_wrapper" in t], targets
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.interpreter
def test_the_ops_on_meta_tensors_give_shapes_and_launch_nothing():
    """A registered op called on meta tensors runs its fake implementation, which allocates and
    launches nothing (a launch would read the meta tensors' missing data); the outputs have the
    real ones' shapes (tests/kernels/test_ops_fakes.py compares them all)."""
    import doracheck.kernels.ops  # noqa: F401  (registers torch.ops.doracheck)

    T, d_in, d_out, r = 40, 24, 20, 4
    meta = {"device": "meta", "dtype": torch.bfloat16}
    W, A, B = torch.empty(d_out, d_in, **meta), torch.empty(r, d_in, **meta), torch.empty(d_out, r, **meta)
    base, xa, dy = torch.empty(T, d_out, **meta), torch.empty(T, r, **meta), torch.empty(T, d_out, **meta)
    g = torch.empty(d_out, device="meta", dtype=torch.float32)
    ops = torch.ops.doracheck
    assert ops.factored_norm(W, A, B, 2.0, False).shape == (4, d_out)
    assert ops.lora_up_compose(base, xa, B, g, None, 2.0).shape == (T, d_out)
    y, z = ops.lora_up_compose_save_z(base, xa, B, g, g.to(torch.bfloat16), 2.0, False)
    assert y.shape == z.shape == (T, d_out)
    dz, dm = ops.grad_scale_dm(dy, base, g, g, None, True, True, True)
    assert dz.shape == (T, d_out) and dm.shape == (d_out,) and dm.device.type == "meta"
    dz, parts = ops.grad_scale_dm(dy, base, g, g, None, True, False, False)
    assert dz.shape == (T, d_out) and parts.shape == (3 * d_out,) and parts.device.type == "meta"  # 16-token blocks, flat


@pytest.mark.parametrize("capability,hip,taken", [
    ((9, 0), None, True), ((8, 0), None, False), ((10, 0), None, False), ((12, 0), None, False), ((9, 4), "6.2", False),
])
def test_the_tma_compose_is_taken_on_hopper_only(capability, hip, taken, monkeypatch):
    """Compute capability 9.x on CUDA only: its tiles need ~213 KB of shared memory (consumer
    Blackwell has ~101 KB a block), data-centre Blackwell is unmeasured, and a ROCm build reports
    an MI300 as major 9."""
    monkeypatch.setattr(compose_triton, "_SM_COUNT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"multi_processor_count": 132})())
    monkeypatch.setattr(torch.version, "hip", hip)
    assert compose_triton.tma_compose_available(0) is taken
    assert compose_triton._sm_count(0) == (132 if taken else 0)
