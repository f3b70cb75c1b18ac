"""Measure the peak tensor memory a function allocates, on any device (CPU included).

CPU torch keeps no allocator statistics, so this counts at the ATen level: a ``TorchDispatchMode`` sees every
op, records each new output storage (not an input's, not tracked yet) and holds a weak reference to that
*storage* (``StorageWeakRef``: it expires when the last tensor or view using it dies, not with one Python
tensor object). After every op, once its outputs exist (when usage peaks), expired storages are dropped and
the live bytes summed; the peak is the largest sum. It sees every tensor an ATen op makes while active,
temporaries included, views once; not scratch inside a kernel (BLAS packing) nor the inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class MemoryReport(NamedTuple):
    peak_bytes: int  # the largest total of live new storages seen after any op
    final_bytes: int  # live new storages when the function returned (its outputs, if kept)
    allocations: int  # how many new storages were seen
    largest_allocation: int  # bytes of the biggest single new storage
    result: Any  # what the function returned


class _Tracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.current = 0
        self.peak = 0
        self.allocations = 0
        self.largest = 0

    def _refresh(self) -> None:
        dead = [ref for ref in self.live if ref.expired()]
        for ref in dead:
            self.current -= self.live.pop(ref)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        before = {StorageWeakRef(t.untyped_storage()) for t in flat_in if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        self._refresh()
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref in before or ref in self.live:
                continue
            nbytes = int(storage.nbytes())
            self.live[ref] = nbytes
            self.current += nbytes
            self.allocations += 1
            self.largest = max(self.largest, nbytes)
        self.peak = max(self.peak, self.current)
        return out


def peak_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Run ``fn(*args, **kwargs)`` and report the peak bytes of tensors it allocated."""
    tracker = _Tracker()
    with tracker:
        result = fn(*args, **kwargs)
    tracker._refresh()
    return MemoryReport(tracker.peak, tracker.current, tracker.allocations, tracker.largest, result)


def peak_extra_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Peak bytes ``fn()`` allocates beyond what existed before: the CUDA caching allocator's
    statistics on a GPU, the tracker above on the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - start)
    return peak_tensor_bytes(fn).peak_bytes
