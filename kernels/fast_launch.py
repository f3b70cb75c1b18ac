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

A host TMA descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``, the compose's
``_lora_up_compose_tma_kernel``) is keyed by everything it holds but its tensor's address: the
tensor's dtype and every other field (shape, strides, block shape, padding, ...), which is all Triton can
specialise a descriptor on (a superset of its key), and its address joins the alignment test. The
launcher encodes the descriptor itself at every launch, in both paths.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from .tracing import tracing
from .triton_common import interpreting

_MAX_ENTRIES = 512  # per kernel: distinct shapes seen; cleared when exceeded (a miss only costs Triton's path)

# kernel -> {key: Entry}; a kernel whose
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
    for a in args:  # type() first: integers (the strides and sizes) are most of the arguments
        kind = type(a)
        if kind is int:  # not bool (Triton specialises it apart) nor another int subclass
            parts.append(a)
        elif kind is float:
            parts.append(float)  # fp32 scalars are not specialised on their value
        elif isinstance(a, torch.Tensor):
            parts.append(a.dtype)
            pointers |= a.data_ptr()
            if device is None:
                device = a.get_device()
        elif kind is TensorDescriptor:
            t = a.base
            parts.append((kind, t.dtype, *_descriptor_fields(a)))
            pointers |= t.data_ptr()
            if device is None:
                device = t.get_device()
        else:
            return None
    if pointers & 15 or device is None:
        return None
    return (device, *parts, *constexprs.items(), *options.items(), _settings())


def _descriptor_fields(desc: TensorDescriptor) -> tuple:
    """Every field of a descriptor but its tensor, as hashable values: the fields differ between
    Triton versions (3.9 added ``round_f32_to_tf32``), so they are read from the dataclass."""
    return tuple((name, tuple(v) if isinstance(v, list) else v)
                 for name in desc.__dataclass_fields__ if name != "base" for v in (getattr(desc, name),))


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, options: dict):
    """``kernel[grid](*args, **constexprs, **options)``, through the compiled kernel Triton chose
    for the same raw arguments before, when there is one (see the module docstring). Returns the
    ``Entry`` it launched through or kept, or None where Triton's own path is the only one."""
    if tracing() or interpreting():
        raise RuntimeError("fast_launch.launch: eager GPU launches only (the caller routes traced and interpreted ones)")
    entries = _CACHE.get(kernel, {})
    key = None if entries is None or not direct_allowed(kernel) else _key(args, constexprs, options)
    hit = None if key is None else entries.get(key)  # type: ignore[union-attr]
    if hit is not None:
        run_entry(hit, grid, args)
        return hit
    compiled = kernel[grid](*args, **constexprs, **options)
    if key is not None and entries is not None:
        return _remember(kernel, entries, key, compiled, args, constexprs, options)
    return None


class Entry(NamedTuple):
    """A compiled kernel Triton chose, and what a direct launch of it needs: the device, the
    constexpr values in signature order (appended to the arguments) and the global settings it
    was chosen under."""

    compiled: Any
    tail: tuple
    device: int
    settings: tuple


def direct_allowed(kernel, entry: Entry | None = None) -> bool:
    """Whether a launch may skip Triton's ``run`` now: no launch, stage-inspection or pre-run
    hook set and, for ``entry``, Triton's global settings as they were when it was kept. A caller
    holding an ``Entry`` for fixed arguments (``compose_triton.InferCompose``) asks this per launch."""
    if _hooks_set() or getattr(kernel, "pre_run_hooks", None):
        return False
    return entry is None or entry.settings == _settings()


def run_entry(entry: Entry, grid: tuple, args: tuple) -> None:
    """Launch ``entry``'s compiled kernel on the current stream of its device with ``args``, which
    must be what Triton specialises identically to the arguments it was kept for (same dtypes,
    integers, 16-byte alignment); the caller has checked ``direct_allowed``."""
    compiled = entry.compiled
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, _stream(entry.device), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *entry.tail)


def _remember(kernel, entries: dict, key: tuple, compiled, args: tuple, constexprs: dict, options: dict) -> Entry | None:
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
        return None
    if len(entries) >= _MAX_ENTRIES:
        entries.clear()
    entry = Entry(compiled, tail, key[0], key[-1])
    entries[key] = entry
    _CACHE[kernel] = entries
    return entry


def clear() -> None:
    """Forget every kept compiled kernel (tests)."""
    _CACHE.clear()
