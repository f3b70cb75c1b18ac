"""Content of ``doracheck audit --report``: fills an HTML document (``doracheck.cli.html_report.Report``,
passed in so this package does not depend on the CLI) with the run's summary, table, legend,
findings and one figure per numerically audited module (``plots.module_figure``)."""

from __future__ import annotations

from collections.abc import Callable

from . import AuditReport
from . import summary as summ
from .plots import module_figure

FINDING_CLASS = {"error": "fail", "warning": "warn", "info": ""}


def _overview(doc, report: AuditReport) -> None:
    s = report.summary()
    doc.paragraph(f"adapter: {report.path} ({report.fmt}, {s['modules']} modules)")
    for i, note in enumerate(report.notes):
        doc.paragraph(f"{'notice' if report.plain_lora and i == 0 else 'note'}: {note}", "warn" if report.plain_lora and i == 0 else "")
    doc.paragraph(summ.summary_line(report), "fail" if s["errors"] else ("warn" if s["warnings"] else "ok"))
    memory = summ.memory_line(report)
    if memory:
        doc.paragraph(memory)


def fill(doc, report: AuditReport, plt, step: Callable[[str], None] | None = None) -> None:
    """Add every section to ``doc``; ``step(name)`` is called per module (a progress bar)."""
    _overview(doc, report)
    doc.heading("Summary table")
    classes = ["fail" if m.count("error") else ("warn" if m.count("warning") else "") for m in report.modules]
    doc.table(summ.header(report), summ.rows(report), row_classes=classes)
    doc.heading("Legend")
    for name, text in summ.legend(report):
        doc.paragraph(f"{name}: {text}", "legend")
    doc.heading("Findings")
    findings = [(c.severity, c.id, m.name, c.message) for m in report.modules for c in m.checks]
    if findings:
        doc.table(("severity", "id", "module", "message"), findings, row_classes=[FINDING_CLASS[f[0]] for f in findings])
    else:
        doc.paragraph("none")
    doc.heading("Modules")
    doc.paragraph("Per module: g - 1 against the zones where bf16 (-2^-9..+2^-8) and fp16 (-2^-12..+2^-11) round g to exactly 1, "
                  "with the noise floor of g dotted; the distribution of the three norm terms per feature (n² = ||W||² + "
                  "2s·<W,BA> + s²·||BA||²); the merge error of the probe outputs in ulps.", "legend")
    for m in report.modules:
        if step:
            step(m.name)
        doc.heading(m.name, 3)
        fig = module_figure(plt, m)
        counts = f"{m.count('error')} errors, {m.count('warning')} warnings"
        if fig is None:
            reason = next((c.message for c in m.checks if c.severity != "info"), None) or next(
                (c.message for c in m.checks if c.id in ("base.missing", "structure.not_dora", "format.kohya", "config.missing")),
                "numerical checks not run")
            doc.paragraph(f"{counts}; no plots: {reason}")
        else:
            doc.figure(fig, counts)
