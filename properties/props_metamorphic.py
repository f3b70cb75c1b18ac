"""The metamorphic properties (5): relations between outputs that hold exactly in real arithmetic:
row scaling of W and B, output permutation, linearity in x (``metamorphic`` states the bounds)."""

from __future__ import annotations

import torch

from doracheck.reference import rel_l2, ulp_distance, ulp_of

from .budgets import budget_for
from .diagnosis import row_scaling_cause
from .platform import permutation_slack
from .problems import Problem
from .props_common import Implementation, _call, _dtype_name, _field, _result
from .results import CheckResult


def metamorphic(impl: Implementation, p: Problem, family: str) -> list[CheckResult]:
    """Row i of W and of B scaled by 4 (exact): y unchanged (<= 1 ulp). Output features
    permuted: y permuted, within 1 ulp plus what the platform's own products move under the
    same permutation (``platform.permutation_slack``; reported in units of that allowance).
    x = x1 + x2 with disjoint supports (exact): y - b additive within 3× the forward budget."""
    dt = _dtype_name(p.x.dtype)
    d_out = p.weight_rows.shape[0]
    with torch.no_grad():
        y = _call(impl, p)
        rows = p.weight_rows.clone()
        B = p.lora_B.clone()
        scaled = torch.arange(d_out, device=B.device) % 3 == 0
        rows[scaled] *= 4
        B[scaled] *= 4
        W_scaled = rows.t().contiguous() if p.fan_in_fan_out else rows
        y_scaled = impl.dora_linear(p.x, W_scaled, p.lora_A, B, p.magnitude, p.scaling, p.bias, fan_in_fan_out=p.fan_in_fan_out)
        scale_err = float(ulp_distance(y_scaled, y).max()) if y.numel() else 0.0
        perm = torch.randperm(d_out, generator=torch.Generator().manual_seed(5)).to(B.device)
        rows_p = p.weight_rows[perm]
        W_perm = rows_p.t().contiguous() if p.fan_in_fan_out else rows_p.contiguous()
        y_perm = impl.dora_linear(
            p.x, W_perm, p.lora_A, p.lora_B[perm], p.magnitude[perm], p.scaling, None if p.bias is None else p.bias[perm],
            fan_in_fan_out=p.fan_in_fan_out,
        )
        perm_err = _permutation_error(y_perm, y[..., perm], p, perm)
        cols = torch.arange(p.x.shape[-1], device=p.x.device) % 2 == 0
        x1 = torch.where(cols, p.x, torch.zeros_like(p.x))
        x2 = p.x - x1
        b = 0 if p.bias is None else p.bias.double()
        lhs = _call(impl, p).double() - b
        rhs = (_call(impl, p, x=x1).double() - b) + (_call(impl, p, x=x2).double() - b)
        lin_err = rel_l2(lhs, rhs)
    fwd = _field(budget_for("forward", "y", dt, family), "rel_l2")
    scale_detail = "ulp distance, rows of W and B ×4"
    if not scale_err <= 1.0:
        scale_detail += " — " + row_scaling_cause(impl, p, W_scaled, B, scale_err, fwd)
    return [
        _result("meta.row_scaling", dt, scale_err, 1.0, 1, scale_detail),
        _result("meta.permutation", dt, perm_err, 1.0, 1, "|Δy| / (1 ulp + platform's own movement), features permuted"),
        _result("meta.linearity", dt, lin_err, 3 * fwd, 1, "rel L2 of y(x1+x2)-b vs (y(x1)-b)+(y(x2)-b)"),
    ]


def _permutation_error(y_perm: torch.Tensor, y_then_perm: torch.Tensor, p: Problem, perm: torch.Tensor) -> float:
    """max |y_perm - y[perm]| / (ulp(y) + the platform's own movement): <= 1 passes."""
    if not y_perm.numel():
        return 0.0
    slack = permutation_slack(p.x, p.weight_rows, p.lora_A, p.lora_B, p.magnitude, p.scaling, perm)
    allowed = ulp_of(y_then_perm.double(), y_perm.dtype) + slack.to(y_perm.device)
    moved = (y_perm.double() - y_then_perm.double()).abs()
    both_nan = torch.isnan(y_perm) & torch.isnan(y_then_perm)
    ratio = torch.where(both_nan, torch.zeros_like(moved), moved / allowed)
    return float(ratio.max())  # torch's max propagates NaN (a NaN on one side only fails)
