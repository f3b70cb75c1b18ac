"""Small pieces shared by the Triton kernels: interpreter detection and the dot helper.

Under ``TRITON_INTERPRET=1`` the interpreter mis-computes ``tl.dot`` on bf16 operands
(it multiplies raw bit patterns, triton#11584), so dots take an ``INTERPRET`` constexpr
and upcast their operands to fp32 there. On a GPU the operands stay in their dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .tracing import tracing

# Read once, when the kernel modules import this one, just before their ``triton.jit``
# decorations: triton decides there, from the same variable, whether a kernel is interpreted,
# so this is the answer for every launch of those kernels (reading the environment at each
# launch cost host time on every call and could only disagree with triton).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether the kernels run under triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRET


def launcher(kernel, traced: bool | None = None):
    """``kernel`` itself in eager, ``wrap_triton(kernel)`` while tracing (``traced``: the
    caller's own ``tracing()`` answer, so a launch asks it once). A registered op's fake
    implementation never reaches a launcher: it only allocates (kernels/ops.py).

    Measured and not kept: launching a hit of a kernel's own cache of compiled kernels directly
    (a Python key over every argument instead of triton's binder) cost as much host time as
    ``JITFunction.run`` on the H200 host with triton 3.6 (cProfile of the model step: 115 µs
    against 88 µs per launch; one layer's T = 1 train call 1839 against 1871 µs, within noise)."""
    return wrap_triton(kernel) if (tracing() if traced is None else traced) else kernel


def traced_launch() -> bool:
    """Whether a launcher must take its traced form (``launcher(kernel, True)``): while tracing,
    where the eager-only TMA compose must not run either."""
    return tracing()


def unused_pointer(like: torch.Tensor, traced: bool) -> torch.Tensor:
    """What to pass for a pointer argument the kernel never dereferences (its flag is off).
    While tracing, a 1-element buffer of its own (of ``like``'s rank and dtype): a tensor passed
    as two pointer arguments made Inductor treat them as aliases and miscompute
    (``norm_triton.rowdot_parts`` says how). In eager ``like`` itself, which costs no allocation
    and is never read through that pointer."""
    return torch.empty((1,) * like.dim(), dtype=like.dtype, device=like.device) if traced else like


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0, on the host. ``triton.cdiv`` is a ``constexpr_function``
    in Triton 3.9 whose call costs a few µs of host time (its arguments are unwrapped one by one),
    and the launchers call it on every launch of the host-bound training step."""
    return -(-a // b)


@triton.jit
def dot_acc(a, b, acc, INTERPRET: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a·b with fp32 accumulation (operands upcast under the interpreter)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in DTYPE.

    The interpreter truncates fp32 -> bf16 (seen with triton 3.9: half of random values
    came out one ulp low), so there the rounding is done on the bits: add 0x7FFF plus the
    lowest kept bit, clear the low half; the truncating cast of that exact value is then exact.
    """
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)
