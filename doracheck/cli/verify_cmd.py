"""``doracheck verify``: run the property suite against an implementation on this machine.

Prints property × dtype → pass/FAIL/n/a, worst error, budget, margin, and each n/a's reason
(``--report FILE.html``: a chart of the margins too). Nothing checkable (n/a everywhere) exits 2:
no false comfort. Exit codes: docs/cli.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

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


def impl_and_dtypes(args, command: str):
    """(Implementation, dtype names) from --impl and --dtype, or None after printing the usage
    error (exit code 2 for the caller); shared by verify and calibrate."""
    from doracheck.properties.implementations import ImplementationError, resolve
    try:
        return resolve(args.impl), parse_dtypes(args.dtype)
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


def format_table(results) -> str:
    rows = [_cells(r) for r in results]
    widths = [max(len(str(row[i])) for row in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(TABLE_HEADER, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def report_problem(path: str) -> str | None:
    """Why ``--report path`` cannot be made (no matplotlib, ``html_report.target_problem``), or
    None; checked before the suite, so a long run does not end in an unwritable report."""
    from doracheck.cli.html_report import matplotlib_or_none, target_problem
    plt, why = matplotlib_or_none()
    if plt is None:
        return f"--report: {why}"
    problem = target_problem(path)
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


def write_report(path: str, results, header: dict, verdict: str, failed: bool) -> None:
    """The HTML report of one run (raises OSError when it cannot be written)."""
    from doracheck.cli.html_report import Report, matplotlib_or_none
    plt, _ = matplotlib_or_none()
    report = Report(f"doracheck verify: {header['impl']}")
    report.paragraph(" ".join(f"{k}={v}" for k, v in header.items()))
    report.paragraph(verdict, "fail" if failed else "ok")
    if any(r.status != "n/a" for r in results):
        report.heading("Margins")
        report.figure(margin_figure(plt, results), "log10(budget / worst) per property and dtype; red: failed")
    report.heading("Results")
    classes = ["fail" if r.status == "FAIL" else ("warn" if r.status == "n/a" else "ok") for r in results]
    report.table((*TABLE_HEADER, "detail"), [(*_cells(r), r.detail) for r in results], classes)
    report.paragraph(" ".join(LEGEND.replace("listed above", "in the detail column").split()), "legend")
    report.write(path)


def run(args) -> int:
    return guarded("verify", _run, args)


def _verdict(results, failed, seconds: float) -> str:
    na = sum(r.status == "n/a" for r in results)
    verdict = "all properties passed" if not failed else f"{len(failed)} of {len(results)} properties FAILED"
    return f"{verdict} ({len(results)} checks, {na} n/a, {seconds:.1f} s)"


def _run(args) -> int:
    from doracheck.cli.progress import Progress
    from doracheck.properties import device_family, run_suite
    from doracheck.properties.suite import suite_steps
    profile = "quick" if args.quick else args.profile
    problem = report_problem(args.report) if args.report else None
    if problem:
        print(f"doracheck verify: {problem}", file=sys.stderr)
        return 2
    resolved = impl_and_dtypes(args, "verify")
    if resolved is None:
        return 2
    impl, dtypes = resolved
    device = _device()
    family = device_family(device)
    header = {"impl": impl.name, "profile": profile, "device": device, "family": family}
    if not args.json:
        print("doracheck verify: " + " ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    start = time.perf_counter()
    with Progress("verify", suite_steps(dtypes), json_output=args.json) as progress:
        results = run_suite(impl, dtypes, profile, device, progress)
    elapsed = time.perf_counter() - start
    failed = [r for r in results if r.status == "FAIL"]
    checked = [r for r in results if r.status != "n/a"]
    nothing = None
    if not checked:
        reason = results[0].detail if results else "no property ran"
        nothing = f"nothing could be checked on {impl.name}: every property is n/a ({reason})"
    verdict = nothing or _verdict(results, failed, elapsed)
    if args.report:
        try:
            write_report(args.report, results, header, verdict, bool(failed or nothing))
        except OSError as exc:
            from doracheck.cli.html_report import write_error

            print(f"doracheck verify: {write_error(args.report, exc)}", file=sys.stderr)
            return 2
    if args.json:
        doc = {**header, "passed": not failed and not nothing, "seconds": round(elapsed, 2)}
        doc.update({"error": nothing} if nothing else {})
        doc.update({"report": args.report} if args.report else {})
        print(json.dumps({**doc, "results": [r.as_dict() for r in results]}, indent=2))
    else:
        _print_text(results, failed, verdict, args.report)
    if nothing:
        print(f"doracheck verify: {nothing}", file=sys.stderr)
        return 2
    return 1 if failed else 0


def _print_text(results, failed, verdict: str, report: str | None) -> None:
    print(format_table(results))
    print(verdict)
    for r in failed:
        print(f"  FAIL {r.prop} [{r.dtype}]: {r.worst:.3e} > {r.budget:.3e}; {r.detail}")
    for r in results:
        if r.status == "n/a":
            print(f"  n/a  {r.prop} [{r.dtype}]: {r.detail.removeprefix('n/a: ')}")
    print()
    print(LEGEND)
    if report:
        print(f"report: {report}")


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="run the property suite against an implementation",
                       description="Run the property suite (oracle distances, metamorphic relations, baseline ratios, "
                                   "edge cases) against an implementation on this machine and print property x dtype "
                                   "-> pass/FAIL/n/a with the worst error, its budget and the margin.",
                       epilog=EXIT_CODES)
    p.add_argument("--impl", default="doracheck",
                   help="what to check: doracheck (this package, the default), torch (doracheck's pure-PyTorch path), "
                        "peft (PEFT's DoRA layer), or MODULE:CALLABLE (any function with dora_linear's signature)")
    p.add_argument("--dtype", default="fp32,bf16,fp16",
                   help="comma list of activation dtypes to check, from fp32, bf16, fp16 (default: all three)")
    p.add_argument("--profile", choices=PROFILES, default="quick",
                   help="quick: one seed per shape; full: more seeds, larger shapes, the hard "
                        "problem kinds and fan_in_fan_out (default: quick)")
    p.add_argument("--quick", action="store_true", help="same as --profile quick")
    p.add_argument("--json", action="store_true", help="print one JSON object (every result with its margin) instead of the table")
    p.add_argument("--report", metavar="FILE.html",
                   help="also write a self-contained HTML report to FILE.html: the table and a chart of the margins "
                        "(needs matplotlib: pip install matplotlib); combines with --json. Only a new file or "
                        "an earlier doracheck report is written; any other existing file is refused")
    p.set_defaults(run=run)
