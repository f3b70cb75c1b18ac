"""``dora_linear`` and ``DoRALinear`` under ``torch.autocast``: PEFT's dtype semantics, the
oracle's values.

Under autocast a linear layer runs its GEMMs in autocast's dtype and returns that dtype, while
every gradient comes back in its parameter's dtype (dx in x's). doracheck does the same (x is
cast once, as F.linear's autocast cast is, and nothing else is re-cast: g, the norm and the
accumulators stay fp32). The values are compared with the fp64 oracle evaluated on what the
GEMMs actually multiply (x, W, A, B rounded to autocast's dtype; m in fp32), within that
dtype's budget rows.
"""

from __future__ import annotations

import os

import pytest
import torch

import doracheck
from doracheck.dispatch import use_path
from doracheck.properties import budget_for, device_family
from doracheck.reference import dora_forward_ref, rel_l2

PATHS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available() else [])
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _layer(d_in, d_out, r, device, seed):
    torch.manual_seed(seed)
    layer = doracheck.DoRALinear(d_in, d_out, r=r, lora_alpha=2 * r, device=device)
    with torch.no_grad():  # off PEFT's init, so that every gradient is non-trivial
        layer.lora_B.normal_(0, 0.05)
        layer.magnitude.mul_(1 + 0.05 * torch.randn_like(layer.magnitude))
        layer.bias.normal_(0, 0.1)
    return layer


def check_training_under_autocast(device: str, dtype: torch.dtype, d_in=24, d_out=20, r=4, tokens=(3, 5)):
    layer = _layer(d_in, d_out, r, device, seed=3)
    x = torch.randn(*tokens, d_in, device=device, requires_grad=True)
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(*tokens, d_out, generator=gen).to(device, dtype)
    with torch.autocast(device, dtype=dtype):
        y = layer(x)
    y.backward(dy)
    # Dtypes as PEFT (and nn.Linear) have them under autocast.
    assert y.dtype == dtype
    assert x.grad.dtype == torch.float32
    for p in (layer.lora_A, layer.lora_B, layer.magnitude):
        assert p.grad is not None and p.grad.dtype == torch.float32

    # The oracle on the operands the GEMMs multiply.
    q = lambda t: t.detach().to(dtype).double()  # noqa: E731
    leaves = [q(x).requires_grad_(), q(layer.lora_A).requires_grad_(), q(layer.lora_B).requires_grad_(),
              layer.magnitude.detach().double().requires_grad_()]
    y_ref = dora_forward_ref(leaves[0], q(layer.weight), leaves[1], leaves[2], leaves[3], layer.scaling, layer.bias.detach().double())
    y_ref.backward(dy.double())
    family, name = device_family(x.device), NAMES[dtype]
    errors = {"y": (rel_l2(y, y_ref), budget_for("forward", "y", name, family).rel_l2)}
    for label, got, ref in zip(("dx", "dA", "dB", "dm"), (x.grad, layer.lora_A.grad, layer.lora_B.grad, layer.magnitude.grad), leaves):
        errors[label] = (rel_l2(got, ref.grad), budget_for("backward", label, name, family).rel_l2)
    for label, (err, budget) in errors.items():
        assert err <= budget, f"{label}: rel err {err:.3e} > {name} budget {budget:.3e} ({family})"
    return errors


@pytest.mark.parametrize("path", PATHS)
def test_doralinear_trains_under_cpu_autocast_bf16(path):
    with use_path(path):
        check_training_under_autocast("cpu", torch.bfloat16)


@pytest.mark.parametrize("path", PATHS)
def test_dora_linear_under_autocast_matches_the_cast_call(path):
    """Inside autocast the call is the call on x cast to autocast's dtype, bitwise (forward and
    every gradient): autocast changes nothing else."""
    layer = _layer(16, 12, 4, "cpu", seed=4)
    x = torch.randn(6, 16)
    results = []
    for under_autocast in (True, False):
        xi = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        with use_path(path):
            if under_autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = layer(xi)
            else:
                y = layer(xi.to(torch.bfloat16))
            y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in layer.parameters() if p.requires_grad]))
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_autocast_inference_and_merged_layer():
    layer = _layer(16, 12, 4, "cpu", seed=6)
    x = torch.randn(2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        layer.merge()
        y_merged = layer(x)
        layer.unmerge()
    assert y.dtype == y_merged.dtype == torch.bfloat16
    assert rel_l2(y_merged, y) <= 2e-2  # merged rounds W' to bf16 inside F.linear; a wrong g would be O(1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_doralinear_trains_under_cuda_autocast(dtype):
    check_training_under_autocast("cuda", dtype, d_in=320, d_out=288, r=16, tokens=(4, 64))
