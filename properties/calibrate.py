"""Measure the error constants of an implementation on this device and propose budget rows.

``calibrate(impl, dtypes, cases, device)`` runs ``cases`` random problems per dtype (kinds
mixed, cancellation excluded from the oracle distances as in the suite) and records, per
(op, output, dtype), the largest observed error; it proposes ``2 ×`` that (rounded up to two
significant digits) as the row for this device's family. A human reviews the proposal before
it goes into ``budgets.MEASURED_ROWS``; nothing here writes the file.
"""

from __future__ import annotations

import datetime
import math
import platform
from dataclasses import dataclass

import torch

from . import props
from .budgets import DTYPES, budget_for, device_family
from .problems import KINDS, make_problem

MARGIN = 2.0


@dataclass
class Proposal:
    op: str
    output: str
    dtype: str
    family: str
    field: str
    observed: float
    proposed: float
    current: float
    cases: int
    note: str

    def as_row(self) -> str:
        return f'Budget("{self.op}", "{self.output}", "{self.dtype}", "{self.family}", "{self.note}", {self.field}={self.proposed:.2e}),'


def _round_up(value: float) -> float:
    if value <= 0 or not math.isfinite(value):
        return value
    exp = math.floor(math.log10(value)) - 1
    return math.ceil(value / 10**exp) * 10**exp


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def calibrate(impl: props.Implementation, dtypes: list[str], cases: int = 16, device: str = "cpu") -> list[Proposal]:
    family = device_family(device)
    today = datetime.date.today().isoformat()
    where = device_name(device)
    observed: dict[tuple[str, str, str, str], float] = {}

    def note(key, value):
        observed[key] = max(observed.get(key, 0.0), value)

    kinds = [k for k in KINDS if k != "cancel"]
    for dt in dtypes:
        dtype = DTYPES[dt]
        for i in range(cases):
            gen = torch.Generator().manual_seed(i)
            # shapes from tiny (1) to 96, T from 1 to 32: small outputs make rel L2 noisier
            d_out, d_in, r = (int(v) for v in torch.randint(1, 97, (3,), generator=gen))
            r = max(1, r // 4)
            tokens = int(torch.randint(1, 33, (1,), generator=gen))
            p = make_problem(d_out, d_in, r, tokens, dtype, kind=kinds[i % len(kinds)], seed=i, device=device, with_bias=i % 2 == 0)
            for res in props.backward_vs_oracle(impl, [p], family):
                op, out = res.prop.split(".")
                note((op, out, dt, "rel_l2"), res.worst)
        for seed in range(max(2, cases // 4)):
            for res in props.compose_near_one(impl, dtype, family, seeds=(seed,), device=device):
                note(("compose", "y", dt, "ulp"), res.worst)
    proposals = []
    for (op, out, dt, field), value in sorted(observed.items()):
        current = getattr(budget_for(op, out, dt, family), field)
        # The compose bound is a design statement (correct rounding: 0.5 ulp), not a margin
        # over what was seen: it is only ever proposed wider if something exceeded it.
        proposed = (current if value <= current else _round_up(value)) if field == "ulp" else _round_up(MARGIN * value)
        n = cases if field == "rel_l2" else max(2, cases // 4)
        msg = f"calibrate {today} on {where} ({family}): max {value:.2e} over {n} cases x{MARGIN:g}"
        proposals.append(Proposal(op, out, dt, family, field, value, proposed, current, n, msg))
    return proposals
