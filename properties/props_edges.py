"""Properties 7 merge_unmerge, 8 determinism_edges, 9 no_stale_cache (module, edges, cache; see ``props``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from doracheck.reference import dora_forward_ref, rel_l2

from .budgets import budget_for, u
from .diagnosis import explaining, rel_distance, verdict
from .problems import make_problem
from .props_common import Implementation, _call, _dtype_name, _field, _grads, _na, _result, _worst_of
from .results import CheckResult


# 7 ---------------------------------------------------------------------------------------
def merge_unmerge(impl: Implementation, dtype: torch.dtype, family: str, device="cpu") -> list[CheckResult]:
    dt = _dtype_name(dtype)
    if impl.module_cls is None:
        return [_na("merge.forward", dt, "the implementation exposes no module with merge/unmerge")]
    gen = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(48, 40).to(device=device, dtype=dtype)
    layer: Any = impl.module_cls.from_linear(linear, r=8, lora_alpha=16)  # type: ignore[attr-defined]
    with torch.no_grad():  # every tensor from the seeded generator: reproducible whatever the global RNG
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen).to(linear.weight) / 48**0.5)
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen).to(linear.bias) * 0.1)
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen).to(layer.lora_A) / 48**0.5)
        layer.magnitude.copy_(torch.linalg.norm(linear.weight.double(), dim=1).to(layer.magnitude))
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen).to(layer.lora_B) * 0.1)
        layer.magnitude.mul_(1 + 0.05 * torch.randn(layer.magnitude.shape, generator=gen).to(layer.magnitude))
    layer.eval()
    x = torch.randn(6, 48, generator=gen).to(device=device, dtype=dtype)
    W0 = layer.weight.detach().clone()
    with torch.no_grad():
        y_ref = dora_forward_ref(x, W0, layer.lora_A, layer.lora_B, layer.magnitude, layer.scaling, layer.bias)
        layer.merge()
        y_merged = layer(x)
        layer.unmerge()
    return [
        _result("merge.forward", dt, rel_l2(y_merged, y_ref), _field(budget_for("merge", "y", dt, family), "rel_l2"), 1, "x·W'ᵀ + b vs the unmerged fp64 forward"),
        _result("merge.unmerge", dt, rel_l2(layer.weight, W0), _field(budget_for("unmerge", "weight", dt, family), "rel_l2"), 1, "W after merge + unmerge vs W"),
    ]


# 8 ---------------------------------------------------------------------------------------
# edge.zero_row's case as a reproducer rebuilds it (properties/repro.py): row 4 of W and of B zeroed, no bias.
_ZERO_ROW_EDIT = ("W, B = p.weight_rows.clone(), p.lora_B.clone()\nW[4] = 0\nB[4] = 0  # row 4 of W + s·B·A is zero\n"
                  "p = replace(p, weight=W.t().contiguous() if p.fan_in_fan_out else W, lora_B=B, bias=None)")


def determinism_edges(impl: Implementation, dtype: torch.dtype, family: str, device="cpu") -> list[CheckResult]:
    dt = _dtype_name(dtype)
    p = make_problem(17, 23, 5, (3, 7), dtype, seed=11, device=device)
    dy = torch.randn(3, 7, 17, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    y1, g1 = _grads(impl.dora_linear, p, dy, lambda t: t.detach().clone())
    y2, g2 = _grads(impl.dora_linear, p, dy, lambda t: t.detach().clone())
    same = torch.equal(y1, y2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    results = [CheckResult("edge.bitwise_repeat", dt, same, 0.0 if same else 1.0, 0.0, 1, "two identical calls, y and grads")]
    with torch.no_grad():
        y = _call(impl, p)
        empty = impl.dora_linear(p.x[:, :0], p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias)
        one = impl.dora_linear(p.x[0, :1], p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias)
        shapes_ok = tuple(empty.shape) == (3, 0, 17) and tuple(one.shape) == (1, 17)
        one_err = rel_l2(one, y[0, :1])
        nc = impl.dora_linear(p.x.transpose(0, 1), p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias)
        nc_err = rel_l2(nc, y.transpose(0, 1))
        flat = impl.dora_linear(p.x.reshape(-1, 23), p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias)
        flat_err = rel_l2(flat, y.reshape(-1, 17))
        W = p.weight_rows.clone()
        B = p.lora_B.clone()
        W[4] = 0
        B[4] = 0
        W = W.t().contiguous() if p.fan_in_fan_out else W
        yz = impl.dora_linear(p.x, W, p.lora_A, B, p.magnitude, p.scaling, None, fan_in_fan_out=p.fan_in_fan_out)
        x = p.x.clone()
        x[1, 2, 3] = float("nan")
        x[2, 5, 0] = float("inf")
        yn = _call(impl, p, x=x)
        bad = ~torch.isfinite(x).all(-1)
    fwd = _field(budget_for("forward", "y", dt, family), "rel_l2")
    zero_ok = bool((yz[..., 4] == 0).all())
    nan_ok = bool((~torch.isfinite(yn[bad])).all()) and bool(torch.isfinite(yn[~bad]).all())
    results += [
        CheckResult("edge.shapes_T0_T1", dt, shapes_ok, 0.0 if shapes_ok else 1.0, 0.0, 1, "T = 0 gives (..., 0, d_out); T = 1 works"),
        _result("edge.T1_consistent", dt, one_err, fwd, 1, "y(x[:1]) vs y(x)[:1]"),
        _result("edge.noncontiguous", dt, nc_err, fwd, 1, "transposed (non-contiguous) x"),
        _result("edge.3d", dt, flat_err, fwd, 1, "3-D x vs flattened"),
        CheckResult("edge.zero_row", dt, zero_ok, 0.0 if zero_ok else 1.0, 0.0, 1,
                    "a zero row of W and B gives 0, not NaN" + ("" if zero_ok else " — " + _zero_row_cause(impl, p, yz, W, B, fwd)),
                    case={"recipe": p.recipe, "edit": _ZERO_ROW_EDIT}),
        CheckResult("edge.nan_inf", dt, nan_ok, 0.0 if nan_ok else 1.0, 0.0, 1, "NaN/Inf in x reach that row only"),
    ]
    return results


def _zero_row_cause(impl: Implementation, p, y_zero, W, B, forward_budget: float) -> str:
    """The failure's cause on the zero-row problem (no bias: y is 0 there by contract)."""
    zero = replace(p, weight=W, lora_B=B, bias=None)
    tolerance = 4 * u(_dtype_name(p.x.dtype)) + forward_budget  # the activation dtype's roundings, a naive compose's
    return verdict(explaining(impl, zero, rel_distance({"y": tolerance})))


# 9 ---------------------------------------------------------------------------------------
def no_stale_cache(impl: Implementation, dtype: torch.dtype, family: str, device="cpu") -> list[CheckResult]:
    """In-place updates (A, B, W, m, each ×1.25 under no_grad) must be seen by the next call."""
    dt = _dtype_name(dtype)
    p = make_problem(24, 40, 8, 6, dtype, seed=21, device=device)
    W, A, B, m = (t.clone() for t in (p.weight, p.lora_A, p.lora_B, p.magnitude))
    if impl.clear_cache is not None:  # a known starting state: any cache may serve what it stored
        impl.clear_cache()
    errors = []
    for t in (A, B, W, m):
        with torch.no_grad():
            impl.dora_linear(p.x, W, A, B, m, p.scaling, p.bias)  # populate any cache
            t.mul_(1.25)
            y = impl.dora_linear(p.x, W, A, B, m, p.scaling, p.bias)
            ref = dora_forward_ref(p.x, W, A, B, m, p.scaling, p.bias)
        errors.append(rel_l2(y, ref))
    worst = _worst_of(errors)
    return [_result("cache.no_stale", dt, worst, _field(budget_for("forward", "y", dt, family), "rel_l2"), 4, "after in-place updates of A, B, W, m")]
