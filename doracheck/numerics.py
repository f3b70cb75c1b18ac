"""The numeric settings doracheck's GEMMs run under (docs/design.md section 2)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def our_numerics(device_type: str):
    """The numerics doracheck's GEMMs run with, for the duration of a forward or backward:
    - autocast off on ``device_type`` (the layer chooses every dtype itself: GEMMs in the
      compute dtype, fp32 g and accumulators; autocast re-casting operands would break it);
    - on CUDA, cuBLAS's 16-bit reduction of split-K partials off (torch's
      ``allow_fp16/bf16_reduced_precision_reduction`` default to True): every reduction
      accumulates in fp32. The caller's settings are restored after.
    Nothing is changed while torch.compile traces (the compiled graph picks its own GEMMs)."""
    from doracheck.kernels.tracing import tracing

    autocast = torch.is_autocast_enabled(device_type)
    matmul = torch.backends.cuda.matmul
    flags = device_type == "cuda" and not tracing()
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction) if flags else None
    if flags:
        matmul.allow_fp16_reduced_precision_reduction = False
        matmul.allow_bf16_reduced_precision_reduction = False
    try:
        if autocast:
            with torch.autocast(device_type, enabled=False):
                yield
        else:
            yield
    finally:
        if saved is not None:
            matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer on ``x`` in, or None where autocast is off
    for x's device (or x is fp64, which autocast leaves alone)."""
    device_type = x.device.type
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
