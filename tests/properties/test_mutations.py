"""Planted bugs make the property suite fail: each mutant is caught by at least the named property.

Gross mutants ("Mutants measure strength", docs/design.md section 3): a compose rounded
naively in the low dtype; a norm accumulated in bf16; a magnitude gradient missing its 1/n;
a norm over the wrong axis; a norm cache that ignores in-place updates.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import doracheck
import doracheck.dispatch
import doracheck.norm_rule
from doracheck.kernels import FactoredNorm
from doracheck.properties import Implementation, run_suite
from doracheck.properties.implementations import doracheck_implementation


def _rows(weight, fan_in_fan_out):
    return weight.t() if fan_in_fan_out else weight


def naive_compose_dora(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, *, fan_in_fan_out=False, **_):
    """Correct fp32 norm, but g rounded to x.dtype and the compose done in x.dtype."""
    n = doracheck.factored_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)
    g = (magnitude.float() / n.clamp_min(1e-12)).to(x.dtype)
    W = _rows(weight, fan_in_fan_out).to(x.dtype)
    y = g * (x @ W.t() + scaling * ((x @ lora_A.to(x.dtype).t()) @ lora_B.to(x.dtype).t()))
    return y + bias.to(x.dtype) if bias is not None else y


def _bf16_accumulated_terms(weight, lora_A, lora_B, scaling, *, fan_in_fan_out=False, **_):
    """The three terms summed 8 columns at a time with the running sum rounded to bf16."""
    W = _rows(weight, fan_in_fan_out).float()
    P = lora_B.float() @ lora_A.float()

    def rowsum(t):
        acc = torch.zeros(t.shape[0], dtype=torch.bfloat16, device=t.device)
        for start in range(0, t.shape[1], 8):
            acc = (acc.float() + t[:, start : start + 8].sum(1)).to(torch.bfloat16)
        return acc.float()

    base, cross, lora = rowsum(W * W), rowsum(W * P), rowsum(P * P)
    norm = torch.sqrt(torch.clamp_min(base + 2 * scaling * cross + scaling * scaling * lora, 0))
    return FactoredNorm(base, cross, lora, norm, None, None)


@contextlib.contextmanager
def bf16_norm():
    """The backend op that forms the norm swapped for one that accumulates in bf16."""
    original = doracheck.dispatch.backend_for

    def mutant_norm(w, a, b, s, fif, need_factors=False):
        return _bf16_accumulated_terms(w, a, b, s, fan_in_fan_out=fif)

    def bf16_norm_backend(*tensors):
        return original(*tensors)._replace(factored_norm=mutant_norm)

    doracheck.dispatch.backend_for = bf16_norm_backend
    doracheck.norm_rule.clear_norm_cache()
    try:
        yield
    finally:
        doracheck.dispatch.backend_for = original
        doracheck.norm_rule.clear_norm_cache()


def bf16_norm_dora(*args, **kwargs):
    with bf16_norm():
        return doracheck.dora_linear(*args, **kwargs)


def bf16_norm_terms(weight, lora_A, lora_B, scaling, *, fan_in_fan_out=False, return_terms=False):
    t = _bf16_accumulated_terms(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)
    return doracheck.NormTerms(t.base, t.cross, t.lora, t.norm) if return_terms else t.norm


def dm_without_one_over_n(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kwargs):
    """The magnitude gradient multiplied by n: dm = Σ dy⊙z instead of Σ dy⊙z / n."""
    fifo = kwargs.get("fan_in_fan_out", False)
    m = magnitude * 1
    if m.requires_grad:
        n = doracheck.factored_norm(weight.detach(), lora_A.detach(), lora_B.detach(), scaling, fan_in_fan_out=fifo)
        m.register_hook(lambda grad: grad * n.to(grad.dtype))
    return doracheck.dora_linear(x, weight, lora_A, lora_B, m, scaling, bias, **kwargs)


def wrong_axis_dora(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, *, fan_in_fan_out=False, **_):
    """Column norms of V = W + s·B·A (PEFT's embedding axis) used as if they were row norms."""
    W = _rows(weight, fan_in_fan_out).double()
    V = W + scaling * (lora_B.double() @ lora_A.double())
    cols = torch.linalg.norm(V, dim=0)
    n = cols.repeat(V.shape[0] // max(cols.numel(), 1) + 1)[: V.shape[0]].float()
    g = magnitude.float() / n.clamp_min(1e-12)
    y = g * (x.float() @ W.float().t() + scaling * ((x.float() @ lora_A.float().t()) @ lora_B.float().t()))
    y = y + bias.float() if bias is not None else y
    return y.to(x.dtype)


@contextlib.contextmanager
def version_blind_cache():
    original = doracheck.norm_rule._fingerprint
    doracheck.norm_rule._fingerprint = lambda t: (id(t), t.data_ptr(), tuple(t.shape), t.dtype, t.device)
    doracheck.norm_rule.clear_norm_cache()
    try:
        yield
    finally:
        doracheck.norm_rule._fingerprint = original
        doracheck.norm_rule.clear_norm_cache()


class MergeWithoutG(doracheck.DoRALinear):
    """A merge that folds the adapter in but forgets the magnitude: W' = W + s·B·A."""

    @torch.no_grad()
    def merge(self) -> None:
        self._merged_norm = self._norm()
        self.weight.add_(self.scaling * (self.lora_B @ self.lora_A))
        self.merged = True


MUTANTS = {
    "naive_compose": (Implementation("naive-compose", naive_compose_dora), ["bf16"], "compose.near_one"),
    "bf16_norm": (Implementation("bf16-norm", bf16_norm_dora, factored_norm=bf16_norm_terms), ["fp32"], "norm.three_term"),
    "dm_missing_1_over_n": (Implementation("dm*n", dm_without_one_over_n), ["fp32"], "backward.dm"),
    "wrong_axis": (Implementation("column-norm", wrong_axis_dora), ["fp32"], "forward.y"),
    "merge_without_g": (Implementation("merge-without-g", doracheck.dora_linear, module_cls=MergeWithoutG), ["fp32"], "merge.forward"),
    "stale_cache": (Implementation("stale-cache", doracheck.dora_linear, clear_cache=doracheck.norm_rule.clear_norm_cache), ["fp32"], "cache.no_stale"),
}
CONTEXTS = {"stale_cache": version_blind_cache}


@pytest.fixture(autouse=True)
def _torch_path():
    with doracheck.dispatch.use_path("torch"):
        yield


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_planted_bug_is_caught(name):
    impl, dtypes, expected = MUTANTS[name]
    with CONTEXTS.get(name, contextlib.nullcontext)():
        results = run_suite(impl, dtypes, "quick", "cpu")
    failed = {r.prop for r in results if r.status == "FAIL"}
    assert expected in failed, f"{name}: expected {expected} to fail, failed: {sorted(failed)}"


@pytest.mark.parametrize("training", [True, False], ids=["training", "no_grad"])
def test_the_bf16_norm_mutant_reaches_the_layer(training):
    """The mutant must change what the layer computes in both kinds of forward, or the property
    that catches it would be catching nothing of the layer."""
    gen = torch.Generator().manual_seed(2)
    W = torch.randn(24, 40, generator=gen)
    A = torch.randn(6, 40, generator=gen) * 0.3
    B = torch.randn(24, 6, generator=gen) * 0.3
    m = torch.rand(24, generator=gen) + 0.5
    x = torch.randn(5, 40, generator=gen)

    def layer():
        args = [t.clone().requires_grad_(training) for t in (x, W, A, B, m)]
        with torch.set_grad_enabled(training):
            return doracheck.dora_linear(args[0], args[1], args[2], args[3], args[4], 1.5).detach()

    doracheck.norm_rule.clear_norm_cache()
    clean = layer()
    with bf16_norm():
        mutated = layer()
    assert not torch.equal(clean, mutated)


def test_unmutated_doracheck_passes_the_same_suite():
    results = run_suite(doracheck_implementation("torch"), ["fp32", "bf16"], "quick", "cpu")
    failed = [f"{r.prop}[{r.dtype}]: {r.detail}" for r in results if r.status == "FAIL"]
    assert not failed, failed


# Small systematic errors in one low precision (tests/mutants.py): caught there, in that dtype.

from mutants import implementations as _small_mutants  # noqa: E402

SMALL = _small_mutants()


def _margin(results, prop):
    r = next(r for r in results if r.prop == prop)
    return r, (r.worst / r.budget if r.budget else float("inf"))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_error_in_one_precision_is_caught_there(name):
    impl, dt, prop = SMALL[name]
    results = run_suite(impl, [dt], "quick", "cpu")
    caught, ratio = _margin(results, prop)
    assert caught.status == "FAIL", f"{name}: {prop} [{dt}] passed: worst {caught.worst:.3e} <= budget {caught.budget:.3e}"
    assert ratio > 1.0


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_doracheck_passes_what_catches_the_small_errors(dt):
    """The other side of the margin: the correct implementation passes each catching property."""
    results = run_suite(doracheck_implementation("torch"), [dt], "quick", "cpu")
    for _name, (_impl, mutant_dt, prop) in SMALL.items():
        if mutant_dt != dt:
            continue
        r, ratio = _margin(results, prop)
        assert r.status == "pass" and ratio < 1.0, (prop, r)
