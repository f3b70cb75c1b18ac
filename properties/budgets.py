"""Tolerance budgets: how far an implementation may be from the fp64 oracle.

A budget row is keyed by (op, output, dtype, family) and has named fields only. Lookup
falls back from the exact family to the default row (family ``"*"``). Default rows are
derived from the unit roundoff u of the dtype with the multiplier written next to them;
non-default rows cite the measurement that justified them.

Families: cpu, interpreter, sm80, sm89, sm90, sm100, sm120 (see ``device_family``).

Unit roundoff: u(fp32) = 2⁻²⁴ ≈ 6.0e-8, u(bf16) = 2⁻⁸ ≈ 3.9e-3, u(fp16) = 2⁻¹¹ ≈ 4.9e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doracheck.reference import UNIT_ROUNDOFF

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FAMILIES = ("cpu", "interpreter", "sm80", "sm89", "sm90", "sm100", "sm120")


def u(dtype: str) -> float:
    return UNIT_ROUNDOFF[DTYPES[dtype]]


@dataclass(frozen=True)
class Budget:
    op: str  # "norm" | "forward" | "backward"
    output: str  # "norm" | "y" | "dx" | "dA" | "dB" | "dm" | "db"
    dtype: str  # "fp32" | "bf16" | "fp16"  (the activation dtype)
    family: str  # "*" (default) or one of FAMILIES
    rel_l2: float  # max ||impl - oracle|| / ||oracle|| over a case
    note: str  # the derivation or the measurement that justified the row


def _default_rows() -> list[Budget]:
    rows: list[Budget] = []
    for dt in DTYPES:
        # forward: base and lora GEMM outputs are rounded to dt (2 roundings), then the
        # compose rounds once more: RMS relative error about u each, so 3u of RMS plus
        # fp32 accumulation (negligible for bf16/fp16; for fp32 it is K·u-sized: 64u).
        mult = 64.0 if dt == "fp32" else 4.0
        rows.append(Budget("forward", "y", dt, "*", mult * u(dt), f"default: {mult:g}·u({dt})"))
        # backward: each gradient is one or two chained GEMMs whose operands were rounded
        # to dt (dz = g⊙dy, dz·B, xa): about 3-4 roundings of u; 8u for bf16/fp16, 128u fp32.
        bmult = 128.0 if dt == "fp32" else 8.0
        for out in ("dx", "dA", "dB", "dm", "db"):
            rows.append(Budget("backward", out, dt, "*", bmult * u(dt), f"default: {bmult:g}·u({dt})"))
    # norm: always fp32 accumulation whatever the weight dtype (inputs are already
    # quantized), K = d_in + r terms: rel error of n² ≲ γ_K·cond; for well-conditioned rows
    # 64·u(fp32) covers K up to a few thousand with random data.
    for dt in ("fp32", "fp16"):
        rows.append(Budget("norm", "norm", dt, "*", 64.0 * u("fp32"), "default: 64·u(fp32) (fp32 accumulation)"))
    # bf16 weights with fp32 adapters (PEFT's default): the Triton U = W·Aᵀ runs on bf16
    # tensor cores with A split into two bf16 halves, so A carries 16 of its 24 bits:
    # 2⁻¹⁷ relative per product, up to 2⁻¹⁶ on a cross-dominated n². Budget 2⁻¹⁶ = 256·u(fp32);
    # that is 256x below one bf16 ulp of the output, so g is unaffected at bf16 precision.
    rows.append(Budget("norm", "norm", "bf16", "*", 256.0 * u("fp32"), "default: 256·u(fp32) = 2^-16 (bf16 hi+lo split of fp32 A)"))
    return rows


# Measured rows go here, each with the measurement that justified it, e.g.
#   Budget("forward", "y", "bf16", "sm90", 0.006, "H200, doracheck calibrate 2026-11-29: max 0.0041 over 64 cases")
MEASURED_ROWS: list[Budget] = [
    # torch's default allow_fp16_reduced_precision_reduction lets cuBLAS reduce split-K partials
    # of x·Wᵀ in fp16; at d_in = 8192, T = 1 (a GEMV) the output then carries ~5u, not ~2u.
    Budget(
        "forward", "y", "fp16", "sm90", 8.0 * u("fp16"),
        "H200 2026-11-29, tests/test_kernels_gpu.py (64x8192 r1024 T1 fp16): measured 2.59e-3 (5.3u) > 4u default",
    ),
]

_TABLE = {(b.op, b.output, b.dtype, b.family): b for b in _default_rows() + MEASURED_ROWS}


def budget_for(op: str, output: str, dtype: str, family: str) -> Budget:
    """The row for this family, else the default row; KeyError if neither exists."""
    key = (op, output, dtype, family)
    if key in _TABLE:
        return _TABLE[key]
    return _TABLE[(op, output, dtype, "*")]


def all_budgets() -> list[Budget]:
    return list(_TABLE.values())


def device_family(device: torch.device | str | None = None) -> str:
    """cpu | interpreter | smXY for the given (or current) device."""
    import os

    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu"
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm{major}{minor}"
