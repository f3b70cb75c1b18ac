"""doracheck.properties: checks any DoRA implementation against the oracles, with budgets.

The implementation under test is always an argument (``props.Implementation``); ``doracheck verify``
and the tests run the same functions (``suite.run_suite``). The folder ``properties/`` is installed
as ``doracheck.properties`` (``package-dir`` in pyproject.toml; docs/design.md section 5).
"""

from .budgets import Budget, all_budgets, budget_for, device_family
from .problems import KINDS, Problem, cases_for, make_case, make_problem
from .props import Implementation, baseline_ratio
from .results import CheckResult
from .suite import run_suite
from .unsupported import Unsupported

Case = Problem

__all__ = [
    "Budget",
    "Case",
    "CheckResult",
    "Implementation",
    "KINDS",
    "Problem",
    "Unsupported",
    "all_budgets",
    "baseline_ratio",
    "budget_for",
    "cases_for",
    "device_family",
    "make_case",
    "make_problem",
    "run_suite",
]
