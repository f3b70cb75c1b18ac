"""The norm rule applied to a whole model before a forward without grad mode, so that compiled
inference and decode read each layer's norm instead of recomputing it.

torch.compile does not consult a Python-side lookup (docs/design.md section 6), so a compiled
decode step would recompute every layer's norm per token. ``attach(layers, entry_points)``
(``integrations.peft.enable``) gives every accelerated (module, adapter) a ``NormSlot`` and hooks
the entry points: the PEFT model (outer) and the base model its ``generate`` calls (inner).

- Before a forward of an entry point without grad mode, ``_prepare`` brings each slot's
  max(n, eps) (fp32, in the layer's ``ModuleState``, not in ``state_dict``) up to date by
  ``norm_rule`` (same stamp, era and lookup as every other path) and *arms* the layer; with grad
  mode, after a backward (until the next era), under FSDP2 or while tracing it disarms them. The
  post-hook disarms them (``KeyboardInterrupt`` skips it: the next eager call or era end does).
- ``generate`` needs nothing of its own: each of its forwards is a forward without grad mode of
  the base model, prepared by the hook (a wrapper that prepared once per call showed no decode
  gain beyond the spread, docs/performance.md).
- An armed layer reads max(n, eps) from its state (eager and compiled; Dynamo guards on the
  flag). When only the base model's ``__call__`` is compiled (transformers, for a static cache)
  its hooks run eagerly around the compiled body; when the outer model is traced nothing is
  armed and that graph computes its norms. A slot whose tensors are not the layer's 2-D
  matrices (sharded, offloaded to meta, inference tensors) leaves its layer unarmed.

Writes the rule cannot see (``param.data`` edits between inference calls, or during a forward)
need ``clear_norm_cache()``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from . import dispatch, norm_rule
from .forward import norm_with_floor
from .kernels.tracing import tracing
from .numerics import our_numerics

STATE = "_doracheck"  # the one private attribute doracheck sets on a module: a ``ModuleState``


class ModuleState:
    """What doracheck keeps on a module it touches, under the one attribute ``_doracheck``. On a
    routed PEFT LoRA layer: ``originals`` (adapter -> PEFT's own variant, for ``disable``),
    ``norms`` (adapter -> max(n, eps), fp32 (d_out,)), ``armed`` (``norms`` is current for this
    forward). On an entry point: ``holder`` (shared with the other entry point), ``role`` ("outer"
    or "inner") and ``hooks``."""

    def __init__(self) -> None:
        self.originals: dict = {}
        self.norms: dict[str, torch.Tensor] = {}
        self.armed = False
        self.holder: _Holder | None = None
        self.role: str | None = None
        self.hooks: tuple = ()


def state_of(module: nn.Module) -> ModuleState:
    """The module's ``ModuleState``, made on first use."""
    state = module.__dict__.get(STATE)
    if state is None:
        state = module.__dict__[STATE] = ModuleState()
    return state


def _find_holders(module: nn.Module, adapter: str) -> tuple | None:
    """Weak references to (the chain of registered ``base_layer`` submodules below ``module``,
    lora_A[adapter], lora_B[adapter]), or None when the adapter is gone. Weak, so that a
    replaced base layer and its W are freed at once, not at the next forward without grad."""
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
    still where ``module`` keeps them, else None (one was replaced, or a wrapper added below)."""
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
    """max(n, eps) of one (module, adapter), kept in the module's ``ModuleState``, and the
    stamp and era it was computed for."""

    def __init__(self, module: nn.Module, adapter: str):
        self.module, self.adapter = module, adapter
        self.stamp: tuple | None = None
        self._holders: tuple | None = None  # weak references: (base-layer chain, lora_A module, lora_B module) last seen

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of a whole model) without the weak references and the stamp
        (ids and addresses mean nothing elsewhere): the loaded slot refreshes on first use."""
        return {**self.__dict__, "stamp": None, "_holders": None}

    def _tensors(self):
        """(W, A, B) as the module holds them now, or None once the adapter is gone. Runs for
        every slot before each forward without grad (each decode token), so the holding modules
        are remembered and re-checked by dict lookups, not PEFT's ``get_base_layer()``: with
        ``refresh`` comparing its stamp first, 28 layers take about 60 µs per forward on a
        2-core AMD EPYC instead of 170."""
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
        """Bring the slot's max(n, eps) up to date by ``norm_rule`` (same stamp, era and path:
        nothing to do). False when the adapter is gone or the tensors are not the layer's."""
        tensors = self._tensors()
        if tensors is None:
            return False
        W, A, B = tensors
        if W.dim() != 2 or A.dim() != 2 or B.dim() != 2 or W.is_meta or A.is_meta or B.is_meta:
            # Meta: offloaded by accelerate; its hook loads the weights inside the forward.
            return False
        module = self.module
        fan_in_fan_out = bool(getattr(module, "fan_in_fan_out", False))
        scaling: dict = getattr(module, "scaling")  # noqa: B009 (PEFT's per-adapter dict; typed for mypy)
        s = float(scaling[self.adapter])
        key = norm_rule.stamp(W, A, B, s, fan_in_fan_out)
        if key is None:  # inference tensors have no version counter: the layer computes its own norm
            return False
        backend = dispatch.backend_for(W, A, B)
        norms = state_of(module).norms
        buffer = norms.get(self.adapter)
        stamp = (key, era, backend.name, id(buffer))
        if stamp == self.stamp:
            return True
        d_out, d_in = (W.shape[1], W.shape[0]) if fan_in_fan_out else (W.shape[0], W.shape[1])
        if A.shape[1] != d_in or tuple(B.shape) != (d_out, A.shape[0]):
            return False

        def compute():
            fn, n_safe = norm_with_floor(backend, W, A, B, s, fan_in_fan_out)
            return fn._replace(U=None, G=None), n_safe

        with our_numerics(W.device.type):
            _, n_safe = norm_rule.lookup_or_compute(W, A, B, s, fan_in_fan_out, compute, recording=False, tag=backend.name)
        if buffer is None or buffer.shape != n_safe.shape or buffer.dtype != n_safe.dtype or buffer.device != n_safe.device:
            # First use, or moved/cast by .to(). Made outside inference mode so no_grad can rewrite
            # it; static so that CUDA-graph replays of a compiled decode step read it in place.
            with torch.inference_mode(False):
                buffer = torch.empty(n_safe.shape, dtype=n_safe.dtype, device=n_safe.device)
            if buffer.is_cuda:
                torch._dynamo.mark_static_address(buffer)
            norms[self.adapter] = buffer
        buffer.copy_(n_safe)
        self.stamp = (key, era, backend.name, id(buffer))
        return True


def norm_buffer(module: nn.Module, adapter: str) -> torch.Tensor | None:
    """The armed max(n, eps) of (module, adapter), or None (not armed, or no slot)."""
    state = module.__dict__.get(STATE)
    if state is None or not state.armed:
        return None
    return state.norms.get(adapter)


class _Holder:
    """What the entry points of one model share: its slots, and whether a forward of it is
    prepared (read, and guarded on, by traced inner hooks)."""

    def __init__(self, slots: list[NormSlot]):
        self.slots = slots
        self.prepared = False
        self.owner: nn.Module | None = None  # the entry point whose forward prepared
        self.outer_traced = False  # set while torch.compile traces the outer model's forward

    def __getstate__(self) -> dict:
        """Pickled (or deep-copied) as not running anything: a copy made during a forward must
        prepare its own."""
        return {**self.__dict__, "prepared": False, "owner": None, "outer_traced": False}


_lock = threading.RLock()
_holders: weakref.WeakSet = weakref.WeakSet()


def _arm(slots: list[NormSlot], value: bool) -> None:
    for slot in slots:
        state_of(slot.module).armed = value


@torch.compiler.disable
def _prepare(model: nn.Module, holder: _Holder) -> None:
    with _lock:
        holder.prepared, holder.owner = True, model
        if torch.is_grad_enabled() or tracing() or norm_rule.backward_seen() or norm_rule.fsdp_active():
            _arm(holder.slots, False)
            return
        era = norm_rule.era()
        fresh = {id(slot): slot.refresh(era) for slot in holder.slots}
        for slot in holder.slots:  # a module with one slot that could not be refreshed stays unarmed
            state_of(slot.module).armed = True
        for slot in holder.slots:
            if not fresh[id(slot)]:
                state_of(slot.module).armed = False


@torch.compiler.disable
def _finish(holder: _Holder) -> None:
    with _lock:
        _arm(holder.slots, False)
        holder.prepared, holder.owner = False, None


def _before(model: nn.Module, args) -> None:
    state = model.__dict__.get(STATE)
    holder = None if state is None else state.holder
    if holder is None:
        return
    if torch.compiler.is_compiling():
        # Outer model traced: no graph break, nothing armed, the graph computes the norms. Inner
        # model traced alone (static cache): a graph break, _prepare runs eagerly before it.
        if state.role == "outer":
            holder.outer_traced = True
            return
        if holder.outer_traced:
            return
    _prepare(model, holder)  # eager: decided again at every call (cheap when nothing changed)


def _after(model: nn.Module, args, output) -> None:
    state = model.__dict__.get(STATE)
    holder = None if state is None else state.holder
    if holder is None:
        return
    if torch.compiler.is_compiling() and state.role == "outer":
        holder.outer_traced = False
        return
    if holder.owner is model:
        _finish(holder)


def _on_era_end() -> None:
    """A new era: whatever an interrupted forward left armed or prepared is undone."""
    for holder in list(_holders):
        if holder.prepared:
            _arm(holder.slots, False)
            holder.prepared, holder.owner = False, None


norm_rule.on_era_end(_on_era_end)


def attach(layers: list[tuple[nn.Module, str]], entry_points: list[nn.Module]) -> None:
    """A ``NormSlot`` for each (module, adapter) of ``layers``, and hooks on ``entry_points``
    (outermost first, sharing one holder), replacing what an earlier call attached there."""
    for entry in entry_points:
        _remove_hooks(entry)
    slots = []
    for module, adapter in layers:
        state_of(module).armed = False
        slots.append(NormSlot(module, adapter))
    holder = _Holder(slots)
    _holders.add(holder)
    for i, entry in enumerate(entry_points):
        state = state_of(entry)
        state.holder = holder
        state.role = "outer" if i == 0 else "inner"
        state.hooks = (entry.register_forward_pre_hook(_before), entry.register_forward_hook(_after, always_call=True))


def _remove_hooks(entry: nn.Module) -> None:
    state = entry.__dict__.get(STATE)
    if state is None:
        return
    for handle in state.hooks:
        handle.remove()
    state.hooks = ()
    state.holder, state.role = None, None


def detach(model: nn.Module) -> None:
    """Remove every hook, flag and norm ``attach`` added anywhere in ``model`` (a
    ``torch.compile`` wrapper is looked through); a module's state goes once nothing is left in it."""
    model = getattr(model, "_orig_mod", model)
    for module in model.modules():
        _remove_hooks(module)
        state = module.__dict__.get(STATE)
        if state is not None:
            state.armed = False
            state.norms.clear()
            if not state.originals:
                module.__dict__.pop(STATE)
