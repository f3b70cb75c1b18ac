"""The one place that decides which implementation runs a call (torch or Triton).

``backend_for(*tensors)`` gives the layer its ``Backend`` once per call; ``choose_path(device)``
is the rule under it, and says why (``doracheck env``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import NamedTuple

import torch

from doracheck.kernels.backends import TORCH, Backend


class PathChoice(NamedTuple):
    name: str  # "torch" or "triton"
    reason: str


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether triton can be imported (looked up once at import: find_spec costs tens of µs)."""
    return _HAS_TRITON


_PATH_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar("doracheck_path", default=None)


def _forced_path() -> str | None:
    """A path forced by ``use_path`` (innermost wins) or by the DORACHECK_PATH variable."""
    override = _PATH_OVERRIDE.get()
    if override:
        return override
    forced = os.environ.get("DORACHECK_PATH", "").strip().lower()
    return forced or None


@contextlib.contextmanager
def use_path(name: str):
    """Force the implementation ("torch", "triton" or "auto") for calls made inside the block."""
    if name not in ("torch", "triton", "auto"):
        raise ValueError(f"use_path: expected torch, triton or auto, got {name!r}")
    token = _PATH_OVERRIDE.set(name)
    try:
        yield
    finally:
        _PATH_OVERRIDE.reset(token)


def forced_path(name: str, fn):
    """``fn`` wrapped so that each call runs under ``use_path(name)``. The path is decided in
    the forward; the backward it records reuses that decision (it runs outside the block)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with use_path(name):
            return fn(*args, **kwargs)

    return wrapper


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_path(device: torch.device) -> PathChoice:
    """The implementation for tensors on ``device``. auto: Triton on CUDA when triton imports,
    else torch. Forcing "triton" (``use_path`` or DORACHECK_PATH) also works for CPU tensors
    under TRITON_INTERPRET=1, which is how CI runs the kernels without a GPU."""
    if torch.compiler.is_compiling():
        # Automatic: overrides are Python state Dynamo does not trace (they apply to eager calls).
        name = "triton" if device.type == "cuda" and _HAS_TRITON else "torch"
        return PathChoice(name, "torch.compile: automatic choice")
    forced = _forced_path()
    has_triton = triton_available()
    if forced == "torch":
        return PathChoice("torch", "forced: the torch path")
    if forced == "triton":
        if not has_triton:
            raise RuntimeError("doracheck: the Triton path was forced but triton is not installed")
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"doracheck: the Triton path was forced for {device.type} tensors; set TRITON_INTERPRET=1 to run the "
                "kernels on the CPU"
            )
        return PathChoice("triton", "forced: the Triton kernels")
    if forced not in (None, "auto"):
        raise ValueError(f"DORACHECK_PATH: expected torch, triton or auto, got {forced!r}")
    if device.type != "cuda":
        return PathChoice("torch", f"tensors on {device.type}: the torch path (Triton kernels run on CUDA)")
    if not has_triton:
        return PathChoice("torch", "CUDA tensors but triton is not installed: the torch path")
    return PathChoice("triton", "CUDA tensors and triton present: the Triton kernels")


def describe_path(device: torch.device | str) -> PathChoice:
    return choose_path(torch.device(device))


def backend_for(*tensors: torch.Tensor | None) -> Backend:
    """The backend of one call on ``tensors`` (None ignored): the torch twin when any is fp64
    (gradcheck, the oracles' callers), else ``choose_path`` for the first tensor's device."""
    first = None
    for t in tensors:  # a loop, not comprehensions: this runs once per layer call
        if t is not None:
            if t.dtype == torch.float64:
                return TORCH
            if first is None:
                first = t
    if first is None:
        raise ValueError("backend_for: expected at least one tensor, got only None")
    if _plain_cuda_triton(first.device) or choose_path(first.device).name == "triton":
        from doracheck.kernels.backends import triton_backend

        return triton_backend()
    return TORCH


def _plain_cuda_triton(device: torch.device) -> bool:
    """``choose_path``'s common case without building its reason: CUDA, triton, nothing forced,
    not tracing (about 1 µs instead of 2.6 on a 2-core AMD EPYC). False means "ask", not "torch"."""
    # is_compiling first: Dynamo cannot trace ContextVar.get, and a graph break in every layer
    # made compiled decode 7x slower (H200: 41.7 against 278.5 tok/s).
    return (device.type == "cuda" and _HAS_TRITON and not torch.compiler.is_compiling() and not _PATH_OVERRIDE.get()
            and not os.environ.get("DORACHECK_PATH"))


def factored_norm_full(weight, lora_A, lora_B, scaling, *, fan_in_fan_out=False, need_factors=False):
    """The factored norm as ``doracheck.kernels.FactoredNorm`` (fp32). ``need_factors``
    asks for U and G too (the exact ``detach_norm=False`` backward)."""
    return backend_for(weight, lora_A, lora_B).factored_norm(weight, lora_A, lora_B, float(scaling), fan_in_fan_out,
                                                             need_factors)


def compose(base, lora, g, scaling, bias=None, base_dropped=None, out=None):
    """The elementwise stable compose of a given lora output (torch; the layer's backends
    fuse it into the up-projection)."""
    from doracheck.kernels import compose_torch
    return compose_torch(base, lora, g, scaling, bias, base_dropped=base_dropped, out=out)
