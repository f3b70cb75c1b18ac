"""The one place that decides which implementation runs a call (torch or Triton).

Callers ask ``choose_path(tensor)``; ``describe_path`` says why, for ``doracheck env``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import NamedTuple

import torch


class PathChoice(NamedTuple):
    name: str  # "torch" or "triton"
    reason: str


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    """``fn`` wrapped so that each call runs under ``use_path(name)`` (forward and the
    autograd backward it records both decide at call time, inside the block)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with use_path(name):
            return fn(*args, **kwargs)

    return wrapper


def choose_path(device: torch.device) -> PathChoice:
    """Decide the implementation for tensors on ``device``.

    This version ships the torch path only; the Triton kernels plug in here when they land
    (issue 3), so the decision and its reason stay in one function.
    """
    forced = _forced_path()
    if forced not in (None, "torch", "auto"):
        return PathChoice("torch", f"DORACHECK_PATH={forced} asked for, but this version has only the torch path")
    if device.type != "cuda":
        return PathChoice("torch", f"tensors on {device.type}: the torch path")
    return PathChoice("torch", "CUDA tensors: the torch path (Triton kernels are not in this version)")


def describe_path(device: torch.device | str) -> PathChoice:
    return choose_path(torch.device(device))


# --- routing: each op asks choose_path once per call --------------------------------------


def factored_norm_full(weight, lora_A, lora_B, scaling, *, fan_in_fan_out=False):
    """Factored norm with its factors (U, G): ``doracheck.kernels.FactoredNorm``."""
    from doracheck.kernels import factored_norm_torch

    return factored_norm_torch(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)


def compose(base, lora, g, scaling, bias=None, base_dropped=None, out=None):
    from doracheck.kernels import compose_torch

    return compose_torch(base, lora, g, scaling, bias, base_dropped=base_dropped, out=out)


def scaled_grad_and_dm_sum(dy, z, g):
    from doracheck.kernels import scaled_grad_and_dm_sum_torch

    return scaled_grad_and_dm_sum_torch(dy, z, g)
