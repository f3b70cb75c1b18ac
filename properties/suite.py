"""Run every property against one implementation: what ``doracheck verify`` and the tests share.

``run_suite(impl, dtypes, profile, device)`` returns ``CheckResult`` rows, property × dtype. Profiles:
``quick`` (one seed per shape; under 2 minutes on a 2-core CPU) and ``full`` (``problems.cases_for``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

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


class SuiteItem(NamedTuple):
    """One property group in one dtype: a progress step of ``verify``, one test item of the pytest
    plugin. ``run()`` gives its rows (``run_item`` guards it)."""

    name: str  # e.g. "compose.near_one", "accuracy" (forward.y and backward.*)
    dtype: str
    message: str  # the progress line
    run: Callable[[], list[CheckResult]]


def suite_items(impl: props.Implementation, dtypes: list[str], profile: str = "quick", device: str = "cpu") -> list[SuiteItem]:
    """Every item of the suite, in verify's order, each run in the implementation's ``setting`` if
    any. Problems are built when an item first runs (cached per dtype), from fixed seeds: every
    process builds the same items and inputs."""
    family = device_family(device)
    items = [SuiteItem("grad.gradcheck", "fp64", "gradcheck (fp64)", lambda: props.gradcheck_fp64(impl, family))]
    for dt in dtypes:
        items += _dtype_items(impl, dt, profile, device, family)
    if impl.setting is None:
        return items
    return [item._replace(run=_within(impl.setting, item.run)) for item in items]


def _within(setting: Callable[[], contextlib.AbstractContextManager], run: Callable[[], list[CheckResult]]):
    def run_within() -> list[CheckResult]:
        with setting():
            return run()

    return run_within


def _dtype_items(impl: props.Implementation, dt: str, profile: str, device: str, family: str) -> list[SuiteItem]:
    dtype = DTYPES[dt]

    @functools.cache
    def cases():
        return cases_for(dtype, device, profile)

    def small():
        return [make_problem(7, 13, 3, 4, dtype, seed=1, device=device),
                make_problem(9, 11, 3, 4, dtype, seed=2, kind="cancel", device=device)]

    def item(name: str, message: str, run: Callable[[], list[CheckResult]]) -> SuiteItem:
        return SuiteItem(name, dt, f"{dt}: {message}", run)

    return [
        item("norm.three_term", "norm terms", lambda: props.three_term_identity(impl, small(), family)),
        item("norm.memory", "norm memory", lambda: props.norm_memory(impl, dtype, family, device, impl.norm_memory_bound)),
        item("compose.near_one", "compose near g = 1", lambda: props.compose_near_one(impl, dtype, family, device=device)),
        item("accuracy", "forward and backward against the fp64 oracle", lambda: props.backward_vs_oracle(impl, cases(), family)),
        item("meta", "metamorphic relations", lambda: props.metamorphic(impl, cases()[1], family)),
        item("ratio", "baseline ratio", lambda: props.baseline_ratio_checks(impl, cases(), family)),
        item("merge", "merge and unmerge", lambda: props.merge_unmerge(impl, dtype, family, device)),
        item("edge", "edge cases", lambda: props.determinism_edges(impl, dtype, family, device)),
        item("cache.no_stale", "no stale norm", lambda: props.no_stale_cache(impl, dtype, family, device)),
    ]


def run_item(item: SuiteItem) -> list[CheckResult]:
    """The item's rows; a mode the implementation lacks is n/a, an exception a failure."""
    rows = _guard(item.name, item.dtype, item.run)
    for row in rows:
        row.item = item.name  # a reproducer (``repro``) re-runs the item by this name
    return rows


def suite_steps(dtypes: list[str]) -> int:
    """How many progress messages ``run_suite`` sends for these dtypes (one per item)."""
    return 1 + 9 * len(dtypes)


def run_suite(
    impl: props.Implementation,
    dtypes: list[str],
    profile: str = "quick",
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Every item's rows, in order (what ``doracheck verify`` prints)."""
    results: list[CheckResult] = []
    for item in suite_items(impl, dtypes, profile, device):
        if progress is not None:
            progress(item.message)
        results += run_item(item)
    return results
