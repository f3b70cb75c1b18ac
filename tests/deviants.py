"""One planted deviation per class of ``doracheck.reference.deviations``: thin wrappers around
doracheck's own layer (its torch path on the CPU), each departing from the contract in one known
way. ``tests/properties/test_diagnosis.py`` checks that the suite fails each and names its class."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import doracheck

EPS = 1e-12


def _norm(weight, lora_A, lora_B, scaling, fan_in_fan_out=False, **_):
    n = doracheck.factored_norm(weight.detach(), lora_A.detach(), lora_B.detach(), scaling, fan_in_fan_out=fan_in_fan_out)
    return n.to(torch.float64)


def _with_g(g_of: callable):
    """dora_linear with g = m / max(n, eps) replaced by ``g_of(m, n, args)`` (as m' = g·max(n, eps))."""

    def dora(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
        n = _norm(weight, lora_A, lora_B, scaling, **kw)
        m = g_of(magnitude, n, (weight, lora_A, lora_B, scaling, kw)) * torch.clamp_min(n, EPS).to(magnitude.dtype)
        return doracheck.dora_linear(x, weight, lora_A, lora_B, m.to(magnitude.dtype), scaling, bias, **kw)

    return dora


def bias_scaled_by_g(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    y = doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, None, **kw)
    if bias is None:
        return y
    g = magnitude / torch.clamp_min(_norm(weight, lora_A, lora_B, scaling, **kw), EPS).to(magnitude.dtype)
    return (y.float() + (g.float() * bias.float())).to(y.dtype)


def _low(x, weight, lora_A, lora_B, magnitude, scaling, bias, kw, naive: bool):
    """The compose with g and every step in x's dtype (PEFT's form, or b + g·(base + s·lora))."""
    dt = x.dtype
    W = weight.t() if kw.get("fan_in_fan_out") else weight
    x_d = x
    if kw.get("training") and kw.get("dropout_p", 0) > 0:
        x_d = x * kw["dropout_mask"].to(dt) / (1 - kw["dropout_p"])
    g = (magnitude / torch.clamp_min(_norm(weight, lora_A, lora_B, scaling, **kw), EPS)).to(dt)
    base, lora = F.linear(x, W.to(dt)), F.linear(F.linear(x_d, lora_A.to(dt)), lora_B.to(dt))
    if naive:
        out = g * (base + scaling * lora)
        return out if bias is None else out + bias.to(dt)
    base_b = base if bias is None else base + bias.to(dt)
    base_d = base if x_d is x else F.linear(x_d, W.to(dt))
    return base_b + (g - 1) * base_d + g * lora * scaling


def low_precision_compose(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    return _low(x, weight, lora_A, lora_B, magnitude, scaling, bias, kw, naive=False)


def naive_compose(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    return _low(x, weight, lora_A, lora_B, magnitude, scaling, bias, kw, naive=True)


def g_rounded(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    """PEFT 0.21's order (with the eps floor): the dense W + s·B·A and its norm in x's dtype, g = m/n in fp32, the base
    recovered as (x·Wᵀ + b) - b, the compose promoted to fp32 and rounded once."""
    dt = x.dtype
    W = (weight.t() if kw.get("fan_in_fan_out") else weight).to(dt)
    n = torch.linalg.norm(W + scaling * (lora_B.to(dt) @ lora_A.to(dt)), dim=1).to(dt).clamp_min(EPS)
    g = magnitude / n
    result = F.linear(x, W, None if bias is None else bias.to(dt))
    base = result if bias is None else result - bias.to(dt)
    lora = F.linear(F.linear(x, lora_A.to(dt)), lora_B.to(dt))
    return (result + (g - 1) * base + g * lora * scaling).to(dt)


def _columns(m, n, args):
    weight, lora_A, lora_B, scaling, kw = args
    W = (weight.t() if kw.get("fan_in_fan_out") else weight).double()
    cols = torch.linalg.norm(W.detach() + scaling * (lora_B.detach().double() @ lora_A.detach().double()), dim=0)
    tiled = cols.repeat(W.shape[0] // max(cols.numel(), 1) + 1)[: W.shape[0]]
    return m / torch.clamp_min(tiled, EPS).to(m.dtype)


def _norm_with(scale_of):
    def g(m, n, args):
        weight, lora_A, lora_B, scaling, kw = args
        other = _norm(weight, lora_A, lora_B, scale_of(scaling), **kw)
        return m / torch.clamp_min(other, EPS).to(m.dtype)

    return g


def norm_detach_flipped(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, *, detach_norm=True, **kw):
    return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias, detach_norm=not detach_norm, **kw)


def _rescaled(factor_of):
    def dora(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
        return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling * factor_of(lora_A.shape[0]), bias, **kw)

    return dora


def fan_in_fan_out_ignored(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, *, fan_in_fan_out=False, **kw):
    return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias, **kw)


def magnitude_ignored(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    n = _norm(weight, lora_A, lora_B, scaling, **kw).to(magnitude.dtype)
    return doracheck.dora_linear(x, weight, lora_A, lora_B, n, scaling, bias, **kw)


def magnitude_twice(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude * magnitude, scaling, bias, **kw)


def dropout_on_base(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kw):
    """Dropout applied to the input of the whole layer: the base term sees x_d too."""
    if kw.get("training") and kw.get("dropout_p", 0) > 0:
        x = x * kw["dropout_mask"].to(x.dtype) / (1 - kw["dropout_p"])
        kw = {k: v for k, v in kw.items() if k not in ("training", "dropout_p", "dropout_mask")}
    return doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias, **kw)


zero_row_gives_nan = _with_g(lambda m, n, args: m / n.to(m.dtype))  # g = m / n: no eps floor

PLANTED = {  # class name (reference.deviations) -> (wrapper, the dtype where it shows)
    "bias scaled by g": (bias_scaled_by_g, "fp32"),
    "g rounded": (g_rounded, "bf16"),
    "low-precision compose": (low_precision_compose, "bf16"),
    "naive compose": (naive_compose, "bf16"),
    "column norm": (_with_g(_columns), "fp32"),
    "norm not detached / detached": (norm_detach_flipped, "fp32"),
    "rsLoRA scaling confused": (_rescaled(math.sqrt), "fp32"),
    "plain scaling confused": (_rescaled(lambda r: 1 / math.sqrt(r)), "fp32"),
    "s twice in the norm": (_with_g(_norm_with(lambda s: s * s)), "fp32"),
    "s missing from the norm": (_with_g(_norm_with(lambda s: 1.0)), "fp32"),
    "fan_in_fan_out ignored": (fan_in_fan_out_ignored, "fp32"),
    "magnitude ignored": (magnitude_ignored, "fp32"),
    "magnitude applied twice": (magnitude_twice, "fp32"),
    "zero row gives NaN": (zero_row_gives_nan, "fp32"),
    "dropout on the base too": (dropout_on_base, "fp32"),
}
