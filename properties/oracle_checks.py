"""Oracle-distance checks: any callable with ``dora_linear``'s signature against the fp64 oracle.

Each check is a plain function returning ``CheckResult`` rows (one per output), usable from
pytest and from ``doracheck verify``. The implementation under test is an argument; this
module never imports it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from doracheck.reference import dora_forward_ref, norm_terms_ref, rel_l2

from .budgets import DTYPES, budget_for

DoraImpl = Callable[..., torch.Tensor]
NormImpl = Callable[..., torch.Tensor]


@dataclass
class CheckResult:
    prop: str  # e.g. "forward.y", "backward.dA", "norm.norm"
    dtype: str
    passed: bool
    worst: float  # worst relative L2 error over the cases
    budget: float
    cases: int
    detail: str = ""

    @property
    def margin(self) -> float:
        """budget / worst (> 1 passes); inf when the error is exactly 0."""
        return math.inf if self.worst == 0 else self.budget / self.worst

    def as_dict(self) -> dict:
        d = asdict(self)
        d["margin"] = None if math.isinf(self.margin) else self.margin
        return d


@dataclass
class Case:
    """Quantized inputs of one random DoRA problem (tensors in their test dtypes)."""

    x: torch.Tensor
    weight: torch.Tensor
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    magnitude: torch.Tensor
    scaling: float
    bias: torch.Tensor | None
    label: str


QUICK_SHAPES = ((7, 13, 3, 5), (16, 33, 8, (2, 9)), (48, 64, 16, 17))  # (d_out, d_in, r, T or batch shape)


def make_case(
    d_out: int,
    d_in: int,
    r: int,
    tokens,
    dtype: torch.dtype,
    *,
    adapter_dtype: torch.dtype | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    with_bias: bool = True,
) -> Case:
    """Random W ~ N(0, 1/d_in), A ~ N(0, 1/d_in), B ~ N(0, 1/r), magnitude = n·(1 + δ), |δ| ≤ 0.05."""
    gen = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    lead = tuple(tokens) if isinstance(tokens, tuple) else (tokens,)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    W = randn(d_out, d_in, scale=d_in**-0.5).to(dtype)
    A = randn(r, d_in, scale=d_in**-0.5).to(adapter_dtype)
    B = randn(d_out, r, scale=r**-0.5).to(adapter_dtype)
    s = 2.0
    n = norm_terms_ref(W, A, B, s).norm
    delta = (torch.rand(d_out, generator=gen, dtype=torch.float64) - 0.5) * 0.1
    m = (n * (1 + delta)).to(adapter_dtype)
    x = randn(*lead, d_in).to(dtype)
    b = randn(d_out, scale=0.1).to(dtype) if with_bias else None
    label = f"{d_out}x{d_in} r{r} T{lead} {dtype} adapters {adapter_dtype}"
    dev = torch.device(device)

    def mv(t):
        return t.to(dev) if t is not None else None

    return Case(mv(x), mv(W), mv(A), mv(B), mv(m), s, mv(b), label)


FULL_SHAPES = QUICK_SHAPES + ((64, 96, 32, (3, 11)), (129, 257, 64, 33))


def cases_for(dtype: torch.dtype, device, profile: str = "quick") -> list[Case]:
    """The random cases of a profile: quick = one seed per shape; full = 4 seeds, more shapes."""
    shapes, seeds = (QUICK_SHAPES, 1) if profile == "quick" else (FULL_SHAPES, 4)
    cases = []
    for seed in range(seeds):
        for i, (d_out, d_in, r, t) in enumerate(shapes):
            cases.append(make_case(d_out, d_in, r, t, dtype, seed=100 * seed + i, device=device))
        if dtype != torch.float32:  # PEFT's default: fp32 adapters under low-precision activations
            cases.append(make_case(24, 40, 8, 6, dtype, adapter_dtype=torch.float32, seed=7 + seed, device=device))
    return cases


def _grads(fn, case: Case, dy: torch.Tensor, upcast: bool):
    cast = (lambda t: t.detach().to(torch.float64)) if upcast else (lambda t: t.detach().clone())
    leaves = {
        "x": cast(case.x).requires_grad_(),
        "lora_A": cast(case.lora_A).requires_grad_(),
        "lora_B": cast(case.lora_B).requires_grad_(),
        "magnitude": cast(case.magnitude).requires_grad_(),
        "bias": cast(case.bias).requires_grad_() if case.bias is not None else None,
    }
    W = cast(case.weight)
    y = fn(leaves["x"], W, leaves["lora_A"], leaves["lora_B"], leaves["magnitude"], case.scaling, leaves["bias"])
    names = [k for k, v in leaves.items() if v is not None]
    grads = torch.autograd.grad(y, [leaves[k] for k in names], dy.to(y.dtype))
    return y.detach(), dict(zip(names, grads))


_GRAD_OUTPUT = {"x": "dx", "lora_A": "dA", "lora_B": "dB", "magnitude": "dm", "bias": "db"}


def check_forward_backward(
    impl: DoraImpl, dtype_name: str, family: str, device="cpu", profile: str = "quick"
) -> list[CheckResult]:
    """Forward y and the gradients of x, A, B, m, b against the fp64 oracle (relative L2)."""
    dtype = DTYPES[dtype_name]
    worst: dict[str, tuple[float, str]] = {}
    cases = cases_for(dtype, device, profile)
    for case in cases:
        gen = torch.Generator().manual_seed(zlib.crc32(case.label.encode()))
        dy = torch.randn(*case.x.shape[:-1], case.weight.shape[0], generator=gen).to(device=case.x.device, dtype=dtype)
        y, grads = _grads(impl, case, dy, upcast=False)
        y_ref, grads_ref = _grads(dora_forward_ref, case, dy, upcast=True)
        errors = {"forward.y": rel_l2(y, y_ref)}
        for k, g in grads.items():
            errors[f"backward.{_GRAD_OUTPUT[k]}"] = rel_l2(g, grads_ref[k])
        for prop, err in errors.items():
            if prop not in worst or not (err <= worst[prop][0]):
                worst[prop] = (err, case.label)
    results = []
    for prop, (err, label) in worst.items():
        op, output = prop.split(".")
        budget = budget_for(op, output, dtype_name, family).rel_l2
        results.append(CheckResult(prop, dtype_name, err <= budget, err, budget, len(cases), f"worst case: {label}"))
    return results


def check_norm(
    norm_impl: NormImpl, dtype_name: str, family: str, device="cpu", profile: str = "quick"
) -> list[CheckResult]:
    """The implementation's row norm against the fp64 oracle's, relative L2 per case."""
    dtype = DTYPES[dtype_name]
    worst, worst_label = 0.0, ""
    cases = cases_for(dtype, device, profile)
    for case in cases:
        n = norm_impl(case.weight, case.lora_A, case.lora_B, case.scaling)
        ref = norm_terms_ref(case.weight.cpu(), case.lora_A.cpu(), case.lora_B.cpu(), case.scaling).norm
        err = rel_l2(n.cpu(), ref)
        if not (err <= worst):
            worst, worst_label = err, case.label
    budget = budget_for("norm", "norm", dtype_name, family).rel_l2
    return [CheckResult("norm.norm", dtype_name, worst <= budget, worst, budget, len(cases), f"worst case: {worst_label}")]
