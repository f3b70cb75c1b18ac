"""Norms as module state for inference and decode, eager and compiled.

Under torch.compile a Python-side cache is not consulted (docs/design.md section 6): a compiled
decode step recomputed every layer's norm for every token (per layer a d_out×d_in×r GEMM, as
much work as r tokens of the layer itself; measured: compiled decode at 0.30x compiled PEFT
LoRA's tokens/s). Here the norm becomes module state that the model refreshes:

- ``attach(layers, entry_points)`` (``integrations.peft.enable``) gives every accelerated
  (module, adapter) a ``NormSlot``: max(n, eps) in fp32 as a non-persistent buffer of the module
  (not in ``state_dict``; a static input to CUDA graphs), and hooks the entry points: the PEFT
  model (outer) and the base model its ``generate`` calls (inner), sharing one ``_Holder``.
- Before a forward of an entry point, ``_prepare`` decides: without grad mode (evaluation,
  generation) it brings every buffer up to date and *arms* those layers (a flag on each layer
  module); otherwise it disarms them. The post-hook of the entry point that prepared disarms
  them again (Python's ``KeyboardInterrupt`` skips it: then the next eager call of either
  entry point, or the next era end, does). Traced inside the outer model's compiled body, the
  inner hook does nothing when the outer one already prepared this forward.
- ``_prepare`` and ``_finish`` are ``torch.compiler.disable``d and are called only where they
  must run. When the base model's ``__call__`` alone is compiled (transformers does that for a
  static cache in ``generate``) its traced hooks break the graph before and after the body and
  run them eagerly, so the compiled decode step reads the buffers. When the outer model is
  traced (``torch.compile(peft_model)``, with ``fullgraph=True`` too) no hook breaks the graph
  and nothing is armed: that graph computes the norms itself.
- An armed layer reads max(n, eps) from its buffer instead of computing the norm (eager: no
  per-layer cache lookup; compiled: the graph reads the buffer). Dynamo guards on the flag, so
  a graph that reads buffers runs only for layers their own model prepared; a layer called any
  other way (a submodule on its own, inside another model's forward, a training forward)
  computes its norm.

When a buffer is refreshed is the norm-reuse rule of ``norm_cache`` for forwards without grad
mode, checked per slot in a few attribute reads: recomputed when W, A or B is another tensor,
at another address, of another shape or at another version, when s changes, and after every
optimizer step or training forward (a new era); nothing is armed while a backward may have been
followed by writes nothing sees (the era's ``backward_seen``) or under FSDP2, and a slot whose
tensors are not the layer's 2-D matrices (FSDP1 or ZeRO-3 shards outside their unit's forward)
leaves its layer unarmed. The one write nothing can see is the eager rule's too: ``param.data``
edits between two inference calls with no backward or optimizer step between them (or after a
backward that torch.compile compiled, which cannot record that it ran); call
``doracheck.clear_norm_cache()`` after those (it ends the era: every buffer is refreshed).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn

from . import dispatch, norm_cache
from .forward import norm_with_floor
from .kernels.tracing import tracing
from .numerics import our_numerics

_NAMES = "_doracheck_norm_buffers"  # on each layer module: {adapter: buffer name}
_ARMED = "_doracheck_norms_armed"  # on each layer module: bool, read by the layer
_HOOKS = "_doracheck_norm_hooks"
_HOLDER = "_doracheck_norm_holder"  # on each entry point: the _Holder of its model
_ROLE = "_doracheck_norm_role"  # on each entry point: "outer" or "inner"
_GENERATE = "_doracheck_user_generate"  # on each entry point: a ``generate`` the instance had before ``attach``
_WRAPPED = "_doracheck_generate_wrapped"  # on each entry point whose ``generate`` is ``_generate``


def _find_holders(module: nn.Module, adapter: str) -> tuple | None:
    """Weak references to (the chain base_layer -> ... -> the base layer below ``module``,
    lora_A[adapter], lora_B[adapter]), or None when the adapter is gone. The chain follows
    registered ``base_layer`` submodules (PEFT's ``get_base_layer`` follows any attribute of
    that name; a tuner layer registers it as a submodule). Weak, so that a replaced base layer
    and its W are freed at once, not kept until the next forward without grad mode."""
    chain: list[Any] = []
    below: Any = module
    while "base_layer" in below._modules:
        below = below._modules["base_layer"]
        chain.append(weakref.ref(below))
    lora_A, lora_B = module._modules.get("lora_A"), module._modules.get("lora_B")
    if lora_A is None or lora_B is None:
        return None
    A_mod, B_mod = lora_A._modules.get(adapter), lora_B._modules.get(adapter)
    if A_mod is None or B_mod is None:
        return None
    return tuple(chain), weakref.ref(A_mod), weakref.ref(B_mod)


def _still_held(module: nn.Module, adapter: str, holders: tuple) -> tuple | None:
    """(base layer, lora_A module, lora_B module) when the modules ``_find_holders`` saw are
    still where ``module`` keeps them, else None (a replaced base layer, lora_A or lora_B, or a
    wrapper added below, is seen)."""
    chain, A_ref, B_ref = holders
    outer: Any = module
    for ref in chain:
        inner = ref()
        if inner is None or outer._modules.get("base_layer") is not inner:
            return None
        outer = inner
    if "base_layer" in outer._modules:
        return None
    A_mod, B_mod = A_ref(), B_ref()
    lora_A, lora_B = module._modules.get("lora_A"), module._modules.get("lora_B")
    if (A_mod is None or B_mod is None or lora_A is None or lora_B is None or lora_A._modules.get(adapter) is not A_mod
            or lora_B._modules.get(adapter) is not B_mod):
        return None
    return outer, A_mod, B_mod


class NormSlot:
    """max(n, eps) of one (module, adapter) as a buffer of the module, and what it was computed from."""

    def __init__(self, module: nn.Module, adapter: str, name: str):
        self.module, self.adapter, self.name = module, adapter, name
        self.stamp: tuple | None = None
        self._holders: tuple | None = None  # weak references: (base-layer chain, lora_A module, lora_B module) last seen

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of a whole model) without the weak references, which cannot
        be pickled, and without the stamp, whose ids and addresses mean nothing elsewhere: the
        loaded slot finds its modules and refreshes its buffer on first use."""
        return {**self.__dict__, "stamp": None, "_holders": None}

    def _tensors(self):
        """(W, A, B) as the module holds them now, or None once the adapter is gone.

        Called for every slot before every forward without grad mode (each decode token), so
        the modules that hold W, A and B are remembered and only checked to still be where the
        layer keeps them: a few dict lookups instead of PEFT's ``get_base_layer()`` and
        ``Module.__getattr__``. With ``refresh`` comparing its stamp before any other check, the
        check of 28 layers went from 170 to 62 µs per forward on a 2-core AMD EPYC
        (benchmarks/prepare_cost.py)."""
        held = None if self._holders is None else _still_held(self.module, self.adapter, self._holders)
        if held is None:
            self._holders = _find_holders(self.module, self.adapter)
            if self._holders is None:  # delete_adapter: nothing reads this slot any more
                return None
            held = _still_held(self.module, self.adapter, self._holders)
            if held is None:  # cannot happen right after _find_holders; never trust a half-built chain
                return None
        base, lora_A, lora_B = held
        try:
            return base._parameters["weight"], lora_A._parameters["weight"], lora_B._parameters["weight"]
        except KeyError:
            return None

    def refresh(self, era: int) -> bool:
        """Bring the buffer up to date (recomputed unless W, A, B (object, address, shape,
        version), s, the era and the buffer itself are those it was computed from). False when
        the adapter is gone or the tensors are not the layer's matrices (sharded)."""
        tensors = self._tensors()
        if tensors is None:
            return False
        W, A, B = tensors
        if W.dim() != 2 or A.dim() != 2 or B.dim() != 2:
            return False
        module = self.module
        fan_in_fan_out = bool(getattr(module, "fan_in_fan_out", False))
        scaling: dict = getattr(module, "scaling")  # noqa: B009 (PEFT's per-adapter dict; typed for mypy)
        s = float(scaling[self.adapter])
        buffer = module._buffers.get(self.name)
        # Compared first: this runs for every layer before every decode token, and the checks
        # below only need to run when something changed.
        try:
            stamp = (era, s, fan_in_fan_out, id(W), id(A), id(B), W.data_ptr(), A.data_ptr(), B.data_ptr(), W._version,
                     A._version, B._version, W.shape, A.shape, B.shape, W.dtype, A.dtype, B.dtype, W.device, id(buffer),
                     None if buffer is None else buffer.dtype)
        except RuntimeError:  # inference tensors have no version counter: the layer computes its own norm
            return False
        if stamp == self.stamp:
            return True
        if W.is_meta or A.is_meta or B.is_meta:
            # Offloaded (accelerate's device_map to "cpu"/"disk", cpu_offload): the weights are
            # meta tensors until the layer's own hook loads them inside the forward; the layer
            # then computes its norm itself.
            return False
        d_out, d_in = (W.shape[1], W.shape[0]) if fan_in_fan_out else (W.shape[0], W.shape[1])
        if A.shape[1] != d_in or tuple(B.shape) != (d_out, A.shape[0]):
            return False
        with our_numerics(W.device.type):
            _, n_safe = norm_with_floor(dispatch.backend_for(W, A, B), W, A, B, s, fan_in_fan_out)
        if buffer is None or buffer.shape != n_safe.shape or buffer.dtype != n_safe.dtype or buffer.device != n_safe.device:
            # First use, or moved / cast by .to(). Made outside inference mode, so that a buffer
            # first filled under torch.inference_mode() can still be rewritten under no_grad.
            with torch.inference_mode(False):
                buffer = torch.empty(n_safe.shape, dtype=n_safe.dtype, device=n_safe.device)
            self.module.register_buffer(self.name, buffer, persistent=False)
        buffer.copy_(n_safe)
        self.stamp = (*stamp[:-2], id(buffer), buffer.dtype)
        return True


def norm_buffer(module: nn.Module, adapter: str) -> torch.Tensor | None:
    """The armed max(n, eps) buffer of (module, adapter), or None (not armed, or no slot)."""
    if not getattr(module, _ARMED, False):
        return None
    names = getattr(module, _NAMES, None)
    name = None if names is None else names.get(adapter)
    return None if name is None else module._buffers.get(name)


class _Holder:
    """What the entry points of one model share: its slots, and whether a forward of it is
    prepared (read, and guarded on, by traced inner hooks)."""

    def __init__(self, slots: list[NormSlot]):
        self.slots = slots
        self.prepared = False
        self.owner: nn.Module | None = None  # the entry point whose forward prepared
        self.outer_traced = False  # set while torch.compile traces the outer model's forward
        self.generations = 0  # ``generate`` calls of this model under way (nested or in threads)
        self.generating = False  # generations > 0; a bool, so a traced hook's guard has two values
        self.generating_threads: dict[int, int] = {}  # thread id -> its generate calls under way

    def __getstate__(self) -> dict:
        """Pickled (or deep-copied) as not running anything: a copy made during a ``generate``
        call or a forward must prepare its own."""
        return {**self.__dict__, "prepared": False, "owner": None, "outer_traced": False, "generations": 0,
                "generating": False, "generating_threads": {}}


_lock = threading.RLock()
_holders: weakref.WeakSet = weakref.WeakSet()


def _arm(slots: list[NormSlot], value: bool) -> None:
    for slot in slots:
        slot.module.__dict__[_ARMED] = value


@torch.compiler.disable
def _prepare(model: nn.Module, holder: _Holder) -> None:
    with _lock:
        holder.prepared, holder.owner = True, model
        if torch.is_grad_enabled() or tracing() or norm_cache.backward_seen() or norm_cache.fsdp_active():
            _arm(holder.slots, False)
            return
        era = norm_cache.era()
        for slot in holder.slots:
            slot.module.__dict__[_ARMED] = False
            if slot.refresh(era):
                slot.module.__dict__[_ARMED] = True
        for slot in holder.slots:  # a module with one slot that could not be refreshed stays unarmed
            if slot.stamp is None or slot.stamp[0] != era:
                slot.module.__dict__[_ARMED] = False


@torch.compiler.disable
def _finish(holder: _Holder) -> None:
    with _lock:
        _arm(holder.slots, False)
        holder.prepared, holder.owner = False, None


def _generating_here(holder: _Holder) -> bool:
    """Whether this forward runs inside one of the model's ``generate`` calls: then it was
    prepared once for the whole call. Eager: this thread's own call only (another thread's
    forward decides for itself, so it sees writes made meanwhile). Traced: the bool (Dynamo
    guards on it; it cannot trace thread ids), so a compiled forward traced by another thread
    during a generate call is prepared by that call, not by itself."""
    return holder.generating and (torch.compiler.is_compiling() or threading.get_ident() in holder.generating_threads)


def _before(model: nn.Module, args) -> None:
    holder = model.__dict__.get(_HOLDER)
    if holder is None or _generating_here(holder):  # inside generate: prepared once for the whole call
        return
    if torch.compiler.is_compiling():
        # Traced. The outer model traced (torch.compile(peft_model), fullgraph or not): no
        # graph break anywhere, nothing armed, the graph computes the norms. The inner model
        # traced on its own (transformers compiles its __call__ for a static cache): a graph
        # break, and _prepare runs eagerly before the compiled body.
        # (Not skipped when an earlier forward was left prepared, by Ctrl-C: decided again.)
        if model.__dict__.get(_ROLE) == "outer":
            holder.outer_traced = True
            return
        if holder.outer_traced:
            return
    _prepare(model, holder)  # eager: decided again at every call (cheap when nothing changed)


def _after(model: nn.Module, args, output) -> None:
    holder = model.__dict__.get(_HOLDER)
    if holder is None or _generating_here(holder):
        return
    if torch.compiler.is_compiling() and model.__dict__.get(_ROLE) == "outer":
        holder.outer_traced = False
        return
    if holder.owner is model:
        _finish(holder)


@torch.compiler.disable
def _begin_generation(model: nn.Module, holder: _Holder) -> None:
    """The first ``generate`` call under way prepares (as a forward without grad mode would:
    generate runs its forwards under no_grad) and holds the layers armed until the last one ends."""
    with _lock:
        if holder.generations == 0:
            with torch.no_grad():
                _prepare(model, holder)
        thread = threading.get_ident()
        holder.generating_threads[thread] = holder.generating_threads.get(thread, 0) + 1
        holder.generations += 1
        holder.generating = True


@torch.compiler.disable
def _end_generation(holder: _Holder) -> None:
    with _lock:
        thread = threading.get_ident()
        left = holder.generating_threads.get(thread, 0) - 1
        if left > 0:
            holder.generating_threads[thread] = left
        else:
            holder.generating_threads.pop(thread, None)
        holder.generations -= 1
        holder.generating = holder.generations > 0
        if not holder.generating:
            _finish(holder)


def _generate(self: nn.Module, *args, **kwargs):
    """``generate`` of an entry point, prepared once for the whole call (``attach`` puts this,
    bound to the entry point, in the instance's ``__dict__``, so it is found before the class's
    ``generate``).

    Per forward, the check costs host time between two graph breaks when transformers compiles
    the base model's ``__call__`` for a static cache (its hooks break the graph), once per
    decode token: on the H200 host of 2026-12-01 that held compiled decode at 0.77x compiled
    PEFT LoRA's tokens/s while the kernels took 5% longer than LoRA's. Within one ``generate``
    call nothing trains and no forward with grad mode runs, so the buffers checked at its start
    stay valid: the hooks do nothing until it returns, and the compiled decode step has no
    graph break. A write to the adapters from inside the call (a streamer or logits processor
    that edits weights) is not seen unless it ends the era (``doracheck.clear_norm_cache()``:
    the layers are then disarmed and compute their own norms). Forwards of other threads
    meanwhile prepare for themselves (eager ones; see ``_generating_here``)."""
    holder = self.__dict__.get(_HOLDER)
    original = self.__dict__.get(_GENERATE)
    generate = original if original is not None else type(self).generate.__get__(self)  # type: ignore[attr-defined]
    if holder is None:
        return generate(*args, **kwargs)
    _begin_generation(self, holder)
    try:
        return generate(*args, **kwargs)
    finally:
        _end_generation(holder)


def _on_era_end() -> None:
    """A new era: whatever an interrupted forward left armed or prepared is undone."""
    for holder in list(_holders):
        if holder.prepared:
            _arm(holder.slots, False)
            holder.prepared, holder.owner = False, None


norm_cache.on_era_end(_on_era_end)


def attach(layers: list[tuple[nn.Module, str]], entry_points: list[nn.Module]) -> None:
    """A ``NormSlot`` for each (module, adapter) of ``layers``, and the hooks on each module of
    ``entry_points`` (outermost first: the model and, for a PEFT model, the base model its
    ``generate`` calls; they share one holder). Replaces what an earlier call attached there."""
    for entry in entry_points:
        _remove_hooks(entry)
    slots = []
    for module, adapter in layers:
        names = module.__dict__.setdefault(_NAMES, {})
        name = names.get(adapter) or f"_doracheck_norm_{len(names)}"
        names[adapter] = name
        module.__dict__[_ARMED] = False
        slots.append(NormSlot(module, adapter, name))
    holder = _Holder(slots)
    _holders.add(holder)
    for i, entry in enumerate(entry_points):
        entry.__dict__[_HOLDER] = holder
        entry.__dict__[_ROLE] = "outer" if i == 0 else "inner"
        entry.__dict__[_HOOKS] = (entry.register_forward_pre_hook(_before),
                                  entry.register_forward_hook(_after, always_call=True))
        if callable(getattr(type(entry), "generate", None)) or callable(entry.__dict__.get("generate")):
            # A partial of a module-level function: copy.deepcopy binds it to the copy, pickle
            # stores the function by name (a bound method would be looked up as ``entry._generate``).
            if "generate" in entry.__dict__:
                entry.__dict__[_GENERATE] = entry.__dict__["generate"]
            entry.__dict__["generate"] = functools.partial(_generate, entry)
            entry.__dict__[_WRAPPED] = True


def _remove_hooks(entry: nn.Module) -> None:
    for handle in entry.__dict__.pop(_HOOKS, ()):
        handle.remove()
    if entry.__dict__.pop(_WRAPPED, False):
        current = entry.__dict__.get("generate")
        users = entry.__dict__.pop(_GENERATE, None)
        if isinstance(current, functools.partial) and current.func is _generate:  # ours, not one set after attach
            entry.__dict__.pop("generate")
            if users is not None:
                entry.__dict__["generate"] = users
    entry.__dict__.pop(_HOLDER, None)
    entry.__dict__.pop(_ROLE, None)


def detach(model: nn.Module) -> None:
    """Remove every hook, flag and norm buffer ``attach`` added anywhere in ``model`` (a
    ``torch.compile`` wrapper is looked through)."""
    model = getattr(model, "_orig_mod", model)
    for module in model.modules():
        _remove_hooks(module)
        module.__dict__.pop(_ARMED, None)
        for name in (module.__dict__.pop(_NAMES, None) or {}).values():
            module._buffers.pop(name, None)
