"""The numeric settings doracheck's GEMMs run under (docs/design.md section 2)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from doracheck.kernels.tracing import tracing


def _flag_functions():
    """torch's own getters and setters of the two cuBLAS reduction flags, or None where this
    torch has not got them (then the ``torch.backends.cuda.matmul`` properties are used)."""
    pairs = []
    for half in ("fp16", "bf16"):
        get = getattr(torch._C, f"_get_cublas_allow_{half}_reduced_precision_reduction", None)
        set_ = getattr(torch._C, f"_set_cublas_allow_{half}_reduced_precision_reduction", None)
        if get is None or set_ is None:
            return None
        pairs.append((get, set_))
    return tuple(pairs)


_FLAGS = _flag_functions()
_PROPERTIES = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")


def _read_flags() -> tuple:
    """The two flags exactly as torch holds them: a bool each, or (allow, allow_split_k) each
    since torch 2.10, where assigning a bool to the property also sets allow_split_k."""
    if _FLAGS is None:
        matmul = torch.backends.cuda.matmul
        return tuple(getattr(matmul, name) for name in _PROPERTIES)
    return (_FLAGS[0][0](), _FLAGS[1][0]())


def _write_flags(values: tuple) -> None:
    if _FLAGS is None:
        matmul = torch.backends.cuda.matmul
        for name, value in zip(_PROPERTIES, values):
            setattr(matmul, name, value)
        return
    for (_, set_), value in zip(_FLAGS, values):
        if isinstance(value, tuple):
            set_(*value)
        else:
            set_(value)


def _fp32_reduction(value):
    """The flag with 16-bit reduction off, in ``value``'s form: ``value`` itself where off already
    (a caller's stricter (False, False) is kept), else what assigning False sets: split-K
    allowed, its partials reduced in fp32."""
    if isinstance(value, tuple):
        return value if not value[0] else (False, True)
    return False


# Process state, while calls run on several threads (autograd's device threads, DataParallel,
# servers): the first call in saves and switches them, the last out restores them (per-call
# save/restore let an early exit switch them back on under a call still running).
_flags_lock = threading.Lock()
_flags_held: dict[str, Any] = {"depth": 0, "saved": None}


def _flags_enter() -> None:
    """Only a flag that is on is written (and written back on the last exit): with the flags
    off, entering costs two reads (it runs around every eager doracheck GEMM)."""
    with _flags_lock:
        if _flags_held["depth"] == 0:
            saved = _read_flags()
            target = (_fp32_reduction(saved[0]), _fp32_reduction(saved[1]))
            if target != saved:
                _write_flags(target)
                _flags_held["saved"] = saved
        _flags_held["depth"] += 1


def _flags_exit() -> None:
    with _flags_lock:
        _flags_held["depth"] -= 1
        if _flags_held["depth"] == 0:
            saved, _flags_held["saved"] = _flags_held["saved"], None
            if saved is not None:
                _write_flags(saved)


class _FlagsOff:
    """Eager CUDA calls without autocast (the hot path): only the two flags, switched off and
    restored; a plain class (cheaper to enter than a generator context manager)."""

    __slots__ = ()

    def __enter__(self):
        _flags_enter()
        return self

    def __exit__(self, *exc):
        _flags_exit()
        return False


@contextlib.contextmanager
def _numerics_general(device_type: str):
    """Every other case: autocast on, or torch.compile tracing (a nested ``with`` on torch's own
    autocast context, which Dynamo traces)."""
    flags = device_type == "cuda" and not tracing()
    if flags:
        _flags_enter()
    try:
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                yield
        else:
            yield
    finally:
        if flags:
            _flags_exit()


_NOTHING = contextlib.nullcontext()


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled``, False for a device type autocast does not know (meta
    tensors of an offloaded model), where torch raises."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def our_numerics(device_type: str):
    """The numerics of doracheck's GEMMs for a forward or backward (``with our_numerics(dt):``):
    - autocast off on ``device_type`` (the layer chooses every dtype: GEMMs in the compute
      dtype, fp32 g and accumulators; autocast re-casting operands would break it);
    - on CUDA, cuBLAS's 16-bit reduction of split-K partials off (torch's
      ``allow_fp16/bf16_reduced_precision_reduction`` default to True), so every reduction
      accumulates in fp32; the caller's settings are restored exactly (both parts of torch
      >= 2.10's (allow, allow_split_k) pair).
    Nothing changes while torch.compile traces. Entered several times per eager layer call, so
    the common case takes a plain class (``_FlagsOff``)."""
    if torch.compiler.is_compiling() or _autocast_enabled(device_type):
        return _numerics_general(device_type)
    if device_type != "cuda" or tracing():
        return _NOTHING
    return _FlagsOff()


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer on ``x`` in, or None where autocast is off
    for x's device (or x is fp64, which autocast leaves alone)."""
    device_type = x.device.type
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
