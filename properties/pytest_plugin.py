"""doracheck's conformance suite as a pytest plugin (registered as the ``pytest11`` entry point
``doracheck``; inert unless ``--doracheck-impl`` is given).

    pytest --doracheck-impl MODULE:CALLABLE [--doracheck-profile quick|full]
           [--doracheck-dtype bf16,fp16,fp32] [--doracheck-variant NAME] [-n auto] [-k compose]

collects one test item per property group × dtype, ``test_doracheck[compose.near_one-bf16]``,
from the same suite code ``doracheck verify`` runs (``suite.suite_items``). A failing item's
message is verify's diagnostics (worst error, budget, margin, the worst case and its
conditioning); an item whose properties are all n/a is a skip with the reason; an
implementation that cannot be imported is a collection error. Under pytest-xdist each worker is
pinned to one GPU (``gpu_workers.gpu_for_worker``) and budgets resolve by the device the worker
runs on; the suite's problems come from fixed seeds (no hypothesis), so every worker builds the
same items and a run on one GPU and on two gives the same verdicts.

Aliases for ``--doracheck-impl``: ``doracheck`` (also ``doracheck:dora_linear``), ``torch``,
``peft`` (also ``doracheck.properties.impl_peft:peft_dora_linear``), ``doracheck@VARIANT``.
"""

from __future__ import annotations

import os

import pytest

_OPTIONS = ("doracheck_impl", "doracheck_profile", "doracheck_dtype", "doracheck_variant")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("doracheck", "doracheck conformance suite")
    group.addoption("--doracheck-impl", metavar="SPEC",
                    help="run doracheck's property suite against SPEC: MODULE:CALLABLE with dora_linear's signature, or "
                         "doracheck | torch | peft | doracheck@VARIANT")
    group.addoption("--doracheck-profile", choices=("quick", "full"), default="quick",
                    help="quick (one seed per shape) or full (4 seeds, larger shapes, hard kinds); default quick")
    group.addoption("--doracheck-dtype", default="fp32,bf16,fp16", metavar="LIST",
                    help="comma list of fp32, bf16, fp16 (default all three)")
    group.addoption("--doracheck-variant", metavar="NAME",
                    help="force doracheck's planner variant (e.g. merged+whole) while the items run")


def pytest_configure(config) -> None:
    if not config.getoption("doracheck_impl"):
        return
    config.addinivalue_line("markers", "doracheck: an item of doracheck's conformance suite")
    import torch

    from .gpu_workers import gpu_for_worker

    if torch.cuda.is_available():  # as ``doracheck verify`` runs: nothing else set
        gpu = gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())
        if gpu is not None:
            torch.cuda.set_device(gpu)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class DoracheckSuite(pytest.Collector):
    """The suite's items for one implementation; resolving the implementation happens here, so
    an import failure is this collector's collection error."""

    def collect(self):
        from .implementations import ImplementationError, resolve
        from .suite import suite_items

        config = self.config
        spec = config.getoption("doracheck_impl")
        try:
            impl = resolve(spec)
        except ImplementationError as exc:
            raise self.CollectError(f"--doracheck-impl {spec}: {exc}") from None
        dtypes = [d.strip() for d in config.getoption("doracheck_dtype").split(",") if d.strip()]
        bad = [d for d in dtypes if d not in ("fp32", "bf16", "fp16")]
        if bad or not dtypes:
            raise self.CollectError(f"--doracheck-dtype: expected a comma list of fp32, bf16, fp16, got {bad or dtypes}")
        for item in suite_items(impl, dtypes, config.getoption("doracheck_profile"), _device()):
            yield DoracheckItem.from_parent(self, name=f"test_doracheck[{item.name}-{item.dtype}]", suite_item=item,
                                            impl_name=impl.name)

    class CollectError(Exception):
        pass

    def repr_failure(self, excinfo):  # one line, not a traceback into the plugin
        if excinfo.errisinstance(self.CollectError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


class DoracheckFailure(AssertionError):
    pass


class DoracheckItem(pytest.Item):
    def __init__(self, *, suite_item, impl_name: str, **kwargs):
        super().__init__(**kwargs)
        self.suite_item = suite_item
        self.impl_name = impl_name
        self.add_marker("doracheck")
        self.results: list = []

    def runtest(self) -> None:
        import contextlib

        from .suite import run_item

        variant = self.config.getoption("doracheck_variant")
        guard: contextlib.AbstractContextManager = contextlib.nullcontext()
        if variant:
            from doracheck.planner import use_variant

            guard = use_variant(variant)
        with guard:
            self.results = run_item(self.suite_item)
        for r in self.results:
            self.user_properties.append((f"{r.prop}[{r.dtype}]", f"{r.status} worst={r.worst:.3e} budget={r.budget:.3e}"))
        failed = [r for r in self.results if r.status == "FAIL"]
        if failed:
            raise DoracheckFailure("\n".join(_describe(r) for r in failed))
        if self.results and all(r.status == "n/a" for r in self.results):
            reason = "; ".join(sorted({r.detail.removeprefix("n/a: ") for r in self.results}))
            raise pytest.skip.Exception(f"n/a: {reason}", _use_item_location=True)

    def repr_failure(self, excinfo, style=None):
        if excinfo.errisinstance(DoracheckFailure):
            return f"doracheck conformance ({self.impl_name}, {self.suite_item.name} [{self.suite_item.dtype}]):\n{excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return "doracheck", 0, f"{self.suite_item.name} [{self.suite_item.dtype}]"


def _describe(r) -> str:
    margin = "inf" if r.margin == float("inf") else f"{r.margin:.2f}x"
    return f"  FAIL {r.prop} [{r.dtype}]: worst {r.worst:.3e} > budget {r.budget:.3e} (margin {margin}) over {r.cases} cases; {r.detail}"


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, which then applies to these items too
def pytest_collection_modifyitems(session, config, items) -> None:
    if not config.getoption("doracheck_impl"):
        return
    from _pytest.runner import collect_one_node

    suite = DoracheckSuite.from_parent(session, name="doracheck", nodeid="doracheck")
    report = collect_one_node(suite)
    session.ihook.pytest_collectreport(report=report)
    if report.passed:
        items.extend(node for node in report.result if isinstance(node, pytest.Item))
