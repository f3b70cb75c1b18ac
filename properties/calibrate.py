"""How tight the budgets are on this device: measured error against each bound.

``calibrate(impl, dtypes, cases, device)`` runs ``cases`` random problems per dtype (kinds mixed, cancellation
excluded from the oracle distances as in the suite) and records per (op, output, dtype) the largest error
relative to its bound and the worst case. Near 1: the bound is close to what this machine does; far below 1:
loose (to tighten from its derivation, never from these numbers). Nothing is proposed or written."""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import torch

from . import props
from .budgets import DTYPES, device_family
from .problems import KINDS, make_problem


@dataclass
class Tightness:
    prop: str  # e.g. forward.y, backward.dA, ratio.backward.dA, compose.near_one
    dtype: str
    family: str
    worst_error: float  # the implementation's error in the case closest to its bound
    bound: float  # that case's bound
    tightness: float  # worst_error / bound: > 1 fails; NaN where an error was NaN
    cases: int
    worst_case: str


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _ratio(err: float, bound: float) -> float:
    if math.isnan(err) or math.isnan(bound):
        return math.nan
    return err / bound if bound > 0 else (0.0 if err == 0 else math.inf)


def calibrate(impl: props.Implementation, dtypes: list[str], cases: int = 16, device: str = "cpu", progress=None) -> list[Tightness]:
    family = device_family(device)
    worst: dict[tuple[str, str], Tightness] = {}
    counts: dict[tuple[str, str], int] = {}

    def note(dt: str, res) -> None:
        if res.status == "n/a":
            return
        t = _ratio(res.worst, res.budget)
        key = (res.prop, dt)
        counts[key] = counts.get(key, 0) + 1
        current = worst.get(key)
        if current is None or props._worse(t, current.tightness):
            worst[key] = Tightness(res.prop, dt, family, res.worst, res.budget, t, 0, res.detail)
        worst[key].cases = counts[key]

    kinds = [k for k in KINDS if k != "cancel"]
    for dt in dtypes:
        dtype = DTYPES[dt]
        for i in range(cases):
            gen = torch.Generator().manual_seed(i)
            # shapes from 1 to 96, T from 1 to 32: small outputs make rel L2 noisier
            d_out, d_in, r = (int(v) for v in torch.randint(1, 97, (3,), generator=gen))
            r = max(1, r // 4)
            tokens = int(torch.randint(1, 33, (1,), generator=gen))
            p = make_problem(d_out, d_in, r, tokens, dtype, kind=kinds[i % len(kinds)], seed=i, device=device, with_bias=i % 2 == 0)
            for res in props.backward_vs_oracle(impl, [p], family) + props.baseline_ratio_checks(impl, [p], family):
                note(dt, res)
            if progress is not None:
                progress(f"{dt} case {i + 1}/{cases}")
        for seed in range(max(2, cases // 4)):
            for res in props.compose_near_one(impl, dtype, family, seeds=(seed,), device=device):
                note(dt, res)
    return sorted(worst.values(), key=lambda t: (t.dtype, t.prop))
