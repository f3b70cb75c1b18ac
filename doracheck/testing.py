"""Helpers for test runners: which GPU a pytest-xdist worker uses."""

from __future__ import annotations


def gpu_for_worker(worker: str | None, gpu_count: int) -> int | None:
    """The GPU index for pytest-xdist worker ``worker`` ("gw0", "gw1", ...): N mod ``gpu_count``.

    None when there is no choice to make (fewer than two GPUs) or the name is not an xdist
    worker's (the main process, "master"), so the default device is kept.
    """
    if gpu_count < 2 or not worker or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return int(worker[2:]) % gpu_count
