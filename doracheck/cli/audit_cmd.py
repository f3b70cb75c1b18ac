"""``doracheck audit PATH [--base PATH] [--config FILE] [--json] [--verbose] [--report FILE.html]
[--device auto|cpu|cuda] [--strict]``: options, output and exit codes in docs/cli.md.

Text: the summary table, the findings (``--verbose`` adds info), a summary line, the norm scratch memory
and a legend (not with ``--quiet`` or under CI); ``--json``: one JSON object. ``--strict`` fails a plain
LoRA adapter (exit 1: a pipeline expecting DoRA catches a forgotten ``use_dora=True``). ``--make-sample``:
hidden, deprecated alias of ``doracheck sample PATH`` (one-line notice)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from doracheck.audit import AuditReport

PROG = "doracheck audit"


def format_table(header, rows) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_legend(entries, width: int = 100) -> str:
    lines = ["legend:"]
    for name, text in entries:
        lines += textwrap.wrap(f"{name}: {text}", width=width, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)


def _finite_json(value):
    """Non-finite floats become null (JSON has no Infinity/NaN); everything else unchanged."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def print_text(report, verbose: bool, legend: bool = True) -> None:
    from doracheck.audit import summary
    print(f"{PROG}: {report.path} ({report.fmt}, {len(report.modules)} modules)")
    for i, note in enumerate(report.notes):  # a plain LoRA adapter's notice comes first
        print(f"{'notice' if report.plain_lora and i == 0 else 'note'}: {note}")
    print(format_table(summary.header(report), summary.rows(report)))
    shown = {"error", "warning", "info"} if verbose else {"error", "warning"}
    findings = [(m.name, c) for m in report.modules for c in m.checks if c.severity in shown]
    if findings:
        print("\nfindings:")
        for name, c in findings:
            print(f"  {c.severity:7s} {c.id:22s} {name}: {c.message}")
    hidden = 0 if verbose else report.summary()["infos"]
    print()
    if hidden:
        print(f"({hidden} info findings not shown: --verbose lists them)")
    print(summary.summary_line(report))
    memory = summary.memory_line(report)
    if memory:
        print(memory)
    if legend:
        print()
        print(format_legend(summary.legend(report)))


def _check_report_path(args) -> str | None:
    """The reason --report cannot be honoured (checked before the audit), or None."""
    from doracheck.cli.html_report import matplotlib_or_none, target_problem
    if not args.report:
        return None
    _, missing = matplotlib_or_none()
    if missing:
        return f"--report: {missing}"
    target = Path(args.report)
    inputs = [Path(p) for p in (args.path, args.base, args.config) if p]
    try:
        if Path(args.path).is_dir():
            inputs += [Path(args.path) / "adapter_model.safetensors", Path(args.path) / "adapter_config.json"]
        if target.is_file() and any(p.exists() and p.samefile(target) for p in inputs):  # a folder: target_problem
            return f"--report {target}: is one of the audit's input files; choose another name"
    except OSError as exc:
        return f"--report {target}: cannot check it against the inputs: {exc.strerror or exc}"
    problem = target_problem(args.report)
    return f"--report: {problem}" if problem else None


def _write_report(report, path: str, json_output: bool) -> None:
    from doracheck.audit.html import fill
    from doracheck.cli.html_report import Report, matplotlib_or_none
    from doracheck.cli.progress import Progress
    plt, _ = matplotlib_or_none()
    doc = Report(f"doracheck audit: {report.path}")
    with Progress("report", len(report.modules), json_output=json_output, unit="module") as bar:
        fill(doc, report, plt, bar)
    doc.write(path)


def run(args) -> int:
    from doracheck.cli.verify_cmd import guarded
    return guarded("audit", _run, args)


def _audit(args) -> AuditReport | int:
    """The report, or the exit code 2 after printing the input problems."""
    from doracheck.audit import AuditInputError, audit_path
    from doracheck.cli.progress import Progress
    bars: list[Progress] = []

    def progress(i: int, total: int, name: str) -> None:
        if not bars:
            bars.append(Progress("audit", total, json_output=args.json, unit="module"))
        bars[0](name)

    try:
        return audit_path(args.path, base=args.base, config=args.config, device=args.device, progress=progress,
                          keep_arrays=bool(args.report))
    except AuditInputError as exc:
        for line in exc.lines:
            print(f"{PROG}: {line}", file=sys.stderr)
        return 2
    finally:
        for bar in bars:
            bar.done()


def _run(args) -> int:
    if args.make_sample:
        from doracheck.cli.sample_cmd import make

        print(f"{PROG}: --make-sample is deprecated: use 'doracheck sample PATH' (it never overwrites files)", file=sys.stderr)
        return make(args.path, fresh=False, command=PROG)
    problem = _check_report_path(args)
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    report = _audit(args)
    if isinstance(report, int):
        return report
    if args.json:
        print(json.dumps(_finite_json(report.as_dict()), indent=2, allow_nan=False))
    else:
        print_text(report, args.verbose, legend=not (args.quiet or os.environ.get("CI")))
    if args.report:
        from doracheck.cli.html_report import write_error

        try:
            _write_report(report, args.report, args.json)
        except OSError as exc:
            print(f"{PROG}: {write_error(args.report, exc)}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"report: {args.report}")
    s = report.summary()
    failed = s["errors"] > 0 or (args.strict and (s["warnings"] > 0 or report.plain_lora))
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "audit", help="health and numerical audit of a DoRA checkpoint (safetensors)",
        description="Audit a PEFT (or kohya/LyCORIS) DoRA adapter saved as safetensors: structure, finite values, "
        "magnitudes, and with --base the norms, the scale g = m/n, 16-bit collapse, overflow headroom and merge error. "
        "Reads only safetensors (never unpickles); one module in memory at a time. "
        "Exit 0 no errors, 1 errors (--strict: warnings too), 2 unusable input, 130 interrupted. "
        "Try it: doracheck sample DIR.",
    )
    p.add_argument("path", metavar="PATH", help="adapter_model.safetensors, a folder holding it (PEFT's save_pretrained), or any "
                   "safetensors file with DoRA tensors")
    p.add_argument("--base", metavar="PATH", help="the base model the adapter was trained on, for the norm, scale and merge checks: "
                   "a safetensors file, a sharded folder (model.safetensors.index.json) or a folder with one safetensors file")
    p.add_argument("--config", metavar="FILE", help="adapter_config.json (default: the one next to the adapter)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table (no progress bar)")
    p.add_argument("--quiet", "-q", action="store_true", help="leave out the legend of the table's columns (also left out "
                   "when the CI environment variable is set)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also list info-level findings (norm terms, g statistics, 16-bit collapse, merge error per module)")
    p.add_argument("--report", metavar="FILE.html", help="also write a self-contained HTML report with the table, the legend, "
                   "the findings and per-module plots (needs matplotlib). Only a new file or an earlier doracheck report "
                   "is written; any other existing file is refused before the audit")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the norms are computed (default auto: cuda when available)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too, and on a plain LoRA adapter (no DoRA magnitudes)")
    p.add_argument("--make-sample", action="store_true", help=argparse.SUPPRESS)  # deprecated: doracheck sample PATH
    p.set_defaults(run=run)
