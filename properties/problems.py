"""Deterministic DoRA test problems: the inputs every property runs on.

``make_problem`` draws one problem from a seed; ``KINDS`` name the hard cases the design asks for.
The hypothesis strategies (``strategies.py``) and ``doracheck verify`` both build on it, so a failing
hypothesis example is reproducible from its arguments alone. Magnitudes sit near the norm:
m_i = n_i·(1 + δ_i), |δ| log-uniform over [1e-7, 1e-1] with random sign (docs/design.md section 2:
trained magnitudes concentrate near g = 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from doracheck.reference import norm_terms_ref

KINDS = ("random", "fresh", "dynamic_range", "cancel", "zero_rows", "near_limits")


@dataclass
class Problem:
    """Quantized inputs of one DoRA problem, in their test dtypes."""

    x: torch.Tensor
    weight: torch.Tensor  # (d_out, d_in), or (d_in, d_out) with fan_in_fan_out
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    magnitude: torch.Tensor
    scaling: float
    bias: torch.Tensor | None
    fan_in_fan_out: bool
    label: str
    kind: str = "random"
    recipe: str = ""  # the make_problem call that rebuilds it (what a reproducer prints)

    @property
    def weight_rows(self) -> torch.Tensor:
        return self.weight.t() if self.fan_in_fan_out else self.weight

    def args(self):
        return (self.x, self.weight, self.lora_A, self.lora_B, self.magnitude, self.scaling, self.bias)

    def to(self, device) -> Problem:
        return replace(
            self, x=self.x.to(device), weight=self.weight.to(device), lora_A=self.lora_A.to(device),
            lora_B=self.lora_B.to(device), magnitude=self.magnitude.to(device),
            bias=None if self.bias is None else self.bias.to(device),
        )


def log_uniform_deltas(n: int, gen: torch.Generator, lo: float = 1e-7, hi: float = 1e-1) -> torch.Tensor:
    """δ with |δ| log-uniform in [lo, hi] and a random sign (float64)."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    mag = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    return mag * sign


def make_problem(
    d_out: int,
    d_in: int,
    r: int,
    tokens,
    dtype: torch.dtype,
    *,
    adapter_dtype: torch.dtype | None = None,
    seed: int = 0,
    kind: str = "random",
    scaling: float = 2.0,
    with_bias: bool = True,
    fan_in_fan_out: bool = False,
    device: str | torch.device = "cpu",
) -> Problem:
    """One problem: W ~ N(0, 1/d_in), A ~ N(0, 1/d_in), B ~ N(0, 1/r)·0.5, m = n·(1 + δ).

    kind: "random"; "fresh" (B = 0, so g = 1 + δ around the plain norm); "dynamic_range" (rows of
    W and B scaled by 2^k, k in [-12, 12]); "cancel" (half the rows of W are -s·(B·A) rounded, so W
    nearly cancels s·B·A); "zero_rows" (some rows of W and B are 0); "near_limits" (values scaled
    towards the dtype's range while the output stays finite)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    lead = tuple(tokens) if isinstance(tokens, tuple) else (tokens,)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    W = randn(d_out, d_in, scale=d_in**-0.5)
    A = randn(r, d_in, scale=d_in**-0.5)
    B = randn(d_out, r, scale=0.5 * r**-0.5)
    x = randn(*lead, d_in)
    if kind == "fresh":
        B.zero_()
    elif kind == "dynamic_range":
        # 2^±12 between rows (2^±6 in fp16, whose range would overflow the gradients).
        span = 6 if dtype == torch.float16 else 12
        rows = torch.pow(2.0, torch.randint(-span, span + 1, (d_out, 1), generator=gen).to(torch.float64))
        W, B = W * rows, B * rows
    elif kind == "cancel":
        # Half the rows: W_i = -s·(B·A)_i + ε·(its own random row), ε in [1e-2, 1e-1], so n_i is
        # 10-100x below ||W_i|| (κ about 1e2 to 1e4): hard, but within the factored norm's reach
        # in fp32 (its error grows like u·κ, see budgets.cond_k).
        half = torch.arange(d_out) % 2 == 0
        A_q = A.to(adapter_dtype).to(torch.float64)
        B_q = B.to(adapter_dtype).to(torch.float64)
        lora_rows = -scaling * (B_q[half] @ A_q)
        eps = torch.pow(10.0, -1 - torch.rand(int(half.sum()), 1, generator=gen, dtype=torch.float64))
        rows_norm = lora_rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
        noise = torch.randn(lora_rows.shape, generator=gen, dtype=torch.float64)
        W[half] = lora_rows + eps * rows_norm * noise / noise.norm(dim=1, keepdim=True).clamp_min(1e-30)
    elif kind == "zero_rows":
        zero = torch.rand(d_out, generator=gen) < 0.25
        zero[0] = True
        W[zero] = 0
        B[zero] = 0
    elif kind == "near_limits":
        # W towards the top of the dtype's range (fp16: entries up to ~2^11; fp32/bf16: 2^60,
        # as far as n² = Σ W² still fits fp32), x scaled down so the output stays O(1).
        big = 2.0 ** min(math.floor(math.log2(torch.finfo(dtype).max)) - 6, 60)
        W, x = W * big, x / big
    W_q = W.to(dtype)
    A_q, B_q = A.to(adapter_dtype), B.to(adapter_dtype)
    n = norm_terms_ref(W_q, A_q, B_q, scaling).norm
    m = (n * (1 + log_uniform_deltas(d_out, gen))).to(adapter_dtype)
    b = randn(d_out, scale=0.1).to(dtype) if with_bias else None
    stored = W_q.t().contiguous() if fan_in_fan_out else W_q
    label = f"{kind} {d_out}x{d_in} r{r} T{lead} {str(dtype)[6:]}/{str(adapter_dtype)[6:]}{' fifo' if fan_in_fan_out else ''} seed{seed}"
    recipe = (f"make_problem({d_out}, {d_in}, {r}, {tokens!r}, {dtype}, adapter_dtype={adapter_dtype}, seed={seed}, "
              f"kind={kind!r}, scaling={scaling!r}, with_bias={with_bias}, fan_in_fan_out={fan_in_fan_out})")
    problem = Problem(x.to(dtype), stored, A_q, B_q, m, scaling, b, fan_in_fan_out, label, kind, recipe)
    return problem.to(device) if torch.device(device).type != "cpu" else problem


def make_case(d_out, d_in, r, tokens, dtype, *, adapter_dtype=None, seed=0, device="cpu", with_bias=True) -> Problem:
    """A "random"-kind problem (see ``problems.make_problem``)."""
    return make_problem(d_out, d_in, r, tokens, dtype, adapter_dtype=adapter_dtype, seed=seed, device=device, with_bias=with_bias)


# (d_out, d_in, r, T or batch shape). d_out = 160 gives the per-feature outputs dm and db enough
# elements for the baseline ratio (props.RATIO_MIN_ELEMENTS, effective count).
QUICK_SHAPES = ((7, 13, 3, 5), (16, 33, 8, (2, 9)), (48, 64, 16, 17), (160, 24, 8, 12))
FULL_SHAPES = QUICK_SHAPES + ((64, 96, 32, (3, 11)), (129, 257, 64, 33))


def cases_for(dtype: torch.dtype, device, profile: str = "quick") -> list[Problem]:
    """The random cases of a profile: quick = one seed per shape; full = 4 seeds, more shapes,
    and the hard kinds of ``problems.KINDS``."""
    shapes, seeds = (QUICK_SHAPES, 1) if profile == "quick" else (FULL_SHAPES, 4)
    cases = []
    for seed in range(seeds):
        for i, (d_out, d_in, r, t) in enumerate(shapes):
            cases.append(make_case(d_out, d_in, r, t, dtype, seed=100 * seed + i, device=device))
        if dtype != torch.float32:  # PEFT's default: fp32 adapters under low-precision activations
            cases.append(make_case(24, 40, 8, 6, dtype, adapter_dtype=torch.float32, seed=7 + seed, device=device))
    for j, kind in enumerate(("dynamic_range", "fresh", "zero_rows", "cancel")):
        cases.append(make_problem(19, 29, 4, 5, dtype, kind=kind, seed=300 + j, device=device, fan_in_fan_out=j == 1))
    # A square transposed weight: reading it as (d_out, d_in) regardless is a wrong answer, not a shape error.
    cases.append(make_problem(24, 24, 4, 5, dtype, seed=400, device=device, fan_in_fan_out=True))
    if profile == "full":
        for j, kind in enumerate(KINDS):
            cases.append(make_problem(33, 47, 6, 9, dtype, kind=kind, seed=500 + j, device=device, fan_in_fan_out=j % 2 == 1))
    return cases
