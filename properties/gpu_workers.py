"""Pinning each pytest-xdist worker to one GPU: the documented helper for multi-GPU test runs.

``gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())`` gives the
GPU index worker gwN should use (N mod the GPU count), or None to keep the default device;
``tests/conftest.py`` calls it at collection time and passes the index to
``torch.cuda.set_device``, so ``pytest -n K`` spreads its workers over the GPUs.
"""

from __future__ import annotations


def gpu_for_worker(worker: str | None, gpu_count: int) -> int | None:
    """The GPU index for pytest-xdist worker ``worker`` ("gw0", "gw1", ...): N mod ``gpu_count``.

    None when there is no choice to make (fewer than two GPUs) or the name is not an xdist
    worker's (the main process, "master"), so the default device is kept.
    """
    if gpu_count < 2 or not worker or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return int(worker[2:]) % gpu_count
