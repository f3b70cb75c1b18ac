"""Reuse the DoRA norm while W, A, B and s are unchanged.

The key is the implementation path (torch / triton) and, for each of W, A, B (and the
magnitude, when a caller caches a value that depends on it): the tensor's identity, its data pointer and its version
counter (bumped by every in-place write through the tensor or a view of it, including
optimizer steps under no_grad), plus s, the layout flag, shapes, dtypes and device. An
entry also holds weak references to the three tensors and is dropped when B is freed, so a
new tensor that happens to reuse an address never matches.

This covers inference calls, gradient-accumulation micro-steps and activation-checkpoint
recomputation. Not covered (so not cached): tensors without a version counter (inference
tensors), torch.compile tracing (the cache is Python state; compiled graphs recompute), and
any process where PyTorch FSDP2 (``fully_shard``) manages modules: FSDP2 all-gathers new
values into the same unsharded parameter tensors while preserving their version counters
(``torch.autograd._unsafe_preserve_version_counter`` in its copy-out), so after an optimizer
step W, A and B would look unchanged. There the norm is computed in every forward, on the
unsharded parameters.
One hole cannot be closed cheaply: writes through ``param.data`` bypass the version counter;
call ``clear_norm_cache()`` after such writes.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

MAX_ENTRIES = 4096
_lock = threading.RLock()  # re-entrant: the weakref callback may run inside a locked section
_entries: OrderedDict[int, tuple] = OrderedDict()
_stats = {"hits": 0, "misses": 0}


def _fingerprint(t: torch.Tensor):
    return (id(t), t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device)


def _key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude):
    try:
        mag = _fingerprint(magnitude) if magnitude is not None else None
        return (_fingerprint(weight), _fingerprint(lora_A), _fingerprint(lora_B), mag, float(scaling), bool(fan_in_fan_out))
    except RuntimeError:  # inference tensors have no version counter
        return None


_fsdp_seen: dict[str, object] = {"fingerprint": None, "active": False}


def _fsdp_state_class():
    """FSDP2's state class (its module moved in torch 2.6), or None where there is none."""
    for name in ("torch.distributed.fsdp._fully_shard._fsdp_state", "torch.distributed._composable.fsdp._fsdp_state"):
        try:
            module = __import__(name, fromlist=["FSDPState"])
        except ImportError:
            continue
        cls = getattr(module, "FSDPState", None)
        if cls is not None:
            return cls
    return None


_STATE_MAPPING: list = []


def _state_mapping():
    """torch.distributed's registry of composable-API module states (imported once), or None."""
    if not _STATE_MAPPING:
        try:
            from torch.distributed._composable_state import _module_state_mapping
        except ImportError:
            _module_state_mapping = None
        _STATE_MAPPING.append(_module_state_mapping)
    return _STATE_MAPPING[0]


def fsdp_active() -> bool:
    """True once any module in this process is managed by FSDP2 (``fully_shard``); it stays
    True. Re-checked only when the registry of composable-API states changes (its size or its
    newest entry), which is O(1) in every forward."""
    if _fsdp_seen["active"]:
        return True
    _module_state_mapping = _state_mapping()
    if _module_state_mapping is None:  # a build without torch.distributed
        return False
    data = getattr(_module_state_mapping, "data", None)  # the WeakKeyDictionary's dict, insertion-ordered
    newest = next(reversed(data), None) if data else None
    fingerprint = (len(_module_state_mapping), id(newest))
    if fingerprint != _fsdp_seen["fingerprint"]:
        _fsdp_seen["fingerprint"] = fingerprint
        cls = _fsdp_state_class()
        if cls is not None:
            states = [s() if isinstance(s, weakref.ref) else s for s in list(_module_state_mapping.values())]
            _fsdp_seen["active"] = any(isinstance(st, cls) for st in states)
    return bool(_fsdp_seen["active"])


def _cacheable() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return False
    return not fsdp_active()


def lookup_or_compute(weight, lora_A, lora_B, scaling, fan_in_fan_out, compute, *, magnitude=None, tag=""):
    """Return the cached value for these tensors' current contents, or ``compute()`` and cache
    it. With ``magnitude`` the value may depend on it too (its version is part of the key);
    ``tag`` (the implementation path) is part of the key, so paths never share entries."""
    if not _cacheable():
        return compute()
    key = _key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude)
    key = None if key is None else (*key, tag)
    if key is None:
        return compute()
    slot = id(lora_B)
    with _lock:
        entry = _entries.get(slot)
        if entry is not None:
            refs, entry_key, value = entry
            if entry_key == key and refs[0]() is weight and refs[1]() is lora_A and refs[2]() is lora_B:
                _entries.move_to_end(slot)
                _stats["hits"] += 1
                return value
    value = compute()
    refs = (weakref.ref(weight), weakref.ref(lora_A), weakref.ref(lora_B, lambda _r, s=slot: _forget(s)))
    with _lock:
        _stats["misses"] += 1
        _entries[slot] = (refs, key, value)
        _entries.move_to_end(slot)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)
    return value


def _forget(slot: int) -> None:
    with _lock:
        _entries.pop(slot, None)


def clear_norm_cache() -> None:
    """Drop every cached norm (needed only after writes through ``.data``)."""
    with _lock:
        _entries.clear()


def norm_cache_stats() -> dict:
    """{"hits", "misses", "entries"} since start (for tests and benchmarks)."""
    with _lock:
        return {**_stats, "entries": len(_entries)}
