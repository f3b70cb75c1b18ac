"""Timing calls the way METHOD.md asks: warm-up first, then CUDA events (the host clock on a
CPU), sorted times for medians and quantiles; one callable a call at a time (``time_ms``), or
several side by side (``time_interleaved``). Inputs are the caller's (random, never zeros)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

import torch


def time_ms(fn: Callable[[], object], device: torch.device | str, reps: int = 20, warmup: int = 3) -> list[float]:
    """Sorted per-call times in ms."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    return sorted(_sample_ms(fn, dev, 1) for _ in range(reps))


def quantile(sorted_times: list[float], q: float) -> float:
    pos = q * (len(sorted_times) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_times) - 1)
    return sorted_times[lo] + (sorted_times[hi] - sorted_times[lo]) * (pos - lo)


MAX_CALLS_PER_SAMPLE = 64


def time_interleaved(fns: Mapping[str, Callable[[], object]], device: torch.device | str, rounds: int = 15,
                     warmup: int = 3, min_sample_ms: float = 2.0) -> dict[str, list[float]]:
    """Sorted per-call ms for each named callable, measured side by side: round-robin, the order rotating
    each round, so drift (clocks, allocator state, host load) falls on all alike, not on whichever ran
    first. Each of the ``rounds`` samples times ``k`` back-to-back calls between two CUDA events (the host
    clock on a CPU) and divides by ``k``, chosen from a warm call so a sample lasts about ``min_sample_ms``
    (at most ``MAX_CALLS_PER_SAMPLE``: a 20 µs call gets 1.3 ms samples). Back-to-back calls let the host
    run ahead of the GPU as between a model's layers, so a host-bound call is timed at its host cost and a
    GPU-bound one at its GPU time; one event pair and one sync a sample keep their cost out of short calls."""
    dev = torch.device(device)
    names = list(fns)
    if not names or rounds < 1:
        raise ValueError(f"time_interleaved: expected at least one callable and one round, got {len(names)} and {rounds}")
    calls_per_sample = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        one = _sample_ms(fns[name], dev, 1)
        calls_per_sample[name] = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(min_sample_ms / max(one, 1e-3))))
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            k = calls_per_sample[name]
            times[name].append(_sample_ms(fns[name], dev, k) / k)
    return {name: sorted(t) for name, t in times.items()}


def _sample_ms(fn: Callable[[], object], dev: torch.device, k: int) -> float:
    if dev.type == "cuda":
        with torch.cuda.device(dev):  # the events go on dev's stream even if it is not current
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) * 1e3
