"""The DoRA layer as two torch.autograd.Functions with hand-written backwards.

``DoRALinearFunction`` (``dora_linear``, ``DoRALinear``) computes x·Wᵀ itself;
``DoRAFromBaseFunction`` (the PEFT integration) starts from a base output PEFT already has.
Each picks its backend once per call (``dispatch.backend_for``), runs ``forward``, keeps a
``Saved`` record for ``backward.layer_backward``, all under ``numerics.our_numerics``. The math
is in the docstrings of ``doracheck.forward`` and ``doracheck.backward``.
"""

from __future__ import annotations

import torch

from . import backward as backward_pass
from . import dispatch, norm_rule
from . import forward as forward_pass
from .kernels.compose_torch import accumulation_dtype
from .kernels.tracing import tracing
from .layer_state import SAVED_TENSORS, LayerArgs, Need, Saved
from .numerics import autocast_dtype, our_numerics

_PARAM_NAMES = ("weight", "lora_A", "lora_B", "magnitude", "bias")


def _held_on_ctx(t: torch.Tensor | None) -> bool:
    """Whether a parameter argument rides on the ctx rather than through ``save_for_backward``:
    module parameters (``nn.Parameter``, not inference tensors), alive with their module anyway.
    Any other tensor (a weight dequantized or cast for this call) is saved, so it is freed after
    the backward (a ctx reference would keep it as long as the graph)."""
    return isinstance(t, torch.nn.Parameter) and not t.is_inference()


def _save(ctx, saved: Saved, a: LayerArgs, lead: tuple) -> None:
    """Keep ``saved`` and the parameters for the backward. Activations go through
    ``save_for_backward`` (and saved-tensor hooks such as activation checkpointing's: three Python
    calls per tensor and step). In eager, module parameters ride on the ctx with their version
    counters, checked by ``_restore`` as autograd checks saved tensors: a hook would only pack and
    unpack them again (5 hook-packed tensors per PEFT layer call instead of 10). While
    torch.compile traces everything is saved (the form it supports). ``n_safe`` is kept only for
    the exact-norm backward, which reads it."""
    tensors = tuple(saved[:SAVED_TENSORS])
    if a.detach_norm:
        tensors = tensors[:6] + (None,) + tensors[7:]
    params = (a.weight, a.lora_A, a.lora_B, a.magnitude, a.bias)
    held = (None,) * len(params) if tracing() else tuple(t if _held_on_ctx(t) else None for t in params)
    ctx.save_for_backward(*tensors, *(None if h is not None else t for t, h in zip(params, held)))
    ctx.params = held
    ctx.param_versions = tuple(None if t is None else t._version for t in held)
    ctx.flags = saved.flags()
    ctx.settings = (a.scaling, a.fan_in_fan_out, a.dropout_p, a.detach_norm)
    ctx.lead = lead


def _check_versions(ctx) -> None:
    """Refuse ctx-held parameters written in place since the forward (as autograd does)."""
    for name, t, version in zip(_PARAM_NAMES, ctx.params, ctx.param_versions):
        if t is not None and t._version != version:
            raise RuntimeError(
                f"{name}: modified by an inplace operation between the DoRA forward and its backward (version "
                f"{t._version}, expected {version}), so the gradient would be wrong; clone it before modifying it, "
                "or modify it after the backward"
            )


def _restore(ctx) -> tuple[Saved, LayerArgs]:
    tensors = ctx.saved_tensors
    _check_versions(ctx)
    params = tuple(h if h is not None else t for h, t in zip(ctx.params, tensors[SAVED_TENSORS:]))
    return Saved.rebuild(tensors, ctx.flags), LayerArgs(*params, *ctx.settings)


def _records(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a call on ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class DoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
        a = LayerArgs(weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, dropout_p, detach_norm)
        backend = dispatch.backend_for(x, weight, lora_A, lora_B, magnitude, bias)
        y, saved = forward_pass.linear_forward(x, a, keep_mask, backend)
        _save(ctx, saved, a, x.shape[:-1])
        return y  # 2-D: reshaped by the caller, so in-place ops on the result are allowed

    @staticmethod
    def backward(ctx, dy):
        norm_rule.note_backward()
        saved, a = _restore(ctx)
        with our_numerics(dy.device.type):
            grads = backward_pass.layer_backward(saved, dy, a, ctx.lead, Need(*ctx.needs_input_grad[:6]))
        return (*grads, None, None, None, None, None)


def dora_linear_autograd(x, weight, lora_A, lora_B, magnitude, scaling, bias, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
    """Apply ``DoRALinearFunction`` (arguments validated, ``scaling`` a float); without autograd,
    the forward alone. Under autocast x is first cast to autocast's dtype (as ``F.linear``), so
    the GEMMs and y use it, while the norm, g and the adapter gradients keep the parameters'."""
    cast_to = autocast_dtype(x)
    if cast_to is not None and x.dtype != cast_to:
        x = x.to(cast_to)
    with our_numerics(x.device.type):
        if not _records(x, weight, lora_A, lora_B, magnitude, bias):
            a = LayerArgs(weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, dropout_p, detach_norm)
            backend = dispatch.backend_for(x, weight, lora_A, lora_B, magnitude, bias)
            y, _ = forward_pass.linear_forward(x, a, keep_mask, backend, need_saved=False)
        else:
            y = DoRALinearFunction.apply(
                x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out
            )
    return y.reshape(*x.shape[:-1], y.shape[-1])


class DoRAFromBaseFunction(torch.autograd.Function):
    """DoRA on top of an output a caller (PEFT's LoRA Linear) already computed. PEFT's form, for
    each active adapter in turn: y = result + (g-1)⊙(result - b) + g⊙s⊙lora, lora = (x·Aᵀ)·Bᵀ,
    i.e. y = g⊙(result - b + s·(x·Aᵀ)·Bᵀ) + b; with dropout (``keep_mask``, x_d = x·keep/(1-p)):
    y = result + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ, one extra x_d·Wᵀ GEMM, z_d saved.

    ``result_is_base=True`` (the first active adapter: result = x·Wᵀ + b exactly): ``result`` is
    rewritten in place (marked dirty): no T×d_out buffer, no second x·Wᵀ, and the backward returns
    the whole dx = dz·W + s·(dz·B)·A and no gradient to ``result``, so the base layer's backward
    (another d_out×d_in GEMM) never runs. Only for frozen W (the caller checks).

    While torch.compile traces, y is a new tensor (``in_place=False``): a compiled region whose
    input ``result`` a Function marks dirty was seen to train a different model (the variant's
    forward compiled as its own frame after an earlier compile skipped PEFT's Linear.forward).

    ``result_is_base=False`` (result carries an earlier adapter's output too): y is a new tensor
    (the earlier adapter may have saved ``result``), ``result`` gets its gradient (g⊙dy; dy with
    dropout), dx only this adapter's own terms, and a trainable bias the part this adapter adds:
    Σ_t (1-g)⊙dy (nothing with dropout)."""

    @staticmethod
    def forward(ctx, result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask=None, dropout_p=0.0,
                result_is_base=True, in_place=True):
        # ``result`` comes first: when it is a view (F.linear on 3-D input), autograd rebases its
        # history through CopySlices, which takes the dirty tensor's gradient from slot 0.
        a = LayerArgs(weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, dropout_p, True)
        with our_numerics(result.device.type):
            backend = dispatch.backend_for(x, weight, lora_A, lora_B, magnitude, bias)
            out, saved = forward_pass.from_base_forward(result, x, a, keep_mask, backend, need_saved=True, in_place=in_place,
                                                        result_is_base=result_is_base)
        if in_place:
            ctx.mark_dirty(result)
        _save(ctx, saved, a, x.shape[:-1])
        ctx.result_is_base = result_is_base
        return out

    @staticmethod
    def backward(ctx, dy):
        return (*_from_base_grads(ctx, dy), None, None, None, None, None, None)


def _from_base_grads(ctx, dy: torch.Tensor) -> tuple:
    """(d_result, dx, None, dA, dB, dm, db): the gradients of a from-base Function's first seven
    inputs (result, x, weight, lora_A, lora_B, magnitude, bias), from what ``_save`` kept."""
    norm_rule.note_backward()
    saved, a = _restore(ctx)
    T, d_out = saved.x2.shape[0], saved.g.shape[0]
    assert saved.h is not None  # every training forward keeps z, z_d or the output
    saved = saved._replace(h=saved.h.reshape(T, d_out))
    need = ctx.needs_input_grad  # result, x, weight, lora_A, lora_B, magnitude, bias, ...
    with our_numerics(dy.device.type):
        dx, _dW, dA, dB, dm, db = backward_pass.layer_backward(
            saved, dy, a, ctx.lead, Need(need[1], False, need[3], need[4], need[5], need[6]), base_in_dx=ctx.result_is_base
        )
        d_result = None
        if not ctx.result_is_base:
            d_result, db = _through_result(dy.reshape(T, d_out), saved, db)
            d_result = d_result.reshape(dy.shape) if need[0] else None
    return d_result, dx, None, dA, dB, dm, db


def _through_result(dy2: torch.Tensor, saved: Saved, db: torch.Tensor | None):
    """(gradient to ``result``, the bias gradient corrected) for a later adapter. With dropout
    y = result + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙lora_d: b reaches y only through result. Without,
    ∂y/∂result = g (saturated as dz is where n < eps, g up to m/1e-12) and ∂y/∂b = 1 - g."""
    if saved.keep is not None:
        return dy2, None if db is None else torch.zeros_like(db)
    acc = accumulation_dtype(saved.x2, saved.g)
    d_result = backward_pass.saturated(dy2.to(acc) * saved.g, dy2.dtype)
    if db is not None:  # Σ_t (1-g)⊙dy
        db = (db.to(acc) - d_result.to(acc).sum(0)).to(db.dtype)
    return d_result, db


def dora_from_base(x, result, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out=False, keep_mask=None, dropout_p=0.0,
                   result_is_base=True, n_safe=None):
    """y of ``DoRAFromBaseFunction`` (see the class), into ``result`` when ``result_is_base`` and
    nothing traces. ``scaling``: a float. ``n_safe``: max(n, eps) from an armed
    ``inference_norms`` buffer, used only where autograd records nothing."""
    in_place = result_is_base and not tracing()
    if not _records(result, x, lora_A, lora_B, magnitude, bias):
        # No autograd: the forward alone, without the Function machinery (decode runs here).
        a = LayerArgs(weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, dropout_p, True)
        with our_numerics(result.device.type):
            backend = dispatch.backend_for(x, weight, lora_A, lora_B, magnitude, bias)
            out, _ = forward_pass.from_base_forward(result, x, a, keep_mask, backend, need_saved=False, in_place=in_place,
                                                    result_is_base=result_is_base, n_safe=n_safe)
        return out
    return DoRAFromBaseFunction.apply(
        result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask, dropout_p, result_is_base, in_place
    )
