"""``verify`` leaves no path of doracheck's own layer unexercised: its chunked backward runs at the
suite's sizes (the implementation's ``setting``), and LoRA dropout is judged in training with a
supplied keep-mask, so bugs confined to either path are rejected by the quick profile."""

from __future__ import annotations

import pytest

import doracheck
from doracheck import backward
from doracheck.properties.implementations import doracheck_implementation
from doracheck.properties.props_common import Implementation
from doracheck.properties.suite import run_suite


def failed(impl: Implementation, dtypes=("fp32",)) -> list[str]:
    return [f"{r.prop} [{r.dtype}]" for r in run_suite(impl, list(dtypes), "quick", "cpu") if r.status == "FAIL"]


def test_doracheck_passes_with_its_chunked_backward_exercised():
    assert failed(doracheck_implementation(), ("fp32", "bf16")) == []


def test_an_off_by_one_at_a_chunk_boundary_is_rejected(monkeypatch):
    """Each chunk but the last stops one token short: those tokens get no gradient."""
    real = backward._chunk

    def short_chunks(p, t0, t1):
        return real(p, t0, t1 - 1 if t1 < p.dy2.shape[0] else t1)

    monkeypatch.setattr(backward, "_chunk", short_chunks)
    assert any(name.startswith("backward.") for name in failed(doracheck_implementation()))
    plain = Implementation("doracheck, default chunking", doracheck.dora_linear, doracheck.factored_norm)
    assert failed(plain) == []  # at the default 32 MiB threshold the bug never runs: why the setting exists


@pytest.mark.parametrize("output", ["lora_A", "magnitude"])
def test_a_gradient_bug_confined_to_the_dropout_path_is_rejected(output):
    def off_under_dropout(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
        args = {"lora_A": lora_A, "magnitude": magnitude}
        if kw.get("training") and kw.get("dropout_p", 0) > 0 and args[output].requires_grad:
            args[output] = args[output] * 1
            args[output].register_hook(lambda grad: grad * 1.01)
        return doracheck.dora_linear(x, weight, args["lora_A"], lora_B, args["magnitude"], scaling, bias, **kw)

    wanted = {"lora_A": "backward.dA", "magnitude": "backward.dm"}[output]
    assert f"{wanted} [fp32]" in failed(Implementation("dropout-only bug", off_under_dropout))


def same_dtype_only(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    """Like most trainers' layers: the whole model in one dtype, mixed dtypes refused."""
    for t in (weight, lora_A, lora_B, magnitude, bias):
        if t is not None and t.dtype != x.dtype:
            raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {x.dtype} != {t.dtype}")
    return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias, **kw)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_an_implementation_refusing_mixed_dtypes_is_judged_in_the_configuration_it_supports(dtype):
    rows = run_suite(Implementation("same dtype only", same_dtype_only), [dtype], "quick", "cpu")
    assert [f"{r.prop}: {r.detail}" for r in rows if r.status == "FAIL"] == []
    refused = {r.prop: r.detail for r in rows if r.status == "n/a" and r.prop.endswith("mixed_dtypes")}
    assert set(refused) == {"accuracy.mixed_dtypes", "ratio.mixed_dtypes", "compose.mixed_dtypes"}, refused
    assert all("adapters in fp32" in detail or "m in fp32" in detail for detail in refused.values())
    judged = {r.prop for r in rows if r.status == "pass"}
    assert {"forward.y", "backward.dA", "compose.near_one"} <= judged  # real verdicts in the same-dtype configuration
