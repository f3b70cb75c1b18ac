"""Regression tests for defects found in review (each test names what used to go wrong)."""

from __future__ import annotations

import contextlib
import json
import math
import os

import pytest
import torch

import doracheck
from doracheck.dispatch import use_path
from doracheck.norm_rule import clear_norm_cache
from doracheck.properties import props
from doracheck.reference import dora_forward_ref, norm_terms_ref, rel_l2

PATHS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available() else [])


def _problem(dtype=torch.float32, seed=0, d_out=8, d_in=12, r=3):
    gen = torch.Generator().manual_seed(seed)
    W = (torch.randn(d_out, d_in, generator=gen) / 3).to(dtype)
    A = torch.randn(r, d_in, generator=gen) / 3
    B = torch.randn(d_out, r, generator=gen)
    m = torch.rand(d_out, generator=gen) + 0.5
    x = torch.randn(2, 5, d_in, generator=gen).to(dtype)
    return x, W, A, B, m


@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_bias_is_read_correctly(path):
    """The Triton kernels used to read a strided bias as if contiguous."""
    x, W, A, B, m = _problem()
    b = torch.arange(16.0)[::2]
    with use_path(path):
        y = doracheck.dora_linear(x, W, A, B, m, 2.0, b)
    assert rel_l2(y, dora_forward_ref(x, W, A, B, m, 2.0, b)) < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_inplace_ops_on_the_output_are_allowed(path):
    """The output used to be a view made inside the autograd.Function (in-place ops raised)."""
    x, W, A, B, m = _problem()
    b = torch.randn(8)
    A.requires_grad_()
    with use_path(path):
        y = doracheck.dora_linear(x, W, A, B, m, 2.0, b)  # with a bias the saved tensor is z, not y
        y.relu_()
        y.sum().backward()
    A_ref = A.detach().double().requires_grad_()
    dora_forward_ref(x, W, A_ref, B, m, 2.0, b).relu().sum().backward()
    assert rel_l2(A.grad, A_ref.grad) < 1e-5


def test_rank_zero_is_rejected():
    x, W, _, _, m = _problem()
    with pytest.raises(ValueError, match="lora_A"):
        doracheck.dora_linear(x, W, torch.zeros(0, 12), torch.zeros(8, 0), m, 2.0)


@pytest.mark.parametrize("path", PATHS)
def test_fp16_adapters_with_large_gram_stay_finite(path):
    """fp16 lora_B used to split G into fp16 pieces, which overflowed (NaN norm)."""
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(6, 64, generator=gen).half()
    A = (torch.randn(2, 64, generator=gen) * 40).half()
    B = torch.randn(6, 2, generator=gen).half()
    with use_path(path):
        n = doracheck.factored_norm(W, A, B, 0.5)
    ref = norm_terms_ref(W, A, B, 0.5).norm
    assert torch.isfinite(n).all() and rel_l2(n, ref) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_fp16_adapters_under_bf16_weights_keep_their_bits(path):
    """A of another 16-bit dtype than W used to be rounded to W's dtype in the cross term."""
    gen = torch.Generator().manual_seed(2)
    W = torch.randn(16, 40, generator=gen).bfloat16()
    A = (torch.randn(4, 40, generator=gen) * 0.3).half()
    B = torch.randn(16, 4, generator=gen).half()
    with use_path(path):
        terms = doracheck.factored_norm(W, A, B, 2.0, return_terms=True)
    ref = norm_terms_ref(W, A, B, 2.0)
    assert rel_l2(terms.cross, ref.cross) < 1e-4


def test_norm_cache_entries_are_per_path():
    """A norm cached by one path used to be served to the other."""
    if len(PATHS) < 2:
        pytest.skip("needs the interpreter for the Triton path")
    x, W, A, B, m = _problem()
    clear_norm_cache()
    from doracheck import norm_rule as norm_cache

    with use_path("torch"):
        doracheck.dora_linear(x, W, A, B, m, 2.0)
    misses = norm_cache.norm_cache_stats()["misses"]
    with use_path("triton"):
        doracheck.dora_linear(x, W, A, B, m, 2.0)
    assert norm_cache.norm_cache_stats()["misses"] == misses + 1


@pytest.mark.parametrize("path", PATHS)
def test_zero_magnitude_with_exact_norm_gradient_does_not_poison_dA(path):
    """With detach_norm=False and one m_i = 0, dA used to be all NaN on the Triton path."""
    x, W, A, B, m = _problem()
    m[2] = 0
    A.requires_grad_()
    with use_path(path):
        doracheck.dora_linear(x, W, A, B, m, 2.0, detach_norm=False).sum().backward()
    assert torch.isfinite(A.grad).all()


def test_merge_refuses_zero_magnitude_instead_of_corrupting_the_weight():
    linear = torch.nn.Linear(6, 4)
    layer = doracheck.DoRALinear.from_linear(linear, r=2, lora_alpha=4)
    with torch.no_grad():
        layer.magnitude[1] = 0
    before = linear.weight.detach().clone()
    with pytest.raises(ValueError, match="merge"):
        layer.merge()
    assert torch.equal(linear.weight, before)


def test_dropout_mask_must_broadcast_to_x():
    x, W, A, B, m = _problem()
    with pytest.raises(ValueError, match="dropout_mask"):
        doracheck.dora_linear(x[0, :1], W, A, B, m, 2.0, dropout_p=0.5, training=True, dropout_mask=torch.ones(3, 12))


def test_property_worst_cases_do_not_drop_nan():
    """max() over floats and `not (err <= worst)` used to let a NaN error pass."""
    assert props._worst_of([1e-7, float("nan"), 2e-7]) != props._worst_of([1e-7, 2e-7])
    assert math.isnan(props._worst_of([1e-7, float("nan"), 2e-7]))
    nan_impl = props.Implementation("nan", lambda x, *a, **k: torch.full((*x.shape[:-1], a[0].shape[0]), float("nan"), dtype=x.dtype))
    result = props.compose_near_one(nan_impl, torch.bfloat16, "cpu", seeds=(0,))[0]
    assert result.status == "FAIL"


def test_audit_fp8_base_and_json_without_infinity(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from doracheck.audit.sample import write_sample
    from doracheck.cli.main import main

    folder = write_sample(tmp_path / "s")
    with safe_open(str(folder / "base_model.safetensors"), "pt") as f:
        base = {k: f.get_tensor(k).to(torch.float8_e4m3fn) for k in f.keys()}
    save_file(base, str(folder / "base_model.safetensors"))
    code = main(["audit", str(folder), "--base", str(folder / "base_model.safetensors"), "--json", "--device", "cpu"])
    out = capsys.readouterr().out
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert code == 1
    assert "structure.dtype" in {c["id"] for m in doc["modules"] for c in m["checks"]}


# --- review of the planner / host-overhead change (2026-11-29) -------------------------------


def _run_python(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_fsdp_detection_survives_the_pre_2_6_layout_and_same_size_registry():
    """In a fresh process (FSDP detection is sticky): with torch < 2.6's module layout the
    forward still runs; an FSDP state registered while another state died (same registry size)
    is still seen."""
    out = _run_python(
        "import sys, gc, torch, torch.nn as nn\n"
        "sys.modules['torch.distributed.fsdp._fully_shard._fsdp_state'] = None\n"
        "import doracheck\n"
        "W = torch.randn(8, 16); A = torch.randn(4, 16); B = torch.randn(8, 4); m = torch.rand(8) + 0.5\n"
        "doracheck.dora_linear(torch.randn(3, 16), W, A, B, m, 2.0)\n"
        "del sys.modules['torch.distributed.fsdp._fully_shard._fsdp_state']\n"
        "from torch.distributed._composable_state import _insert_module_state, _State, _module_state_mapping\n"
        "from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState\n"
        "from doracheck.norm_rule import fsdp_active\n"
        "m1 = nn.Linear(2, 2); s1 = _State(); _insert_module_state(m1, s1)\n"
        "a = fsdp_active(); n1 = len(_module_state_mapping)\n"
        "del m1; gc.collect()\n"
        "m2 = nn.Linear(2, 2); s2 = FSDPState(); _insert_module_state(m2, s2)\n"
        "print(a, fsdp_active(), n1 == len(_module_state_mapping))\n"
    )
    assert out.split() == ["False", "True", "True"]


def test_tracing_outside_dynamo_does_not_poison_the_zero_addend():
    """A backward traced under FakeTensorMode must not leave a fake tensor in a cache that
    later eager backwards use."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import doracheck.backward as ag

    ag._ZEROS.clear()
    with FakeTensorMode():
        W = torch.randn(8, 16)
        A = torch.randn(4, 16, requires_grad=True)
        doracheck.dora_linear(torch.randn(3, 16), W, A, torch.randn(8, 4), torch.rand(8) + 0.5, 2.0).sum().backward()
    assert all(type(z) is torch.Tensor for z in ag._ZEROS.values())
    A = torch.randn(4, 16, requires_grad=True)
    doracheck.dora_linear(torch.randn(3, 16), torch.randn(8, 16), A, torch.randn(8, 4), torch.rand(8) + 0.5, 2.0).sum().backward()
    assert torch.isfinite(A.grad).all()


@pytest.mark.parametrize("variant", ["factored+recompute_xa", "merged+recompute_xa"])
def test_forced_variant_under_non_reentrant_checkpoint(variant):
    from torch.utils.checkpoint import checkpoint

    from doracheck.planner import use_variant

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(12, 16, generator=gen)
    A = (torch.randn(4, 16, generator=gen) * 0.3).requires_grad_()
    x = torch.randn(8, 16, generator=gen, requires_grad=True)
    B, m = torch.randn(12, 4, generator=gen) * 0.3, torch.rand(12, generator=gen) + 0.5
    with use_variant(variant):
        checkpoint(lambda t: doracheck.dora_linear(t, W, A, B, m, 2.0), x, use_reentrant=False).sum().backward()
        ga = A.grad.clone()
        A.grad = None
        doracheck.dora_linear(x, W, A, B, m, 2.0).sum().backward()
    assert torch.allclose(ga, A.grad)


def test_recomputed_xa_with_dropout_is_bitwise_the_saved_one():
    from doracheck.planner import use_variant

    gen = torch.Generator().manual_seed(1)
    W = torch.randn(12, 16, generator=gen).bfloat16()
    x = torch.randn(5, 16, generator=gen).bfloat16()
    B = (torch.randn(12, 4, generator=gen) * 0.3).bfloat16().requires_grad_()
    A, m = (torch.randn(4, 16, generator=gen) * 0.3).bfloat16(), (torch.rand(12, generator=gen) + 0.5)
    mask = (torch.rand(5, 16, generator=gen) > 0.3).bfloat16()
    grads = []
    for variant in ("factored", "factored+recompute_xa"):
        B.grad = None
        with use_variant(variant):
            y = doracheck.dora_linear(x, W, A, B, m, 2.0, dropout_p=0.3, training=True, dropout_mask=mask)
            y.float().sum().backward()
        grads.append(B.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_timed_plans_are_keyed_by_dropout_and_norm_mode():
    from doracheck.planner import plan

    def fake(variants, *args, **kwargs):
        return {v.name: 1.0 if v.order == "merged" else 2.0 for v in variants}

    shape = (96, 80, 8, 70000, torch.float32, True)
    with_dropout = plan(*shape, timed=True, device="cpu", dropout=True, measure=fake)
    without = plan(*shape, timed=True, device="cpu", dropout=False, measure=fake)
    assert with_dropout.variant.order == "factored" and without.variant.order == "merged"


@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_magnitude_in_inference(path):
    """Inference on the Triton path hands m to the compose kernel (which divides it by n); a
    strided m used to be read as if contiguous, silently giving wrong outputs."""
    from doracheck.autograd import dora_from_base

    x, W, A, B, _ = _problem()
    m_strided = (torch.rand(8, 2, generator=torch.Generator().manual_seed(3)) + 0.5)[:, 0]
    assert m_strided.stride(0) != 1
    base = torch.nn.functional.linear(x, W)
    with use_path(path), torch.no_grad():
        y = doracheck.dora_linear(x, W, A, B, m_strided, 2.0)
        r = dora_from_base(x, base.clone(), W, A, B, m_strided, None, 2.0)
    expected = dora_forward_ref(x, W, A, B, m_strided.contiguous(), 2.0)
    assert rel_l2(y, expected) < 1e-6
    assert rel_l2(r, expected) < 1e-6


def _chunked_grads(monkeypatch, chunk_bytes, tensors, path, dy_value=1e-3):
    from doracheck.kernels import settings

    monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", chunk_bytes)
    leaves = [t.clone().requires_grad_() for t in tensors]
    x, W, A, B, m = leaves
    with use_path(path):
        doracheck.dora_linear(x, W, A, B, m, 1.0).backward(torch.full((x.shape[0], W.shape[0]), dy_value, dtype=x.dtype))
    return {name: t.grad for name, t in zip(("x", "W", "A", "B", "m"), leaves)}


@pytest.mark.parametrize("path", PATHS)
def test_fp16_chunked_backward_stays_finite_where_g_times_B_exceeds_fp16(monkeypatch, path):
    """Over token chunks the backward used to form g⊙B in fp16: with g = 200 and |B| = 400 that
    is inf, and dx, dA came out NaN where the per-chunk dz = g⊙dy (and the unchunked path) stay
    finite. fp16 now keeps the per-chunk products."""
    gen = torch.Generator().manual_seed(5)
    d_out, d_in, r, T = 8, 16, 2, 64
    W = torch.randn(d_out, d_in, generator=gen) * 1e-3
    A = torch.randn(r, d_in, generator=gen) * 1e-7
    B = torch.randn(d_out, r, generator=gen) * 400
    m = W.norm(dim=1) * 200
    x = torch.randn(T, d_in, generator=gen)
    tensors = [t.half() for t in (x, W, A, B, m)]
    whole = _chunked_grads(monkeypatch, 1 << 30, tensors, path)
    chunked = _chunked_grads(monkeypatch, d_out * 2 * 8, tensors, path)  # 8 tokens a chunk
    for name in ("x", "A", "B", "m"):
        assert bool(torch.isfinite(whole[name]).all()), name
        assert bool(torch.isfinite(chunked[name]).all()), name
        if name != "B":  # dB = s·dzᵀ·xa: xa (about 1e-7) is subnormal in fp16 here, so dB is rounding noise
            assert rel_l2(chunked[name], whole[name]) < 1e-2, name


def test_fp16_chunked_dB_on_the_cpu_is_not_rounded_before_g(monkeypatch):
    """Without cuBLAS's fp32-output GEMM, dyᵀ·xa over all tokens used to be rounded to fp16
    before g scaled it: 65536 overflowed to inf (g = 0.01 would have brought it to 655)."""
    d_out, d_in, r, T = 4, 8, 2, 4096
    W = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(6))
    A = torch.full((r, d_in), 2.0)
    B = torch.randn(d_out, r, generator=torch.Generator().manual_seed(7)) * 0.1
    m = W.norm(dim=1) * 0.01
    tensors = [t.half() for t in (torch.ones(T, d_in), W, A, B, m)]
    whole = _chunked_grads(monkeypatch, 1 << 30, tensors, "torch", dy_value=1.0)
    chunked = _chunked_grads(monkeypatch, 1024, tensors, "torch", dy_value=1.0)  # 128 tokens a chunk
    assert bool(torch.isfinite(chunked["B"]).all())
    assert rel_l2(chunked["B"], whole["B"]) < 1e-2


@pytest.mark.parametrize("half", ["fp16", "bf16"])
@pytest.mark.parametrize("user", [True, False, (True, True), (False, True), (False, False)])
def test_our_numerics_turns_16_bit_reduction_off_and_restores_the_callers_flags_exactly(half, user):
    """Inside: no 16-bit split-K reduction. After (also after an exception): the caller's flag
    exactly as it was, both parts of torch >= 2.10's (allow, allow_split_k) pair (a bool
    restore would set allow_split_k back to True), and a caller's stricter (False, False) is
    left alone inside. Runs on CPU builds too: the flags are process state."""
    from doracheck.numerics import our_numerics

    matmul = torch.backends.cuda.matmul
    name = f"allow_{half}_reduced_precision_reduction"
    raw = getattr(torch._C, f"_get_cublas_{name}", None)
    if raw is None:
        pytest.skip("this torch has no cuBLAS reduction flags")
    before = raw()
    if isinstance(user, tuple) and not isinstance(before, tuple):
        pytest.skip("(allow, allow_split_k) pairs need torch >= 2.10")
    try:
        setattr(matmul, name, user)
        as_set = raw()
        for raising in (False, True):
            with pytest.raises(RuntimeError) if raising else contextlib.nullcontext():
                with our_numerics("cuda"):
                    inside = raw()
                    assert (inside[0] if isinstance(inside, tuple) else inside) is False
                    if as_set == (False, False):
                        assert inside == (False, False)
                    if raising:
                        raise RuntimeError("inside a layer call")
            assert raw() == as_set
    finally:
        if isinstance(before, tuple):
            getattr(torch._C, f"_set_cublas_{name}")(*before)
        else:
            setattr(matmul, name, before)


def test_our_numerics_turns_autocast_off_under_torch_compile_too():
    """Under torch.compile (fullgraph) inside autocast, the block still runs without autocast:
    a GEMM of fp32 operands stays fp32 (autocast would make it bf16)."""
    from doracheck.numerics import our_numerics

    def gemm(x, w):
        with our_numerics("cpu"):
            return x @ w

    compiled = torch.compile(gemm, fullgraph=True, backend="aot_eager")
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w).dtype == torch.bfloat16  # autocast is on here
        assert gemm(x, w).dtype == torch.float32
        assert compiled(x, w).dtype == torch.float32


def test_eager_launches_are_made_on_the_tensors_device_when_it_is_not_current(monkeypatch):
    """Triton launches on the current device: a layer that accelerate's device_map put on
    cuda:1 while cuda:0 is current must have its launches made under cuda:1 (policy, with
    stand-ins for the CUDA calls; the two-GPU test below runs it for real)."""
    from doracheck.kernels import ops

    class OnCuda(torch.Tensor):  # a CPU tensor that says it lives on a CUDA device
        index = 1

        @property
        def is_cuda(self):
            return True

        @property
        def device(self):
            return torch.device("cuda", self.index)

    entered = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append(-1)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    on_1 = torch.zeros(2).as_subclass(OnCuda)
    assert ops.launch_device((None, 2.0, on_1)) == 1
    assert ops._on_device(lambda *a: "ran", (on_1,)) == "ran" and entered == [1, -1]
    OnCuda.index = 0
    entered.clear()
    assert ops.launch_device((on_1,)) is None and ops._on_device(lambda *a: "ran", (on_1,)) == "ran" and entered == []
    assert ops.launch_device((torch.zeros(2),)) is None and ops.launch_device((1.0, None)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_a_layer_on_another_gpu_than_the_current_one_gives_the_same_bits():
    """A DoRA layer on cuda:1 called while cuda:0 is current (accelerate's device_map) trains
    and infers bitwise as when cuda:1 is current."""
    torch.manual_seed(0)
    dev = torch.device("cuda", 1)
    W = torch.randn(96, 64, device=dev, dtype=torch.bfloat16)
    A = (torch.randn(16, 64, device=dev) * 0.1).to(torch.bfloat16).requires_grad_()
    B = (torch.randn(96, 16, device=dev) * 0.1).to(torch.bfloat16).requires_grad_()
    m = (torch.rand(96, device=dev) + 0.5).requires_grad_()
    x = torch.randn(4, 32, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def run(current):
        with torch.cuda.device(current):
            y = doracheck.dora_linear(x, W, A, B, m, 2.0)
            y.float().square().sum().backward()
            with torch.no_grad():
                y_infer = doracheck.dora_linear(x, W, A, B, m, 2.0)
        torch.cuda.synchronize(dev)
        grads = [t.grad.clone() for t in (x, A, B, m)]
        for t in (x, A, B, m):
            t.grad = None
        return [y.detach(), y_infer, *grads]

    on_1, on_0 = run(1), run(0)
    assert all(torch.equal(a, b) for a, b in zip(on_1, on_0))


def test_our_numerics_holds_the_flags_off_until_the_last_of_several_threads_leaves():
    """Calls on several threads (per-device backward threads, DataParallel replicas) overlap:
    A enters, B enters, A leaves while B still runs. B must still run with 16-bit reduction off,
    and the caller's flags come back only when B leaves (each call restoring on its own switched
    them back on under B and left them off for good afterwards)."""
    from doracheck.numerics import our_numerics

    raw = getattr(torch._C, "_get_cublas_allow_bf16_reduced_precision_reduction", None)
    if raw is None:
        pytest.skip("this torch has no cuBLAS reduction flags")
    before = raw()

    def off(value):
        return (value[0] if isinstance(value, tuple) else value) is False

    assert not off(before), "expects torch's default, 16-bit reduction allowed"
    a, b = our_numerics("cuda"), our_numerics("cuda")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert off(raw())  # B still inside
    b.__exit__(None, None, None)
    assert raw() == before


def test_registered_op_bodies_launch_on_their_tensors_device(monkeypatch):
    """A graph compiled with aot_eager (or the eager backend) runs the registered op bodies
    themselves, not ``ops.call``: they take the same device guard (stand-ins for CUDA)."""
    from doracheck.kernels import ops

    seen = []
    monkeypatch.setattr(ops, "launch_device", lambda args: seen.append(args) or None)
    body = ops._guarded(lambda base, scale=1.0: base * scale)
    x = torch.ones(3)
    assert torch.equal(body(x, scale=2.0), x * 2.0) and seen == [(x,)]


def test_a_stored_norm_is_read_only_on_the_stream_it_was_computed_on(monkeypatch):
    """Threads serving one model with a CUDA stream each: a norm computed on stream A must not
    be read on stream B, which could read it before A's kernels finish (the current stream is
    part of the cache key; stand-in streams here)."""
    from doracheck import norm_rule as norm_cache

    stream = {"now": 1}
    monkeypatch.setattr(norm_cache, "_stream_of", lambda t: stream["now"])
    clear_norm_cache()
    W, A, B = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    computed = []

    def compute():
        computed.append(stream["now"])
        return torch.ones(6)

    with torch.no_grad():
        for now in (1, 1, 2, 2, 1):
            stream["now"] = now
            norm_cache.lookup_or_compute(W, A, B, 1.0, False, compute, recording=False)
    assert computed == [1, 2, 1]  # each stream computes its own; the same stream reads its own
    clear_norm_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cached_zero_addend_is_never_made_inside_a_graph_capture():
    """A zero made while a stream is being captured is only recorded, never filled: it must not
    be kept for later eager calls (dB's addcmul reads it)."""
    from doracheck import backward as backward_pass

    backward_pass._ZEROS.clear()
    like = torch.ones(3, device="cuda", dtype=torch.bfloat16)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        backward_pass._zero_scalar(like)
    assert (like.dtype, like.device) not in backward_pass._ZEROS
    zero = backward_pass._zero_scalar(like)
    assert (like.dtype, like.device) in backward_pass._ZEROS and zero.item() == 0
