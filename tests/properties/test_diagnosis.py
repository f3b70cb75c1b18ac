"""Verification that names the cause: each known deviation (``reference.deviations``), planted in
a thin wrapper around doracheck's own layer (``tests/deviants.py``), is failed by the quick suite
in the dtype where it shows, and the failure lines name it; the correct layer is named by none.
The planted × diagnosed matrix is printed (``-s``) for the record."""

from __future__ import annotations

import re

import pytest
from deviants import PLANTED

from doracheck.properties.implementations import doracheck_implementation
from doracheck.properties.props_common import Implementation
from doracheck.properties.suite import run_suite
from doracheck.reference.deviations import DEVIATION_BY_NAME, DEVIATIONS

NAMED = re.compile(r'matches "([^"]+)"')


def diagnosed(impl: Implementation, dtype: str) -> tuple[list[str], set[str]]:
    """(the failing properties, the deviation classes their failure lines name)."""
    rows = [r for r in run_suite(impl, [dtype], "quick", "cpu") if r.status == "FAIL"]
    return [f"{r.prop} [{r.dtype}]" for r in rows], {name for r in rows for name in NAMED.findall(r.detail)}


def test_every_class_is_planted():
    assert set(PLANTED) == set(DEVIATION_BY_NAME) and len(DEVIATIONS) == 15


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_deviation_fails_and_is_named(name):
    wrapper, dtype = PLANTED[name]
    failed, named = diagnosed(Implementation(f"planted: {name}", wrapper), dtype)
    print(f"\nplanted {name!r} [{dtype}]: failed {failed}; diagnosed {sorted(named)}")
    assert failed, f"{name}: no property failed"
    assert named == {name}, f"{name}: failures {failed} name {sorted(named)}"  # the diagonal of the matrix


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_correct_layer_is_named_by_none(dtype):
    failed, named = diagnosed(doracheck_implementation(), dtype)
    assert not failed and not named


def test_a_row_scaling_failure_is_explained_by_the_form_that_causes_it():
    """Rows of W and B ×4 leave g⊙z exactly invariant; PEFT's (g-1)·base + base form, rounded in
    fp32, is not (as PEFT 0.21 fails it). Its failure line names that form; the product form
    rounded in the same dtype (the naive compose) passes, so the explanation discriminates."""
    import torch
    from deviants import low_precision_compose, naive_compose

    from doracheck.properties.problems import cases_for
    from doracheck.properties.props_metamorphic import metamorphic

    case = cases_for(torch.float32, "cpu")[1]
    row = {r.prop: r for r in metamorphic(Implementation("(g-1) form", low_precision_compose), case, "cpu")}["meta.row_scaling"]
    assert row.status == "FAIL" and "explained by the (g-1)·base + base form" in row.detail, row.detail
    product = {r.prop: r for r in metamorphic(Implementation("product form", naive_compose), case, "cpu")}["meta.row_scaling"]
    assert product.status == "pass", product.detail
    for name in ("bias scaled by g", "column norm", "magnitude ignored"):  # they move y too, for another reason
        wrapper, _ = PLANTED[name]
        row = {r.prop: r for r in metamorphic(Implementation(name, wrapper), case, "cpu")}["meta.row_scaling"]
        assert row.status == "FAIL" and "(g-1)" not in row.detail and NAMED.findall(row.detail) == [name], row.detail
