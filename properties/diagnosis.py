"""Naming the cause of a failure: which known deviation (``reference.deviations``) reproduces it.

Run only on a failing case, at its own size. A deviation names the cause when it is
distinguishable from the contract on that case (some output differs by more than the property's
tolerance) and reproduces every output of the implementation within that tolerance (non-finite
values in the same places, the finite ones close). The tolerance is the property's own: what a
correct implementation may differ from the contract by is what an implementation of the
deviation may differ from the deviation by.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from doracheck.reference import dora_forward_ref, rel_l2, ulp_distance
from doracheck.reference.deviations import DEVIATION_BY_NAME, DEVIATIONS, Deviation

from .problems import Problem
from .props_common import Implementation, _call, _dtype_name, _grads

Close = Callable[[str, torch.Tensor, torch.Tensor], bool]
Distance = Callable[[str, torch.Tensor, torch.Tensor], float]
NOT_EXPLAINED = "no known deviation explains it"


def rel_distance(tolerances: dict[str, float]) -> Distance:
    """The relative L2 distance of the finite entries in units of the output's tolerance (<= 1:
    close), inf where the non-finite entries do not coincide."""

    def distance(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if a.shape != b.shape:
            return math.inf
        finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(finite_a, finite_b):
            return math.inf
        if not bool(finite_a.any()):
            return 0.0
        err = rel_l2(a[finite_a], b[finite_a]) / tolerances[name]
        return err if math.isfinite(err) else math.inf

    return distance


def _outputs(fn, p: Problem, dy: torch.Tensor | None, cast, **kw) -> dict[str, torch.Tensor]:
    if dy is None:
        with torch.no_grad():
            args = [cast(t) if isinstance(t, torch.Tensor) else t for t in p.args()]
            return {"y": fn(*args, fan_in_fan_out=p.fan_in_fan_out, **kw)}
    y, grads = _grads(fn, p, dy, cast, **kw)
    return {"y": y, **grads}


def explaining(impl: Implementation, p: Problem, distance: Distance, dy: torch.Tensor | None = None, **kw) -> list[Deviation]:
    """The deviations that best explain the implementation's outputs on ``p`` (forward only when
    ``dy`` is None; with ``dy`` also every gradient): among those distinguishable from the contract
    there (some output farther than 1, ``distance`` being in units of the property's tolerance)
    and reproducing every output within 1, the closest (several only when within 10% of it),
    classes that change the meaning before those that only round."""
    dt = _dtype_name(p.x.dtype)
    if dy is None:
        with torch.no_grad():
            got = {"y": _call(impl, p, **kw)}
    else:
        got = _outputs(impl.dora_linear, p, dy, lambda t: t.detach().clone(), **kw)
    contract = _outputs(dora_forward_ref, p, dy, lambda t: t.detach().double(), **kw)
    found: list[tuple[float, Deviation]] = []
    for deviation in DEVIATIONS:
        if dt not in deviation.in_dtypes:
            continue
        try:
            wrong = _outputs(functools.partial(deviation.forward, dtype=p.x.dtype), p, dy, lambda t: t.detach().double(), **kw)
        except (RuntimeError, ValueError):  # not applicable to this case (a transposed non-square weight)
            continue
        if all(distance(k, wrong[k], contract[k]) <= 1 for k in got):
            continue  # the same as the contract here: it cannot be told apart
        far = max(distance(k, got[k], wrong[k]) for k in got)
        if far <= 1:
            found.append((far, deviation))
    if not found:
        return []
    semantic = [(far, d) for far, d in found if "fp32" in d.in_dtypes]
    if semantic:  # the property's tolerance already covers rounding noise: a class that only rounds
        found = semantic  # is named when no change of meaning explains the failure
    best = min(far for far, _ in found)
    return [d for far, d in found if far <= 1.1 * best + 1e-12]


def verdict(deviations: list[Deviation]) -> str:
    """The text a failure line carries: `matches "name" (description)`, or that none does."""
    if not deviations:
        return NOT_EXPLAINED
    return "; ".join(f'matches "{d.name}" ({d.description})' for d in deviations)


def row_scaling_cause(impl: Implementation, p: Problem, W_scaled: torch.Tensor, B_scaled: torch.Tensor, moved: float,
                      forward_tolerance: float) -> str:
    """The cause of a ``meta.row_scaling`` failure (the implementation moved y by ``moved`` ulp when
    rows of W and B were scaled by 4). A change of meaning is named as for accuracy (the deviation
    that reproduces y on this case). Otherwise the rounding form: the contract's g⊙z is exactly
    invariant (g/4 and 4z are exact), PEFT's (g-1)⊙base + base + g⊙s⊙lora rounded in the
    activation dtype is not (4·base - 3·base cancels); named when that form, on this case, moves y
    by as many ulps as the implementation did, within a factor of 4."""
    semantic = explaining(impl, p, rel_distance({"y": forward_tolerance}))
    if semantic:
        return verdict(semantic)
    form = DEVIATION_BY_NAME["low-precision compose"]

    def y_of(W: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return form.forward(p.x, W, p.lora_A, B, p.magnitude, p.scaling, p.bias, dtype=p.x.dtype,
                            fan_in_fan_out=p.fan_in_fan_out).to(p.x.dtype)

    by_form = float(ulp_distance(y_of(W_scaled, B_scaled), y_of(p.weight, p.lora_B)).max()) if p.x.numel() else 0.0
    if not (by_form > 1 and by_form / 4 <= moved <= 4 * by_form):
        return NOT_EXPLAINED
    return (f'explained by the (g-1)·base + base form of the compose (as in "{form.name}"): rounded in '
            f"{_dtype_name(p.x.dtype)}, it moves y by {by_form:.0f} ulp here (the implementation {moved:.0f}), "
            "the product form g⊙z by none")
