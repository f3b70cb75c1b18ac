"""Launching a Triton kernel again without Triton's per-call binder (eager, on a GPU).

``kernel[grid](*args, **constexprs)`` runs ``JITFunction.run`` every call: it binds every
argument, specialises each one (dtype, 16-byte alignment of pointers, integers equal to 1 or
divisible by 16, 32- or 64-bit), hashes that into a key and looks the compiled kernel up. On
the H200 host of 2026-12-02 that took 38.9 µs of host time per launch of the compose kernel
at T = 1, while calling the compiled kernel's launcher with the arguments already bound took
7.7 µs (benchmarks/results/decode_layer_host_armed_h200.txt); eager decode makes one such
launch per layer and token, and is host-bound.

``launch(kernel, grid, args, constexprs, options)`` keeps, per kernel, the compiled kernel
that Triton's own ``run`` returned for a key made of the raw values that decide Triton's
specialisation: every integer argument as it is, each tensor's dtype, whether all pointers are
16-byte aligned, the constexprs, the options, the device and the global settings Triton adds to
its options (debug, instrumentation mode). Equal raw values give Triton's
key, so the kernel found is the one Triton itself would launch; a new raw value (another
shape) goes through ``run`` once more. Triton's own path is taken whenever this one could
differ from it: while torch.compile traces, under the interpreter, with a launch hook set (a
profiler such as proton added calls to Triton's launch hooks), a stage-inspection hook or a
kernel pre-run hook, for an argument of another type, or when a pointer is not 16-byte
aligned (a rare offset view; Triton specialises on it).
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs

from .tracing import tracing
from .triton_common import interpreting

_MAX_ENTRIES = 512  # per kernel: distinct shapes seen; cleared when exceeded (a miss only costs Triton's path)

# kernel -> {key: (compiled kernel, constexpr values in signature order)}; a kernel whose
# signature this module cannot bind (constexprs not last, a Triton without the expected
# internals) maps to None and always takes Triton's path.
_CACHE: dict[Any, dict | None] = {}


def _active(hook) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 and 3.9 keep a ``HookChain`` there,
    empty unless a tool (a profiler) added calls; a plain callable counts as set."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    """Launch hooks or a stage-inspection hook set: Triton's own path, every launch."""
    return (_active(knobs.runtime.launch_enter_hook) or _active(knobs.runtime.launch_exit_hook)
            or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None)


def _settings() -> tuple:
    """The global settings Triton's ``run`` adds to its options (so to its key): debug,
    instrumentation mode and, in Triton 3.9, fpsan's homomorphic casts."""
    return (knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            getattr(knobs.compilation, "fpsan_homomorphic_casts", None))


def _stream(device: int) -> int:
    """The current CUDA stream of ``device`` as Triton's own launch gets it."""
    return torch._C._cuda_getCurrentRawStream(device)


def _key(args: tuple, constexprs: dict, options: dict) -> tuple | None:
    """The raw values Triton specialises on, or None when an argument is of a type this module
    does not key (Triton's path then)."""
    parts: list = []
    pointers = 0
    device = None
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(a.dtype)
            pointers |= a.data_ptr()
            device = a.get_device() if device is None else device
        elif isinstance(a, int) and not isinstance(a, bool):
            parts.append(a)
        elif isinstance(a, float):
            parts.append(float)  # fp32 scalars are not specialised on their value
        else:
            return None
    if pointers & 15 or device is None:
        return None
    return (device, *parts, *constexprs.items(), *options.items(), _settings())


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, options: dict) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, through the compiled kernel Triton chose
    for the same raw arguments before, when there is one (see the module docstring)."""
    if tracing() or interpreting():
        raise RuntimeError("fast_launch.launch: eager GPU launches only (the caller routes traced and interpreted ones)")
    entries = _CACHE.get(kernel, {})
    key = None if entries is None or _hooks_set() or getattr(kernel, "pre_run_hooks", None) else _key(args, constexprs, options)
    hit = None if key is None else entries.get(key)  # type: ignore[union-attr]
    if hit is not None:
        compiled, tail = hit
        device = key[0]  # type: ignore[index]
        stream = _stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
        return
    compiled = kernel[grid](*args, **constexprs, **options)
    if key is not None and entries is not None:
        _remember(kernel, entries, key, compiled, args, constexprs, options)


def _remember(kernel, entries: dict, key: tuple, compiled, args: tuple, constexprs: dict, options: dict) -> None:
    """Keep ``compiled`` for ``key`` once the kernel's signature is known to bind as
    (args in order, then the constexprs): checked against Triton's own binder."""
    try:
        binder = kernel.device_caches[key[0]][4]
        bound = tuple(binder(*args, **constexprs, **options)[0].values())
        tail = bound[len(args):]
        ok = (compiled is not None and len(bound) == len(args) + len(constexprs)
              and all(b is a for b, a in zip(bound, args)) and tail == tuple(constexprs.values())
              and callable(getattr(compiled, "run", None)) and compiled.function is not None)
    except Exception:  # a Triton whose internals differ: its own path from now on
        ok = False
    if not ok:
        _CACHE[kernel] = None
        return
    if len(entries) >= _MAX_ENTRIES:
        entries.clear()
    entries[key] = (compiled, tail)
    _CACHE[kernel] = entries


def clear() -> None:
    """Forget every kept compiled kernel (tests)."""
    _CACHE.clear()
