"""``doracheck verify`` on several implementations at once (issue 47, items 4 and 5): the property ×
implementation matrix, the Markdown report and its safety, ``--json`` for several, and the
reproducers of ``--repro``, run the way a user would run them.

One CLI run (doracheck beside a planted deviation from ``tests/deviants.py``, the bias scaled by g,
fp32, quick) feeds most tests; the others call ``main`` in this process or run the suite's accuracy
item directly, to keep the file to two subprocesses of torch start-up beyond that run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_clean

from doracheck.cli.html_report import MD_MARKER
from doracheck.cli.main import main
from doracheck.cli.verify_cmd import Run, write_report
from doracheck.properties.implementations import resolve
from doracheck.properties.repro import snippet
from doracheck.properties.suite import run_item, suite_items

TESTS = Path(__file__).resolve().parents[1]
PLANTED = "deviants:bias_scaled_by_g"
BOTH = ["verify", "--impl", "doracheck", "--impl", PLANTED, "--quick", "--dtype", "fp32"]
SNIPPET = re.compile(r"```python\n(.*?)```", re.S)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(folder, the finished ``verify --impl doracheck --impl PLANTED --repro --report r.md``)."""
    folder = tmp_path_factory.mktemp("matrix")
    proc = run_clean([*BOTH, "--repro", "--report", "r.md"], folder, env={"PYTHONPATH": str(TESTS)})
    return folder, proc


def matrix_rows(stdout: str) -> dict[str, list[str]]:
    """"property [dtype]" -> the cells, from the text matrix (header, rule, rows up to the verdicts)."""
    lines = stdout.splitlines()[1:]  # after the "doracheck verify: impl=..." line
    header = re.split(r"\s{2,}", lines[0])
    assert header == ["property", "doracheck", PLANTED], lines[0]
    rows = {}
    for line in lines[2:]:
        if line.startswith("doracheck:"):
            break
        name, *cells = re.split(r"\s{2,}", line)
        rows[name] = cells
    return rows


def fail_lines(stdout: str, spec: str) -> list[str]:
    """The FAIL and n/a lines printed under ``spec``'s verdict line (up to the next blank line)."""
    section = stdout.split(f"\n{spec}: ", 1)[1].split("\n", 1)[1].split("\n\n")[0]
    return [line.strip() for line in section.splitlines() if line.startswith(("  FAIL ", "  n/a "))]


def test_only_the_planted_implementation_fails_and_its_cause_is_named(both):
    _, proc = both
    assert proc.returncode == 1, proc.stderr
    rows = matrix_rows(proc.stdout)
    assert len(rows) >= 25 and "forward.y [fp32]" in rows and "grad.gradcheck_detach_true [fp64]" in rows
    assert all(ours.startswith("pass") or ours == "n/a" for ours, _ in rows.values()), rows  # doracheck fails nothing
    failed = {name for name, (_, theirs) in rows.items() if theirs.startswith("FAIL")}
    assert {"forward.y [fp32]", "backward.db [fp32]", "compose.near_one [fp32]"} <= failed
    assert rows["backward.dx [fp32]"][1].startswith("pass") and rows["norm.three_term [fp32]"][1] == "n/a"
    for cells in rows.values():
        for cell in cells:
            assert cell in ("n/a", "-") or re.fullmatch(r"(pass|FAIL) (\d+\.\dx|\de[+-]\d\dx|exact)", cell), cell
    assert "\ndoracheck: all properties passed" in proc.stdout
    assert re.search(rf"\n{re.escape(PLANTED)}: \d+ of \d+ properties FAILED", proc.stdout)
    lines = fail_lines(proc.stdout, PLANTED)
    forward = next(line for line in lines if line.startswith("FAIL forward.y [fp32]"))
    assert 'matches "bias scaled by g"' in forward
    assert {line.split(" [")[0].removeprefix("FAIL ") for line in lines if line.startswith("FAIL")} == {f.split(" [")[0] for f in failed}


def test_the_markdown_report_has_the_matrix_the_facts_and_each_failure(both):
    folder, proc = both
    assert proc.stdout.rstrip().endswith("report: r.md")
    page = (folder / "r.md").read_text()
    assert page.startswith(MD_MARKER + "\n")
    assert f"| property | doracheck | {PLANTED} |" in page
    assert re.search(r'\n\| forward\.y \[fp32\] \| pass [\d.]+x \| FAIL \S+ — matches "bias scaled by g" \|\n', page)  # the cause in the cell
    for fact in ("profile quick", "dtypes fp32", "device cpu", "versions: doracheck ", ", torch ", ", python ",
                 "configurations: A, B and m in the activation dtype"):
        assert fact in page, fact
    section = page.split(f"### FAIL forward.y [fp32] of {PLANTED}", 1)[1]
    assert 'matches "bias scaled by g"' in section.split("```python")[0]
    assert SNIPPET.search(section).group(1).startswith(f"# doracheck verify --impl {PLANTED}: forward.y [fp32] FAIL")
    assert "### FAIL" not in page.split(f"## Results of {PLANTED}")[0]  # none under doracheck


def test_reproducers_print_what_verify_reported_and_none_for_the_correct_implementation(both, tmp_path):
    _, proc = both
    snippets = SNIPPET.findall(proc.stdout)
    assert snippets and all(s.startswith(f"# doracheck verify --impl {PLANTED}: ") for s in snippets)
    lines = fail_lines(proc.stdout, PLANTED)
    assert len(snippets) == sum(line.startswith("FAIL") for line in lines)

    def one(prop: str) -> tuple[Path, str]:
        """The snippet of ``prop`` in a file, and the error verify reported for it."""
        text = next(s for s in snippets if s.startswith(f"# doracheck verify --impl {PLANTED}: {prop} [fp32]"))
        (tmp_path / f"{prop}.py").write_text(text)
        return tmp_path / f"{prop}.py", next(line for line in lines if line.startswith(f"FAIL {prop} [fp32]: ")).split()[3]

    (accuracy, reported), (generic, reported_generic) = one("forward.y"), one("meta.linearity")
    assert "make_problem(" in accuracy.read_text() and "suite_items(" in generic.read_text()
    # each file standalone, one after the other in one interpreter (one torch start-up)
    run = "import runpy, sys\nfor path in sys.argv[1:]:\n    runpy.run_path(path, run_name='__main__')\n"
    out = subprocess.run([sys.executable, "-c", run, str(accuracy), str(generic)], capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"forward.y [fp32]: relative L2 error {reported}, budget " in out.stdout, (reported, out.stdout)
    assert f"meta.linearity [fp32] FAIL {reported_generic} (budget " in out.stdout, (reported_generic, out.stdout)


def test_a_dropout_case_is_rebuilt_with_its_keep_mask(capsys):
    # the planted deviation acts only in training with dropout, so its worst case is the dropout run
    spec = "deviants:dropout_on_base"
    item = next(i for i in suite_items(resolve(spec), ["fp32"]) if i.name == "accuracy")
    row = next(r for r in run_item(item) if r.prop == "forward.y")
    assert row.status == "FAIL" and row.item == "accuracy" and row.case["dropout_p"] > 0
    exec(compile(snippet(spec, row, "cpu", "quick"), "repro", "exec"), {"__name__": "__main__"})
    assert f"forward.y [fp32]: relative L2 error {row.worst:.3e}, budget {row.budget:.3e}" in capsys.readouterr().out


def test_json_for_several_implementations(capsys):
    assert main([*BOTH, "--json", "--repro"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and {"profile", "device", "family"} <= set(doc)
    ours, theirs = doc["implementations"]
    assert (ours["impl"], ours["passed"], theirs["impl"], theirs["passed"]) == ("doracheck", True, PLANTED, False)
    assert set(ours) == set(theirs) == {"impl", "profile", "device", "family", "passed", "seconds", "results"}
    assert not any("repro" in r for r in ours["results"])
    failed = [r for r in theirs["results"] if r["status"] == "FAIL"]
    assert failed and all(r["repro"].startswith(f"# doracheck verify --impl {PLANTED}: {r['prop']} ") for r in failed)
    assert not any("repro" in r for r in theirs["results"] if r["status"] != "FAIL")


def test_exit_2_when_nothing_is_checkable_for_any_implementation(na_module, capsys):
    na_spec = f"{na_module}:never"
    """A CI line `--impl doracheck --impl mine` must not stay green with nothing of `mine` checked."""
    assert main(["verify", "--impl", na_spec, "--impl", "doracheck", "--quick", "--dtype", "fp32", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("nothing could be checked") == 1
    doc = json.loads(captured.out)
    assert doc["passed"] is False and [d["passed"] for d in doc["implementations"]] == [False, True]


def test_a_spec_given_twice_is_judged_once_and_a_bad_dtype_is_said_once(capsys):
    assert main(["verify", "--impl", "torch", "--impl", "torch", "--quick", "--dtype", "fp32", "--json"]) == 0
    assert "implementations" not in json.loads(capsys.readouterr().out)  # one implementation: the one-impl object
    assert main(["verify", "--impl", "torch", "--impl", "doracheck", "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.count("--dtype") == 1


def test_a_markdown_report_replaces_only_its_own(tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\n")
    assert main([*BOTH, "--report", str(notes)]) == 2  # refused before the suite runs
    assert "is not a Markdown report written by doracheck" in capsys.readouterr().err
    assert notes.read_text() == "# my notes\n"
    assert main([*BOTH, "--report", str(tmp_path / "r.txt")]) == 2
    assert "give a name ending in .html or .htm or .md" in capsys.readouterr().err
    run = Run("x", "x", [], [], {}, None, "all properties passed", 0.0)
    write_report(str(tmp_path / "r.md"), [run], {"impl": "x"}, ["first"])
    write_report(str(tmp_path / "r.md"), [run], {"impl": "x"}, ["second"])  # its own earlier report: replaced
    assert "second" in (tmp_path / "r.md").read_text() and "first" not in (tmp_path / "r.md").read_text()
    with pytest.raises(OSError, match="not a Markdown report"):
        write_report(str(notes), [run], {"impl": "x"}, [])


def test_a_markdown_cell_stays_one_literal_cell():
    """An implementation's error text (newlines, '|', HTML) must not break the table or inject markup."""
    from doracheck.cli.html_report import MarkdownReport

    report = MarkdownReport("t")
    report.table(("property", "detail"), [("p", "boom | pipe\nsecond line <b>bold</b> & amp")])
    rows = report.render().strip().splitlines()[-3:]
    assert rows[-1] == "| p | boom \\| pipe second line &lt;b&gt;bold&lt;/b&gt; &amp; amp |"


def test_a_zero_row_failure_is_rebuilt_beside_the_oracle(capsys):
    """edge.zero_row's reproducer rebuilds its case (row 4 of W and B zeroed, no bias), calls the
    implementation and the fp64 oracle, and shows the NaNs the oracle does not have."""
    import torch

    import doracheck
    from doracheck.properties.props_common import Implementation
    from doracheck.properties.props_edges import determinism_edges

    spec = "deviants:zero_row_gives_nan"
    row = next(r for r in determinism_edges(resolve(spec), torch.float32, "cpu") if r.prop == "edge.zero_row")
    assert row.status == "FAIL" and row.case["edit"]
    exec(compile(snippet(spec, row, "cpu", "quick"), "repro", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert re.search(r"edge\.zero_row \[fp32\]: y has [1-9]\d* non-finite values \(the fp64 oracle 0\)", out), out
    good = next(r for r in determinism_edges(Implementation("doracheck", doracheck.dora_linear), torch.float32, "cpu")
                if r.prop == "edge.zero_row")
    assert good.status == "pass"
