"""Norms as module state for inference and decode, eager and compiled.

Under torch.compile a Python-side cache is not consulted (docs/design.md section 6): a compiled
decode step recomputed every layer's norm for every token (per layer a d_out×d_in×r GEMM, as
much work as r tokens of the layer itself; measured: compiled decode at 0.30x compiled PEFT
LoRA's tokens/s). Here the norm becomes module state that the model refreshes:

- ``attach(model, layers)`` (``integrations.peft.enable``) gives every accelerated (module,
  adapter) a ``NormSlot``: max(n, eps) in fp32 as a non-persistent buffer of the module (not in
  ``state_dict``; a static input to CUDA graphs), and puts two hooks on the model.
- Before a forward without grad mode (evaluation, generation), the pre-hook brings every
  buffer of that model up to date and *arms* its layers (a flag on each layer module); the
  post-hook (called even when the forward raises) disarms them when the outermost hooked call
  of that model ends. Both are excluded from tracing (``torch.compiler.disable``): a compiled
  model gets one graph break before and one after its body.
- An armed layer reads max(n, eps) from its buffer instead of computing the norm (eager: no
  per-layer cache lookup; compiled: the graph reads the buffer). Dynamo guards on the flag, so
  a graph that reads buffers runs only for layers the pre-hook of their own model prepared; a
  layer called any other way (a submodule on its own, inside another model's forward, a
  training forward) computes its norm.

When a buffer is refreshed is the norm-reuse rule of ``norm_cache`` for forwards without grad
mode, checked per slot in a few attribute reads: recomputed when W, A or B is another tensor,
at another address or at another version, when s changes, and after every optimizer step or
training forward (a new era); not armed at all while a backward may have been followed by
writes nothing sees (the era's ``backward_seen``) or under FSDP2. The one write nothing can see
is the eager rule's too: ``param.data`` edits between two inference calls with no backward or
optimizer step between them; call ``doracheck.clear_norm_cache()`` after those (it starts a new
era, so every buffer is refreshed).
"""

from __future__ import annotations

import torch
from torch import nn

from . import dispatch, norm_cache
from .kernels.constants import EPS
from .kernels.tracing import tracing
from .numerics import our_numerics

_SLOTS = "_doracheck_norm_slots"  # on a hooked model: the list of its NormSlots
_NAMES = "_doracheck_norm_buffers"  # on each layer module: {adapter: buffer name}
_ARMED = "_doracheck_norms_armed"  # on each layer module: bool, read by the layer
_HOOKS = "_doracheck_norm_hooks"
_depth: dict[int, int] = {}  # id(slot list) -> hooked calls of that model now running


class NormSlot:
    """max(n, eps) of one (module, adapter) as a buffer of the module, and what it was computed from."""

    def __init__(self, module: nn.Module, adapter: str, name: str):
        self.module, self.adapter, self.name = module, adapter, name
        self.stamp: tuple | None = None

    def _tensors(self):
        """(W, A, B) as the module holds them now, or None once the adapter is gone."""
        m = self.module
        try:
            return (m.get_base_layer()._parameters["weight"], m.lora_A[self.adapter]._parameters["weight"],
                    m.lora_B[self.adapter]._parameters["weight"])
        except KeyError:  # delete_adapter: nothing reads this slot any more
            return None

    def refresh(self, era: int) -> None:
        """Recompute the buffer unless W, A, B (object, address, version), s, the era and the
        buffer itself are those it was computed from."""
        tensors = self._tensors()
        if tensors is None:
            return
        W, A, B = tensors
        scaling: dict = getattr(self.module, "scaling")  # noqa: B009 (PEFT's per-adapter dict; typed for mypy)
        s = float(scaling[self.adapter])
        buffer = self.module._buffers.get(self.name)
        stamp = (era, s, id(W), id(A), id(B), W.data_ptr(), A.data_ptr(), B.data_ptr(), W._version, A._version, B._version,
                 W.dtype, A.dtype, B.dtype, W.device, id(buffer), None if buffer is None else buffer.dtype)
        if stamp == self.stamp:
            return
        fan_in_fan_out = self.module.fan_in_fan_out
        with torch.no_grad(), our_numerics(W.device.type):
            backend = dispatch.backend_for(W, A, B)
            n_safe = torch.clamp_min(backend.factored_norm(W, A, B, s, fan_in_fan_out, False).norm, EPS)
        if buffer is None or buffer.shape != n_safe.shape or buffer.dtype != n_safe.dtype or buffer.device != n_safe.device:
            # First use, or moved / cast by .to(). Made outside inference mode, so that a buffer
            # first filled under torch.inference_mode() can still be rewritten under no_grad.
            with torch.inference_mode(False):
                buffer = torch.empty(n_safe.shape, dtype=n_safe.dtype, device=n_safe.device)
            self.module.register_buffer(self.name, buffer, persistent=False)
        buffer.copy_(n_safe)
        self.stamp = (*stamp[:-2], id(buffer), buffer.dtype)


def norm_buffer(module: nn.Module, adapter: str) -> torch.Tensor | None:
    """The armed max(n, eps) buffer of (module, adapter), or None (not armed, or no slot)."""
    if not getattr(module, _ARMED, False):
        return None
    names = getattr(module, _NAMES, None)
    name = None if names is None else names.get(adapter)
    return None if name is None else module._buffers.get(name)


def _arm(slots: list, value: bool) -> None:
    for slot in slots:
        slot.module.__dict__[_ARMED] = value


@torch.compiler.disable
def _before(model: nn.Module, args) -> None:
    slots = model.__dict__.get(_SLOTS, [])
    key = id(slots)
    _depth[key] = _depth.get(key, 0) + 1
    if _depth[key] > 1:
        return  # a nested call of the same model: the outermost call prepared (or declined) it
    if torch.is_grad_enabled() or tracing() or norm_cache.backward_seen() or norm_cache.fsdp_active():
        _arm(slots, False)
        return
    era = norm_cache.era()
    for slot in slots:
        slot.refresh(era)
    _arm(slots, True)


@torch.compiler.disable
def _after(model: nn.Module, args, output) -> None:
    slots = model.__dict__.get(_SLOTS, [])
    key = id(slots)
    left = _depth.pop(key, 1) - 1
    if left > 0:
        _depth[key] = left
    else:
        _arm(slots, False)


def attach(model: nn.Module, layers: list[tuple[nn.Module, str]], entry_points: list[nn.Module]) -> None:
    """A ``NormSlot`` for each (module, adapter) of ``layers``, and the hooks on each module of
    ``entry_points`` (the model and, for a PEFT model, the base model its ``generate`` calls;
    they share one slot list). Calling it again replaces what an earlier call attached."""
    detach(model, entry_points)
    slots = []
    for module, adapter in layers:
        names = module.__dict__.setdefault(_NAMES, {})
        name = names.get(adapter) or f"_doracheck_norm_{len(names)}"
        names[adapter] = name
        module.__dict__[_ARMED] = False
        slots.append(NormSlot(module, adapter, name))
    for entry in entry_points:
        entry.__dict__[_SLOTS] = slots
        entry.__dict__[_HOOKS] = (entry.register_forward_pre_hook(_before),
                                  entry.register_forward_hook(_after, always_call=True))


def detach(model: nn.Module, entry_points: list[nn.Module]) -> None:
    """Remove the hooks, the flags and every norm buffer ``attach`` added."""
    for entry in entry_points:
        for handle in entry.__dict__.pop(_HOOKS, ()):
            handle.remove()
        slots = entry.__dict__.pop(_SLOTS, None)
        if slots is not None:
            _depth.pop(id(slots), None)
    for module in model.modules():
        module.__dict__.pop(_ARMED, None)
        for name in (module.__dict__.pop(_NAMES, None) or {}).values():
            module._buffers.pop(name, None)
