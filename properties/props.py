"""The properties, each a plain function: (implementation, inputs, family) -> [CheckResult].

The implementation is a ``props_common.Implementation``; a property needing a piece it lacks, or a
mode it does not offer (``Unsupported``), is "n/a" with the reason. This module gathers the
properties under one name (``props.metamorphic``, ...); each lives in the module of its kind:

 1 three_term_identity   norm² = base + 2s·cross + s²·lora against the mpmath oracle, each term too
 2 norm_memory           the norm's peak extra memory within its declared bound, far below dense
 3 compose_near_one      exact intermediates, g = 1 + δ: within 0.5 ulp + an fp32-sized term
 4 gradients             gradcheck in fp64 (both norm modes); backward vs the fp64 oracle
 5 metamorphic           row scaling of W and B; output permutation; linearity in x
 6 baseline_ratio        err(impl) <= k·err(naive same precision) + floor (``baseline_ratio``)
 7 merge_unmerge         x·W'ᵀ vs the unmerged forward; unmerge restores W
 8 determinism_edges     bitwise repeatability; T = 0, T = 1, zero rows, NaN/Inf, non-contiguous, 3-D
 9 no_stale_cache        in-place updates of A, B, W, m are seen by the next call

``props_norm``: 1-3; ``props_accuracy``: 4 and 6; ``props_metamorphic``: 5; ``props_edges``: 7-9;
``props_common``: ``Implementation`` and the helpers every property uses.
"""

from __future__ import annotations

from .budgets import budget_for
from .problems import Problem, make_problem
from .props_accuracy import (
    RATIO_MIN_ELEMENTS,
    _over,
    _zero_row_nan,
    a_priori_bound,
    backward_vs_oracle,
    baseline_ratio,
    baseline_ratio_checks,
    conditioning,
    effective_count,
    gradcheck_fp64,
    representation_noise,
)
from .props_common import (
    GRAD_NAMES,
    Implementation,
    _call,
    _dtype_name,
    _field,
    _grads,
    _na,
    _result,
    _worse,
    _worst_of,
)
from .props_edges import determinism_edges, merge_unmerge, no_stale_cache
from .props_metamorphic import _permutation_error, metamorphic
from .props_norm import (
    compose_error_ulps,
    compose_near_one,
    compose_problem,
    norm_memory,
    three_term_identity,
)
from .results import CheckResult

__all__ = [
    "GRAD_NAMES",
    "RATIO_MIN_ELEMENTS",
    "CheckResult",
    "Implementation",
    "Problem",
    "_call",
    "_dtype_name",
    "_field",
    "_grads",
    "_na",
    "_over",
    "_permutation_error",
    "_result",
    "_worse",
    "_worst_of",
    "_zero_row_nan",
    "a_priori_bound",
    "backward_vs_oracle",
    "baseline_ratio",
    "baseline_ratio_checks",
    "budget_for",
    "compose_error_ulps",
    "compose_near_one",
    "compose_problem",
    "conditioning",
    "determinism_edges",
    "effective_count",
    "gradcheck_fp64",
    "make_problem",
    "merge_unmerge",
    "metamorphic",
    "no_stale_cache",
    "norm_memory",
    "representation_noise",
    "three_term_identity",
]
