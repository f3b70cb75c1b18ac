"""Whether torch.compile / export is tracing right now (no triton import: usable anywhere)."""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode


def _mode_keys():
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    return None if keys is None else tuple(getattr(keys, k) for k in ("FAKE", "PROXY", "FUNCTIONAL") if hasattr(keys, k))


_get_dispatch_mode = getattr(torch._C, "_get_dispatch_mode", None)
_MODE_KEYS = _mode_keys() if _get_dispatch_mode is not None else None


def tracing() -> bool:
    """True while torch.compile / export traces (fake, proxy or functional tensors): kernels
    must go through ``wrap_triton`` then, and nothing traced may be kept in Python caches. In
    eager Triton kernels are launched directly: ``wrap_triton`` costs about 190 µs of CPU per
    launch in eager (H200 host, torch 2.11).

    The mode check reads the dispatch-mode slots directly: ``detect_fake_mode`` cost 16 µs a
    call on the H200 host, four calls a step."""
    if torch.compiler.is_compiling():
        return True
    if _MODE_KEYS is not None and _get_dispatch_mode is not None:
        for key in _MODE_KEYS:  # a loop, not any() over a generator: this runs several times a call
            if _get_dispatch_mode(key) is not None:
                return True
        return False
    return detect_fake_mode() is not None
