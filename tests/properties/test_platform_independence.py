"""The suite on a platform whose GEMMs are not bitwise permutation-equivariant (docs/design.md section 3).

Some CPUs (an AMD EPYC with torch's AVX2 build, for one) give other bits for ``x @ W.t()`` when
the rows of W are permuted. CI cannot choose its machine, so this test makes such a platform on
purpose: a dispatch mode that computes every float GEMM in three K-chunks and adds them in an
order that depends on the output column ((p1 + p2) + p3 for even columns, p1 + (p2 + p3) for odd
ones). Under it the old bitwise-permutation check fails, and the suite as it is passes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import doracheck
from doracheck.dispatch import use_path
from doracheck.properties import make_problem, props, run_suite
from doracheck.properties.implementations import doracheck_implementation
from doracheck.reference import ulp_distance

aten = torch.ops.aten


def _column_ordered_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    K = a.shape[-1]
    if K < 3 or not a.is_floating_point():
        return aten.mm.default(a, b)
    c1, c2 = K // 3, 2 * K // 3
    p1, p2, p3 = (aten.mm.default(a[:, i:j], b[i:j]) for i, j in ((0, c1), (c1, c2), (c2, K)))
    left, right = (p1 + p2) + p3, p1 + (p2 + p3)
    odd = torch.arange(b.shape[1]) % 2 == 1
    return torch.where(odd, right, left)


class ColumnOrderedGemms(TorchDispatchMode):
    """Every mm / addmm / bmm with an accumulation order that depends on the output column."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default:
            return _column_ordered_mm(*args)
        if func is aten.mm.out:
            return kwargs["out"].copy_(_column_ordered_mm(*args))
        if func in (aten.addmm.default, aten.addmm.out):
            inp, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            prod = _column_ordered_mm(a, b)
            res = prod * alpha if beta == 0 else inp * beta + prod * alpha
            return kwargs["out"].copy_(res) if "out" in kwargs else res.to(prod.dtype)
        if func is aten.bmm.default:
            a, b = args
            return torch.stack([_column_ordered_mm(a[i], b[i]) for i in range(a.shape[0])])
        return func(*args, **kwargs)


def test_the_mode_breaks_bitwise_permutation_equivariance():
    gen = torch.Generator().manual_seed(0)
    x, W = torch.randn(5, 64, generator=gen), torch.randn(7, 64, generator=gen)
    perm = torch.tensor([1, 0, 3, 2, 5, 4, 6])
    with ColumnOrderedGemms():
        moved = ulp_distance(x @ W[perm].t(), (x @ W.t())[:, perm])
    assert float(moved.max()) >= 1  # this platform permutes inexactly


def test_doracheck_output_moves_under_permutation_on_that_platform():
    """What the old check (<= 1 ulp, bitwise in spirit) demanded does not hold there."""
    p = make_problem(16, 33, 8, 9, torch.float32, seed=11)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(5))
    with ColumnOrderedGemms(), use_path("torch"), torch.no_grad():
        y = doracheck.dora_linear(p.x, p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias)
        y_perm = doracheck.dora_linear(p.x, p.weight[perm], p.lora_A, p.lora_B[perm], p.magnitude[perm], p.scaling, p.bias[perm])
    assert float(ulp_distance(y_perm, y[..., perm]).max()) > 1


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_the_quick_suite_passes_on_that_platform(dt):
    with ColumnOrderedGemms(), use_path("torch"):
        results = run_suite(doracheck_implementation("torch"), [dt], "quick", "cpu")
    failed = [f"{r.prop} [{r.dtype}]: {r.worst:.3e} > {r.budget:.3e} ({r.detail})" for r in results if r.status == "FAIL"]
    assert not failed, failed
    assert any(r.prop == "meta.permutation" and r.status == "pass" for r in results)


def test_permutation_property_still_catches_a_wrong_axis_there():
    problem = make_problem(16, 33, 8, 9, torch.float32, seed=11)

    def positional(x, weight, *args, **kwargs):
        y = doracheck.dora_linear(x, weight, *args, **kwargs)
        bump = torch.ones(y.shape[-1], dtype=y.dtype)
        bump[-1] += 1e-3
        return y * bump

    with ColumnOrderedGemms(), use_path("torch"):
        results = props.metamorphic(props.Implementation("positional", positional), problem, "cpu")
    assert next(r for r in results if r.prop == "meta.permutation").status == "FAIL"
