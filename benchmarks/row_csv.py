"""Benchmark rows to CSV as they are measured, so a run cut short by its time limit keeps them."""

from __future__ import annotations

import csv
import os


class RowWriter:
    """``add(row)`` writes one dict row (the first row fixes the columns); no file: no-op.
    ``append=True`` adds to an existing file (its header kept) instead of starting it again."""

    def __init__(self, path: str | None, append: bool = False):
        self._fresh = not (append and path and os.path.exists(path) and os.path.getsize(path) > 0)
        self._file = open(path, "a" if append else "w", newline="") if path else None  # noqa: SIM115 (closed in close())
        self._writer: csv.DictWriter | None = None

    def add(self, row: dict) -> None:
        if self._file is None:
            return
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            if self._fresh:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def print_report(lines: list[str], out: str | None) -> None:
    """Print a diagnostic's report and, with ``out``, write it to that file too."""
    report = "\n".join(lines)
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report + "\n")
