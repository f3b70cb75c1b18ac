"""The numeric settings doracheck's GEMMs run under (docs/design.md section 2)."""

from __future__ import annotations

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
    return tuple(get() for get, _ in _FLAGS)


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
    """The flag with 16-bit reduction off, in ``value``'s form: ``value`` itself where it is off
    already (a caller's (False, False), split-K off too, is kept: it is stricter), else what
    ``matmul.allow_*_reduced_precision_reduction = False`` sets: split-K allowed, its partials
    reduced in fp32."""
    if isinstance(value, tuple):
        return value if not value[0] else (False, True)
    return False


class our_numerics:
    """The numerics doracheck's GEMMs run with, for the duration of a forward or backward
    (``with our_numerics(device_type):``):
    - autocast off on ``device_type`` (the layer chooses every dtype itself: GEMMs in the
      compute dtype, fp32 g and accumulators; autocast re-casting operands would break it);
    - on CUDA, cuBLAS's 16-bit reduction of split-K partials off (torch's
      ``allow_fp16/bf16_reduced_precision_reduction`` default to True): every reduction
      accumulates in fp32. The caller's settings are restored after, exactly as they were
      (both parts of torch >= 2.10's (allow, allow_split_k) pair).
    Nothing is changed while torch.compile traces (the compiled graph picks its own GEMMs).
    A class rather than a generator context manager, and torch's flag functions rather than
    the properties: it is entered several times per layer call, on the host-bound path."""

    __slots__ = ("device_type", "saved", "autocast_off")

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.saved: tuple | None = None
        self.autocast_off = None

    def __enter__(self):
        if torch.is_autocast_enabled(self.device_type):
            self.autocast_off = torch.autocast(self.device_type, enabled=False)
            self.autocast_off.__enter__()
        if self.device_type == "cuda" and not tracing():
            self.saved = _read_flags()
            _write_flags(tuple(_fp32_reduction(v) for v in self.saved))
        return self

    def __exit__(self, *exc):
        try:
            if self.saved is not None:
                saved, self.saved = self.saved, None
                _write_flags(saved)
        finally:
            if self.autocast_off is not None:
                off, self.autocast_off = self.autocast_off, None
                off.__exit__(*exc)
        return False


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer on ``x`` in, or None where autocast is off
    for x's device (or x is fp64, which autocast leaves alone)."""
    device_type = x.device.type
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
