"""Pinning each pytest-xdist worker to one GPU, for multi-GPU test runs: ``tests/conftest.py``
passes ``gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())`` to
``torch.cuda.set_device`` at collection, so ``pytest -n K`` spreads its workers over the GPUs."""

from __future__ import annotations


def gpu_for_worker(worker: str | None, gpu_count: int) -> int | None:
    """The GPU index for xdist worker ``worker`` ("gw0", "gw1", ...): N mod ``gpu_count``; None (keep
    the default device) with fewer than two GPUs or a name not an xdist worker's ("master")."""
    if gpu_count < 2 or not worker or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return int(worker[2:]) % gpu_count
