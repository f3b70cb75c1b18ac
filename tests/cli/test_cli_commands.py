"""The commands as a user meets them, run as the installed ``doracheck`` in a fresh folder:
exit codes (0 ok, 1 failed checks, 2 usage, 130 Ctrl-C, 141 stdout closed), one line on stderr for an error,
never a traceback, and no file changed except a report or CSV that was asked for.

--version; a help string for every option; Ctrl-C in verify, calibrate and bench; bench's
table with its spread, CSV columns and an unwritable --csv; the H200 label of bench --plan and
Plan's rounded text; progress bars on a terminal only; verify --report (HTML with the table
and an SVG chart of the margins); the legends under the tables.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import select
import signal
import subprocess
import time

import pytest
import torch
from cli_run import doracheck_command, no_traceback, require_matplotlib, run_cli, snapshot

from doracheck.cli.main import build_parser

SMALL_BENCH = ["bench", "--shapes", "48x40r4", "--tokens", "3", "--reps", "2", "--dtype", "fp32"]
QUICK_VERIFY = ["verify", "--quick", "--dtype", "fp32"]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "keep.txt").write_text("a file the commands must leave alone\n")
    return tmp_path


def changed(before: dict, folder) -> set[str]:
    after = snapshot(folder)
    return {name for name in set(before) | set(after) if before.get(name) != after.get(name)}


def table_props(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("property")) + 2
    props = []
    for line in lines[start:]:
        if not line or line[0] == " " or line.startswith(("all properties", "doracheck")) or "FAILED" in line:
            break
        props.append(line.split()[0])
    return props


# --version --------------------------------------------------------------------------------------

def test_version_is_one_line_with_torch_and_triton(folder):
    before = snapshot(folder)
    proc = run_cli(["--version"], folder)
    no_traceback(proc)
    assert proc.returncode == 0 and proc.stderr == ""
    assert re.fullmatch(r"doracheck \d+\.\d+\.\d+ \(torch \S+, (triton \S+|triton not installed), python \S+\)\n", proc.stdout)
    # the installed distribution's version, read without importing torch: "2.11.0" for a
    # torch.__version__ of "2.11.0+cu130" (the local build tag is not in the metadata)
    assert f"(torch {importlib.metadata.version('torch')}," in proc.stdout
    assert torch.__version__.startswith(importlib.metadata.version("torch"))
    assert not changed(before, folder)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["audit", "--help"], ["verify", "--help"], ["bench", "--help"],
                                  ["env", "--help"], ["sample", "--help"], ["calibrate", "--help"]], ids=" ".join)
def test_help_and_version_start_without_importing_torch(args, tmp_path):
    """``--help`` and ``--version`` answer at once: nothing on their path imports torch (2.5-3.5 s)."""
    import subprocess
    import sys

    code = ("import sys\nfrom doracheck.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "exit 0 False", done.stderr[-2000:]


def test_after_import_doracheck_its_modules_resolve_as_attributes(tmp_path):
    """The public names load on first use, yet ``import doracheck`` still reaches the layer's modules
    as attributes (``doracheck.kernels.backends``, ``doracheck.norm_rule``), as an eager import did."""
    import subprocess
    import sys

    code = ("import doracheck\nprint(doracheck.kernels.backends.TORCH.name, doracheck.kernels.tracing.tracing(), "
            "doracheck.norm_rule.era() >= 0, doracheck.dora_linear.__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["torch", "False", "True", "dora_linear"], done.stderr[-2000:]


# help --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["env", "verify", "calibrate", "bench"])
def test_every_option_has_a_help_string(command, folder):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices[command]
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        assert action.help and len(action.help) > 10, f"{command} {action.option_strings} has no help"
    proc = run_cli([command, "--help"], folder)
    no_traceback(proc)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for action in options:
        assert action.option_strings[-1] in text
        assert " ".join(action.help.replace("%%", "%").split()[:3]) in text
    if command != "env":
        assert "130 interrupted" in text  # the exit codes are in the help


# Ctrl-C ------------------------------------------------------------------------------------------

def interrupt_after_start(args: list[str], cwd, lines_first: int = 1) -> tuple[int, str, str]:
    """Start the command, wait until it printed ``lines_first`` lines (it is past start-up and in
    its run), send SIGINT as a terminal's Ctrl-C does, and return (exit code, stdout, stderr)."""
    env = {**os.environ, "CI": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*doracheck_command(), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    head = "".join(proc.stdout.readline() for _ in range(lines_first))
    time.sleep(0.5)
    assert proc.poll() is None, "the command ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, head + out, err


@pytest.mark.parametrize("args", [["verify", "--profile", "full"], ["calibrate", "--cases", "1000"]], ids=["verify", "calibrate"])
def test_ctrl_c_is_exit_130_with_one_line(args, folder):
    before = snapshot(folder)
    code, out, err = interrupt_after_start(args, folder)
    assert "Traceback" not in out + err
    assert code == 130
    assert err == f"doracheck {args[0]}: interrupted\n"
    assert not changed(before, folder)


def test_ctrl_c_in_bench_keeps_the_csv_rows_measured(folder):
    before = snapshot(folder)
    tokens = ",".join(str(t) for t in range(1, 400))
    code, out, err = interrupt_after_start([*SMALL_BENCH[:3], "--tokens", tokens, "--reps", "2", "--csv", "rows.csv"],
                                           folder, lines_first=4)
    assert "Traceback" not in out + err
    assert code == 130
    assert re.fullmatch(r"doracheck bench: interrupted; the \d+ rows measured are in rows\.csv\n", err), err
    assert changed(before, folder) == {"rows.csv"}
    with open(folder / "rows.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == int(err.split("the ")[1].split()[0])


def test_a_closed_stdout_is_a_quiet_exit_141(folder):
    """``doracheck bench | head -1``: the reader leaves; no traceback, exit 141 (128 + SIGPIPE)."""
    env = {**os.environ, "CI": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*doracheck_command(), *SMALL_BENCH, "--tokens", "1,2,3,4,5,6"], cwd=folder,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().startswith("doracheck bench on ")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == ""


# bench -------------------------------------------------------------------------------------------

def test_bench_csv_in_a_missing_folder_is_exit_2_with_one_line(folder):
    before = snapshot(folder)
    proc = run_cli([*SMALL_BENCH, "--csv", "/missing/dir/x.csv"], folder)
    no_traceback(proc)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "doracheck bench: --csv: cannot write /missing/dir/x.csv: No such file or directory\n"
    assert not changed(before, folder)


def test_bench_prints_an_aligned_table_with_spread_and_a_legend_and_writes_the_csv(folder):
    before = snapshot(folder)
    proc = run_cli([*SMALL_BENCH, "--csv", "rows.csv"], folder)
    no_traceback(proc)
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("shape"))
    header, rule, *body = lines[head:head + 4]
    assert header.split() == ["shape", "T", "dtype", "mode", "variant", "nn.Linear", "ms", "p10-p90", "doracheck", "ms",
                              "p10-p90", "ratio"]
    assert set(rule) <= {"-", " "}
    for line in body:  # right-aligned numbers: every row as long as the rule, columns under their headers
        assert len(line) == len(rule) and re.search(r" \d+\.\d+-\d+\.\d+ ", line) and line.endswith("x")
    assert [line.split()[4] for line in body] == ["infer", "train"]
    assert "ratio = doracheck's median / nn.Linear's median" in proc.stdout
    assert "each of the 2 samples" in proc.stdout and "p10-p90 (10th to 90th percentile)" in proc.stdout
    assert changed(before, folder) == {"rows.csv"}
    with open(folder / "rows.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        assert row["device"] and row["torch"] == torch.__version__ and row["doracheck"]
        assert (row["d_in"], row["d_out"], row["r"], row["tokens"], row["dtype"]) == ("48", "40", "4", "3", "fp32")
        for what in ("linear", "doracheck"):
            p10, median, p90 = (float(row[f"{what}_{q}ms"]) for q in ("p10_", "", "p90_"))
            assert 0 < p10 <= median <= p90


def test_bench_plan_labels_the_predictions_as_the_h200_cost_model(folder):
    before = snapshot(folder)
    proc = run_cli([*SMALL_BENCH, "--mode", "infer", "--plan"], folder)
    no_traceback(proc)
    assert proc.returncode == 0
    assert "predicted for H200 (cost model)" in proc.stdout
    if not torch.cuda.is_available():
        notes = [line for line in proc.stdout.splitlines() if line.startswith("note:")]
        assert notes == ["note: the predictions are the cost model's for an H200, not for cpu: compare the measured "
                         "times with each other, not with them"]
    assert "vs fastest = measured median" in proc.stdout and "pick: model" in proc.stdout
    assert not changed(before, folder)


def test_plan_prints_rounded_milliseconds():
    from doracheck import plan

    p = plan(4096, 4096, 16, 4096, torch.float32, True)
    for text in (repr(p), str(p), repr([p])):
        assert not re.search(r"\d\.\d{5,}", text), text
    assert repr(p).startswith("Plan(variant='factored'") and "predicted_ms={'factored': " in repr(p)
    assert str(p).startswith(f"{p.variant.name} (cost model); predicted ms: factored {p.predicted_ms['factored']:.4g}")


# progress bars -----------------------------------------------------------------------------------

def run_on_a_terminal(args: list[str], cwd) -> tuple[int, str, str]:
    """The command with stderr on a pseudo-terminal and CI unset: (exit code, stdout, stderr)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal 120 columns wide
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.Popen([*doracheck_command(), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=slave,
                            env={**env, "PYTHONWARNINGS": "ignore"})
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    os.close(master)
    out = proc.stdout.read().decode()
    proc.wait(timeout=300)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_verify_and_calibrate_show_a_bar_on_a_terminal_only(folder):
    code, out, err = run_on_a_terminal(QUICK_VERIFY, folder)
    assert code == 0 and "all properties passed" in out
    assert "verify" in err and "%|" in err and "fp32" in err  # tqdm's bar, with the step it is on
    code, out, err = run_on_a_terminal(["calibrate", "--cases", "2", "--dtype", "fp32"], folder)
    assert code == 0 and "tightness" in out
    assert "calibrate" in err and "%|" in err and "fp32 case" in err
    proc = run_cli(["calibrate", "--cases", "2", "--dtype", "fp32"], folder)  # not a terminal (and CI set)
    assert proc.returncode == 0 and proc.stderr == ""


def test_bench_shows_a_bar_over_rows_with_json_on_a_terminal(folder):
    code, out, err = run_on_a_terminal([*SMALL_BENCH, "--json"], folder)
    assert code == 0 and len(json.loads(out)["rows"]) == 2
    assert "bench" in err and "%|" in err
    code, out, err = run_on_a_terminal(SMALL_BENCH, folder)  # the table's lines are its progress
    assert code == 0 and err == ""


# verify: table, legend, report -------------------------------------------------------------------

def test_verify_prints_the_table_and_its_legend_and_writes_the_report(folder):
    require_matplotlib()
    before = snapshot(folder)
    proc = run_cli([*QUICK_VERIFY, "--report", "report.html"], folder)
    no_traceback(proc)
    assert proc.returncode == 0 and proc.stderr == ""
    props = table_props(proc.stdout)
    assert len(props) >= 20 and "forward.y" in props
    assert "all properties passed" in proc.stdout
    for phrase in ("worst: the largest error over the cases", "budget: the bound it must stay within",
                   "margin = budget / worst: above 1x passes", "n/a: the implementation lacks that feature"):
        assert phrase in proc.stdout
    assert proc.stdout.rstrip().endswith("report: report.html")
    assert changed(before, folder) == {"report.html"}
    page = (folder / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "all properties passed" in page
    assert not re.search(r"""(src|href)=["']?https?:""", page)  # self-contained: nothing fetched at view time
    for prop in props:
        assert f"<td>{prop}</td>" in page
    assert page.count("<tr class=") == len(props)


def test_verify_report_combines_with_json(folder):
    require_matplotlib()
    before = snapshot(folder)
    proc = run_cli([*QUICK_VERIFY, "--json", "--report", "r.html"], folder)
    no_traceback(proc)
    assert proc.returncode == 0
    doc = json.loads(proc.stdout)
    assert doc["passed"] is True and doc["report"] == "r.html"
    assert changed(before, folder) == {"r.html"}
    page = (folder / "r.html").read_text()
    assert "<svg" in page and "all properties passed" in page
    for r in doc["results"]:
        assert f"<td>{r['prop']}</td>" in page


def test_verify_report_without_matplotlib_is_exit_2_before_the_suite(folder, tmp_path_factory):
    fake = tmp_path_factory.mktemp("no_matplotlib")
    (fake / "matplotlib").mkdir()
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is not installed (test)')\n")
    before = snapshot(folder)
    start = time.perf_counter()
    proc = run_cli([*QUICK_VERIFY, "--report", "report.html"], folder, env={"PYTHONPATH": str(fake)})
    no_traceback(proc)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("doracheck verify: --report: the HTML report needs matplotlib: pip install matplotlib\n")
    assert time.perf_counter() - start < 60  # the suite did not run
    assert not changed(before, folder)


def test_verify_report_in_a_missing_folder_is_exit_2(folder):
    require_matplotlib()
    before = snapshot(folder)
    proc = run_cli([*QUICK_VERIFY, "--report", "/missing/dir/r.html"], folder)
    no_traceback(proc)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "doracheck verify: --report: cannot write /missing/dir/r.html: no such folder /missing/dir\n"
    assert not changed(before, folder)


def test_report_marks_failures_nan_and_exact_results(tmp_path):
    require_matplotlib()
    pytest.importorskip("matplotlib")
    from doracheck.cli.verify_cmd import Run, write_report
    from doracheck.properties.results import CheckResult

    results = [CheckResult("grad.gradcheck", "fp64", True, 0.0, 0.0, 1),
               CheckResult("forward.y", "fp32", True, 1e-7, 1e-5, 3),
               CheckResult("backward.dx", "bf16", False, 3e-2, 1e-2, 3, "3x over"),
               CheckResult("edge.zero_row", "bf16", False, float("nan"), 0.0, 1, "NaN on a zero row"),
               CheckResult("norm.three_term", "fp16", True, 0.0, 0.0, 0, "n/a: not supported", status="n/a")]
    failed = [r for r in results if r.status == "FAIL"]
    run = Run("test", "test", results, failed, {id(r): "# repro" for r in failed}, None, "2 of 5 properties FAILED", 0.0)
    write_report(str(tmp_path / "r.html"), [run], {"impl": "test"}, [])
    page = (tmp_path / "r.html").read_text()
    assert "2 of 5 properties FAILED" in page and 'class="fail"' in page and 'class="warn"' in page
    svg = page[page.index("<svg"):page.index("</svg>")]
    assert svg.count("FAIL") >= 2 and "exact (error 0)" in svg and "norm.three_term" not in svg
