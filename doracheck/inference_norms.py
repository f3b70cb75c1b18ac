"""Norms as module state for inference and decode, eager and compiled.

Under torch.compile a Python-side cache is not consulted (docs/design.md section 6): a compiled
decode step recomputed every layer's norm for every token (per layer a d_out×d_in×r GEMM, as
much work as r tokens of the layer itself; measured: compiled decode at 0.30x compiled PEFT
LoRA's tokens/s). Here the norm becomes module state that the model refreshes:

- ``attach(model, layers)`` (``integrations.peft.enable``) gives every accelerated (module,
  adapter) a ``NormSlot``: max(n, eps) in fp32 as a non-persistent buffer of the module (not in
  ``state_dict``; a static input to CUDA graphs), and puts two hooks on the model.
- Before a forward without grad mode (evaluation, generation), the pre-hook brings every
  buffer up to date and *arms* the model; the post-hook (called even when the forward raises)
  disarms it. Both are excluded from tracing (``torch.compiler.disable``): a compiled model
  gets one graph break before and one after its body.
- While armed, a layer reads max(n, eps) from its buffer instead of computing the norm (eager:
  no per-layer cache lookup; compiled: the graph reads the buffer). Dynamo guards on the
  armed flag, so a graph that reads buffers runs only after the pre-hook ran eagerly; a layer
  called any other way (a submodule on its own, a training forward) computes its norm.

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

_SLOTS = "_doracheck_norm_slots"  # on the hooked model: list of NormSlot
_NAMES = "_doracheck_norm_buffers"  # on each layer module: {adapter: buffer name}
_HOOKS = "_doracheck_norm_hooks"
_state = {"armed": False, "depth": 0}


def armed() -> bool:
    """Whether the running forward was prepared by the pre-hook (read inside layers; Dynamo
    guards on it)."""
    return _state["armed"]


class NormSlot:
    """max(n, eps) of one (module, adapter) as a buffer of the module, and what it was computed from."""

    def __init__(self, module: nn.Module, adapter: str, name: str):
        self.module, self.adapter, self.name = module, adapter, name
        self.stamp: tuple | None = None

    def _tensors(self):
        m = self.module
        return (m.get_base_layer()._parameters["weight"], m.lora_A[self.adapter]._parameters["weight"],
                m.lora_B[self.adapter]._parameters["weight"])

    def refresh(self, era: int) -> None:
        """Recompute the buffer unless W, A, B (object, address, version), s and the era are
        those it was computed from."""
        W, A, B = self._tensors()
        s = float(self.module.scaling[self.adapter])
        stamp = (era, s, id(W), id(A), id(B), W.data_ptr(), A.data_ptr(), B.data_ptr(), W._version, A._version, B._version,
                 W.dtype, A.dtype, B.dtype, W.device)
        if stamp == self.stamp:
            return
        fan_in_fan_out = self.module.fan_in_fan_out
        with torch.no_grad(), our_numerics(W.device.type):
            backend = dispatch.backend_for(W, A, B)
            n_safe = torch.clamp_min(backend.factored_norm(W, A, B, s, fan_in_fan_out, False).norm, EPS)
        buffer = self.module._buffers.get(self.name)
        if buffer is None or buffer.shape != n_safe.shape or buffer.dtype != n_safe.dtype or buffer.device != n_safe.device:
            self.module.register_buffer(self.name, n_safe, persistent=False)  # first use, or moved / cast by .to()
        else:
            buffer.copy_(n_safe)
        self.stamp = stamp


def norm_buffer(module: nn.Module, adapter: str) -> torch.Tensor | None:
    """The armed max(n, eps) buffer of (module, adapter), or None (not armed, or no slot)."""
    if not _state["armed"]:
        return None
    names = module.__dict__.get(_NAMES)
    name = None if names is None else names.get(adapter)
    return None if name is None else module._buffers.get(name)


@torch.compiler.disable
def _before(model: nn.Module, args) -> None:
    _state["depth"] += 1
    if _state["depth"] > 1:
        return  # a nested hooked model: the outermost call prepared (or declined) this forward
    _state["armed"] = False
    if torch.is_grad_enabled() or tracing() or norm_cache.backward_seen() or norm_cache.fsdp_active():
        return
    era = norm_cache.era()
    for slot in model.__dict__.get(_SLOTS, ()):
        slot.refresh(era)
    _state["armed"] = True


@torch.compiler.disable
def _after(model: nn.Module, args, output) -> None:
    _state["depth"] = max(0, _state["depth"] - 1)
    if _state["depth"] == 0:
        _state["armed"] = False


def attach(model: nn.Module, layers: list[tuple[nn.Module, str]], entry_points: list[nn.Module]) -> None:
    """A ``NormSlot`` for each (module, adapter) of ``layers``, and the hooks on each module of
    ``entry_points`` (the model and, for a PEFT model, the base model its ``generate`` calls).
    Calling it again replaces what an earlier call attached."""
    detach(model, entry_points)
    slots = []
    for module, adapter in layers:
        names = module.__dict__.setdefault(_NAMES, {})
        name = names.get(adapter) or f"_doracheck_norm_{len(names)}"
        names[adapter] = name
        slots.append(NormSlot(module, adapter, name))
    for entry in entry_points:
        entry.__dict__[_SLOTS] = slots
        entry.__dict__[_HOOKS] = (entry.register_forward_pre_hook(_before),
                                  entry.register_forward_hook(_after, always_call=True))


def detach(model: nn.Module, entry_points: list[nn.Module]) -> None:
    """Remove the hooks and every norm buffer ``attach`` added."""
    for entry in entry_points:
        for handle in entry.__dict__.pop(_HOOKS, ()):
            handle.remove()
        entry.__dict__.pop(_SLOTS, None)
    for module in model.modules():
        for name in (module.__dict__.pop(_NAMES, None) or {}).values():
            module._buffers.pop(name, None)
