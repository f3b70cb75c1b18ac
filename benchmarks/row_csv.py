"""Benchmark rows to CSV as they are measured, so a run cut short by its time limit keeps them."""

from __future__ import annotations

import csv


class RowWriter:
    """``add(row)`` writes one dict row (the first row fixes the columns); no file: no-op."""

    def __init__(self, path: str | None):
        self._file = open(path, "w", newline="") if path else None  # noqa: SIM115 (closed in close())
        self._writer: csv.DictWriter | None = None

    def add(self, row: dict) -> None:
        if self._file is None:
            return
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
