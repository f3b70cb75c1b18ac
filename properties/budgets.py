"""Tolerance budgets: how far an implementation may be from the oracle. Data, one row each.

A row is keyed by (op, output, dtype, family), named fields only; lookup falls back from the exact family to
the default row (family "*"). **A budget is a bound, not a fit** (docs/design.md section 3): every row is an
a-priori bound from the dtype's unit roundoff u and the number of roundings on the way to the output (written
next to it), or a baseline ratio against the same-precision eager reference on the same machine, floored at
the case's representation noise. No row comes from this implementation's observed error (such a row passes
anything, bugs included: bf16 rows at twice the observed error pass a 1% error in dx). ``doracheck calibrate``
reports how tight each bound is on a machine; it never proposes a row.

The oracle distance (``forward``/``backward`` rows) bounds the error absolutely and catches gross bugs in any
precision, but in 16 bits, where an output's rounding alone is u, cannot resolve a 1% error. The baseline
ratio (``ratio_*`` rows) can: a correct implementation is about as accurate as the naive PEFT-style
computation in the same dtype on the same inputs (measured: at most 1.6x it, quick and full profiles, CPU), so
``err(impl) <= 2·err(naive) + floor`` fails a 1.01x gradient (``tests/properties/test_mutations.py``).

u(fp32) = 2⁻²⁴ ≈ 6.0e-8, u(bf16) = 2⁻⁸ ≈ 3.9e-3, u(fp16) = 2⁻¹¹ ≈ 4.9e-4. Families: cpu, interpreter (Triton
under TRITON_INTERPRET=1), sm80, sm89, sm90, sm100, sm120.

Fields:
  rel_l2       max ||impl - oracle||₂ / ||oracle||₂ over a case; forward and backward rows multiply it by
               the case's condition ρ of that output (``reference.output_conditions``)
  ulp          max |impl - exact| in ulps of the output dtype (the compose property)
  fp32_terms   K in the compose allowance K·u(fp32)·(|b| + |g|·|z|) added to ``ulp``
  ratio_k      baseline ratio: err(impl) <= ratio_k·err(naive same-precision) + floor
  floor_repr   the floor in units of the case's representation noise: the relative L2 error of the exact
               output rounded once to the dtype (no implementation returning it does better)
  cond_k       K in the term K·u(fp32)·κ added to rel_l2 / the floor; κ = max_i (||W_i||² + 2|s·<W_i,(BA)_i>|
               + s²·||(BA)_i||²) / n_i² measures how much W cancels s·B·A. The factored norm's n² carries
               about u(fp32)·κ relative error (a dense fp32 norm u·sqrt(κ)): an a-priori bound, not a fudge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from doracheck.reference import UNIT_ROUNDOFF

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FAMILIES = ("cpu", "interpreter", "sm80", "sm89", "sm90", "sm100", "sm120")


def u(dtype: str) -> float:
    return UNIT_ROUNDOFF[DTYPES[dtype]]


@dataclass(frozen=True)
class Budget:
    op: str  # norm | norm_terms | forward | backward | compose | ratio_forward | ratio_backward | merge | unmerge
    output: str  # norm | terms | y | dx | dA | dB | dm | db | weight
    dtype: str  # fp32 | bf16 | fp16 (the activation dtype)
    family: str  # "*" (default) or one of FAMILIES
    note: str  # the derivation or the measurement behind the row
    rel_l2: float | None = None
    ulp: float | None = None
    fp32_terms: float | None = None
    ratio_k: float | None = None
    floor_repr: float | None = None
    cond_k: float | None = None


def _default_rows() -> list[Budget]:
    rows: list[Budget] = []
    for dt in DTYPES:
        # forward: base and lora GEMM outputs rounded to dt, then the compose: 3 roundings of at most u, 4u
        # with one to spare; fp32 is dominated by the K-term accumulations, random-walk size sqrt(K)·u, below
        # 64u up to K = 4096 (the suite's problems have K <= 257).
        mult = 64.0 if dt == "fp32" else 4.0
        rows.append(Budget("forward", "y", dt, "*", f"a-priori bound: {mult:g}·u({dt})·ρ_y + 16·u(fp32)·κ", rel_l2=mult * u(dt), cond_k=16.0))
        # backward: one or two chained GEMMs on operands rounded to dt (dz = g⊙dy, dz·B, xa): 3-4 roundings of
        # at most u, 8u; fp32 128u (accumulation, as above).
        bmult = 128.0 if dt == "fp32" else 8.0
        for out in ("dx", "dA", "dB", "dm", "db"):
            rows.append(Budget("backward", out, dt, "*", f"a-priori bound: {bmult:g}·u({dt})·ρ_{out} + 16·u(fp32)·κ", rel_l2=bmult * u(dt), cond_k=16.0))
        # baseline ratio: at most twice the naive same-precision error, plus one rounding of the exact output
        # to dt (the floor where the naive computation happens to be exact).
        for op, outs in (("ratio_forward", ("y",)), ("ratio_backward", ("dx", "dA", "dB", "dm", "db"))):
            for out in outs:
                note = f"baseline ratio: k = 2, floor = 1 x representation noise in {dt} + 16·u(fp32)·κ"
                rows.append(Budget(op, out, dt, "*", note, ratio_k=2.0, floor_repr=1.0, cond_k=16.0))
        # compose near g = 1, exact intermediates: 0.5 ulp plus 8·u(fp32)·(|b| + |g|·|z|) for g and fp32 sums.
        rows.append(Budget("compose", "y", dt, "*", "design: 0.5 ulp + 8·u(fp32)·(|b| + |g||z|)", ulp=0.5, fp32_terms=8.0))
        # merge: W' = g ⊙ (W + s·B·A) rounded once to W's dtype, so x·W'ᵀ is off by that rounding (u per
        # element, RMS u/sqrt(3)) plus the forward's own: 8u; unmerge rounds W'/g - s·B·A once more: 4u of W.
        rows.append(Budget("merge", "y", dt, "*", f"default: 8·u({dt})", rel_l2=8 * u(dt)))
        rows.append(Budget("unmerge", "weight", dt, "*", f"default: 4·u({dt})", rel_l2=4 * u(dt)))
    # norm and its terms: fp32 accumulation whatever the weight dtype (inputs are quantized), K = d_in + r
    # terms: 64·u(fp32) relative to the magnitude sum base + 2s|cross| + s²·lora.
    for dt in ("fp32", "fp16"):
        rows.append(Budget("norm", "norm", dt, "*", "default: 64·u(fp32) (fp32 accumulation)", rel_l2=64 * u("fp32")))
        rows.append(Budget("norm_terms", "terms", dt, "*", "default: 64·u(fp32) of the magnitude sum", rel_l2=64 * u("fp32")))
    # bf16 weights, fp32 adapters (PEFT's default): Triton's U = W·Aᵀ uses bf16 tensor cores; A split in two
    # bf16 halves keeps 16 of 24 bits: 2⁻¹⁷ per product, up to 2⁻¹⁶ on a cross-dominated n², 256x < bf16 ulp.
    note = "default: 256·u(fp32) = 2^-16 (bf16 hi+lo split of fp32 A)"
    rows.append(Budget("norm", "norm", "bf16", "*", note, rel_l2=256 * u("fp32")))
    rows.append(Budget("norm_terms", "terms", "bf16", "*", note, rel_l2=256 * u("fp32")))
    return rows


# Family rows override the default for one family. None: every default holds on each family measured
# (cpu, interpreter, sm90), fp32 reductions in every CUDA GEMM doracheck issues (docs/design.md section 2).
FAMILY_ROWS: list[Budget] = []

_TABLE = {(b.op, b.output, b.dtype, b.family): b for b in _default_rows() + FAMILY_ROWS}


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
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu"
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm{major}{minor}"
