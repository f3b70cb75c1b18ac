"""The training forward of a PEFT DoRA layer, with fewer host steps on repeat calls.

The eager training step is host-bound (issue 17; benchmarks/README.md, eleventh pass): on the
H200 hosts the model forward spends 2.0-2.2x PEFT LoRA's host time, and gradient checkpointing
runs it twice. Of one layer call, the Python between PEFT's call and the GPU work (the general
variant forward's decisions, ``check_dora_inputs``, ``dora_from_base``'s checks, a thirteen-
argument ``autograd.Function``, ``_save``'s per-parameter questions) cost about as much as the
work itself: on a 2-core CPU with the norm and compose stubbed to one op each, 218 µs per call
against 152 µs for the same forward without those steps (2026-12-02).

So a layer keeps a ``TrainPlan`` per adapter after a training call that the general path
checked in full. A later call checks in a few reads that the plan still holds (the same module
and parameter objects in the same places, each parameter with the shape, dtype and device it
had, the same s, and the per-call conditions below) and then runs
``autograd.PlannedFromBaseFunction``: the very ``forward.from_base_forward`` the general path
runs for such a call, with the same record for the same backward. So the plan changes the host
steps, never the numbers (bitwise; tests/test_train_plan.py). Anything else returns None and
the general path decides (and raises the errors that name the problem).

Covered: the first active adapter (``result`` is x·Wᵀ + b), a frozen base weight, dropout
inactive (eval mode, or ``nn.Identity``), no variant keyword arguments, ``fan_in_fan_out`` off,
x and ``result`` plain tensors of 16- or 32-bit dtypes on the parameters' device (x in fp32 and
``result`` in bf16 where PEFT cast x to its default fp32 adapters on a bf16 model), a
contiguous ``result``, autograd recording the call, autocast off, nothing tracing, FSDP2 not in
use (it swaps the parameter objects at every forward, so a plan would never hold).
``DORACHECK_TRAIN_PLANS=0`` turns plans off (read at import; ``ENABLED`` at run time).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn

from doracheck import dispatch, norm_cache
from doracheck.autograd import PlannedFromBaseFunction
from doracheck.integrations.peft_armed import _Plans
from doracheck.kernels.tracing import tracing
from doracheck.numerics import _autocast_enabled

_TRAIN_PLANS = "_doracheck_train_plans"  # on each layer module: _Plans {adapter: TrainPlan}
ENABLED = os.environ.get("DORACHECK_TRAIN_PLANS", "1") != "0"  # tests and benchmarks may set it
_PLAIN = (torch.Tensor, nn.Parameter)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _shape_of(t: torch.Tensor) -> tuple:
    """What a write through ``.data`` may change and the full checks looked at."""
    return (t.shape, t.dtype, t.device)


class TrainPlan:
    """One (layer, adapter) as a checked training call found it; ``run`` checks it still is and
    runs the planned Function. Weak references only: a replaced module or parameter is freed at
    once, and a plan whose objects are gone never matches."""

    __slots__ = ("refs", "shapes", "scaling", "x_dtype", "dtype", "device", "device_type", "d_in", "d_out", "has_bias")

    def __init__(self, base_layer, A_mod, B_mod, m_mod, dropout, weight, lora_A, lora_B, magnitude, bias, scaling: float,
                 x_dtype: torch.dtype, dtype: torch.dtype):
        ref = weakref.ref
        self.refs = (ref(base_layer), ref(A_mod), ref(B_mod), ref(m_mod), ref(dropout), ref(weight), ref(lora_A), ref(lora_B),
                     ref(magnitude), None if bias is None else ref(bias))
        self.has_bias = bias is not None
        self.shapes = (_shape_of(weight), _shape_of(lora_A), _shape_of(lora_B), _shape_of(magnitude),
                       None if bias is None else _shape_of(bias))
        # x's dtype and the base output's (the compute dtype): they differ where PEFT cast x to
        # fp32 adapters (its default for a 16-bit base model); the forward casts x as it would.
        self.scaling, self.x_dtype, self.dtype = scaling, x_dtype, dtype
        self.device, self.device_type = weight.device, weight.device.type
        self.d_out, self.d_in = weight.shape

    def run(self, module: nn.Module, adapter: str, x: torch.Tensor, result: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """y (``result`` rewritten), or None when anything differs from the plan or the call is
        one the plan does not cover."""
        mods: dict[str, Any] = module._modules
        md = module.__dict__
        refs: Any = self.refs
        base_layer: Any = mods.get("base_layer")
        if base_layer is None or base_layer is not refs[0]():
            return None
        A_mod: Any = mods["lora_A"]._modules.get(adapter)
        B_mod: Any = mods["lora_B"]._modules.get(adapter)
        m_mod: Any = mods["lora_magnitude_vector"]._modules.get(adapter)
        dropout = mods["lora_dropout"]._modules.get(adapter)
        if (A_mod is None or B_mod is None or m_mod is None or A_mod is not refs[1]() or B_mod is not refs[2]()
                or m_mod is not refs[3]() or dropout is not refs[4]()):  # None first: a dead reference is None too
            return None
        bp = base_layer._parameters
        weight: Any = bp.get("weight")
        bias: Any = bp.get("bias")
        lora_A: Any = A_mod._parameters.get("weight")
        lora_B: Any = B_mod._parameters.get("weight")
        magnitude: Any = m_mod._parameters.get("weight")
        if (weight is None or weight is not refs[5]() or lora_A is not refs[6]() or lora_B is not refs[7]()
                or magnitude is not refs[8]() or (bias is not None) != self.has_bias or "bias" not in bp
                or "base_layer" in base_layer._modules
                or (bias is not None and bias is not refs[9]())):  # type: ignore[misc]
            return None
        # Held on the ctx only as module parameters outside inference mode (``autograd._held_on_ctx``):
        # ``torch.utils.swap_tensors`` or a ``.data`` write of an inference tensor changes that in place.
        for p in (weight, lora_A, lora_B, magnitude, bias):
            if p is not None and (type(p) is not nn.Parameter or p.is_inference()):
                return None
        active = md.get("_active_adapter")
        if ((active != adapter and active != [adapter]) or weight.requires_grad or md.get("fan_in_fan_out")
                or (md.get("training") and type(dropout) is not nn.Identity)
                or (kwargs and any(v is not None for v in kwargs.values())) or md["scaling"].get(adapter) != self.scaling):
            return None
        shapes = self.shapes
        if (_shape_of(weight) != shapes[0] or _shape_of(lora_A) != shapes[1] or _shape_of(lora_B) != shapes[2]
                or _shape_of(magnitude) != shapes[3] or (bias is not None and _shape_of(bias) != shapes[4])):
            return None
        if (type(x) is not torch.Tensor or type(result) is not torch.Tensor or x.dtype != self.x_dtype or result.dtype != self.dtype
                or x.device != self.device or x.dim() < 1 or x.shape[-1] != self.d_in or result.shape[-1] != self.d_out
                or result.shape[:-1] != x.shape[:-1] or not result.is_contiguous()
                or not (x.requires_grad or lora_A.requires_grad or lora_B.requires_grad or magnitude.requires_grad
                        or (bias is not None and bias.requires_grad))
                or _autocast_enabled(self.device_type) or tracing() or norm_cache.fsdp_active()):
            return None
        backend = dispatch.backend_for(x, weight, lora_A, lora_B, magnitude, bias)  # use_path / DORACHECK_PATH, as now
        return PlannedFromBaseFunction.apply(result, x, weight, lora_A, lora_B, magnitude, bias, self.scaling, backend)


def train_forward(module: nn.Module, adapter: str, x: torch.Tensor, result: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """y through the layer's plan for ``adapter``, or None (no plan, or it does not hold): the
    general path then runs and may keep a plan (``keep_plan``). Call only with grad mode on."""
    plans = module.__dict__.get(_TRAIN_PLANS)
    plan = None if plans is None else plans.get(adapter)
    return None if plan is None or not ENABLED else plan.run(module, adapter, x, result, kwargs)


def _parameters(base_layer: nn.Module, A_mod: nn.Module, B_mod: nn.Module, m_mod: nn.Module) -> tuple | None:
    """(weight, bias, lora_A, lora_B, magnitude) where each is a registered module parameter (bias
    also None) outside inference mode, else None (pruned, parametrized or wrapped layers)."""
    try:
        bp = base_layer._parameters
        weight, bias = bp["weight"], bp["bias"]
        found = (weight, bias, A_mod._parameters["weight"], B_mod._parameters["weight"], m_mod._parameters["weight"])
    except (KeyError, AttributeError):
        return None
    if any(t is not None and (type(t) is not nn.Parameter or t.is_inference()) for t in found) or weight is None:
        return None
    return found


def keep_plan(module: nn.Module, adapter: str, submodules: tuple, x: torch.Tensor, result: torch.Tensor, scaling: float) -> None:
    """After the general path checked and ran a training call in full: keep a plan for the next
    call where the call is one the plan covers (the module docstring), else drop any plan."""
    base_layer, A_mod, B_mod, m_mod, dropout, _ = submodules
    plans = module.__dict__.get(_TRAIN_PLANS)
    found = _parameters(base_layer, A_mod, B_mod, m_mod)
    if (found is None or not ENABLED or x.dtype not in _DTYPES or result.dtype not in _DTYPES or type(x) is not torch.Tensor
            or type(result) is not torch.Tensor or module.__dict__["scaling"].get(adapter) != scaling
            or norm_cache.fsdp_active()):
        if plans is not None:
            plans.pop(adapter, None)
        return
    weight, bias, lora_A, lora_B, magnitude = found
    if plans is None:
        plans = module.__dict__[_TRAIN_PLANS] = _Plans()
    plans[adapter] = TrainPlan(base_layer, A_mod, B_mod, m_mod, dropout, weight, lora_A, lora_B, magnitude, bias, scaling,
                               x.dtype, result.dtype)
