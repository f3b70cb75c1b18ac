"""Eager launches of already-compiled Triton kernels without ``JITFunction.run``'s per-call binding.

On every launch, ``JITFunction.run`` binds the arguments, specialises each one, hashes a cache
key and looks the compiled kernel up, then calls the compiled kernel's launcher. On the H200
host (triton 3.6) that run took about 88 µs per launch under cProfile, 264 launches per
training step of the benchmark model (benchmarks/host_cprofile_step.py; a doracheck layer
launches 3-6 kernels a call). ``FastKernel`` keeps the compiled kernels it has seen under a key
of its own and launches a hit through the same launcher call ``JITFunction.run`` makes after
its lookup (triton >= 3.3):

    kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
               launch_metadata, launch_enter_hook, launch_exit_hook, *every argument in order)

The key holds everything triton specialises on, and more: per parameter in signature order,
a constexpr's value; a tensor's dtype and whether its address is 16-byte aligned; an int's
range (int32, int64, uint64) and whether it is 1 or divisible by 16; a bool's value; a float's
type; plus the launch options (``num_warps``, ``num_stages``), the device and triton's debug
flag. Two calls with one key get one compiled kernel from triton too, so a hit can only
reuse the kernel triton would pick. A miss, or an argument of any other type, goes through
``JITFunction.run`` (which compiles when needed and returns the kernel kept for later hits).

Off (every launch through triton) under ``TRITON_INTERPRET=1``, with
``DORACHECK_TRITON_LAUNCH=triton``, on a triton without ``knobs.runtime``, and while torch.compile
traces (``triton_common.launcher`` hands out ``wrap_triton`` then).
"""

from __future__ import annotations

import os
from typing import Any

import torch

_INT32 = (-(2**31), 2**31)
_UINT64_FROM = 2**63


def _knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs if hasattr(knobs, "runtime") else None


def enabled() -> bool:
    """Whether launches may bypass ``JITFunction.run`` in this process (read per launch: cheap)."""
    return (
        os.environ.get("TRITON_INTERPRET", "0") != "1"
        and os.environ.get("DORACHECK_TRITON_LAUNCH", "") != "triton"
        and _knobs() is not None
    )


def arg_key(value: Any, is_constexpr: bool):
    """What one argument contributes to the key (module docstring); ``NotImplemented`` for a
    type the fast path does not handle (the launch then goes through triton)."""
    if is_constexpr:
        return ("c", value)
    if isinstance(value, torch.Tensor):
        return ("t", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        size = 0 if _INT32[0] <= value < _INT32[1] else (2 if value >= _UINT64_FROM else 1)
        return ("i", size, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("f",)
    if value is None:
        return ("n",)
    return NotImplemented


class FastKernel:
    """``kernel[grid](*args, **kwargs)`` as a JITFunction takes it, launched directly on a hit."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = [p.name for p in kernel.params]
        self.constexpr = [bool(p.is_constexpr) for p in kernel.params]
        self.defaults = [p.default if p.has_default else None for p in kernel.params]
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _values(self, args: tuple, kwargs: dict) -> list | None:
        if len(args) > len(self.names):
            return None
        values = list(args)
        for i in range(len(args), len(self.names)):
            name = self.names[i]
            values.append(kwargs[name] if name in kwargs else self.defaults[i])
        return values

    def launch(self, grid: tuple, args: tuple, kwargs: dict):
        knobs = _knobs()
        values = self._values(args, kwargs)
        if values is None or knobs is None:
            return self.kernel[grid](*args, **kwargs)
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.names))
        device = torch.cuda.current_device()
        key_parts = [device, options, knobs.runtime.debug]
        for value, is_constexpr in zip(values, self.constexpr):
            part = arg_key(value, is_constexpr)
            if part is NotImplemented:
                return self.kernel[grid](*args, **kwargs)
            key_parts.append(part)
        key = tuple(key_parts)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)  # compiles if needed; the kernel triton picked
            if compiled is not None:
                self.compiled[key] = compiled
            return compiled
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        stream = _raw_stream(device)
        launch_metadata = compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, launch_metadata,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
        return compiled


def _raw_stream(device: int) -> int:
    """The current CUDA stream of ``device`` as a handle (what triton's driver asks torch for)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


_FAST: dict[Any, FastKernel] = {}


def fast(kernel):
    """The ``FastKernel`` of a ``@triton.jit`` function (made once), or ``kernel`` itself where
    the fast path is off."""
    if not enabled():
        return kernel
    wrapper = _FAST.get(kernel)
    if wrapper is None:
        wrapper = _FAST[kernel] = FastKernel(kernel)
    return wrapper
