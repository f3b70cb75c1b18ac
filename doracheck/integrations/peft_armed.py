"""The forward of an armed PEFT DoRA layer, in the fewest host operations.

An armed layer (``doracheck.inference_norms``: inside ``generate``, or another forward without
grad mode that the model's hook prepared) reads max(n, eps) from its buffer, so its forward is
    y = b + g⊙(result - b + s·(x·Aᵀ)·Bᵀ),  g = m / max(n, eps)  (written into ``result`` = x·Wᵀ + b):
two GPU operations, x·Aᵀ (cuBLAS, fp32 reduction) and the compose kernel. Eager decode runs it
for every layer of every token and is host-bound: on the H200 host of 2026-12-02 the general
path spent 187 µs of host time per layer call after the base linear (PEFT LoRA's whole layer
took 104; benchmarks/results/decode_layer_host_fast_h200.txt), most of it in Python around
those two launches.

``armed_forward`` first tries the layer's ``ArmedPlan`` for the adapter: what the full checks
found on an earlier call, kept with weak references, and checked again in a few reads per call
(the same objects in the same places, B, m, b and the norm buffer at the same address with the
same shape, strides and dtype, the same s, the same backend as ``dispatch`` chooses now, and the
per-call conditions below). Where it holds,
x·Aᵀ and the compose (``compose_triton.InferCompose``: Triton's compiled kernel launched
directly) run with nothing else. Anything else goes through the full checks
(``_checked_forward``): they answer None for the general path where the call is unusual, and
otherwise run ``forward.compose_armed`` and keep a new plan. Both compute the same two operations
with the same arguments, so the plan's output is bitwise the general path's (tested).

Declined (None, the general path): several active adapters, dropout in training mode, variant
keyword arguments, ``fan_in_fan_out``, a trainable or nested base layer, a weight or bias that
is not a registered parameter (pruning, parametrizations), x and result of different dtypes,
fp64, a non-contiguous result, autocast, tracing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from doracheck import dispatch, inference_norms
from doracheck.forward import compose_armed
from doracheck.kernels.tracing import tracing
from doracheck.numerics import _flags_enter, _flags_exit, our_numerics
from doracheck.validation import check_dora_inputs

_PLANS = "_doracheck_armed_plans"  # on each layer module: _Plans {adapter: ArmedPlan}


class _Plans(dict):
    """A layer's plans. Copied, deep-copied or pickled as empty: a plan refers to the original
    layer's objects, and holds a compiled kernel that does not pickle."""

    def __reduce__(self):
        return (_Plans, ())

    def __copy__(self):
        return _Plans()

    def __deepcopy__(self, memo):
        return _Plans()


def _sig(t: torch.Tensor) -> tuple:
    """What a kernel argument must keep for a launch prepared with it: address, shape, strides,
    dtype (a write through ``.data`` may change any of them and leave the object in place)."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def armed_forward(module: nn.Module, adapter: str, x: torch.Tensor, result: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """y written into ``result``, or None for the general path (see the module docstring)."""
    plans = module.__dict__.get(_PLANS)
    plan = None if plans is None else plans.get(adapter)
    if plan is not None:
        y = plan.run(module, adapter, x, result, kwargs)
        if y is not None:
            return y
    return _checked_forward(module, adapter, x, result, kwargs)


class ArmedPlan:
    """One armed (layer, adapter) as the full checks found it; ``run`` checks it still is, then
    runs x·Aᵀ and the compose directly. Weak references only: a replaced module or parameter is
    freed at once, and a plan whose objects are gone never matches."""

    __slots__ = ("refs", "sigs", "lora_A_shape", "scaling", "buffer", "names", "dtype", "device", "device_type", "d_in",
                 "d_out", "r", "compose", "backend")

    def __init__(self, module, base_layer, A_mod, B_mod, m_mod, dropout, weight, lora_A, lora_B, magnitude, bias, scaling,
                 n_safe, names, backend):
        from doracheck.kernels.compose_triton import InferCompose

        ref = weakref.ref
        self.refs = (ref(base_layer), ref(A_mod), ref(B_mod), ref(m_mod), ref(dropout), ref(weight), ref(lora_A), ref(lora_B),
                     ref(magnitude), None if bias is None else ref(bias), ref(n_safe))
        self.sigs = (_sig(lora_B), _sig(magnitude), None if bias is None else _sig(bias), _sig(n_safe))
        self.lora_A_shape, self.scaling = lora_A.shape, scaling
        self.buffer, self.names = ref(n_safe), names
        self.dtype, self.device = lora_A.dtype, lora_A.get_device()  # x's and result's dtype too (checked when kept)
        self.device_type = lora_A.device.type
        self.d_out, self.r = lora_B.shape
        self.d_in = lora_A.shape[1]
        self.backend = backend
        # The Triton launch kept per token count; the torch twin (CPU) calls the backend's op.
        self.compose = InferCompose(self.d_out, self.r, scaling) if backend.name == "triton" else None

    def run(self, module: nn.Module, adapter: str, x: torch.Tensor, result: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """y written into ``result``, or None when anything differs from the plan or the call is
        unusual (then the full checks decide)."""
        mods: dict[str, Any] = module._modules
        md = module.__dict__
        refs = self.refs
        base_layer = mods.get("base_layer")
        if base_layer is None or base_layer is not refs[0]() or "base_layer" in base_layer._modules:
            return None
        A_mod, B_mod = mods["lora_A"]._modules.get(adapter), mods["lora_B"]._modules.get(adapter)
        m_mod, dropout = mods["lora_magnitude_vector"]._modules.get(adapter), mods["lora_dropout"]._modules.get(adapter)
        if A_mod is not refs[1]() or B_mod is not refs[2]() or m_mod is not refs[3]() or dropout is not refs[4]():
            return None
        bp = base_layer._parameters
        weight, bias = bp.get("weight"), bp.get("bias")
        lora_A, lora_B = A_mod._parameters.get("weight"), B_mod._parameters.get("weight")
        magnitude = m_mod._parameters.get("weight")
        if (weight is None or weight is not refs[5]() or lora_A is not refs[6]() or lora_B is not refs[7]()
                or magnitude is not refs[8]() or "bias" not in bp or (bias is None) != (refs[9] is None)
                or (bias is not None and bias is not refs[9]())):  # type: ignore[misc]
            return None
        names = md.get(inference_norms._NAMES)
        n_safe = None if names is None or names is not self.names else module._buffers.get(names.get(adapter))
        active = md.get("_active_adapter")
        if (n_safe is None or n_safe is not self.buffer() or not md.get(inference_norms._ARMED) or weight.requires_grad
                or (active != adapter and active != [adapter]) or md.get("fan_in_fan_out")
                or (md.get("training") and type(dropout) is not nn.Identity)
                or (kwargs and any(v is not None for v in kwargs.values())) or md["scaling"].get(adapter) != self.scaling):
            return None
        sigs = self.sigs
        if (_sig(lora_B) != sigs[0] or _sig(magnitude) != sigs[1] or (bias is not None and _sig(bias) != sigs[2])
                or _sig(n_safe) != sigs[3] or lora_A.shape != self.lora_A_shape or lora_A.dtype != self.dtype):
            return None
        d_in, d_out = self.d_in, self.d_out
        if (x.dtype != self.dtype or result.dtype != self.dtype or x.get_device() != self.device or x.shape[-1] != d_in
                or result.shape[-1] != d_out or result.shape[:-1] != x.shape[:-1] or not result.is_contiguous()
                or torch.is_autocast_enabled(self.device_type) or tracing()
                or dispatch.backend_for(x, lora_B, magnitude, bias) is not self.backend):  # use_path / DORACHECK_PATH
            return None
        compose = self.compose
        if compose is None:  # the torch twin: the general inference compose, as the full checks run it
            with our_numerics(self.device_type):
                return compose_armed(result, x, lora_A, lora_B, magnitude, bias, self.scaling, n_safe, self.backend)
        x2 = x.reshape(-1, d_in)  # as the general path: a view, or the same copy where x's strides do not flatten
        _flags_enter()  # x·Aᵀ with fp32 reduction (numerics.our_numerics, without autocast: checked above)
        try:
            xa = F.linear(x2, lora_A)  # the very GEMM of x2 @ A.t() (ATen's 2-D linear without bias is that mm)
        finally:
            _flags_exit()
        compose(result, xa, x2.shape[0], lora_B, magnitude, bias, n_safe)
        return result


def _checked_forward(module: nn.Module, adapter: str, x: torch.Tensor, result: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The full checks of an armed call; None for the general path, else the output (through
    ``forward.compose_armed``) with a plan kept for the next call."""
    mods: dict[str, Any] = module._modules
    try:
        base_layer = mods["base_layer"]
        A_mod, B_mod = mods["lora_A"]._modules[adapter], mods["lora_B"]._modules[adapter]
        m_mod, dropout = mods["lora_magnitude_vector"]._modules[adapter], mods["lora_dropout"]._modules[adapter]
        weight, lora_A, lora_B = base_layer._parameters["weight"], A_mod._parameters["weight"], B_mod._parameters["weight"]
        magnitude = m_mod._parameters["weight"]
    except KeyError:
        return None
    n_safe = inference_norms.norm_buffer(module, adapter)
    active = module.__dict__.get("_active_adapter")  # PEFT keeps a str or a list of names there
    if (n_safe is None or "base_layer" in base_layer._modules or (active != adapter and active != [adapter])
            or module.fan_in_fan_out or (module.training and type(dropout) is not nn.Identity)
            or (kwargs and any(v is not None for v in kwargs.values())) or weight is None or weight.requires_grad
            or x.dtype != result.dtype or x.dtype == torch.float64 or not result.is_contiguous()):
        return None
    if "bias" not in base_layer._parameters:  # pruned or parametrized: a plain attribute the general path reads
        return None
    bias = base_layer._parameters["bias"]
    scalings: dict = getattr(module, "scaling")  # noqa: B009 (PEFT's per-adapter dict; typed for mypy)
    scaling = float(scalings[adapter])
    check_dora_inputs(x, weight, lora_A, lora_B, magnitude, scaling, bias, dropout_p=0.0, fan_in_fan_out=False)
    if result.shape[-1] != lora_B.shape[0] or result.shape[:-1] != x.shape[:-1]:
        return None  # the general path raises the error that names it
    backend = dispatch.backend_for(x, weight, lora_A, lora_B, magnitude, bias)
    with our_numerics(result.device.type):
        y = compose_armed(result, x, lora_A, lora_B, magnitude, bias, scaling, n_safe, backend)
    if (scalings[adapter] == scaling and lora_A.dtype == x.dtype and magnitude.stride(0) == 1
            and (bias is None or bias.is_contiguous())):  # as the general path passes them, without a copy
        try:
            plan = ArmedPlan(module, base_layer, A_mod, B_mod, m_mod, dropout, weight, lora_A, lora_B, magnitude, bias, scaling,
                             n_safe, module.__dict__.get(inference_norms._NAMES), backend)
        except RuntimeError:  # a tensor without storage (a wrapper subclass) has no address to keep: no plan
            return y
        plans = module.__dict__.get(_PLANS)
        if plans is None:
            plans = module.__dict__[_PLANS] = _Plans()
        plans[adapter] = plan
    return y
