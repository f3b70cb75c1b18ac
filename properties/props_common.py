"""What every property shares: the ``Implementation`` under test and the result helpers.

An ``Implementation`` is a callable with ``dora_linear``'s signature and, optionally, a norm
function (``factored_norm``'s signature, ``return_terms=True`` supported) and a module class with
``from_linear``/``merge``/``unmerge`` (``DoRALinear``'s API); a property needing a piece it lacks
reports "n/a" (``_na``). Also: NaN-aware worst-case tracking, the call and gradient helpers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .budgets import DTYPES
from .problems import Problem
from .results import CheckResult

GRAD_NAMES = ("dx", "dA", "dB", "dm", "db")


@dataclass
class Implementation:
    """An implementation under test: ``dora_linear`` and, when it has them, its norm, module class,
    cache reset and declared norm-memory bound."""

    name: str
    dora_linear: Callable[..., torch.Tensor]
    factored_norm: Callable[..., object] | None = None
    module_cls: type | None = None
    clear_cache: Callable[[], None] | None = None
    norm_memory_bound: Callable[..., int] | None = None  # (d_out, d_in, r, device, lora_B_dtype=) -> bytes it declares
    # A context every suite item runs in (doracheck's: small chunk thresholds, so its chunked backward
    # runs at the suite's sizes beside the whole one).
    setting: Callable[[], contextlib.AbstractContextManager] | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _worse(err: float, worst: float) -> bool:
    """NaN-aware "err is worse than worst": NaN beats everything and is never replaced."""
    if math.isnan(worst):
        return False
    return math.isnan(err) or err > worst


def _worst_of(errors) -> float:
    out = 0.0
    for e in errors:
        if _worse(float(e), out):
            out = float(e)
    return out


def _na(prop: str, dtype: str, reason: str) -> CheckResult:
    return CheckResult(prop, dtype, True, 0.0, 0.0, 0, f"n/a: {reason}", status="n/a")


def _result(prop: str, dtype: str, worst: float, budget: float, cases: int, detail: str) -> CheckResult:
    return CheckResult(prop, dtype, bool(worst <= budget), worst, budget, cases, detail)


def _call(impl: Implementation, p: Problem, x=None, **kw):
    return impl.dora_linear(
        p.x if x is None else x, p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias, fan_in_fan_out=p.fan_in_fan_out, **kw
    )


def _field(budget, name: str) -> float:
    """A budget field that this property needs (a missing one is a budgets-file defect)."""
    value = getattr(budget, name)
    if value is None:
        raise KeyError(f"budget row {budget.op}/{budget.output}/{budget.dtype}/{budget.family} has no {name}")
    return float(value)


def _grads(fn, p: Problem, dy: torch.Tensor, cast, **kw):
    """(y, {name: gradient}) for x, A, B, m and b (b only when the problem has a bias)."""
    names = [k for k, t in zip(GRAD_NAMES, (p.x, p.lora_A, p.lora_B, p.magnitude, p.bias)) if t is not None]
    tensors = {k: t for k, t in zip(GRAD_NAMES, (p.x, p.lora_A, p.lora_B, p.magnitude, p.bias)) if t is not None}
    leaves = {k: cast(tensors[k]).requires_grad_() for k in names}
    y = fn(
        leaves["dx"], p.weight, leaves["dA"], leaves["dB"], leaves["dm"], p.scaling, leaves.get("db"),
        fan_in_fan_out=p.fan_in_fan_out, **kw,
    )
    grads = torch.autograd.grad(y, [leaves[k] for k in names], dy.to(y.dtype), allow_unused=True)
    return y.detach(), {k: (g if g is not None else torch.zeros_like(leaves[k])) for k, g in zip(names, grads)}


def mixed(p: Problem) -> bool:
    """Whether the problem has A, B or m in another dtype than x (fp32 adapters, autocast style),
    as against the whole model cast to the activation dtype."""
    return any(t.dtype != p.x.dtype for t in (p.lora_A, p.lora_B, p.magnitude))


def configuration(p: Problem) -> str:
    """The configuration a problem is in, for the failure lines."""
    return f"adapters in {_dtype_name(p.lora_A.dtype)}, m in {_dtype_name(p.magnitude.dtype)}" if mixed(p) else "adapters in the activation dtype"


def rejects_configuration(exc: Exception) -> bool:
    """An implementation's refusal of mixed dtypes (a dtype-mismatch error), as against a crash."""
    from .unsupported import Unsupported

    return isinstance(exc, Unsupported) or (isinstance(exc, (RuntimeError, TypeError, ValueError)) and "dtype" in str(exc).lower())
