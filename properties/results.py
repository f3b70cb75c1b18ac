"""``CheckResult``: one property × dtype outcome, as verify prints it and tests assert it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class CheckResult:
    prop: str  # e.g. "forward.y", "backward.dA", "norm.norm"
    dtype: str
    passed: bool
    worst: float  # the worst error over the cases, in the property's unit
    budget: float
    cases: int
    detail: str = ""
    status: str = ""  # "pass" | "FAIL" | "n/a" (derived from ``passed`` unless given)
    item: str = ""  # the suite item that gave it (``suite.run_item``): what ``--repro`` re-runs
    case: dict | None = None  # an accuracy row's worst case (recipe, dy seed, dropout): ``repro`` rebuilds it

    def __post_init__(self):
        if not self.status:
            self.status = "pass" if self.passed else "FAIL"

    @property
    def margin(self) -> float:
        """budget / worst (> 1 passes); inf when the error is exactly 0."""
        return math.inf if self.worst == 0 else self.budget / self.worst

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["item"], d["case"]  # bookkeeping for the reproducers, not part of --json's rows
        d["margin"] = None if math.isinf(self.margin) else self.margin
        return d
