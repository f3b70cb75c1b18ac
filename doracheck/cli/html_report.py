"""Self-contained HTML reports (``audit --report``, ``verify --report``): one file, the plots
inline as SVG made with matplotlib (the optional ``report`` extra), no network at view time.
``Report`` collects headings, tables, paragraphs and figures; ``write(path)`` goes through a
temporary file in the same folder, moved into place at the end. A report never replaces a user's
file: ``target_problem(path)`` (checked before a command does any work, and again just before the
move) refuses a name without an .html/.htm suffix, a folder, a missing or read-only folder, and an
existing file that is not an earlier doracheck report (``<!DOCTYPE html>``, ``GENERATOR``).
"""

from __future__ import annotations

import html
import io
import os
from collections.abc import Sequence
from typing import Any

from doracheck.safe_files import install, temp_beside

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1em}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}
th{background:#f3f3f3}.fail{color:#b00020;font-weight:600}.warn{color:#a65e00}.ok{color:#1b7e28}
h2{border-bottom:1px solid #ddd;padding-bottom:4px}figure{margin:0.5em 0}p.legend{font-size:13px;color:#555}"""
GENERATOR = '<meta name="generator" content="doracheck">'
SUFFIXES = (".html", ".htm")
_SNIFF_BYTES = 4096  # the doctype and GENERATOR come first in every report doracheck writes


class TargetRefused(OSError):
    """``target_problem`` objected at write time (the one-line reason is ``str(exc)``)."""

    def __str__(self) -> str:
        return str(self.args[0])


def write_error(path: str, exc: OSError) -> str:
    """The one line (without the command's prefix) for a report that could not be written."""
    if isinstance(exc, TargetRefused):
        return f"--report: {exc}"
    return f"--report: cannot write {path}: {exc.strerror or exc}"


def _ours(path: str) -> bool:
    """Whether the existing file at ``path`` is an HTML report doracheck wrote."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    return head.startswith(b"<!DOCTYPE html>") and GENERATOR.encode() in head


def target_problem(path: str) -> str | None:
    """Why an HTML report cannot be written to ``path`` (one line, without the command's
    prefix), or None. Refuses anything but a new file or an earlier doracheck report."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.isdir(path):
            return f"{path} is a folder; give a file name such as report.html"
        if not path.lower().endswith(SUFFIXES):
            return f"{path}: the report is an HTML file; give a name ending in .html"
        if not os.path.isdir(folder):
            return f"cannot write {path}: no such folder {folder}"
        if not os.access(folder, os.W_OK):
            return f"cannot write {path}: the folder {folder} is not writable"
        try:
            os.lstat(path)  # other errors than "no such file" (a name too long, no access) are reported
        except FileNotFoundError:
            return None
        if not os.path.isfile(path):
            return f"cannot write {path}: it exists and is not a regular file"
        if not _ours(path):
            return (f"{path} exists and is not an HTML report written by doracheck; it is left alone "
                    "(remove it or choose another name)")
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def matplotlib_or_none() -> tuple[Any, str | None]:
    """(matplotlib.pyplot or None, why it is missing). Uses the non-interactive Agg backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "the HTML report needs matplotlib: pip install matplotlib"
    return plt, None


class Report:
    def __init__(self, title: str):
        self.title = title
        self._parts: list[str] = []

    def heading(self, text: str, level: int = 2) -> None:
        self._parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def paragraph(self, text: str, css: str = "") -> None:
        cls = f' class="{css}"' if css else ""
        self._parts.append(f"<p{cls}>{html.escape(text)}</p>")

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]], row_classes: Sequence[str] | None = None) -> None:
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
        body = []
        for i, row in enumerate(rows):
            cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
            body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
        self._parts.append(f"<table><tr>{head}</tr>{''.join(body)}</table>")

    def figure(self, fig, caption: str = "") -> None:
        """A matplotlib figure, inline as SVG (then closed)."""
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight")
        import matplotlib.pyplot as plt
        plt.close(fig)
        svg = buf.getvalue()
        svg = svg[svg.index("<svg"):]  # drop the XML prologue: the SVG sits inside HTML
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(f"<figure>{svg}{cap}</figure>")

    def render(self) -> str:
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'>{GENERATOR}<title>{html.escape(self.title)}</title>"
                f"<style>{_STYLE}</style></head><body><h1>{html.escape(self.title)}</h1>{''.join(self._parts)}</body></html>\n")

    def write(self, path: str) -> None:
        """Write the report to ``path`` (``replace_file``); raises OSError when ``target_problem``
        objects or the write fails, leaving ``path`` as it was."""
        replace_file(path, self.render().encode("utf-8"))


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder and ``os.replace``,
    after checking ``target_problem`` again (the file may have appeared meanwhile)."""
    problem = target_problem(path)
    if problem:
        raise TargetRefused(problem)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.remove(tmp)
        raise
    install(tmp, path)
