"""Property checks keep NaN in their worst cases, and a failure says where it fails."""

from __future__ import annotations

import math

import torch

import doracheck
from doracheck.properties import props


def test_property_worst_cases_do_not_drop_nan():
    """max() over floats and `not (err <= worst)` used to let a NaN error pass."""
    assert props._worst_of([1e-7, float("nan"), 2e-7]) != props._worst_of([1e-7, 2e-7])
    assert math.isnan(props._worst_of([1e-7, float("nan"), 2e-7]))
    nan_impl = props.Implementation("nan", lambda x, *a, **k: torch.full((*x.shape[:-1], a[0].shape[0]), float("nan"), dtype=x.dtype))
    result = props.compose_near_one(nan_impl, torch.bfloat16, "cpu", seeds=(0,))[0]
    assert result.status == "FAIL"


def test_a_gradcheck_failure_names_the_input_the_element_and_both_values():
    """A magnitude gradient 1% off: the failure line says which input, which element, the analytic
    and the numerical value and the relative error, not only that gradcheck failed."""
    import re

    from doracheck.properties.props_common import Implementation

    def dm_one_percent_off(x, W, A, B, m, s, b=None, **kw):
        m = m * 1
        if m.requires_grad:
            m.register_hook(lambda grad: grad * 1.01)
        return doracheck.dora_linear(x, W, A, B, m, s, b, **kw)

    results = props.gradcheck_fp64(Implementation("dm-off", dm_one_percent_off), "cpu")
    assert results and all(r.status == "FAIL" for r in results)
    for r in results:
        assert re.search(r"worst dmagnitude\[\d+\] \(output \d+\): analytic \S+ vs numerical \S+, error 0\.01", r.detail), r.detail
        assert 0.009 < r.worst < 0.011
