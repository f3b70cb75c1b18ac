"""``doracheck.properties.impl_peft.peft_dora_linear`` (PEFT's own DoRA layer behind
``dora_linear``'s signature) against the fp64 oracle ``doracheck.reference.dora_forward_ref``.

float32, odd shapes (d_in=13, d_out=7, r=3, x (2, 5, 13)); forward and the gradients of x,
weight, lora_A, lora_B, magnitude and bias must agree to relative L2 <= 1e-5: a few fp32
ulps, while any semantic slip in the wrapper (scaling, transposition, dropout placement,
which parameter got substituted) would be an O(1) error. Dropout cases share one keep-mask
between PEFT and the oracle. Also: ``detach_norm=False`` and a missing peft raise
``Unsupported``; PEFT's NaN for a zero row of W + s·B·A comes through; PEFT's optional DoRA
cache cannot serve a norm from an earlier call.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("peft")

from doracheck.properties.impl_peft import peft_dora_linear  # noqa: E402
from doracheck.properties.unsupported import Unsupported  # noqa: E402
from doracheck.reference import dora_forward_ref, rel_l2  # noqa: E402

TOL = 1e-5
D_IN, D_OUT, R = 13, 7, 3
X_SHAPE = (2, 5, D_IN)
P = 0.3


def _problem(seed: int, *, with_bias: bool, fan_in_fan_out: bool, scaling: float = 2.0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

    W = randn(D_OUT, D_IN, scale=D_IN**-0.5)
    A = randn(R, D_IN, scale=D_IN**-0.5)
    B = randn(D_OUT, R, scale=R**-0.5)
    n = torch.linalg.norm(W.double() + scaling * (B.double() @ A.double()), dim=1)
    m = (n * (1 + 0.1 * (torch.rand(D_OUT, generator=gen, dtype=torch.float64) - 0.5))).float()
    x = randn(*X_SHAPE)
    b = randn(D_OUT, scale=0.1) if with_bias else None
    weight = W.t().contiguous() if fan_in_fan_out else W
    tensors = {"x": x, "weight": weight, "lora_A": A, "lora_B": B, "magnitude": m, "bias": b}
    mask = (torch.rand(X_SHAPE, generator=gen) >= P).float()
    dy = randn(*X_SHAPE[:-1], D_OUT)
    return tensors, scaling, mask, dy


def _run(fn, tensors, scaling, dy, dtype, **kwargs):
    leaves = {
        k: (v.detach().to(dtype).requires_grad_() if v is not None else None) for k, v in tensors.items()
    }
    y = fn(
        leaves["x"],
        leaves["weight"],
        leaves["lora_A"],
        leaves["lora_B"],
        leaves["magnitude"],
        scaling,
        leaves["bias"],
        **kwargs,
    )
    names = [k for k, v in leaves.items() if v is not None]
    grads = torch.autograd.grad(y, [leaves[k] for k in names], dy.to(y.dtype))
    return y.detach(), dict(zip(names, grads))


@pytest.mark.parametrize("mode", ["eval", "train_no_dropout", "train_dropout"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True], ids=["W_out_in", "fan_in_fan_out"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_matches_fp64_oracle(with_bias, fan_in_fan_out, mode):
    tensors, s, mask, dy = _problem(
        7 + 2 * with_bias + fan_in_fan_out, with_bias=with_bias, fan_in_fan_out=fan_in_fan_out
    )
    kwargs = {"fan_in_fan_out": fan_in_fan_out}
    if mode == "train_no_dropout":
        kwargs.update(training=True, dropout_p=0.0)
    elif mode == "train_dropout":
        kwargs.update(training=True, dropout_p=P, dropout_mask=mask)
    y, grads = _run(peft_dora_linear, tensors, s, dy, torch.float32, **kwargs)
    y_ref, grads_ref = _run(dora_forward_ref, tensors, s, dy, torch.float64, **kwargs)
    assert y.dtype == torch.float32 and y.shape == (*X_SHAPE[:-1], D_OUT)
    errors = {"y": rel_l2(y, y_ref)} | {f"d{k}": rel_l2(g, grads_ref[k]) for k, g in grads.items()}
    assert set(errors) == {"y", "dx", "dweight", "dlora_A", "dlora_B", "dmagnitude"} | (
        {"dbias"} if with_bias else set()
    )
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"relative L2 above {TOL}: {bad} (all: {errors})"


def test_dropout_inactive_in_eval_ignores_the_mask():
    tensors, s, mask, dy = _problem(3, with_bias=True, fan_in_fan_out=False)
    args = [tensors[k] for k in ("x", "weight", "lora_A", "lora_B", "magnitude")]
    y_eval = peft_dora_linear(*args, s, tensors["bias"])
    y_masked = peft_dora_linear(*args, s, tensors["bias"], dropout_p=P, training=False, dropout_mask=mask)
    torch.testing.assert_close(y_masked, y_eval, rtol=0, atol=0)
    y_train = peft_dora_linear(*args, s, tensors["bias"], dropout_p=P, training=True, dropout_mask=mask)
    assert rel_l2(y_train, y_eval) > 1e-3  # the mask does act in training


def test_dropout_without_mask_draws_one():
    tensors, s, _, _ = _problem(4, with_bias=True, fan_in_fan_out=False)
    args = [tensors[k] for k in ("x", "weight", "lora_A", "lora_B", "magnitude")]
    y_eval = peft_dora_linear(*args, s, tensors["bias"])
    torch.manual_seed(0)
    y = peft_dora_linear(*args, s, tensors["bias"], dropout_p=0.5, training=True)
    assert torch.isfinite(y).all()
    assert rel_l2(y, y_eval) > 1e-3


def test_scaling_is_set_per_call():
    """The cached PEFT module must not keep the scaling of an earlier call."""
    for s in (2.0, 0.5, 2.0):
        tensors, _, _, dy = _problem(5, with_bias=False, fan_in_fan_out=False, scaling=s)
        y, _ = _run(peft_dora_linear, tensors, s, dy, torch.float32)
        y_ref, _ = _run(dora_forward_ref, tensors, s, dy, torch.float64)
        assert rel_l2(y, y_ref) <= TOL


def test_peft_dora_cache_cannot_serve_stale_norms(monkeypatch):
    """With PEFT's ENABLE_DORA_CACHING on (eval mode caches B·A and the norm per layer), a
    second call with other adapter weights must still use its own norm."""
    from peft.tuners.lora import dora as peft_dora

    monkeypatch.setattr(peft_dora, "ENABLE_DORA_CACHING", True)
    for seed in (11, 12):
        tensors, s, _, dy = _problem(seed, with_bias=True, fan_in_fan_out=False)
        y, _ = _run(peft_dora_linear, tensors, s, dy, torch.float32)
        y_ref, _ = _run(dora_forward_ref, tensors, s, dy, torch.float64)
        assert rel_l2(y, y_ref) <= TOL


def test_detach_norm_false_is_unsupported():
    tensors, s, _, _ = _problem(6, with_bias=True, fan_in_fan_out=False)
    args = [tensors[k] for k in ("x", "weight", "lora_A", "lora_B", "magnitude")]
    with pytest.raises(Unsupported, match="always detaches the weight norm"):
        peft_dora_linear(*args, s, tensors["bias"], detach_norm=False)


def test_missing_peft_is_unsupported(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    tensors, s, _, _ = _problem(6, with_bias=True, fan_in_fan_out=False)
    args = [tensors[k] for k in ("x", "weight", "lora_A", "lora_B", "magnitude")]
    with pytest.raises(Unsupported, match="peft is not installed"):
        peft_dora_linear(*args, s, tensors["bias"])


def test_zero_row_gives_nan_as_peft_does():
    """PEFT divides by ||V_i|| without a clamp: a zero row of V = W + s·B·A gives NaN for that
    output feature (doracheck gives 0 there). The wrapper must not hide it."""
    tensors, s, _, _ = _problem(8, with_bias=True, fan_in_fan_out=False)
    tensors["weight"][2].zero_()
    tensors["lora_B"][2].zero_()
    args = [tensors[k] for k in ("x", "weight", "lora_A", "lora_B", "magnitude")]
    y = peft_dora_linear(*args, s, tensors["bias"])
    assert torch.isnan(y[..., 2]).all()
    others = torch.cat([y[..., :2], y[..., 3:]], dim=-1)
    assert torch.isfinite(others).all()
    ref = dora_forward_ref(*args, s, tensors["bias"])
    assert torch.isfinite(ref).all()  # the oracle clamps the norm: feature 2 is just the bias
