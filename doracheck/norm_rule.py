"""When doracheck computes a DoRA norm and when it reuses one: the one rule, for every path.

Every DoRA call needs the row norms n = ||W + s·B·A||. ``lookup_or_compute`` decides for every
entry point, and for the model-level refresh ``generate`` and compiled inference read
(``inference_norms``):

1. **A training forward** (autograd records it, outside a backward) computes the norm and
   stores it in the slot of its (layer, adapter). It reads nothing stored before.
2. **Its activation-checkpoint recompute** (a forward inside a backward: autograd's running
   graph task) reuses the stored norm when the stamp matches.
3. **A forward without grad mode** (evaluation, ``generate``, decode, reentrant
   checkpointing's first pass) reuses the stored norm when the stamp matches, until an
   optimizer step (a global post-hook on every ``torch.optim`` optimizer), a backward, or
   ``clear_norm_cache()``. After a backward it neither reads nor stores (and drops the layer's
   slot) until an optimizer step, training forward or ``clear_norm_cache()`` starts a new era:
   parameters may be written by hand meanwhile (``p.data -= lr * p.grad``).

The stamp is what a reused norm was computed from: W, A and B as (object, address, version,
shape, strides, dtype, device), s, ``fan_in_fan_out``, the implementation path and the current
CUDA stream. Version counters do not see in-place writes through ``p.data``: after such a write
outside an optimizer step (hand-editing adapters between two inference calls, a training loop
whose backward torch.compile compiled, which cannot record that it ran, updated by hand), and
after any write made during a forward or a ``generate`` call (``inference_norms`` checks once
before them), call ``clear_norm_cache()``. Never stored: while torch.compile traces (a compiled
graph recomputes, unless it reads an ``inference_norms`` state), under CUDA graph capture, for
inference tensors (no version counter), and once FSDP2 (``fully_shard``) manages modules (it
all-gathers new values into the same tensors, version counters preserved). A slot holds weak
references to W, A and B and is dropped when B is freed: a new tensor at a reused address never
matches.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from doracheck.kernels.tracing import tracing

MAX_ENTRIES = 4096
_lock = threading.RLock()  # re-entrant: the weakref callback may run inside a locked section
_entries: OrderedDict[int, tuple] = OrderedDict()
_stats = {"hits": 0, "misses": 0}

# The training era: a stored norm is read across forwards only within the era it was stored in.
_era = {"number": 0, "backward_seen": False}

_era_listeners: list = []  # called at the end of every era (inference_norms disarms an interrupted forward's layers)


def on_era_end(listener) -> None:
    """Call ``listener()`` whenever an era ends (see ``era``)."""
    _era_listeners.append(listener)


def _end_era() -> None:
    _era["number"] += 1
    _era["backward_seen"] = False
    for listener in _era_listeners:
        listener()


def _on_optimizer_step(_optimizer, _args, _kwargs) -> None:
    _end_era()


_OPTIMIZER_HOOK = register_optimizer_step_post_hook(_on_optimizer_step)


def era() -> int:
    """The current era: it grows at every optimizer step, training forward after a backward,
    and ``clear_norm_cache``."""
    return _era["number"]


def backward_seen() -> bool:
    """Whether a doracheck backward ran in this era (rule 3: no reuse outside a backward)."""
    return bool(_era["backward_seen"])


def note_backward() -> None:
    """Called by every doracheck backward: parameters may be written once it is done (rule 3).
    Not while torch.compile traces (a compiled graph cannot mutate Python state)."""
    if not _compiling():
        _era["backward_seen"] = True


def _compiling() -> bool:
    """Tracing: fake or proxy tensors have no data pointer, and a traced value must not be kept."""
    return tracing()


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (where checkpoint recomputes run)."""
    return torch._C._current_graph_task_id() != -1


def _fingerprint(t: torch.Tensor):
    return (id(t), t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(t: torch.Tensor):
    """The current CUDA stream's handle on ``t``'s device, None off CUDA. Part of the key:
    another stream could read a norm before its kernels finish (threads with a stream each)."""
    if not t.is_cuda:
        return None
    if _RAW_STREAM is not None:
        return _RAW_STREAM(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


def stamp(weight, lora_A, lora_B, scaling, fan_in_fan_out):
    """What a norm is computed from (the module docstring), or None for inference tensors."""
    try:
        return (_fingerprint(weight), _fingerprint(lora_A), _fingerprint(lora_B), float(scaling), bool(fan_in_fan_out),
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
    """True once any module in this process is managed by FSDP2 (``fully_shard``), for good.
    Re-checked only when the composable-API state registry changes (size or newest entry): O(1)."""
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


def lookup_or_compute(weight, lora_A, lora_B, scaling, fan_in_fan_out, compute, *, recording, tag=""):
    """The stored value if the rule allows reusing it, else ``compute()`` (stored). ``recording``:
    autograd records the caller's forward (grad mode is off inside a Function's forward, so the
    caller says). ``tag`` (the implementation path) is part of the key: paths never share."""
    if not _cacheable() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Under CUDA graph capture the norm is part of the graph: a replay recomputes it from the
        # parameters as they are then; a stored tensor would be graph memory that replays overwrite.
        return compute()
    key = stamp(weight, lora_A, lora_B, scaling, fan_in_fan_out)
    if key is None:
        return compute()
    in_backward = _in_backward()
    may_read = in_backward or not recording  # rule 1: a training forward never reads
    if not in_backward and _era["backward_seen"]:
        if recording:
            _end_era()  # a training forward: parameters are what this step will use
        else:
            # Rule 3: no reading, no storing, and the layer's entry is dropped. This may be
            # reentrant checkpointing's first pass, whose recompute must then compute afresh
            # (.data updates between steps would make an older entry stale). Storing this value
            # would be wrong too: an evaluation with swapped weights (an EMA copied in and back
            # through .data) would replace what a pending backward's recompute reads.
            with _lock:
                _entries.pop(id(lora_B), None)
                _stats["misses"] += 1
            return compute()
    era = _era["number"]
    key = (*key, tag, era)
    slot = id(lora_B)
    if may_read:
        with _lock:
            entry = _entries.get(slot)
            if entry is not None:
                refs, entry_key, value = entry
                if (entry_key == key and refs[0]() is weight and refs[1]() is lora_A and refs[2]() is lora_B
                        and not (in_backward and _holds_inference_tensors(value))):
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


def _holds_inference_tensors(value) -> bool:
    """Whether a stored value was formed under ``torch.inference_mode``: a recompute inside a
    backward cannot save such tensors, so it computes afresh (else an inference-mode validation
    before the first step makes reentrant checkpointing's recompute raise)."""
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
    """Drop every stored norm and start a new era (needed only after writes through ``.data``
    that the rule cannot see; the module docstring)."""
    with _lock:
        _entries.clear()
        _end_era()


def norm_cache_stats() -> dict:
    """{"hits", "misses", "entries", "era"} since start (for tests and benchmarks)."""
    with _lock:
        return {**_stats, "entries": len(_entries), "era": _era["number"]}
