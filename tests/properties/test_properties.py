"""The property suite as pytest sees it: hypothesis-driven properties on the torch path (and
the Triton kernels under the interpreter where CI has no GPU), sharpness of the compose
property, and the budgets file's own sanity.

hypothesis runs with the "ci" profile from conftest (derandomized, bounded, no deadline).

Each property these tests run fails on at least one planted bug (so none of them can pass
whatever the implementation does):

| property | planted bug that fails it | where |
|---|---|---|
| norm.three_term | a bf16-accumulated norm; the norm 1e-3 off in bf16 | test_mutations.py |
| norm.memory | the norm through the dense W + s·B·A | test_norm_memory_fails_a_dense_norm |
| compose.near_one | a naive low-precision compose; g one ulp off; PEFT's form | test_mutations.py, test_compose_property_is_sharp |
| grad.gradcheck, backward.* | dm missing its 1/n; a norm over the wrong axis | test_mutations.py |
| meta.permutation | an output off at one feature position | test_permutation_property_catches_a_position_dependent_error |
| ratio.* | dx, dA, dB, dm 1% off in bf16 or fp16 alone | test_mutations.py (tests/mutants.py) |
| merge.forward | a merge that leaves g out | test_mutations.py |
| edge.zero_row | PEFT's NaN on a zero row | test_verify_cli.py |
| cache.no_stale | a norm cache blind to version counters | test_mutations.py |
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import doracheck
from doracheck.dispatch import use_path
from doracheck.properties import Implementation, all_budgets, device_family, props
from doracheck.properties.implementations import doracheck_implementation
from doracheck.properties.problems import make_problem
from doracheck.properties.strategies import problems
from doracheck.reference import naive_compose, peft_style_dora

FAMILY = device_family("cpu")
IMPL = doracheck_implementation("torch")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_all(results):
    bad = [r for r in results if r.status == "FAIL"]
    assert not bad, "; ".join(f"{r.prop}[{r.dtype}] {r.worst:.3e} > {r.budget:.3e}: {r.detail}" for r in bad)


@given(problems(max_dim=40, kinds=("random", "fresh", "dynamic_range", "zero_rows", "near_limits")))
def test_forward_backward_within_budget(problem):
    _assert_all(props.backward_vs_oracle(IMPL, [problem], FAMILY))


@given(problems(min_dim=12, max_dim=24, min_rank=2, tokens=(5, (2, 3)), dtypes=(torch.float32, torch.bfloat16),
                kinds=("random", "fresh", "cancel", "near_limits")))
def test_baseline_ratio(problem):
    """Shapes and kinds where a ratio means something (a dynamic-range output sits in a few entries,
    and zero rows leave the naive baseline NaN: the oracle distance and edge.zero_row judge those):
    every example compares something."""
    results = props.baseline_ratio_checks(IMPL, [problem], FAMILY)
    assert any(r.status != "n/a" for r in results), [r.detail for r in results]
    _assert_all(results)


@given(problems(max_dim=12, max_rank=4, tokens=(1, 3)))
def test_three_term_identity_against_mpmath(problem):
    _assert_all(props.three_term_identity(IMPL, [problem], FAMILY))


@given(problems(max_dim=32, kinds=("random", "fresh", "dynamic_range", "zero_rows")))
def test_metamorphic_relations(problem):
    _assert_all(props.metamorphic(IMPL, problem, FAMILY))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(seed=st.integers(0, 2**16))
def test_compose_within_half_ulp_near_one(dtype, seed):
    _assert_all(props.compose_near_one(IMPL, dtype, FAMILY, seeds=(seed,)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compose_property_is_sharp(dtype):
    """The naive low-precision compose (g rounded to the dtype) and PEFT's form both violate
    the 0.5-ulp property on the same problems, so passing it means something."""
    budget = props.budget_for("compose", "y", props._dtype_name(dtype), FAMILY)
    p = props.compose_problem(dtype, seed=2)
    naive = Implementation("peft-style", peft_style_dora)
    with torch.no_grad():
        y_peft = props._call(naive, p)
        W, A, B = p.weight.double(), p.lora_A.double(), p.lora_B.double()
        base = (p.x.double() @ W.t()).to(dtype)
        lora = ((p.x.double() @ A.t()) @ B.t()).to(dtype)
        n = torch.linalg.norm(W + 2.0 * B @ A, dim=1)
        y_naive = naive_compose(base, lora, p.magnitude.double() / n, 2.0, p.bias)
    assert float(props.compose_error_ulps(y_peft, p, budget.fp32_terms).max()) > 4 * budget.ulp
    assert float(props.compose_error_ulps(y_naive, p, budget.fp32_terms).max()) > 4 * budget.ulp
    _assert_all(props.compose_near_one(IMPL, dtype, FAMILY, seeds=(2,)))


def test_gradcheck_both_norm_modes():
    _assert_all(props.gradcheck_fp64(IMPL, FAMILY))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_edges_cache_memory(dtype):
    _assert_all(props.merge_unmerge(IMPL, dtype, FAMILY))
    _assert_all(props.determinism_edges(IMPL, dtype, FAMILY))
    _assert_all(props.no_stale_cache(IMPL, dtype, FAMILY))


def test_norm_memory_within_declared_bound_and_far_below_dense():
    """The torch path on the CPU, measured by the allocation tracker: family "cpu" whatever
    TRITON_INTERPRET says (under the interpreter family the property is n/a, and CI sets it)."""
    results = props.norm_memory(IMPL, torch.bfloat16, "cpu", "cpu", IMPL.norm_memory_bound)
    assert [r.status for r in results] == ["pass"], results


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the Triton path natively (gpu tests)")
def test_triton_kernels_under_interpreter_pass_core_properties():
    impl = doracheck_implementation("triton")
    for dtype in (torch.float32, torch.bfloat16):
        p = props.make_problem(13, 21, 4, (2, 3), dtype, seed=5)
        with use_path("triton"):
            _assert_all(props.backward_vs_oracle(impl, [p], "interpreter"))
            _assert_all(props.compose_near_one(impl, dtype, "interpreter", seeds=(1,)))
            _assert_all(props.three_term_identity(impl, [props.make_problem(7, 9, 3, 2, dtype, seed=6)], "interpreter"))


def test_budget_rows_can_fail():
    """Every bound is finite and small (none that cannot fail), and each row says where it came from."""
    for b in all_budgets():
        assert b.note, b
        for name in ("rel_l2", "ulp", "fp32_terms", "ratio_k", "floor_repr"):
            value = getattr(b, name)
            if value is None:
                continue
            assert math.isfinite(value) and value >= 0, (b, name)
        if b.rel_l2 is not None:
            assert b.rel_l2 < 0.1, b  # a 10% relative error still fails on any real bug (see test_mutations)
        if b.ulp is not None:
            assert b.ulp <= 1.0, b
        if b.ratio_k is not None:
            assert b.ratio_k <= 2 and b.floor_repr <= 1, b  # looser lets a 1.01x gradient through (test_mutations)
        # A bound, not a fit (docs/design.md section 3): no row may come from the implementation's own error.
        assert not any(tag in b.note.lower() for tag in ("observed", "2x", "calibrate", "max ")), f"a row fitted to our own error: {b}"
        assert b.family == "*" or "bound" in b.note, f"a family row must name the bound it states: {b}"


def test_public_api_is_what_verify_runs():
    assert IMPL.factored_norm is not None and IMPL.module_cls is doracheck.DoRALinear


@pytest.mark.parametrize("relative", [1e-3, 1e-2])
def test_permutation_property_catches_a_position_dependent_error(relative):
    """The permutation allowance (the platform's own movement plus the a-priori reorder bound
    of the norm) still fails an output that depends on a feature's position: the last output
    column off by ``relative``."""

    def positional(x, weight, *args, **kwargs):
        y = doracheck.dora_linear(x, weight, *args, **kwargs)
        bump = torch.ones(y.shape[-1], dtype=y.dtype)
        bump[-1] += relative
        return y * bump

    problem = make_problem(16, 33, 8, 9, torch.float32, seed=11)
    results = props.metamorphic(Implementation("positional", positional), problem, FAMILY)
    perm = next(r for r in results if r.prop == "meta.permutation")
    assert perm.status == "FAIL", perm
    clean = next(r for r in props.metamorphic(IMPL, problem, FAMILY) if r.prop == "meta.permutation")
    assert clean.status == "pass", clean


def test_norm_memory_fails_a_dense_norm():
    """The planted bug the memory property exists for: the norm through the dense W + s·B·A."""

    def dense_norm(weight, lora_A, lora_B, scaling, *, fan_in_fan_out=False, return_terms=False):
        W = (weight.t() if fan_in_fan_out else weight).float()
        n = torch.linalg.vector_norm(W + scaling * (lora_B.float() @ lora_A.float()), dim=1)
        assert not return_terms
        return n

    impl = Implementation("dense-norm", doracheck.dora_linear, factored_norm=dense_norm)
    results = props.norm_memory(impl, torch.bfloat16, "cpu", "cpu", IMPL.norm_memory_bound)
    assert [r.status for r in results] == ["FAIL"], results


def test_a_nan_outside_the_zero_rows_is_not_left_to_edge_zero_row():
    """Only PEFT's NaN (confined to the zero rows' features) is left to edge.zero_row; an
    implementation that returns 0 there but NaN in a healthy feature fails the accuracy checks
    (the whole full profile must not pass)."""
    p = make_problem(19, 29, 4, 5, torch.float32, kind="zero_rows", seed=302)
    n = doracheck.factored_norm(p.weight, p.lora_A, p.lora_B, p.scaling, fan_in_fan_out=p.fan_in_fan_out)
    zero = (n == 0).nonzero().flatten()
    assert zero.numel(), "the zero_rows kind must have a zero row"
    healthy = int((n != 0).nonzero().flatten()[0])

    def nan_next_door(*args, **kwargs):
        y = doracheck.dora_linear(*args, **kwargs)
        bad = torch.zeros(y.shape[-1], dtype=torch.bool)
        bad[healthy] = True
        return torch.where(bad, torch.full_like(y, float("nan")), y)

    results = props.backward_vs_oracle(Implementation("nan-next-door", nan_next_door), [p], FAMILY)
    assert results and any(r.status == "FAIL" for r in results), results
