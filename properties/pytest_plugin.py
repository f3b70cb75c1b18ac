"""doracheck's conformance suite as a pytest plugin: registered by the ``pytest11`` entry module
``pytest_doracheck`` (which holds the options) only when ``--doracheck-impl`` is given.

    pytest --doracheck-impl MODULE:CALLABLE [--doracheck-profile quick|full]
           [--doracheck-dtype bf16,fp16,fp32] [--doracheck-variant NAME] [-n auto] [-k compose]

collects one test item per property group × dtype, ``test_doracheck[compose.near_one-bf16]``, from the suite
code ``doracheck verify`` runs (``suite.suite_items``), with verify's ``--impl`` specs
(``implementations.resolve``). A failing item's message is verify's diagnostics (worst error, budget, margin,
the worst case and its conditioning); an item whose properties are all n/a is a skip with the reason; an
unimportable implementation is a collection error. Under pytest-xdist each worker is pinned to one GPU
(``gpu_workers.gpu_for_worker``) and budgets resolve by its device; problems come from fixed seeds (no
hypothesis), so every worker builds the same items and one GPU or two give the same verdicts. Items join the
session in ``pytest_collection_modifyitems`` (first among its hooks), so ``-k``, ``-m``, ``--deselect``,
``--lf`` and xdist apply; select one by ``-k`` (it has no file to name)."""

from __future__ import annotations

import os

import pytest

DTYPES = ("fp32", "bf16", "fp16")


def check_options(config) -> None:
    """Usage errors before anything runs: a bad dtype list or variant is one line, exit 4."""
    dtypes = [d.strip() for d in config.getoption("doracheck_dtype").split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise pytest.UsageError(f"--doracheck-dtype: expected a comma list of fp32, bf16, fp16, got {config.getoption('doracheck_dtype')!r}")
    variant = config.getoption("doracheck_variant")
    if variant:
        if config.getoption("doracheck_impl") not in ("doracheck", "doracheck:dora_linear"):
            raise pytest.UsageError("--doracheck-variant applies to doracheck's own layer: use it with --doracheck-impl doracheck")
        from doracheck.planner import parse_variant

        try:
            parse_variant(variant)
        except ValueError as exc:
            raise pytest.UsageError(f"--doracheck-variant: {exc}") from None


def pytest_configure(config) -> None:
    """Registered by the entry module only when --doracheck-impl is given."""
    config.addinivalue_line("markers", "doracheck: an item of doracheck's conformance suite")
    import torch

    from .gpu_workers import gpu_for_worker

    if torch.cuda.is_available():  # as ``doracheck verify`` runs: nothing else set
        gpu = gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())
        if gpu is not None:
            torch.cuda.set_device(gpu)


def _spec(config) -> str:
    """The implementation spec, with --doracheck-variant folded in as verify's doracheck@VARIANT."""
    spec, variant = config.getoption("doracheck_impl"), config.getoption("doracheck_variant")
    return f"doracheck@{variant}" if variant else spec


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class DoracheckSuite(pytest.Collector):
    """The suite's items for one implementation, resolved here (an import failure: this collector's error)."""

    def collect(self):
        from .implementations import ImplementationError, resolve
        from .suite import suite_items

        config = self.config
        spec = _spec(config)
        try:
            impl = resolve(spec)
        except ImplementationError as exc:
            raise self.CollectError(f"--doracheck-impl {spec}: {exc}") from None
        dtypes = list(dict.fromkeys(d.strip() for d in config.getoption("doracheck_dtype").split(",") if d.strip()))
        for item in suite_items(impl, dtypes, config.getoption("doracheck_profile"), _device()):
            name = f"test_doracheck[{item.name}-{item.dtype}]"
            yield DoracheckItem.from_parent(self, name=name, nodeid=f"doracheck::{name}", suite_item=item, impl_name=impl.name)

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
        from .unsupported import Unsupported

        try:  # not run_item: a crash of the implementation keeps its own traceback here
            self.results = self.suite_item.run()
        except Unsupported as exc:
            raise pytest.skip.Exception(f"n/a: {exc}", _use_item_location=True) from None
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
