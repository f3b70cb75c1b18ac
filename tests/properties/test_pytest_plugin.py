"""The pytest plugin (``--doracheck-impl``), run the way a user runs it: pytest in a fresh
folder (pytester, in a subprocess so the installed entry point loads as it would for them)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_mutations import MUTANTS

HERE, TESTS = Path(__file__).parent, Path(__file__).parents[1]  # test_mutations.py's folder; tests/, where mutants.py lives
# The group (test item) each planted bug's catching property belongs to.
GROUP = {"compose.near_one": "compose.near_one", "norm.three_term": "norm.three_term", "backward.dm": "accuracy",
         "forward.y": "accuracy", "merge.forward": "merge", "cache.no_stale": "cache.no_stale"}

PLANTED = f'''
import sys
sys.path[:0] = [{str(HERE)!r}, {str(TESTS)!r}]
import test_mutations
for _name, (_impl, _dtypes, _prop) in test_mutations.MUTANTS.items():
    globals()[_name] = _impl
import os
if os.environ.get("PLANTED_VERSION_BLIND_CACHE"):  # the stale_cache bug: a cache that ignores versions, for this process
    _BLIND = test_mutations.version_blind_cache()  # kept: a collected context manager would restore the cache
    _BLIND.__enter__()
'''

PLAIN = '''
import doracheck

def plain_dora_linear(*args, **kwargs):
    """doracheck's forward alone: no norm function, no module class."""
    return doracheck.dora_linear(*args, **kwargs)
'''


@pytest.fixture(autouse=True)
def _as_a_user_runs_it(monkeypatch):
    """The user's environment, not this suite's: no interpreter forced (conftest sets it here)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _run(pytester, *args):
    pytester.makepyfile(planted=PLANTED, plain=PLAIN)  # beside any file a test made
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-rs", *args)


def test_inert_without_the_option(pytester):
    """Installed, the entry module loads in every pytest run: without --doracheck-impl it imports
    neither torch nor doracheck (so no optimizer hook, no import time) and adds no items."""
    pytester.makepyfile(test_user="""
        import sys

        def test_nothing_of_doracheck_was_imported():
            assert "torch" not in sys.modules and "doracheck" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
    assert "test_doracheck" not in result.stdout.str()


def test_bad_options_are_usage_errors(pytester):
    variant = _run(pytester, "--doracheck-impl", "doracheck", "--doracheck-variant", "bogus")
    assert variant.ret == pytest.ExitCode.USAGE_ERROR and "--doracheck-variant" in variant.stderr.str()
    dtype = _run(pytester, "--doracheck-impl", "doracheck", "--doracheck-dtype", "fp8")
    assert dtype.ret == pytest.ExitCode.USAGE_ERROR and "--doracheck-dtype" in dtype.stderr.str()
    alone = _run(pytester, "--doracheck-variant", "merged")
    assert alone.ret == pytest.ExitCode.USAGE_ERROR


def test_last_failed_reruns_exactly_the_failed_items(pytester):
    pytester.makepyfile(planted=PLANTED)  # with the cache provider: --lf reads it
    args = ("--doracheck-impl", "planted:wrong_axis", "--doracheck-dtype", "fp32")
    first = pytester.runpytest_subprocess(*args, "-q", "-k", "accuracy or compose")
    first.assert_outcomes(failed=2, deselected=8)
    again = pytester.runpytest_subprocess(*args, "-q", "--lf")  # the 2 failures only, not all 11 items
    again.assert_outcomes(failed=2, deselected=8)


def test_a_crashing_implementation_shows_its_own_traceback(pytester):
    pytester.makepyfile(crashing="""
        def dora(*args, **kwargs):
            raise RuntimeError("boom in the user's kernel")
    """)
    result = _run(pytester, "--doracheck-impl", "crashing:dora", "--doracheck-dtype", "fp32", "-k", "accuracy")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert "boom in the user's kernel" in out and "crashing.py" in out


def test_doracheck_passes_and_items_are_named_for_k(pytester):
    result = _run(pytester, "--doracheck-impl", "doracheck:dora_linear", "--doracheck-dtype", "fp32", "-v", "-v")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    out = result.stdout.str()
    for name in ("grad.gradcheck-fp64", "norm.three_term-fp32", "compose.near_one-fp32", "accuracy-fp32", "cache.no_stale-fp32"):
        assert f"test_doracheck[{name}] PASSED" in out
    result.assert_outcomes(passed=10)
    only = _run(pytester, "--doracheck-impl", "doracheck", "--doracheck-dtype", "fp32", "-k", "compose")
    only.assert_outcomes(passed=1, deselected=9)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_planted_bug_fails_with_its_property_named(pytester, monkeypatch, name):
    _impl, dtypes, prop = MUTANTS[name]
    if name == "stale_cache":
        monkeypatch.setenv("PLANTED_VERSION_BLIND_CACHE", "1")
    result = _run(pytester, "--doracheck-impl", f"planted:{name}", "--doracheck-dtype", ",".join(dtypes), "-k", GROUP[prop])
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out
    assert f"FAIL {prop} [{dtypes[0]}]" in out and "budget" in out and "margin" in out, out


def test_na_is_a_skip_with_its_reason(pytester):
    result = _run(pytester, "--doracheck-impl", "plain:plain_dora_linear", "--doracheck-dtype", "fp32", "-k", "norm.three_term")
    result.assert_outcomes(skipped=1, deselected=9)
    assert "n/a: the implementation exposes no norm function" in result.stdout.str()


def test_an_unimportable_implementation_is_a_collection_error(pytester):
    result = _run(pytester, "--doracheck-impl", "no_such_module:dora")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    out = result.stdout.str()
    assert "ERROR collecting doracheck" in out and "cannot import module 'no_such_module'" in out


def test_two_workers_give_the_same_verdicts_and_junit_xml(pytester):
    args = ("--doracheck-impl", "planted:naive_compose", "--doracheck-dtype", "fp32,bf16")
    one = _run(pytester, *args, "--junitxml=one.xml")
    two = _run(pytester, *args, "-n", "2", "--junitxml=two.xml")

    def verdicts(path):
        cases = ET.parse(pytester.path / path).getroot().iter("testcase")
        return {c.get("name"): ("failed" if c.find("failure") is not None else "skipped" if c.find("skipped") is not None
                                else "passed") for c in cases}

    assert verdicts("one.xml") == verdicts("two.xml")
    assert verdicts("one.xml")["test_doracheck[compose.near_one-bf16]"] == "failed"
    assert one.ret == two.ret == pytest.ExitCode.TESTS_FAILED
