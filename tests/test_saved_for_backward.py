"""What a DoRA autograd Function keeps for its backward, and how.

Only activations go through ``save_for_backward`` (so through saved-tensor hooks such as
activation checkpointing's, three Python calls per tensor per step on the host-bound eager
step); in eager the parameters ride on the ctx, with their version counters checked in the
backward as autograd checks saved tensors. These tests pin both halves: no parameter is
packed by a hook, and a parameter modified in place between the forward and the backward
still raises instead of giving a wrong gradient.
"""

from __future__ import annotations

import pytest
import torch

import doracheck
from doracheck.autograd import dora_from_base


def _layer(seed: int = 0, dtype=torch.float32, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out, r, T = 12, 10, 4, 7
    W = torch.randn(d_out, d_in, generator=gen, dtype=dtype)
    A = (torch.randn(r, d_in, generator=gen, dtype=dtype) / 3).requires_grad_()
    B = (torch.randn(d_out, r, generator=gen, dtype=dtype) / 3).requires_grad_()
    m = (1 + torch.rand(d_out, generator=gen, dtype=dtype)).requires_grad_()
    b = torch.randn(d_out, generator=gen, dtype=dtype).requires_grad_() if bias else None
    x = torch.randn(2, T, d_in, generator=gen, dtype=dtype).requires_grad_()
    return x, W, A, B, m, b


def _from_base(x, W, A, B, m, b, detach=True):
    result = torch.nn.functional.linear(x.detach(), W, b)
    return dora_from_base(x, result, W, A, B, m, b, 1.5)


def _linear(x, W, A, B, m, b, detach=True):
    return doracheck.dora_linear(x, W, A, B, m, 1.5, b, detach_norm=detach)


@pytest.mark.parametrize("entry", [_from_base, _linear])
@pytest.mark.parametrize("bias", [False, True])
def test_no_parameter_goes_through_the_saved_tensor_hooks(entry, bias):
    x, W, A, B, m, b = _layer(bias=bias)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = entry(x, W, A, B, m, b)
    params = [W, A, B, m] + ([b] if b is not None else [])
    assert packed, "the activations are saved through the hooks"
    assert not any(t is p for t in packed for p in params)
    assert len(packed) <= 6  # x, xa, the output or z, g, n (and the keep-mask with dropout): no n_safe, no parameter
    y.sum().backward()  # the hooks' tensors and the ctx's parameters are enough for the backward
    assert all(p.grad is not None for p in (A, B, m))


@pytest.mark.parametrize("entry", [_from_base, _linear])
@pytest.mark.parametrize("name", ["lora_A", "lora_B", "magnitude"])
def test_a_parameter_modified_in_place_before_the_backward_raises(entry, name):
    x, W, A, B, m, b = _layer()
    y = entry(x, W, A, B, m, b)
    target = {"lora_A": A, "lora_B": B, "magnitude": m}[name]
    with torch.no_grad():
        target.mul_(1.01)
    with pytest.raises(RuntimeError, match=f"{name}: modified by an inplace operation"):
        y.sum().backward()


def test_the_exact_norm_backward_still_gets_max_n_eps():
    """``detach_norm=False`` is the one backward that reads max(n, eps): it is still kept there,
    and the gradient passes gradcheck in fp64."""
    x, W, A, B, m, b = _layer(dtype=torch.float64)
    W.requires_grad_()

    def f(x, W, A, B, m):
        return doracheck.dora_linear(x, W, A, B, m, 1.5, None, detach_norm=False)

    assert torch.autograd.gradcheck(f, (x, W, A, B, m))


def test_checkpointed_gradients_are_bitwise_the_plain_ones():
    """Non-reentrant activation checkpointing recomputes the forward and unpacks the activations
    through its hooks; the parameters come from the ctx. Bitwise the same gradients either way."""
    from torch.utils.checkpoint import checkpoint

    grads = []
    for use_checkpoint in (False, True):
        x, W, A, B, m, b = _layer(seed=5)
        y = checkpoint(_from_base, x, W, A, B, m, b, use_reentrant=False) if use_checkpoint else _from_base(x, W, A, B, m, b)
        (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
        grads.append([t.grad for t in (x, A, B, m)])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
