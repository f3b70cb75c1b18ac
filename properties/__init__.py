"""doracheck.properties: checks any DoRA implementation against the oracles, with budgets.

The implementation under test is always an argument (a callable with ``dora_linear``'s
signature); ``doracheck verify`` and the tests use the same functions.
"""

from .budgets import Budget, all_budgets, budget_for, device_family
from .oracle_checks import Case, CheckResult, check_forward_backward, check_norm, make_case

__all__ = [
    "Budget",
    "Case",
    "CheckResult",
    "all_budgets",
    "budget_for",
    "check_forward_backward",
    "check_norm",
    "device_family",
    "make_case",
]
