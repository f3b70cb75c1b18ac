"""The pytest entry point of doracheck's conformance suite (``pytest11``: ``doracheck``).

Loaded by every pytest run where doracheck is installed, so it imports nothing but pytest: it
adds the ``--doracheck-*`` options and, only when ``--doracheck-impl`` is given, registers the
suite plugin (``doracheck.properties.pytest_plugin``), which imports torch and doracheck. Without
that option no doracheck code runs (no torch import, no optimizer hook).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("doracheck", "doracheck conformance suite")
    group.addoption("--doracheck-impl", metavar="SPEC",
                    help="run doracheck's property suite against SPEC: MODULE:CALLABLE with dora_linear's signature, "
                         "MODULE:NAME of a doracheck.properties.Implementation, or doracheck | torch | peft | doracheck@VARIANT")
    group.addoption("--doracheck-profile", choices=("quick", "full"), default="quick",
                    help="quick (one seed per shape) or full (4 seeds, larger shapes, hard kinds); default quick")
    group.addoption("--doracheck-dtype", default="fp32,bf16,fp16", metavar="LIST",
                    help="comma list of fp32, bf16, fp16 (default all three)")
    group.addoption("--doracheck-variant", metavar="NAME",
                    help="with --doracheck-impl doracheck: force one of doracheck's planner variants "
                         "(e.g. merged+whole), as --impl doracheck@NAME does for verify")


@pytest.hookimpl(trylast=True)
def pytest_configure(config) -> None:
    if config.getoption("doracheck_impl"):
        from doracheck.properties import pytest_plugin

        pytest_plugin.check_options(config)
        config.pluginmanager.register(pytest_plugin, "doracheck-suite")
    elif config.getoption("doracheck_variant"):
        raise pytest.UsageError("--doracheck-variant needs --doracheck-impl doracheck")
