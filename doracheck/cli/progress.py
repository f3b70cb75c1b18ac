"""Progress bars for the long commands (audit, verify, calibrate), with tqdm.

A bar is drawn on stderr only when stderr is a terminal, the command was not asked for
``--json``, and no ``CI`` environment variable is set; otherwise the bar is disabled and costs
nothing, so logs, pipes and machine output get only the results.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def bars_wanted(json_output: bool) -> bool:
    return not json_output and sys.stderr.isatty() and not os.environ.get("CI")


class Progress:
    """``progress(message)`` advances one step and shows the message; ``done()`` clears the bar."""

    def __init__(self, command: str, total: int, *, json_output: bool = False, unit: str = "step"):
        self._bar = tqdm(total=max(total, 1), desc=command, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                         disable=not bars_wanted(json_output))

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
