"""doracheck.dora_linear (torch path) against PEFT 0.21's DoRA, in float32.

PEFT is the reference implementation of DoRA's semantics (docs/design.md section 1). Each test
builds a tiny model, wraps it with ``peft.get_peft_model(LoraConfig(use_dora=True, ...))``
so that the targeted layer becomes a ``peft.tuners.lora.Linear`` whose DoRA part is a
``peft.tuners.lora.dora.DoraLinearLayer``, overwrites the adapter with random non-zero
values (PEFT initialises lora_B to zero, which would make DoRA the identity and any
comparison trivial), and then runs the same input through

* the PEFT module itself (``module(x)``), and
* ``doracheck.dora_linear`` on clones of the tensors taken out of that module
  (``base_layer.weight``/``bias``, ``lora_A[name].weight``, ``lora_B[name].weight``,
  ``lora_magnitude_vector[name].weight``, ``scaling[name]``).

Both are back-propagated with the same upstream gradient, and the forward output and the
gradients of x, lora_A, lora_B and the magnitude must agree to a relative L2 error of
1e-5 (``doracheck.reference.rel_l2``). That is a few fp32 ulps on these sizes: the two
implementations evaluate the same function in different orders (PEFT forms B·A densely
and adds (g-1)⊙base to the base output, doracheck uses the factored norm and a fused
compose), so bitwise equality is not expected, but any semantic difference (scaling,
transposition, dropout placement, what is detached) shows up as an O(1) error.

Cases: with and without bias; a GPT-2 ``Conv1D`` base layer (weight stored (d_in, d_out),
PEFT's ``fan_in_fan_out=True``); rsLoRA (scaling = alpha / sqrt(r)); eval mode; train mode
without dropout; train mode with dropout, where PEFT's ``lora_dropout[name]`` is replaced
by a module applying a fixed keep-mask (x·keep/(1-p)), and doracheck gets the same mask
through ``dropout_mask=keep``. PEFT only takes its dropout branch (recomputing x_d·Wᵀ)
when the dropout module is not ``nn.Identity`` and the layer is in training mode, so the
replacement module exercises exactly that branch. Shapes are non-square with odd sizes and
x is 3-D (batch, seq, d_in).

A last test documents the one intended difference: a row of W and the same row of B both
zero give a zero row of V = W + s·B·A; doracheck clamps the norm (g = m / max(n, 1e-12))
and returns 0 for that output feature, PEFT divides by zero and returns NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import Linear as PeftLoraLinear  # noqa: E402
from peft.tuners.lora.dora import DoraLinearLayer  # noqa: E402

import doracheck  # noqa: E402
from doracheck.reference import rel_l2  # noqa: E402

ADAPTER = "default"
TOL = 1e-5
DTYPE = torch.float32


# --------------------------------------------------------------------------- helpers


class _Tiny(nn.Module):
    """A one-layer model; ``proj`` is the layer PEFT wraps."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return self.proj(x)


class _SharedMaskDropout(nn.Module):
    """Stands in for ``lora_dropout[name]``: x·keep/(1-p) with a fixed 0/1 keep-mask."""

    def __init__(self, keep: torch.Tensor, p: float):
        super().__init__()
        self.register_buffer("keep", keep)
        self.p = p
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.keep / (1.0 - self.p)


@dataclass
class _Params:
    """The tensors doracheck.dora_linear needs, as taken out of a PEFT LoRA module."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    magnitude: torch.Tensor
    scaling: float
    fan_in_fan_out: bool


def _build_peft_linear(
    d_in: int,
    d_out: int,
    r: int,
    lora_alpha: float,
    *,
    bias: bool = True,
    conv1d: bool = False,
    use_rslora: bool = False,
    lora_dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, PeftLoraLinear]:
    """A PEFT DoRA model around one (d_in → d_out) layer, with random non-zero W, b, A, B, m.

    Returns (peft_model, the wrapped LoRA layer). ``conv1d=True`` uses transformers' GPT-2
    ``Conv1D`` (weight (d_in, d_out), always with a bias) and ``fan_in_fan_out=True``.
    """
    torch.manual_seed(seed)
    if conv1d:
        pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
        assert bias, "Conv1D always has a bias"
        base = pytorch_utils.Conv1D(d_out, d_in)
    else:
        base = nn.Linear(d_in, d_out, bias=bias)
    base = base.to(DTYPE)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=["proj"],
        lora_dropout=lora_dropout,
        use_dora=True,
        use_rslora=use_rslora,
        fan_in_fan_out=conv1d,
        bias="none",
    )
    model = get_peft_model(_Tiny(base), config)
    module = model.base_model.model.proj
    assert isinstance(module, PeftLoraLinear)
    assert isinstance(module.lora_magnitude_vector[ADAPTER], DoraLinearLayer)
    assert module.fan_in_fan_out == conv1d

    with torch.no_grad():
        w = module.base_layer.weight
        w.copy_(torch.randn(w.shape) / math.sqrt(d_in))
        if module.base_layer.bias is not None:
            module.base_layer.bias.copy_(torch.randn(d_out))
        a = module.lora_A[ADAPTER].weight
        a.copy_(torch.randn(a.shape) / math.sqrt(d_in))
        bw = module.lora_B[ADAPTER].weight
        bw.copy_(torch.randn(bw.shape) / math.sqrt(r))  # PEFT starts B at 0: make it non-zero
        mag = module.lora_magnitude_vector[ADAPTER].weight
        mag.copy_(0.5 + torch.rand(d_out))  # g = m / n far from 1, so (g-1)⊙base matters
    assert bool((module.lora_B[ADAPTER].weight != 0).all())
    return model, module


def _extract(module: PeftLoraLinear, name: str = ADAPTER) -> _Params:
    """The PEFT module's own tensors (no copies)."""
    base = module.base_layer
    return _Params(
        weight=base.weight,
        bias=base.bias,
        lora_A=module.lora_A[name].weight,
        lora_B=module.lora_B[name].weight,
        magnitude=module.lora_magnitude_vector[name].weight,
        scaling=module.scaling[name],
        fan_in_fan_out=module.fan_in_fan_out,
    )


def _grads(x, params: _Params) -> dict[str, torch.Tensor]:
    return {
        "x": x.grad,
        "lora_A": params.lora_A.grad,
        "lora_B": params.lora_B.grad,
        "magnitude": params.magnitude.grad,
    }


def _run_peft(module: PeftLoraLinear, x: torch.Tensor, dy: torch.Tensor):
    """PEFT forward + backward(dy); returns (y, {x, lora_A, lora_B, magnitude} grads)."""
    params = _extract(module)
    for p in (params.lora_A, params.lora_B, params.magnitude):
        p.grad = None
    xx = x.clone().requires_grad_(True)
    y = module(xx)
    y.backward(dy)
    return y.detach(), {k: v.clone() for k, v in _grads(xx, params).items()}


def _run_doracheck(params: _Params, x: torch.Tensor, dy: torch.Tensor, **kwargs):
    """doracheck.dora_linear on clones of the PEFT tensors, forward + backward(dy)."""
    clone = _Params(
        weight=params.weight.detach().clone(),  # frozen, as in PEFT
        bias=None if params.bias is None else params.bias.detach().clone(),
        lora_A=params.lora_A.detach().clone().requires_grad_(True),
        lora_B=params.lora_B.detach().clone().requires_grad_(True),
        magnitude=params.magnitude.detach().clone().requires_grad_(True),
        scaling=params.scaling,
        fan_in_fan_out=params.fan_in_fan_out,
    )
    xx = x.clone().requires_grad_(True)
    y = doracheck.dora_linear(
        xx,
        clone.weight,
        clone.lora_A,
        clone.lora_B,
        clone.magnitude,
        clone.scaling,
        clone.bias,
        fan_in_fan_out=clone.fan_in_fan_out,
        **kwargs,
    )
    y.backward(dy)
    return y.detach(), _grads(xx, clone)


def _inputs(batch: int, seq: int, d_in: int, d_out: int, seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(batch, seq, d_in, generator=g, dtype=DTYPE)
    dy = torch.randn(batch, seq, d_out, generator=g, dtype=DTYPE)
    return x, dy, g


def _errors(y_peft, g_peft, y_dc, g_dc) -> dict[str, float]:
    errs = {"y": rel_l2(y_dc, y_peft)}
    for key in ("x", "lora_A", "lora_B", "magnitude"):
        assert g_peft[key] is not None, f"PEFT gave no gradient for {key}"
        assert g_dc[key] is not None, f"doracheck gave no gradient for {key}"
        assert g_dc[key].shape == g_peft[key].shape, key
        errs[key] = rel_l2(g_dc[key], g_peft[key])
    return errs


def _assert_close(errs: dict[str, float], case: str) -> None:
    print(
        f"[{case}] worst rel_l2 = {max(errs.values()):.3e}  "
        + "  ".join(f"{k}={v:.2e}" for k, v in errs.items())
    )
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"{case}: relative L2 error above {TOL}: {bad} (all: {errs})"


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    d_in: int = 13
    d_out: int = 7
    r: int = 3
    lora_alpha: float = 5.0
    bias: bool = True
    conv1d: bool = False
    use_rslora: bool = False
    training: bool = False
    dropout_p: float = 0.0  # > 0: lora_dropout configured (and, in training, a shared mask)
    mask_per_token: bool = False  # keep-mask of shape (batch, seq, 1) instead of x's shape
    batch: int = 2
    seq: int = 5
    seed: int = 0


CASES = [
    pytest.param(Case(), id="linear-bias-eval"),
    pytest.param(Case(bias=False, seed=1), id="linear-nobias-eval"),
    pytest.param(Case(d_in=5, d_out=11, r=2, lora_alpha=3.0, seed=2), id="linear-wide-bias-eval"),
    pytest.param(Case(training=True, seed=3), id="linear-bias-train-nodropout"),
    pytest.param(Case(conv1d=True, seed=4), id="conv1d-fanin-fanout-eval"),
    pytest.param(Case(conv1d=True, training=True, seed=5), id="conv1d-fanin-fanout-train"),
    pytest.param(Case(use_rslora=True, lora_alpha=7.0, seed=6), id="rslora-eval"),
    pytest.param(Case(use_rslora=True, bias=False, training=True, seed=7), id="rslora-nobias-train"),
    pytest.param(Case(dropout_p=0.3, seed=8), id="dropout-configured-eval"),
    pytest.param(Case(dropout_p=0.3, training=True, seed=9), id="dropout-train-shared-mask"),
    pytest.param(Case(dropout_p=0.25, training=True, bias=False, seed=10), id="dropout-train-nobias"),
    pytest.param(
        Case(dropout_p=0.4, training=True, conv1d=True, use_rslora=True, d_in=9, d_out=15, r=5, seed=11),
        id="dropout-train-conv1d-rslora",
    ),
    pytest.param(
        Case(dropout_p=0.5, training=True, mask_per_token=True, seed=12), id="dropout-train-token-mask"
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_peft_dora(case: Case, request):
    model, module = _build_peft_linear(
        case.d_in,
        case.d_out,
        case.r,
        case.lora_alpha,
        bias=case.bias,
        conv1d=case.conv1d,
        use_rslora=case.use_rslora,
        lora_dropout=case.dropout_p,
        seed=case.seed,
    )
    model.train(case.training)
    params = _extract(module)
    expected_s = case.lora_alpha / (math.sqrt(case.r) if case.use_rslora else case.r)
    assert params.scaling == pytest.approx(expected_s, rel=1e-12)
    assert (params.bias is not None) == case.bias
    layout = (case.d_in, case.d_out) if case.conv1d else (case.d_out, case.d_in)
    assert tuple(params.weight.shape) == layout

    x, dy, gen = _inputs(case.batch, case.seq, case.d_in, case.d_out, case.seed)
    kwargs = {}
    shared = None
    if case.dropout_p > 0 and case.training:
        mask_shape = (case.batch, case.seq, 1) if case.mask_per_token else x.shape
        keep = (torch.rand(mask_shape, generator=gen) >= case.dropout_p).to(DTYPE)
        assert 0 < keep.sum() < keep.numel()
        shared = _SharedMaskDropout(keep, case.dropout_p)
        module.lora_dropout[ADAPTER] = shared
        kwargs = {"dropout_p": case.dropout_p, "training": True, "dropout_mask": keep}
    elif case.training:
        assert isinstance(module.lora_dropout[ADAPTER], nn.Identity)
        kwargs = {"training": True}
    else:
        kwargs = {"dropout_p": case.dropout_p, "training": False}

    y_peft, g_peft = _run_peft(module, x, dy)
    y_dc, g_dc = _run_doracheck(params, x, dy, **kwargs)

    assert y_dc.shape == y_peft.shape == (case.batch, case.seq, case.d_out)
    assert y_dc.dtype == y_peft.dtype == DTYPE
    assert torch.isfinite(y_peft).all() and torch.isfinite(y_dc).all()
    if shared is not None:
        # PEFT really took its dropout branch, and the mask really changes the result.
        assert shared.calls == 1
        y_nodrop, _ = _run_doracheck(params, x, dy)
        assert rel_l2(y_nodrop, y_peft) > 1e-3

    _assert_close(_errors(y_peft, g_peft, y_dc, g_dc), case=request.node.callspec.id)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_zero_row_doracheck_zero_peft_nan(bias: bool):
    """Row i of W and row i of B all zero: V_i = 0, n_i = 0 (a documented difference).

    doracheck: g_i = m_i / max(0, 1e-12) and z_i = x·V_iᵀ = 0 exactly, so the DoRA part of
    feature i is 0: y[..., i] = 0 without bias, = b_i with bias; every gradient is finite and
    dm_i = 0. PEFT 0.21: m_i / 0 = inf and inf·0 = NaN, so y[..., i] is NaN, and in the
    backward the NaN spreads to all of dx and dA, row i of dB and dm_i. Everything that PEFT
    leaves finite must still agree with doracheck to 1e-5.
    """
    d_in, d_out, r, i = 13, 7, 3, 4
    model, module = _build_peft_linear(d_in, d_out, r, 5.0, bias=bias, seed=20)
    model.eval()
    with torch.no_grad():
        module.base_layer.weight[i].zero_()
        module.lora_B[ADAPTER].weight[i].zero_()
    params = _extract(module)
    assert float(params.magnitude.detach()[i]) > 0
    x, dy, _ = _inputs(2, 5, d_in, d_out, seed=20)

    y_dc, g_dc = _run_doracheck(params, x, dy)
    expected_i = (
        torch.zeros_like(y_dc[..., i]) if not bias else params.bias.detach()[i].expand_as(y_dc[..., i])
    )
    assert torch.equal(y_dc[..., i], expected_i), "doracheck: a zero row of V must give a zero DoRA term"
    assert torch.isfinite(y_dc).all()
    for key, grad in g_dc.items():
        assert torch.isfinite(grad).all(), f"doracheck: non-finite gradient for {key}"
    assert float(g_dc["magnitude"][i]) == 0.0

    y_peft, g_peft = _run_peft(module, x, dy)
    version = peft.__version__
    assert bool(torch.isnan(y_peft[..., i]).all()), f"PEFT {version} no longer gives NaN for a zero row of V"
    assert bool(torch.isnan(g_peft["x"]).all()) and bool(torch.isnan(g_peft["lora_A"]).all())
    assert bool(torch.isnan(g_peft["lora_B"][i]).all()) and bool(torch.isnan(g_peft["magnitude"][i]))

    others = [j for j in range(d_out) if j != i]
    assert torch.isfinite(y_peft[..., others]).all()
    errs = {
        "y": rel_l2(y_dc[..., others], y_peft[..., others]),
        "lora_B": rel_l2(g_dc["lora_B"][others], g_peft["lora_B"][others]),
        "magnitude": rel_l2(g_dc["magnitude"][others], g_peft["magnitude"][others]),
    }
    _assert_close(errs, case=f"zero-row-{'bias' if bias else 'nobias'} (features != {i})")
