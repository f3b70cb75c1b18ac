"""Run every property against one implementation: what ``doracheck verify`` and the tests share.

``run_suite(impl, dtypes, profile, device)`` returns ``CheckResult`` rows, property × dtype.
Profiles: ``quick`` (one seed per shape; under 2 minutes on a 2-core CPU) and ``full``
(4 seeds, larger shapes, the hard problem kinds, fan_in_fan_out).
"""

from __future__ import annotations

from collections.abc import Callable

from . import props
from .budgets import DTYPES, device_family
from .problems import cases_for, make_problem
from .results import CheckResult
from .unsupported import Unsupported


def _guard(name: str, dtype: str, fn: Callable[..., list[CheckResult]], *args, **kwargs) -> list[CheckResult]:
    """Run one property; a mode the implementation lacks becomes n/a, an exception a failure."""
    try:
        return fn(*args, **kwargs)
    except Unsupported as exc:
        return [CheckResult(name, dtype, True, 0.0, 0.0, 0, f"n/a: {exc}", status="n/a")]
    except Exception as exc:  # noqa: BLE001 (a crash of the implementation is a failed property)
        return [CheckResult(name, dtype, False, float("inf"), 0.0, 0, f"raised {type(exc).__name__}: {str(exc)[:200]}")]


def suite_steps(dtypes: list[str]) -> int:
    """How many progress messages ``run_suite`` sends for these dtypes (for a count and an ETA)."""
    return 1 + 5 * len(dtypes)


def run_suite(
    impl: props.Implementation,
    dtypes: list[str],
    profile: str = "quick",
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    family = device_family(device)
    results: list[CheckResult] = []
    say = progress or (lambda _msg: None)
    say("gradcheck (fp64)")
    results += _guard("grad.gradcheck", "fp64", props.gradcheck_fp64, impl, family)
    for dt in dtypes:
        dtype = DTYPES[dt]
        problems = cases_for(dtype, device, profile)
        small = [make_problem(7, 13, 3, 4, dtype, seed=1, device=device),
                 make_problem(9, 11, 3, 4, dtype, seed=2, kind="cancel", device=device)]
        say(f"{dt}: norm")
        results += _guard("norm.three_term", dt, props.three_term_identity, impl, small, family)
        results += _guard("norm.memory", dt, props.norm_memory, impl, dtype, family, device, impl.norm_memory_bound)
        say(f"{dt}: compose near g = 1")
        results += _guard("compose.near_one", dt, props.compose_near_one, impl, dtype, family, device=device)
        say(f"{dt}: forward and backward against the fp64 oracle")
        results += _guard("forward", dt, props.backward_vs_oracle, impl, problems, family)
        say(f"{dt}: metamorphic relations and baseline ratio")
        results += _guard("meta", dt, props.metamorphic, impl, problems[1], family)
        results += _guard("ratio", dt, props.baseline_ratio_checks, impl, problems, family)
        say(f"{dt}: merge, edges, cache")
        results += _guard("merge", dt, props.merge_unmerge, impl, dtype, family, device)
        results += _guard("edge", dt, props.determinism_edges, impl, dtype, family, device)
        results += _guard("cache.no_stale", dt, props.no_stale_cache, impl, dtype, family, device)
    return results
