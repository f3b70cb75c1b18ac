"""Deviation oracles: the DoRA forward as known implementations get it wrong, in float64.

Each ``Deviation`` is the contract (docs/design.md section 1) with one known departure: its
``forward`` has ``dora_linear``'s signature (plus ``dtype``, the activation dtype of the
implementation under test, for the departures that round), is differentiable by autograd, and
is written from the contract directly, like ``dora_forward_ref``: nothing here is shared with
the code under test. ``properties.diagnosis`` runs them on a failing case to name the cause.

    V = W + s_n·B·A,   n = ||V|| over rows (s_n = s in the contract)
    g = m / max(n, eps)                         (n detached unless detach_norm=False)
    y = x·Wᵀ + b + (g - 1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ,   x_d = x·keep/(1-p) (x without dropout)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

EPS = 1e-12


@dataclass(frozen=True)
class Knobs:
    """The departures; the defaults are the contract."""

    bias_in_branch: bool = False  # y = g⊙(x·Wᵀ + b + s·lora)
    round_norm: bool = False  # PEFT 0.21: n of W + s·B·A formed and rounded in the activation dtype, g = m/n in fp32,
    #                           base = (x·Wᵀ + b) - b and the output rounded to that dtype
    peft_low_precision: bool = False  # PEFT's (g-1)·base + g·s·lora + base, every step in the activation dtype
    naive_compose: bool = False  # b + g·(base + s·lora), every step in the activation dtype
    column_norm: bool = False  # n over columns (tiled to d_out rows)
    flip_detach: bool = False  # the norm detached when it should not be, or not when it should
    scaling_factor: str = ""  # "sqrt_r": s·√r everywhere; "inv_sqrt_r": s/√r everywhere
    norm_scaling: str = "s"  # "s2": ||W + s²·B·A||; "1": ||W + B·A||
    ignore_fan_in_fan_out: bool = False  # the weight read as (d_out, d_in) whatever its layout
    magnitude: str = "m"  # "ignored": g = 1; "twice": g = m²/n
    no_eps: bool = False  # g = m / n: a zero row gives NaN or Inf
    dropout_on_base: bool = False  # y = b + g⊙(x_d·Wᵀ + s·lora_d): the base term dropped too


@dataclass(frozen=True)
class Deviation:
    name: str
    description: str
    knobs: Knobs = field(default_factory=Knobs)
    in_dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")  # where the departure shows at all

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return deviant_dora(*args, knobs=self.knobs, **kwargs)


def _tile_rows(cols: torch.Tensor, d_out: int) -> torch.Tensor:
    """Column norms (d_in,) used as if they were the d_out row norms: repeated, then cut."""
    if cols.numel() == 0:
        return cols.new_zeros(d_out)
    return cols.repeat(d_out // cols.numel() + 1)[:d_out]


def deviant_dora(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    *,
    knobs: Knobs = Knobs(),
    dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    detach_norm: bool = True,
    fan_in_fan_out: bool = False,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The DoRA forward with ``knobs``' departures, in float64 (``dtype``: the activation dtype the
    rounding departures round to; x's dtype when None). Returns y in float64."""
    low = dtype or x.dtype
    x, W, A, B, m = (t.double() for t in (x, weight, lora_A, lora_B, magnitude))
    b = None if bias is None else bias.double()
    if fan_in_fan_out and not knobs.ignore_fan_in_fan_out:
        W = W.t()
    r = A.shape[0]
    s = float(scaling) * {"": 1.0, "sqrt_r": math.sqrt(r), "inv_sqrt_r": 1 / math.sqrt(r)}[knobs.scaling_factor]
    s_norm = {"s": s, "s2": s * s, "1": 1.0}[knobs.norm_scaling]
    detach = detach_norm != knobs.flip_detach
    P = B @ A
    V = W + s_norm * (P.detach() if detach else P)
    if knobs.round_norm:
        V = (W.to(low) + s_norm * P.to(low)).double()
    n = _tile_rows(V.norm(dim=0), W.shape[0]) if knobs.column_norm else V.norm(dim=1)
    if knobs.round_norm:
        n = n.to(low).double()
    if detach:
        n = n.detach()
    m_used = {"m": m, "ignored": n, "twice": m * m}[knobs.magnitude]
    g = m_used / (n if knobs.no_eps else torch.clamp_min(n, EPS))
    x_d = x
    if training and dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("deviant_dora: dropout is active: pass dropout_mask")
        x_d = x * dropout_mask.double() / (1.0 - dropout_p)
    if knobs.peft_low_precision or knobs.naive_compose:
        return _low_precision(x, x_d, W, A, B, g, s, b, low, knobs.naive_compose)
    if knobs.round_norm:  # PEFT 0.21's order: g in fp32 from the rounded norm, base recovered from x·Wᵀ + b
        result = (x @ W.t() + (0 if b is None else b)).to(low).double()
        base_d = result if b is None else (result - b).to(low).double()
        lora = ((x_d @ A.t()).to(low).double() @ B.t()).to(low).double()
        return (result + (g - 1) * base_d + g * lora * s).to(low).double()
    base = x @ W.t()
    lora = (x_d @ A.t()) @ B.t()
    if knobs.bias_in_branch:
        return g * (base + (0 if b is None else b) + s * lora)
    if knobs.dropout_on_base:
        return (0 if b is None else b) + g * (x_d @ W.t() + s * lora)
    y = base + (g - 1) * (x_d @ W.t()) + g * s * lora
    return y if b is None else y + b


def _low_precision(x, x_d, W, A, B, g, s: float, b, low: torch.dtype, naive: bool) -> torch.Tensor:
    """The compose with g and every step rounded to ``low`` (the products of the GEMMs are exact
    and rounded once): PEFT's (x·Wᵀ + b) + (g - 1)⊙(x_d·Wᵀ) + g⊙s⊙lora, or with ``naive``
    b + g⊙(x·Wᵀ + s·lora)."""

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return t.to(low).double()

    gl = rnd(g)
    base, lora = rnd(x @ W.t()), rnd(rnd(x_d @ A.t()) @ B.t())
    bl = None if b is None else rnd(b)
    if naive:
        out = rnd(gl * rnd(base + rnd(s * lora)))
        return out if bl is None else rnd(out + bl)
    base_b = base if bl is None else rnd(base + bl)
    base_d = base if x_d is x else rnd(x_d @ W.t())
    return rnd(rnd(base_b + rnd(rnd(gl - 1) * base_d)) + rnd(rnd(gl * lora) * s))


def _class(name: str, description: str, in_dtypes=("fp32", "bf16", "fp16"), **knobs: Any) -> Deviation:
    return Deviation(name, description, Knobs(**knobs), tuple(in_dtypes))


DEVIATIONS: tuple[Deviation, ...] = (
    _class("bias scaled by g", "the bias sits inside the normalised branch: y = g⊙(x·Wᵀ + b + s·lora)", bias_in_branch=True),
    _class("g rounded", "g = m/n taken from a norm rounded to the activation dtype before the compose (W + s·B·A and "
           "its row norm formed in that dtype, as PEFT 0.21 does)", ("bf16", "fp16"), round_norm=True),
    _class("low-precision compose", "(g-1)·base + g·s·lora + base with g and every step in the activation dtype",
           ("bf16", "fp16"), peft_low_precision=True),
    _class("naive compose", "b + g·(base + s·lora) with g and every step in the activation dtype", ("bf16", "fp16"),
           naive_compose=True),
    _class("column norm", "the norm taken over columns (the d_in axis) instead of rows", column_norm=True),
    _class("norm not detached / detached", "the gradient flows through n when it must not, or not when it must",
           flip_detach=True),
    _class("rsLoRA scaling confused", "s·√r (lora_alpha/√r) used where s = lora_alpha/r was given", scaling_factor="sqrt_r"),
    _class("plain scaling confused", "s/√r (lora_alpha/r) used where s = lora_alpha/√r was given", scaling_factor="inv_sqrt_r"),
    _class("s twice in the norm", "the norm of W + s²·B·A", norm_scaling="s2"),
    _class("s missing from the norm", "the norm of the un-scaled W + B·A", norm_scaling="1"),
    _class("fan_in_fan_out ignored", "a (d_in, d_out) weight read as (d_out, d_in)", ignore_fan_in_fan_out=True),
    _class("magnitude ignored", "g = 1: plain LoRA", magnitude="ignored"),
    _class("magnitude applied twice", "g = m²/n", magnitude="twice"),
    _class("zero row gives NaN", "g = m/n without the eps floor: a zero row of W + s·B·A gives NaN or Inf", no_eps=True),
    _class("dropout on the base too", "the base term uses the dropped input: y = b + g⊙(x_d·Wᵀ + s·lora_d)",
           dropout_on_base=True),
)

DEVIATION_BY_NAME: dict[str, Deviation] = {d.name: d for d in DEVIATIONS}

Forward = Callable[..., torch.Tensor]
