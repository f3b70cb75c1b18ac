"""Property checks keep NaN in their worst cases."""

from __future__ import annotations

import math

import torch

from doracheck.properties import props


def test_property_worst_cases_do_not_drop_nan():
    """max() over floats and `not (err <= worst)` used to let a NaN error pass."""
    assert props._worst_of([1e-7, float("nan"), 2e-7]) != props._worst_of([1e-7, 2e-7])
    assert math.isnan(props._worst_of([1e-7, float("nan"), 2e-7]))
    nan_impl = props.Implementation("nan", lambda x, *a, **k: torch.full((*x.shape[:-1], a[0].shape[0]), float("nan"), dtype=x.dtype))
    result = props.compose_near_one(nan_impl, torch.bfloat16, "cpu", seeds=(0,))[0]
    assert result.status == "FAIL"
