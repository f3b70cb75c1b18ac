"""Timing one call the way METHOD.md asks: warm-up first, then CUDA events per repetition (the
host clock on a CPU), median and quantiles; inputs are the caller's (random, never zeros)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], device: torch.device | str, reps: int = 20, warmup: int = 3) -> list[float]:
    """Sorted per-call times in ms."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)


def quantile(sorted_times: list[float], q: float) -> float:
    pos = q * (len(sorted_times) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_times) - 1)
    return sorted_times[lo] + (sorted_times[hi] - sorted_times[lo]) * (pos - lo)
