"""Progress bars for the long commands (audit, verify, calibrate, bench), with tqdm: on stderr
only when it is a terminal, ``CI`` is unset and the command has nothing else to show meanwhile
(docs/cli.md); otherwise disabled and free, so logs, pipes and machine output get only results.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def bars_wanted(json_output: bool = False, draw: bool = True) -> bool:
    """Whether to draw: the command wants a bar (``draw``, and not ``json_output``), stderr is a
    terminal and ``CI`` is not set."""
    return draw and not json_output and sys.stderr.isatty() and not os.environ.get("CI")


class Progress:
    """``progress(message)`` advances one step and shows the message; ``done()`` clears the bar.
    ``json_output``: --json was asked (no bar); ``draw=False``: progress shows otherwise."""

    def __init__(self, command: str, total: int, *, json_output: bool = False, unit: str = "step", draw: bool = True):
        self._bar = tqdm(total=max(total, 1), desc=command, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                         disable=not bars_wanted(json_output, draw))

    def __call__(self, message: str = "") -> None:
        if message:
            self._bar.set_postfix_str(message, refresh=False)
        self._bar.update(1)

    def done(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.done()
