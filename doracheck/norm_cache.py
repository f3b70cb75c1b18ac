"""When a computed DoRA norm may be used again: the one rule, in ``lookup_or_compute``.

A norm n = ||W + s·B·A|| (rows) depends on W, A, B and s. Version counters do not see every
write to them: fused optimizers (``torch.optim.AdamW(fused=True)``, transformers' Trainer
default) and writes through ``p.data`` leave ``_version`` unchanged. So a version match alone
never licenses reuse. The rule, by the kind of forward asking:

1. **A training forward** (grad mode, outside any backward) computes the norm and stores it
   for its own activation-checkpoint recompute, with one exception: the value refreshed right
   after the optimizer step that started this era (below). It reads nothing else stored before.
2. **A recompute inside a backward** (checkpointing, reentrant or not: detected by autograd's
   running graph task): reads the norm its forward stored. Nothing can legitimately write
   the parameters between a forward and its backward.
3. **A forward without grad mode** (evaluation, generation, reentrant checkpointing's first
   pass) reads a stored norm only if, since it was stored, no training has happened:
   - no ``torch.optim`` optimizer has stepped (a global step post-hook; fused, foreach and
     for-loop optimizers alike, and every ``torch.optim.Optimizer`` subclass);
   - no doracheck backward has run: once one has, parameters may be written by hand at any
     time (a tutorial ``p.data -= lr*p.grad``), so until the next optimizer step or training
     forward starts a new era, a forward without grad mode neither reads nor stores, and it
     drops the layer's stored value: it may be the first pass of reentrant checkpointing,
     whose recompute must then compute afresh rather than read an earlier step's value;
   - the tensors are the same objects, at the same address, with the same version counter,
     s, layout, shape, dtype and device (in-place writes under ``no_grad``, ``load_state_dict``),
     and the current CUDA stream is the one the norm was computed on (another stream could read
     it before its kernels finish).

**The refresh after an optimizer step.** The norm changes exactly when the optimizer steps, so
a ``torch.optim`` step post-hook recomputes, right after the step, the norm and g of every layer
a training forward used since its last refresh, if the step holds one of its W, A, B or m
(``refresh_after_step``), and stores them for the new era. The next training forward of the
layer reads that value (once: a second one in the same era computes) if its tensors still
match it (same objects, addresses, version counters, s, layout, stream). Why: the step sits
where the host is ahead of the GPU (the backward's long GEMMs are still running), while a
training forward sits after the model's own host syncs, where host work leaves the GPU idle
(issue 17: the step's forward is host-bound). The refresh computes what the forward would (the
same backend op, the same numerics), so its value is bitwise the forward's own. Gradient-
accumulation micro-steps after the first compute their own (a training forward after a backward
starts an era). ``DORACHECK_NORM_REFRESH=0`` in the environment turns the refresh off.

So training pays one norm per optimizer step (per micro-step with gradient accumulation), moved
out of the forward by the refresh, and none per checkpoint recompute; inference and decode pay
one norm until the model is trained or written. Writes nothing can see: ``param.data`` (or
``set_``) between two forwards with no backward and no optimizer step between them
(hand-editing adapters between inference calls), ``param.data`` writes between an optimizer
step and the next forward (a projection or clamp through ``.data`` after ``optimizer.step()``;
the same in place under ``torch.no_grad()`` is seen), and ``param.data`` updates in a loop whose
backward torch.compile compiled (a compiled backward cannot record that it ran; a
``torch.optim`` step still ends the era). Call ``clear_norm_cache()`` after them. Not cached at all: tensors without a version
counter (inference tensors), torch.compile tracing (a compiled graph recomputes), and
processes where FSDP2 (``fully_shard``) manages modules, since FSDP2 all-gathers new values
into the same unsharded tensors with their version counters preserved.

Entries hold weak references to W, A, B and are dropped when B is freed, so a new tensor
that reuses an address never matches.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from doracheck.kernels.tracing import tracing
from doracheck.numerics import our_numerics

MAX_ENTRIES = 4096
_lock = threading.RLock()  # re-entrant: the weakref callback may run inside a locked section
# slot (id of lora_B) -> (weak refs to W, A, B; key; value; recipe or None; refreshed). recipe =
# (refresh function, its settings, weak ref to m), kept by training forwards; refreshed: stored by the refresh
# after an optimizer step and not yet read by a training forward (which may read it, once).
_entries: OrderedDict[int, tuple] = OrderedDict()
_stats = {"hits": 0, "misses": 0, "refreshed": 0}
_REFRESH = {"on": os.environ.get("DORACHECK_NORM_REFRESH", "1") != "0"}

# The training era: a stored norm is read across forwards only within the era it was stored in.
_era = {"number": 0, "backward_seen": False}


_era_listeners: list = []  # called at the end of every era (inference_norms disarms its layers)


def on_era_end(listener) -> None:
    """Call ``listener()`` whenever an era ends (optimizer step, training forward after a
    backward, ``clear_norm_cache``)."""
    _era_listeners.append(listener)


def _end_era() -> None:
    _era["number"] += 1
    _era["backward_seen"] = False
    for listener in _era_listeners:
        listener()


def _on_optimizer_step(optimizer, _args, _kwargs) -> None:
    _end_era()
    refresh_after_step(optimizer)


_OPTIMIZER_HOOK = register_optimizer_step_post_hook(_on_optimizer_step)


def era() -> int:
    """The number of the current training era (it grows at every optimizer step, training
    forward after a backward, and ``clear_norm_cache``)."""
    return _era["number"]


def backward_seen() -> bool:
    """Whether a doracheck backward ran in this era (then no forward outside a backward may
    reuse a norm: rule 3)."""
    return bool(_era["backward_seen"])


def note_backward() -> None:
    """Called by every doracheck backward: parameters may be written once it is done, so no
    norm is reused outside a backward until an optimizer step or a training forward starts a
    new era. Not while torch.compile traces (a
    compiled graph cannot mutate Python state; compiled forwards store nothing either)."""
    if not _compiling():
        _era["backward_seen"] = True


def _compiling() -> bool:
    """torch.compile, export or make_fx tracing (fake, proxy or functional tensors have no data
    pointer to fingerprint, and a traced value must not be kept for eager calls)."""
    return tracing()


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (where checkpoint recomputes run)."""
    return torch._C._current_graph_task_id() != -1


def _fingerprint(t: torch.Tensor):
    return (id(t), t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(t: torch.Tensor):
    """The current CUDA stream on ``t``'s device (its handle), None for other tensors. Part of
    the key: a norm computed on one stream is read only on that stream, since another stream
    could read it before its kernels finish (threads serving with a stream each)."""
    if not t.is_cuda:
        return None
    if _RAW_STREAM is not None:
        return _RAW_STREAM(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


def _key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude):
    try:
        mag = _fingerprint(magnitude) if magnitude is not None else None
        return (_fingerprint(weight), _fingerprint(lora_A), _fingerprint(lora_B), mag, float(scaling), bool(fan_in_fan_out),
                _stream_of(weight))
    except RuntimeError:  # inference tensors have no version counter
        return None


_fsdp_seen: dict[str, Any] = {"fingerprint": None, "active": False}


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
    # The newest key (a weak reference) is kept itself, not its id: a module registered after
    # another died may get the dead one's address, and then its id (seen in a full test run).
    seen = _fsdp_seen["fingerprint"]
    if seen is None or seen[0] != len(_module_state_mapping) or seen[1] is not newest:
        _fsdp_seen["fingerprint"] = (len(_module_state_mapping), newest)
        cls = _fsdp_state_class()
        if cls is not None:
            states = [s() if isinstance(s, weakref.ref) else s for s in list(_module_state_mapping.values())]
            _fsdp_seen["active"] = any(isinstance(st, cls) for st in states)
    return bool(_fsdp_seen["active"])


def _cacheable() -> bool:
    return not _compiling() and not fsdp_active()


def lookup_or_compute(weight, lora_A, lora_B, scaling, fan_in_fan_out, compute, *, recording, magnitude=None, tag="",
                      refresh=None):
    """The stored value for these tensors if the module rule allows reusing it, else
    ``compute()`` (stored for later). ``recording``: the caller's forward is recorded by
    autograd (a training forward; inside an autograd Function's forward grad mode is off, so
    the caller says). With ``magnitude`` the value may depend on it too (its version is part
    of the key); ``tag`` (the implementation path) is part of the key, so paths never share
    entries. ``refresh = (function, settings)``: ``function([(settings, weight, lora_A, lora_B,
    magnitude), ...])`` returns for each layer what its ``compute()`` would (``settings`` holds no
    tensor); a training forward that passes it lets ``refresh_after_step`` recompute its value,
    with other layers' in the same call, after the next optimizer step."""
    if not _cacheable() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Under CUDA graph capture the norm is part of the graph: a replay recomputes it from the
        # parameters as they are then; a stored tensor would be graph memory that replays overwrite.
        return compute()
    key = _key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude)
    if key is None:
        return compute()
    in_backward = _in_backward()
    may_read = in_backward or not recording  # rule 1: a training forward reads only a refreshed value
    if not in_backward and _era["backward_seen"]:
        if recording:
            _end_era()  # a training forward: parameters are what this step will use
        else:
            # Between a backward and the next step anything may write (rule 3): no reading, no
            # storing, and the layer's stored entry is dropped. This forward may be the first
            # pass of reentrant checkpointing: its recompute inside the backward must then
            # compute afresh, not find an earlier step's value (found in review: parameters
            # updated through .data between steps gave stale norms and g to the recompute).
            # Storing this forward's value instead was wrong too: an evaluation with swapped
            # weights (an EMA copied in and back through .data) before a pending backward would
            # have replaced the value that backward's recompute reads.
            with _lock:
                _entries.pop(id(lora_B), None)
                _stats["misses"] += 1
            return compute()
    era = _era["number"]
    key = (*key, tag, era)
    slot = id(lora_B)
    with _lock:
        entry = _entries.get(slot)
        if entry is not None:
            refs, entry_key, value, recipe, refreshed = entry
            if ((may_read or refreshed) and entry_key == key and refs[0]() is weight and refs[1]() is lora_A
                    and refs[2]() is lora_B and not (in_backward and _holds_inference_tensors(value))):
                if refreshed and not may_read:  # a training forward used it: the next step refreshes it again
                    _entries[slot] = (refs, entry_key, value, recipe, False)
                _entries.move_to_end(slot)
                _stats["hits"] += 1
                return value
    value = compute()
    refs = (weakref.ref(weight), weakref.ref(lora_A), weakref.ref(lora_B, lambda _r, s=slot: _forget(s)))
    recipe = None
    if refresh is not None and recording and not in_backward and magnitude is not None:
        recipe = (refresh[0], refresh[1], weakref.ref(magnitude))
    _store(slot, refs, key, value, recipe, False)
    return value


def _store(slot: int, refs: tuple, key: tuple, value, recipe, refreshed: bool) -> None:
    with _lock:
        if not refreshed:
            _stats["misses"] += 1
        _entries[slot] = (refs, key, value, recipe, refreshed)
        _entries.move_to_end(slot)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)


def refresh_after_step(optimizer) -> int:
    """Recompute, for the new era, the stored value of every layer a training forward used since
    its last refresh and whose W, A, B or m ``optimizer`` holds (rule 1's exception, in the
    module docstring), all of them in one call of their ``refresh`` function (the Triton
    backend replays one CUDA graph for all). Runs in the optimizer-step post-hook, after
    ``_end_era``; returns how many values it stored. Nothing while torch.compile traces, under
    FSDP2, while the current stream is being captured into a CUDA graph, or with
    ``DORACHECK_NORM_REFRESH=0``."""
    if not _REFRESH["on"] or not _cacheable():
        return 0
    with _lock:  # used by a training forward since its last refresh (a layer no longer trained is refreshed once)
        candidates = [(slot, entry) for slot, entry in _entries.items() if entry[3] is not None and not entry[4]]
    if not candidates:
        return 0
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    groups: dict[tuple, list] = {}
    for slot, (refs, old_key, _value, (refresh, settings, magnitude_ref), _refreshed) in candidates:
        weight, lora_A, lora_B = (ref() for ref in refs)
        magnitude = magnitude_ref()
        if weight is None or lora_A is None or lora_B is None or magnitude is None:
            continue
        if not any(id(t) in held for t in (lora_A, lora_B, magnitude, weight)):
            continue  # another optimizer's step refreshes it
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return 0  # the step is being captured: a stored value would be graph memory
        scaling, fan_in_fan_out, tag = old_key[4], old_key[5], old_key[7]
        key = _key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude)
        if key is not None:
            groups.setdefault((refresh, weight.device.type), []).append(
                (slot, refs, (*key, tag), (settings, weight, lora_A, lora_B, magnitude)))
    done = 0
    for (refresh, device_type), items in groups.items():
        with torch.no_grad(), our_numerics(device_type):
            values = refresh([item[3] for item in items])
        for (slot, refs, key, layer), value in zip(items, values):
            _store(slot, refs, (*key, _era["number"]), value, (refresh, layer[0], weakref.ref(layer[4])), True)
        done += len(items)
    with _lock:
        _stats["refreshed"] += done
    return done


def _holds_inference_tensors(value) -> bool:
    """Whether a stored value was formed under ``torch.inference_mode`` (an evaluation run
    there): a recompute inside a backward cannot save such tensors for its own backward, so it
    computes afresh (found in review: an inference-mode validation before the first training
    step made reentrant checkpointing's recompute raise)."""
    parts = value if isinstance(value, tuple) else (value,)
    for part in parts:
        for t in part if isinstance(part, tuple) else (part,):
            if isinstance(t, torch.Tensor) and t.is_inference():
                return True
    return False


def _forget(slot: int) -> None:
    with _lock:
        _entries.pop(slot, None)


def clear_norm_cache() -> None:
    """Drop every stored norm and start a new era: the parameters as they are now are the
    truth (needed only after writes through ``.data`` that the rule cannot see; see the
    module docstring)."""
    with _lock:
        _entries.clear()
        _end_era()


def norm_cache_stats() -> dict:
    """{"hits", "misses", "refreshed", "entries", "era"} since start (for tests and benchmarks);
    "refreshed": values stored by ``refresh_after_step``."""
    with _lock:
        return {**_stats, "entries": len(_entries), "era": _era["number"]}
