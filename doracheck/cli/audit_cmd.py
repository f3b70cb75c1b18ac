"""``doracheck audit PATH [--base PATH] [--config FILE] [--json] [--device auto|cpu|cuda]``.

Exit codes: 0 no error-severity findings, 1 errors found (or warnings with --strict),
2 unusable input (a one-line message naming the file and the problem; never a traceback).
"""

from __future__ import annotations

import json
import math
import sys


def _table(report) -> str:
    header = ("module", "r", "d_in→d_out", "s", "err", "warn", "n range", "median |g-1|", "bf16 collapse", "merge ulp (med/max)")
    rows = []
    for m in report.modules:
        n = m.stats.get("norm")
        g = m.stats.get("g")
        merge = m.stats.get("merge_ulp")
        rows.append(
            (
                m.name,
                str(m.r if m.r is not None else "?"),
                f"{m.d_in}→{m.d_out}" if m.d_in is not None else "?",
                f"{m.scaling:.3g}" if m.scaling is not None else "?",
                str(m.count("error")),
                str(m.count("warning")),
                f"{n['min']:.3g}..{n['max']:.3g}" if n else "-",
                f"{g['median_abs_g_minus_1']:.2e}" if g else "-",
                f"{100 * m.stats['collapse_bf16']:.0f}%" if "collapse_bf16" in m.stats else "-",
                f"{merge['median']:.2f}/{merge['max']:.1f}" if merge else "-",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
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


def run(args) -> int:
    from doracheck.audit import AuditInputError, audit_path, default_progress
    from doracheck.audit.sample import write_sample

    try:
        if args.make_sample:
            folder = write_sample(args.path)
            print(f"wrote a sample DoRA adapter to {folder} (audit it with: doracheck audit {folder} --base {folder}/base_model.safetensors)")
            return 0
        progress = None if args.json else default_progress()
        report = audit_path(args.path, base=args.base, config=args.config, device=args.device, progress=progress)
    except AuditInputError as exc:
        print(f"doracheck audit: {exc}", file=sys.stderr)
        return 2
    summary = report.summary()
    if args.json:
        print(json.dumps(_finite_json(report.as_dict()), indent=2, allow_nan=False))
    else:
        print(f"doracheck audit: {report.path} ({report.fmt}, {summary['modules']} modules)")
        for note in report.notes:
            print(f"note: {note}")
        print(_table(report))
        findings = [(m.name, c) for m in report.modules for c in m.checks if c.severity != "info"]
        if findings:
            print("\nfindings:")
            for name, c in findings:
                print(f"  {c.severity:7s} {c.id:22s} {name}: {c.message}")
        mem = summary["memory_bytes"]
        print(
            f"\nsummary: {summary['modules']} modules, {summary['errors']} errors, {summary['warnings']} warnings; "
            f"norm memory dense {mem['dense_norm'] / 2**20:.1f} MiB vs factored {mem['factored_norm'] / 2**20:.2f} MiB"
        )
    failed = summary["errors"] > 0 or (args.strict and summary["warnings"] > 0)
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="health and numerical audit of a DoRA checkpoint (safetensors)")
    p.add_argument("path", help="adapter_model.safetensors, a folder holding it, or any safetensors file with DoRA tensors")
    p.add_argument("--base", help="base model: a safetensors file, a sharded folder (index.json) or a folder with one file")
    p.add_argument("--config", help="adapter_config.json (default: next to the adapter)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    p.add_argument("--make-sample", action="store_true", help="write a sample DoRA adapter and base model to PATH and exit")
    p.set_defaults(run=run)
