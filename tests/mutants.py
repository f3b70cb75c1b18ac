"""Small systematic errors that act in one low precision only: doracheck with one planted flaw.

Each is a callable with ``dora_linear``'s signature, so ``doracheck verify --impl
mutants:NAME --dtype DT`` (with ``tests/`` on PYTHONPATH) runs the whole suite on it. A
correct implementation must never be mistaken for one of these, and each must be caught in
its precision (``tests/properties/test_mutations.py``, margins in ``properties/verified/``):

- ``{dx,dA,dB,dm}_x1.01_{bf16,fp16}``: that gradient scaled by 1.01 when x is in that dtype
  (caught by the baseline ratio of that gradient: a correct implementation is about as
  accurate as the naive same-precision computation, a 1% bias is not);
- ``g_plus_1ulp_{bf16,fp16}``: the compose's g one ulp of the dtype too large (g·(1 + 2⁻⁷) in
  bf16, g·(1 + 2⁻¹⁰) in fp16), what rounding g to the dtype can do (caught by the 0.5-ulp
  compose property);
- ``norm_x1.001_bf16``: the norm 1e-3 too large for bf16 weights, in the exported norm and in
  the layer (caught by the three-term norm property).
"""

from __future__ import annotations

import torch

import doracheck
from doracheck.properties import Implementation

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ULP_AT_ONE = {"bf16": 2.0**-7, "fp16": 2.0**-10}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` on the way back."""

    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _scaled(t, factor):
    return _ScaleGrad.apply(t, factor) if t is not None and t.requires_grad else t


def grad_scaled(which: str, dt: str, factor: float = 1.01):
    """doracheck with gradient ``which`` (dx, dA, dB, dm) times ``factor`` for x in dtype ``dt``."""
    position = {"dx": 0, "dA": 2, "dB": 3, "dm": 4}[which]

    def impl(*args, **kwargs):
        args = list(args)
        if args[0].dtype == DTYPES[dt]:
            args[position] = _scaled(args[position], factor)
        return doracheck.dora_linear(*args, **kwargs)

    impl.__name__ = f"{which}_x{factor:g}_{dt}"
    return impl


def g_plus_one_ulp(dt: str):
    """doracheck whose compose uses g·(1 + one ulp of dt at 1) for x in dtype ``dt``."""

    def impl(x, weight, lora_A, lora_B, magnitude, *args, **kwargs):
        if x.dtype == DTYPES[dt]:
            magnitude = magnitude * (1.0 + ULP_AT_ONE[dt])
        return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, *args, **kwargs)

    impl.__name__ = f"g_plus_1ulp_{dt}"
    return impl


def _norm_off(weight) -> float:
    return 1.001 if weight.dtype == torch.bfloat16 else 1.0


def norm_off_bf16_layer(x, weight, lora_A, lora_B, magnitude, *args, **kwargs):
    """doracheck with n·1.001 for bf16 weights: g = m / (1.001·n)."""
    return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude / _norm_off(weight), *args, **kwargs)


def norm_off_bf16_norm(weight, lora_A, lora_B, scaling, *, fan_in_fan_out=False, return_terms=False):
    terms = doracheck.factored_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out, return_terms=True)
    f = _norm_off(weight)
    scaled = doracheck.NormTerms(terms.base * f * f, terms.cross * f * f, terms.lora * f * f, terms.norm * f)
    return scaled if return_terms else scaled.norm


def implementations() -> dict[str, tuple[Implementation, str, str]]:
    """name -> (implementation, the dtype it acts in, the property that must catch it)."""
    out: dict[str, tuple[Implementation, str, str]] = {}
    for dt in DTYPES:
        for which in ("dx", "dA", "dB", "dm"):
            fn = grad_scaled(which, dt)
            out[fn.__name__] = (Implementation(fn.__name__, fn), dt, f"ratio.backward.{which}")
        fn = g_plus_one_ulp(dt)
        out[fn.__name__] = (Implementation(fn.__name__, fn), dt, "compose.near_one")
    out["norm_x1.001_bf16"] = (
        Implementation("norm_x1.001_bf16", norm_off_bf16_layer, factored_norm=norm_off_bf16_norm), "bf16", "norm.three_term"
    )
    return out


# Module-level names for ``doracheck verify --impl mutants:NAME`` (NAME without dots).
for _name, (_impl, _dt, _prop) in implementations().items():
    globals()[_name.replace(".", "_")] = _impl.dora_linear
