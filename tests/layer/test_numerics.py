"""``numerics.our_numerics``: 16-bit reductions off and autocast off inside doracheck, the caller's settings restored."""

from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.mark.parametrize("half", ["fp16", "bf16"])
@pytest.mark.parametrize("user", [True, False, (True, True), (False, True), (False, False)])
def test_our_numerics_turns_16_bit_reduction_off_and_restores_the_callers_flags_exactly(half, user):
    """Inside: no 16-bit split-K reduction. After (also after an exception): the caller's flag
    exactly as it was, both parts of torch >= 2.10's (allow, allow_split_k) pair (a bool
    restore would set allow_split_k back to True), and a caller's stricter (False, False) is
    left alone inside. Runs on CPU builds too: the flags are process state."""
    from doracheck.numerics import our_numerics

    matmul = torch.backends.cuda.matmul
    name = f"allow_{half}_reduced_precision_reduction"
    raw = getattr(torch._C, f"_get_cublas_{name}", None)
    if raw is None:
        pytest.skip("this torch has no cuBLAS reduction flags")
    before = raw()
    if isinstance(user, tuple) and not isinstance(before, tuple):
        pytest.skip("(allow, allow_split_k) pairs need torch >= 2.10")
    try:
        setattr(matmul, name, user)
        as_set = raw()
        for raising in (False, True):
            with pytest.raises(RuntimeError) if raising else contextlib.nullcontext():
                with our_numerics("cuda"):
                    inside = raw()
                    assert (inside[0] if isinstance(inside, tuple) else inside) is False
                    if as_set == (False, False):
                        assert inside == (False, False)
                    if raising:
                        raise RuntimeError("inside a layer call")
            assert raw() == as_set
    finally:
        if isinstance(before, tuple):
            getattr(torch._C, f"_set_cublas_{name}")(*before)
        else:
            setattr(matmul, name, before)


def test_our_numerics_turns_autocast_off_under_torch_compile_too():
    """Under torch.compile (fullgraph) inside autocast, the block still runs without autocast:
    a GEMM of fp32 operands stays fp32 (autocast would make it bf16)."""
    from doracheck.numerics import our_numerics

    def gemm(x, w):
        with our_numerics("cpu"):
            return x @ w

    compiled = torch.compile(gemm, fullgraph=True, backend="aot_eager")
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w).dtype == torch.bfloat16  # autocast is on here
        assert gemm(x, w).dtype == torch.float32
        assert compiled(x, w).dtype == torch.float32


def test_our_numerics_holds_the_flags_off_until_the_last_of_several_threads_leaves():
    """Calls on several threads (per-device backward threads, DataParallel replicas) overlap:
    A enters, B enters, A leaves while B still runs. B must still run with 16-bit reduction off,
    and the caller's flags come back only when B leaves (each call restoring on its own switched
    them back on under B and left them off for good afterwards)."""
    from doracheck.numerics import our_numerics

    raw = getattr(torch._C, "_get_cublas_allow_bf16_reduced_precision_reduction", None)
    if raw is None:
        pytest.skip("this torch has no cuBLAS reduction flags")
    before = raw()

    def off(value):
        return (value[0] if isinstance(value, tuple) else value) is False

    assert not off(before), "expects torch's default, 16-bit reduction allowed"
    a, b = our_numerics("cuda"), our_numerics("cuda")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert off(raw())  # B still inside
    b.__exit__(None, None, None)
    assert raw() == before
