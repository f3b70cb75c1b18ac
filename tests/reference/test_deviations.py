"""Each deviation oracle is what its description says: checked against a hand-written statement
of that one departure from the contract (``dora_forward_ref``), in float64."""

from __future__ import annotations

import math

import pytest
import torch

from doracheck.reference import dora_forward_ref, norm_terms_ref
from doracheck.reference.deviations import DEVIATION_BY_NAME, DEVIATIONS


def problem(fan_in_fan_out=False, zero_row=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d, r = 6, 3
    W = torch.randn(d, d, generator=gen, dtype=torch.float64)
    A = torch.randn(r, d, generator=gen, dtype=torch.float64) / 2
    B = torch.randn(d, r, generator=gen, dtype=torch.float64) / 2
    if zero_row:
        W[2], B[2] = 0.0, 0.0
    m = torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(d, generator=gen, dtype=torch.float64)
    x = torch.randn(4, d, generator=gen, dtype=torch.float64)
    return x, (W.t().contiguous() if fan_in_fan_out else W), A, B, m, 1.5, b


def rows_norm(W, A, B, s):
    return torch.linalg.norm(W + s * (B @ A), dim=1)


def contract(x, W, A, B, m, s, b, **kw):
    return dora_forward_ref(x, W, A, B, m, s, b, **kw)


def by_hand(name, x, W, A, B, m, s, b):
    """The departure written out directly."""
    n = rows_norm(W, A, B, s)
    z = x @ W.t() + s * (x @ A.t()) @ B.t()
    r = A.shape[0]
    return {
        "bias scaled by g": (m / n) * (z + b),
        "column norm": (m / torch.linalg.norm(W + s * (B @ A), dim=0)) * z + b,  # square here: no tiling
        "rsLoRA scaling confused": contract(x, W, A, B, m, s * math.sqrt(r), b),
        "plain scaling confused": contract(x, W, A, B, m, s / math.sqrt(r), b),
        "s twice in the norm": (m / rows_norm(W, A, B, s * s)) * z + b,
        "s missing from the norm": (m / rows_norm(W, A, B, 1.0)) * z + b,
        "magnitude ignored": z + b,
        "magnitude applied twice": (m * m / n) * z + b,
    }.get(name)


@pytest.mark.parametrize("name", [d.name for d in DEVIATIONS])
def test_a_deviation_is_what_it_says(name):
    deviation = DEVIATION_BY_NAME[name]
    x, W, A, B, m, s, b = problem()
    y = deviation.forward(x, W, A, B, m, s, b, dtype=torch.bfloat16)
    expected = by_hand(name, x, W, A, B, m, s, b)
    if expected is not None:
        assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12)
    elif name == "g rounded":  # the output of PEFT 0.21's order, rounded to bf16: within bf16 of the contract, not equal
        want = contract(x, W, A, B, m, s, b)
        assert torch.equal(y, y.to(torch.bfloat16).double()) and 0 < (y - want).abs().max() < 0.05 * want.abs().max()
    elif name in ("low-precision compose", "naive compose"):
        assert torch.equal(y, y.to(torch.bfloat16).double())  # every step rounded: the output is a bf16 value
        assert not torch.equal(y, DEVIATION_BY_NAME["g rounded"].forward(x, W, A, B, m, s, b, dtype=torch.bfloat16))
    elif name == "norm not detached / detached":
        leaves = [t.clone().requires_grad_() for t in (A, B)]
        grads_dev = torch.autograd.grad(deviation.forward(x, W, *leaves, m, s, b).sum(), leaves)
        grads_exact = torch.autograd.grad(contract(x, W, *leaves, m, s, b, detach_norm=False).sum(), leaves)
        assert all(torch.allclose(a, c) for a, c in zip(grads_dev, grads_exact))  # detached asked, exact given
        assert torch.allclose(y, contract(x, W, A, B, m, s, b))  # the forward is the contract's
    elif name == "fan_in_fan_out ignored":
        x, Wt, A, B, m, s, b = problem(fan_in_fan_out=True)
        got = deviation.forward(x, Wt, A, B, m, s, b, fan_in_fan_out=True)
        assert torch.allclose(got, contract(x, Wt, A, B, m, s, b))  # Wt read as (d_out, d_in)
    elif name == "zero row gives NaN":
        x, W, A, B, m, s, b = problem(zero_row=True)
        got = deviation.forward(x, W, A, B, m, s, b)
        want = contract(x, W, A, B, m, s, b)
        assert torch.isnan(got[:, 2]).all() and torch.isfinite(want).all()
        keep = [i for i in range(W.shape[0]) if i != 2]
        assert torch.allclose(got[:, keep], want[:, keep])
    elif name == "dropout on the base too":
        keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.3
        got = deviation.forward(x, W, A, B, m, s, b, training=True, dropout_p=0.3, dropout_mask=keep)
        x_d = x * keep / 0.7
        assert torch.allclose(got, contract(x_d, W, A, B, m, s, b))  # the whole layer on the dropped input
    else:
        pytest.fail(f"no statement for {name!r}")


def test_the_contract_knobs_give_the_contract():
    from doracheck.reference.deviations import deviant_dora

    x, W, A, B, m, s, b = problem(seed=5)
    assert torch.allclose(deviant_dora(x, W, A, B, m, s, b), contract(x, W, A, B, m, s, b), rtol=1e-12, atol=1e-12)
    n = norm_terms_ref(W, A, B, s).norm
    assert torch.allclose(n, rows_norm(W, A, B, s))
