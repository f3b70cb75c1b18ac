"""Self-contained HTML reports (``audit --report``, ``verify --report``): one file, the plots
inline as SVG made with matplotlib (the optional ``report`` extra), no network at view time.

``Report`` collects sections of headings, tables, paragraphs and figures; ``write(path)``
writes the file. ``matplotlib_or_none`` gives the library or the one-line reason it is missing.
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence
from typing import Any

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1em}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}
th{background:#f3f3f3}.fail{color:#b00020;font-weight:600}.warn{color:#a65e00}.ok{color:#1b7e28}
h2{border-bottom:1px solid #ddd;padding-bottom:4px}figure{margin:0.5em 0}p.legend{font-size:13px;color:#555}"""


def matplotlib_or_none() -> tuple[Any, str | None]:
    """(matplotlib.pyplot or None, why it is missing). Uses the non-interactive Agg backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "the HTML report needs matplotlib: pip install 'doracheck[report]'"
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
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{_STYLE}</style></head><body><h1>{html.escape(self.title)}</h1>{''.join(self._parts)}</body></html>\n")

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.render())
