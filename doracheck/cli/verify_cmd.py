"""``doracheck verify``: run the property suite against one implementation or several on this machine.

Prints property × dtype → pass/FAIL/n/a, worst error, budget, margin, and each n/a's reason; with
several ``--impl``, a property × implementation matrix. ``--report FILE.html|FILE.md``: the same as
a document (with a chart of the margins in HTML), ``--repro``: a reproducer per failure. Nothing
checkable (n/a everywhere) exits 2: no false comfort. Exit codes: docs/cli.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import NamedTuple

PROFILES = ("quick", "full")
DTYPE_NAMES = ("fp32", "bf16", "fp16")
EXIT_CODES = "exit codes: 0 all passed (n/a counts as passing), 1 a property failed, 2 bad usage or nothing checkable, 130 interrupted"
LEGEND = (
    "worst: the largest error over the cases, in the property's unit (relative error against the fp64 oracle, ulps,\n"
    "  or bytes for norm.memory); budget: the bound it must stay within (properties/budgets.py, derived a priori,\n"
    "  never fitted; 0 asks for bit-exact results); margin = budget / worst: above 1x passes, inf means the error\n"
    "  was exactly 0. n/a: the implementation lacks that feature; it counts as passing, its reason is listed above."
)


class UsageError(Exception):
    pass


def interrupted(command: str, note: str = "") -> int:
    """One line on stderr and exit code 130 (128 + SIGINT), as a shell reports Ctrl-C."""
    print(f"doracheck {command}: interrupted{note}", file=sys.stderr, flush=True)
    return 130


def stdout_closed() -> int:
    """The reader of stdout left (``| head``): exit 141 (128 + SIGPIPE) quietly, as a shell tool
    does, stdout pointed at /dev/null so that exiting flushes nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


def guarded(command: str, body, args) -> int:
    """``body(args)`` with Ctrl-C (exit 130, one line) and a closed stdout (exit 141) handled."""
    try:
        return body(args)
    except KeyboardInterrupt:
        return interrupted(command)
    except BrokenPipeError:
        return stdout_closed()


def parse_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPE_NAMES]
    if bad or not names:
        raise UsageError(f"--dtype: expected a comma list of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return names


def impl_and_dtypes(args, command: str, spec: str | None = None):
    """(Implementation, dtype names) from ``spec`` (default --impl) and --dtype, or None after
    printing the usage error (exit code 2 for the caller); shared by verify and calibrate."""
    from doracheck.properties.implementations import ImplementationError, resolve
    try:
        return resolve(spec or args.impl), parse_dtypes(args.dtype)
    except (UsageError, ImplementationError) as exc:
        print(f"doracheck {command}: {exc}", file=sys.stderr)
        return None


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _cells(r) -> tuple[str, str, str, str, str, str]:
    if r.status == "n/a":
        return (r.prop, r.dtype, r.status, "-", "-", "-")
    margin = "inf" if r.margin == math.inf else f"{r.margin:.1f}x"
    return (r.prop, r.dtype, r.status, f"{r.worst:.3e}", f"{r.budget:.3e}", margin)


TABLE_HEADER = ("property", "dtype", "result", "worst", "budget", "margin")


def format_table(results, header=TABLE_HEADER, rows=None) -> str:
    """Aligned text columns: ``results`` as ``_cells`` rows, or ``rows`` under ``header``."""
    rows = rows if rows is not None else [_cells(r) for r in results]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


class Run(NamedTuple):
    """One implementation's outcome in a verify run."""

    spec: str  # as given to --impl (what a reproducer resolves)
    name: str
    results: list
    failed: list
    repros: dict[int, str]  # id(failed row) -> its reproducer (``properties.repro``)
    nothing: str | None  # why nothing could be checked, or None
    verdict: str
    seconds: float


def matrix(runs: list[Run], causes: bool = False) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the property × implementation matrix: a row per "property [dtype]", a cell per
    implementation ("pass 12.0x", "FAIL 0.3x", "pass exact", "n/a"; "-": not run), ``causes``: a FAIL's diagnosis too."""
    def cell(r) -> str:
        if r is None or r.status == "n/a":
            return "-" if r is None else "n/a"
        margin = "exact" if r.margin == math.inf else _cells(r)[5] if not 0 < r.margin < 0.05 else f"{r.margin:.0e}x"  # far over: its order, not 0.0x
        cause = r.detail.rpartition(" — ")[2] if causes and r.status == "FAIL" and " — " in r.detail else ""
        cause = cause.split(" (")[0] if cause.startswith("matches") else cause.split(":")[0]  # the name, not its description
        return f"{r.status} {margin}{' — ' + cause if cause else ''}"

    keys = list(dict.fromkeys((r.prop, r.dtype) for run in runs for r in run.results))
    by_run = [{(r.prop, r.dtype): r for r in run.results} for run in runs]
    return ["property", *(run.spec for run in runs)], [[f"{p} [{d}]", *(cell(rows.get((p, d))) for rows in by_run)] for p, d in keys]


def report_problem(path: str) -> str | None:
    """Why ``--report path`` cannot be made (an HTML report without matplotlib, ``html_report.target_problem``),
    or None; checked before the suite, so a long run does not end in an unwritable report."""
    from doracheck.cli.html_report import REPORT_SUFFIXES, matplotlib_or_none, target_problem
    why = None if path.lower().endswith(".md") else matplotlib_or_none()[1]
    problem = why or target_problem(path, REPORT_SUFFIXES)
    return f"--report: {problem}" if problem else None


def margin_figure(plt, results):
    """Horizontal bars of log10(margin) per property × dtype (n/a left out): 0 is the budget,
    right of it passes. An exact result (error 0) is drawn at the right edge and labelled
    "exact"; a failure is red and labelled FAIL (a NaN or infinite error at the left edge)."""
    rows = [r for r in results if r.status != "n/a"]
    finite = [math.log10(r.margin) for r in rows if 0 < r.margin < math.inf]
    right, left = max([1.0, *finite]) + 0.6, min([-1.0, *finite]) - 0.6
    values, colors, notes = [], [], []
    for r in rows:
        failed = r.status == "FAIL"
        if math.isnan(r.margin) or r.margin <= 0:
            values.append(left)
            notes.append("FAIL (error NaN or inf)" if failed else "")
        elif math.isinf(r.margin):
            values.append(right)
            notes.append("FAIL" if failed else "exact (error 0)")
        else:
            values.append(math.log10(r.margin))
            notes.append("FAIL" if failed else "")
        colors.append("#b00020" if failed else ("#8fc79a" if math.isinf(r.margin) else "#1b7e28"))
    fig, ax = plt.subplots(figsize=(8.5, 0.2 * len(rows) + 1.3))
    ys = list(range(len(rows)))
    ax.barh(ys, values, color=colors, height=0.7)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{r.prop} [{r.dtype}]" for r in rows], fontsize=7, parse_math=False)
    ax.invert_yaxis()
    ax.axvline(0.0, color="#333", linewidth=0.9)
    for y, (v, note) in enumerate(zip(values, notes)):
        if note:
            ax.text(v, y, f" {note} ", va="center", ha="left" if v >= 0 else "right", fontsize=7,
                    color="#b00020" if note.startswith("FAIL") else "#555")
    ax.set_xlim(left - (1.5 if any(n.startswith("FAIL (") for n in notes) else 0), right + 1.2)
    ax.set_xlabel("log10 margin = log10(budget / worst); right of 0 passes, left of it fails")
    ax.grid(axis="x", alpha=0.3)
    return fig


def facts(header: dict, dtypes: list[str]) -> list[str]:
    """What a report states beside the verdicts: configurations, versions, device, profile, date."""
    from importlib.metadata import PackageNotFoundError, version

    from doracheck import __version__
    from doracheck.properties.calibrate import device_name

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    found = {"doracheck": __version__, **{k: installed(k) for k in ("torch", "triton", "peft")}, "python": sys.version.split()[0]}
    return [f"date {time.strftime('%Y-%m-%d')}; profile {header['profile']}; dtypes {', '.join(dtypes)}; device {header['device']} "
            f"({device_name(header['device'])}), budget family {header['family']}",
            "versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if v),
            "configurations: A, B and m in the activation dtype (the whole model cast) and, under bf16 and fp16, in fp32 (autocast "
            "style); a configuration an implementation refuses is n/a (*.mixed_dtypes, with the reason), the other is judged"]


def write_report(path: str, runs: list[Run], header: dict, facts: list[str]) -> None:
    """The report of a run, HTML or (for a .md path) Markdown: facts, verdicts, the matrix (several
    implementations), each one's margins (HTML) and table, and each failure with its cause and
    reproducer. Raises OSError when it cannot be written."""
    from doracheck.cli.html_report import MarkdownReport, Report, matplotlib_or_none
    markdown = path.lower().endswith(".md")
    plt = None if markdown else matplotlib_or_none()[0]
    report = (MarkdownReport if markdown else Report)(f"doracheck verify: {' vs '.join(run.spec for run in runs)}")
    for line in [" ".join(f"{k}={v}" for k, v in header.items()), *facts]:
        report.paragraph(line)
    several = len(runs) > 1
    for run in runs:
        report.paragraph(f"{run.spec}: {run.verdict}" if several else run.verdict, "fail" if run.failed or run.nothing else "ok")
    if several:
        report.heading("Property × implementation")
        report.table(*matrix(runs, causes=True))
    for run in runs:
        of = f" of {run.spec}" if several else ""
        if plt is not None and any(r.status != "n/a" for r in run.results):
            report.heading(f"Margins{of}")
            report.figure(margin_figure(plt, run.results), "log10(budget / worst) per property and dtype; red: failed")
        report.heading(f"Results{of}")
        classes = ["fail" if r.status == "FAIL" else ("warn" if r.status == "n/a" else "ok") for r in run.results]
        report.table((*TABLE_HEADER, "detail"), [(*_cells(r), r.detail) for r in run.results], classes)
        for r in run.failed:
            report.heading(f"FAIL {r.prop} [{r.dtype}]{of}: {r.worst:.3e} > {r.budget:.3e}", 3)
            report.paragraph(r.detail, "fail")  # the diagnosed cause comes after " — "
            report.pre(run.repros[id(r)])
    report.paragraph(" ".join(LEGEND.replace("listed above", "in the detail column").split()), "legend")
    report.write(path)


def run(args) -> int:
    return guarded("verify", _run, args)


def _verdict(results, failed, seconds: float) -> str:
    na = sum(r.status == "n/a" for r in results)
    verdict = "all properties passed" if not failed else f"{len(failed)} of {len(results)} properties FAILED"
    return f"{verdict} ({len(results)} checks, {na} n/a, {seconds:.1f} s)"


def _judge(spec: str, impl, dtypes: list[str], profile: str, device: str, progress) -> Run:
    from doracheck.properties import run_suite
    from doracheck.properties.repro import snippet
    start = time.perf_counter()
    results = run_suite(impl, dtypes, profile, device, progress)
    elapsed = time.perf_counter() - start
    failed = [r for r in results if r.status == "FAIL"]
    nothing = None if any(r.status != "n/a" for r in results) else (  # no false comfort: exit 2
        f"nothing could be checked on {impl.name}: every property is n/a ({results[0].detail if results else 'no property ran'})")
    repros = {id(r): snippet(spec, r, device, profile) for r in failed}
    return Run(spec, impl.name, results, failed, repros, nothing, nothing or _verdict(results, failed, elapsed), elapsed)


def _run(args) -> int:
    from doracheck.cli.progress import Progress
    from doracheck.properties import device_family
    from doracheck.properties.suite import suite_steps
    profile = "quick" if args.quick else args.profile
    if args.report and (problem := report_problem(args.report)):
        print(f"doracheck verify: {problem}", file=sys.stderr)
        return 2
    specs = list(dict.fromkeys(args.impl or ["doracheck"]))  # a spec given twice is judged once
    resolved = []
    for spec in specs:
        if (pair := impl_and_dtypes(args, "verify", spec)) is None:  # its one error line is printed
            return 2
        resolved.append(pair)
    dtypes = resolved[0][1]
    device = _device()
    header = {"impl": ", ".join(impl.name for impl, _ in resolved), "profile": profile, "device": device, "family": device_family(device)}
    if not args.json:
        print("doracheck verify: " + " ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    with Progress("verify", suite_steps(dtypes) * len(specs), json_output=args.json) as progress:
        runs = [_judge(spec, impl, dtypes, profile, device, progress) for spec, (impl, _) in zip(specs, resolved)]
    # An implementation with nothing checkable is unusable input even beside others: no false comfort.
    code = 2 if any(run.nothing for run in runs) else (1 if any(run.failed for run in runs) else 0)
    if args.report:
        try:
            write_report(args.report, runs, header, facts(header, dtypes))
        except OSError as exc:
            from doracheck.cli.html_report import write_error

            print(f"doracheck verify: {write_error(args.report, exc)}", file=sys.stderr)
            return 2
    if args.json:
        docs = [_doc(run, header, args) for run in runs]
        print(json.dumps(docs[0] if len(runs) == 1 else {**header, "passed": code == 0, "implementations": docs}, indent=2))
    else:
        _print_text(runs, args.report, args.repro)
    for run in [run for run in runs if run.nothing]:
        print(f"doracheck verify: {run.nothing}", file=sys.stderr)
    return code


def _doc(run: Run, header: dict, args) -> dict:
    """One implementation's --json object (with --repro, each failed row carries its reproducer)."""
    doc = {**header, "impl": run.name, "passed": not run.failed and not run.nothing, "seconds": round(run.seconds, 2),
           **{k: v for k, v in (("error", run.nothing), ("report", args.report)) if v}}
    return {**doc, "results": [{**r.as_dict(), **({"repro": run.repros[id(r)]} if args.repro and id(r) in run.repros else {})} for r in run.results]}


def _print_text(runs: list[Run], report: str | None, repro: bool) -> None:
    several = len(runs) > 1
    print(format_table([], *matrix(runs)) if several else format_table(runs[0].results))
    for run in runs:
        print(f"{run.spec}: {run.verdict}" if several else run.verdict)
        for r in run.failed:
            print(f"  FAIL {r.prop} [{r.dtype}]: {r.worst:.3e} > {r.budget:.3e}; {r.detail}")
        for r in run.results:
            if r.status == "n/a":
                print(f"  n/a  {r.prop} [{r.dtype}]: {r.detail.removeprefix('n/a: ')}")
    for text in [text for run in runs for text in run.repros.values()] if repro else []:
        print(f"\n```python\n{text.rstrip()}\n```")
    print()
    print(LEGEND)
    if report:
        print(f"report: {report}")


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="run the property suite against an implementation",
                       description="Run the property suite (oracle distances, metamorphic relations, baseline ratios, "
                                   "edge cases) against an implementation on this machine and print property x dtype "
                                   "-> pass/FAIL/n/a with the worst error, its budget and the margin (several --impl: "
                                   "a property x implementation matrix).",
                       epilog=EXIT_CODES.replace("a property failed", "a property failed (any implementation)"))
    p.add_argument("--impl", action="append", metavar="SPEC",
                   help="what to check, repeatable: doracheck (this package, the default), torch (doracheck's pure-PyTorch "
                        "path), peft (PEFT's DoRA layer), doracheck@VARIANT, or MODULE:CALLABLE (any function with "
                        "dora_linear's signature)")
    p.add_argument("--dtype", default="fp32,bf16,fp16",
                   help="comma list of activation dtypes to check, from fp32, bf16, fp16 (default: all three)")
    p.add_argument("--profile", choices=PROFILES, default="quick",
                   help="quick: one seed per shape; full: more seeds, larger shapes, the hard "
                        "problem kinds and fan_in_fan_out (default: quick)")
    p.add_argument("--quick", action="store_true", help="same as --profile quick")
    p.add_argument("--json", action="store_true", help="print one JSON object (every result with its margin) instead of the table")
    p.add_argument("--report", metavar="FILE.html|FILE.md",
                   help="also write a report (results, versions, device, each failure's cause and reproducer): FILE.html with a chart "
                        "of the margins (needs matplotlib) or FILE.md; combines with --json. Only a new file or an earlier "
                        "doracheck report is written; any other existing file is refused")
    p.add_argument("--repro", action="store_true", help="print a standalone Python reproducer for each failed property (--json: in its row)")
    p.set_defaults(run=run)
