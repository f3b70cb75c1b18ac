"""Edge cases of the DoRA layer: layouts, ranks, dtypes, zero magnitudes, chunked backward, variants."""

from __future__ import annotations

import pytest
import torch
from layer_problems import PATHS, chunked_grads, problem

import doracheck
from doracheck.dispatch import use_path
from doracheck.reference import dora_forward_ref, norm_terms_ref, rel_l2


@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_bias_is_read_correctly(path):
    """The Triton kernels used to read a strided bias as if contiguous."""
    x, W, A, B, m = problem()
    b = torch.arange(16.0)[::2]
    with use_path(path):
        y = doracheck.dora_linear(x, W, A, B, m, 2.0, b)
    assert rel_l2(y, dora_forward_ref(x, W, A, B, m, 2.0, b)) < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_inplace_ops_on_the_output_are_allowed(path):
    """The output used to be a view made inside the autograd.Function (in-place ops raised)."""
    x, W, A, B, m = problem()
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
    x, W, _, _, m = problem()
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


@pytest.mark.parametrize("path", PATHS)
def test_zero_magnitude_with_exact_norm_gradient_does_not_poison_dA(path):
    """With detach_norm=False and one m_i = 0, dA used to be all NaN on the Triton path."""
    x, W, A, B, m = problem()
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
    x, W, A, B, m = problem()
    with pytest.raises(ValueError, match="dropout_mask"):
        doracheck.dora_linear(x[0, :1], W, A, B, m, 2.0, dropout_p=0.5, training=True, dropout_mask=torch.ones(3, 12))


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


@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_magnitude_in_inference(path):
    """Inference on the Triton path hands m to the compose kernel (which divides it by n); a
    strided m used to be read as if contiguous, silently giving wrong outputs."""
    from doracheck.autograd import dora_from_base

    x, W, A, B, _ = problem()
    m_strided = (torch.rand(8, 2, generator=torch.Generator().manual_seed(3)) + 0.5)[:, 0]
    assert m_strided.stride(0) != 1
    base = torch.nn.functional.linear(x, W)
    with use_path(path), torch.no_grad():
        y = doracheck.dora_linear(x, W, A, B, m_strided, 2.0)
        r = dora_from_base(x, base.clone(), W, A, B, m_strided, None, 2.0)
    expected = dora_forward_ref(x, W, A, B, m_strided.contiguous(), 2.0)
    assert rel_l2(y, expected) < 1e-6
    assert rel_l2(r, expected) < 1e-6


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
    whole = chunked_grads(monkeypatch, 1 << 30, tensors, path)
    chunked = chunked_grads(monkeypatch, d_out * 2 * 8, tensors, path)  # 8 tokens a chunk
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
    whole = chunked_grads(monkeypatch, 1 << 30, tensors, "torch", dy_value=1.0)
    chunked = chunked_grads(monkeypatch, 1024, tensors, "torch", dy_value=1.0)  # 128 tokens a chunk
    assert bool(torch.isfinite(chunked["B"]).all())
    assert rel_l2(chunked["B"], whole["B"]) < 1e-2


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
