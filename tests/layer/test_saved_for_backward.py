"""What a DoRA autograd Function keeps for its backward, and how.

Activations go through ``save_for_backward`` (so through saved-tensor hooks such as activation
checkpointing's, three Python calls per tensor per step on the host-bound eager step); in eager,
module parameters (``nn.Parameter``) ride on the ctx, with their version counters checked in the
backward as autograd checks saved tensors, and any other tensor passed as a parameter goes
through ``save_for_backward`` (freed after the backward). These tests pin each part: no module
parameter is packed by a hook, a parameter modified in place between the forward and the
backward still raises instead of giving a wrong gradient, and a temporary weight is not kept
alive by the graph.
"""

from __future__ import annotations

import pytest
import torch

import doracheck
from doracheck.autograd import dora_from_base


def _layer(seed: int = 0, dtype=torch.float32, bias: bool = False, parameters: bool = True):
    """x and the layer's tensors; ``parameters``: W, A, B, m, b as ``nn.Parameter``s (W frozen),
    as a module holds them, else plain tensors."""
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out, r, T = 12, 10, 4, 7
    wrap = (lambda t, grad: torch.nn.Parameter(t, requires_grad=grad)) if parameters else (lambda t, grad: t.requires_grad_(grad))
    W = wrap(torch.randn(d_out, d_in, generator=gen, dtype=dtype), False)
    A = wrap(torch.randn(r, d_in, generator=gen, dtype=dtype) / 3, True)
    B = wrap(torch.randn(d_out, r, generator=gen, dtype=dtype) / 3, True)
    m = wrap(1 + torch.rand(d_out, generator=gen, dtype=dtype), True)
    b = wrap(torch.randn(d_out, generator=gen, dtype=dtype), True) if bias else None
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
@pytest.mark.parametrize("name", ["weight", "lora_A", "lora_B", "magnitude", "bias"])
def test_a_parameter_modified_in_place_before_the_backward_raises(entry, name):
    x, W, A, B, m, b = _layer(bias=True)
    y = entry(x, W, A, B, m, b)
    target = {"weight": W, "lora_A": A, "lora_B": B, "magnitude": m, "bias": b}[name]
    with torch.no_grad():
        target.mul_(1.01)
    with pytest.raises(RuntimeError, match=f"{name}: modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("entry", [_from_base, _linear])
def test_plain_tensors_go_through_save_for_backward_and_autograd_checks_them(entry):
    x, W, A, B, m, b = _layer(parameters=False)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = entry(x, W, A, B, m, b)
    assert any(t is B for t in packed) and any(t is m for t in packed)
    y = entry(x, W, A, B, m, b)  # without hooks: autograd's own version check applies (hooks skip it)
    with torch.no_grad():
        B.mul_(1.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("entry", [_from_base, _linear])
def test_a_temporary_weight_is_freed_after_the_backward(entry):
    """A weight made for this call (dequantized or cast by a caller) is not kept alive by the
    graph once the backward is done, as ``save_for_backward`` frees what it holds."""
    import gc
    import weakref

    x, W, A, B, m, b = _layer()
    temporary = W.detach().clone()
    ref = weakref.ref(temporary)
    y = entry(x, temporary, A, B, m, b)
    del temporary
    y.sum().backward()
    gc.collect()
    assert ref() is None  # y (and its graph) still alive here


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
