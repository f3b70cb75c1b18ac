"""Run PEFT's DoRA Linear layers through doracheck: ``enable(model)`` / ``disable(model)``.

The hook is PEFT's own extension point: each LoRA ``Linear`` keeps a per-adapter ``lora_variant``
object (a ``DoraLinearVariant`` for DoRA) whose static ``forward`` adds the adapter's contribution
to the base layer's output. ``enable`` swaps that object, adapter by adapter, for a
``DoracheckDoraLinearVariant``, a subclass overriding only ``forward``; init, merge, unmerge,
state-dict keys, save/load, several adapters, ``set_adapter`` and ``disable_adapters`` are PEFT's
unchanged. ``disable`` puts the original objects back.

The accelerated forward rewrites PEFT's base output x·Wᵀ + b in place into the DoRA output
(``doracheck.autograd.DoRAFromBaseFunction``), after ``dora_linear``'s input checks: the factored
norm (cached while W, A, B are unchanged, so generation pays for it once), the fused up-projection
+ stable compose, and a backward that computes dx itself, so the base layer's backward GEMM never
runs. With ``enable``'s ``norm_buffers``, compiled inference and decode stop recomputing norms.

Stays on PEFT's path (one info log line per ``enable`` call): embedding and conv DoRA, quantized or
otherwise non-float base layers, a trainable base weight, and, per call, a dropout module other
than ``nn.Dropout``, a non-contiguous base output, or variant keyword arguments (aLoRA offsets).
LoRA dropout (``nn.Dropout``) is accelerated with PEFT's semantics: x_d·Wᵀ is computed once more,
as PEFT does, and the keep-mask is PEFT's own draw. Adapters added after ``enable`` need another
``enable`` call. PEFT is an optional dependency: importing this module needs it, the rest not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.variants import DoraLinearVariant
from torch import nn

from doracheck import inference_norms
from doracheck.autograd import dora_from_base
from doracheck.inference_norms import STATE, state_of
from doracheck.validation import check_dora_inputs

logger = logging.getLogger("doracheck")


class DoracheckDoraLinearVariant(DoraLinearVariant):
    """PEFT's DoRA variant with doracheck's forward (everything else inherited)."""

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:  # type: ignore[override]
        base_layer, lora_A_mod, lora_B_mod, magnitude_mod, dropout, lora_A_dict = _submodules(module, active_adapter)
        weight = base_layer.weight
        dropout_active = module.training and not isinstance(dropout, nn.Identity)
        p = float(getattr(dropout, "p", 0.0))
        # PEFT's loop hands the first active adapter the base output x·Wᵀ + b and every later
        # one the sum so far; only the first may rewrite it in place and skip the base backward.
        active = module.active_adapter
        first = next((name for name in ([active] if isinstance(active, str) else active) if name in lora_A_dict), None)
        result_is_base = first == active_adapter
        if (
            weight.requires_grad
            or (result_is_base and not result.is_contiguous())
            or any(v is not None for v in kwargs.values())
            or (dropout_active and not isinstance(dropout, nn.Dropout))
        ):
            return DoraLinearVariant.forward(module, active_adapter, x, result, **kwargs)
        lora_A = lora_A_mod.weight
        lora_B = lora_B_mod.weight
        magnitude = magnitude_mod.weight
        scaling = float(module.scaling[active_adapter])
        check_dora_inputs(x, weight, lora_A, lora_B, magnitude, scaling, base_layer.bias, dropout_p=p if dropout_active else 0.0,
                          fan_in_fan_out=module.fan_in_fan_out)
        if result.shape[-1] != lora_B.shape[0] or result.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"result: expected shape {(*x.shape[:-1], lora_B.shape[0])} (the base layer's output), got "
                             f"{tuple(result.shape)}")
        # Armed by the model's pre-hook (no grad mode): max(n, eps) from the module's buffer, so
        # neither eager nor compiled inference recomputes the norm.
        n_safe = inference_norms.norm_buffer(module, active_adapter) if x.dtype != torch.float64 else None
        keep = None
        if dropout_active and p > 0:
            # The same draw PEFT's dropout(x) would make (same shape, dtype, device, RNG state).
            keep = dropout(torch.ones_like(x)) != 0
        return dora_from_base(x, result, weight, lora_A, lora_B, magnitude, base_layer.bias, scaling, module.fan_in_fan_out,
                              keep, p if keep is not None else 0.0, result_is_base, n_safe)


def _submodules(module: nn.Module, adapter: str):
    """(base layer, lora_A[adapter], lora_B[adapter], lora_magnitude_vector[adapter],
    lora_dropout[adapter], the lora_A ModuleDict) of a PEFT LoRA layer, read from the module dicts
    directly: this runs every layer call, and PEFT's ``get_base_layer()`` with ``Module.__getattr__``
    cost 7 µs of host time on a 2-core AMD EPYC (1 µs this way). PEFT's accessors otherwise."""
    mods: dict[str, Any] = module._modules
    try:
        base_layer = mods["base_layer"]
        while "base_layer" in base_layer._modules:  # a tuner layer wrapping another, as get_base_layer walks it
            base_layer = base_layer._modules["base_layer"]
        lora_A = mods["lora_A"]
        return (base_layer, lora_A._modules[adapter], mods["lora_B"]._modules[adapter],
                mods["lora_magnitude_vector"]._modules[adapter], mods["lora_dropout"]._modules[adapter], lora_A)
    except KeyError:  # anything unusual: PEFT's accessors (they raise PEFT's own errors)
        peft_layer: Any = module
        return (peft_layer.get_base_layer(), peft_layer.lora_A[adapter], peft_layer.lora_B[adapter],
                peft_layer.lora_magnitude_vector[adapter], peft_layer.lora_dropout[adapter], peft_layer.lora_A)


def _why_not(module: nn.Module, adapter: str) -> str | None:
    """None when (module, adapter) can run through doracheck, else the reason it cannot."""
    if type(module) is not LoraLinear:
        return f"{type(module).__name__} layers (only plain Linear / Conv1D DoRA is accelerated)"
    weight = getattr(module.get_base_layer(), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return "quantized or non-float base weights"
    if weight.dim() != 2:
        return "non-2-D base weights"
    return None


def enable(model: nn.Module, *, norm_buffers: bool = True) -> nn.Module:
    """Route every PEFT DoRA Linear adapter of ``model`` through doracheck, in place; says at INFO
    (logger "doracheck") how many adapters it routed and which stay on PEFT's path and why. Returns
    the model (the fixed API: ``model = enable(model)``; ``_ =`` in a REPL that would print it).

    ``norm_buffers`` (default True): hook the model so that forwards without grad mode read each
    layer's norm from its state, refreshed by the norm rule before the forward (once per ``generate``
    call; ``doracheck.inference_norms``), so a compiled ``generate`` stops recomputing norms. False:
    no hooks; every layer looks its norm up itself."""
    accelerated = 0
    skipped: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        variants = getattr(module, "lora_variant", None)
        if not isinstance(variants, dict):
            continue
        for adapter, variant in list(variants.items()):
            if isinstance(variant, DoracheckDoraLinearVariant) or "Dora" not in type(variant).__name__:
                continue  # already enabled, or not a DoRA variant (e.g. aLoRA): not ours
            reason: str | None = (
                f"{type(variant).__name__}: only Linear / Conv1D DoRA is accelerated"
                if type(variant) is not DoraLinearVariant  # DoraEmbeddingVariant, DoraConv*Variant, ...
                else _why_not(module, adapter)
            )
            if reason is not None:
                skipped.setdefault(reason, []).append(f"{name}[{adapter}]")
                continue
            state_of(module).originals[adapter] = variant
            variants[adapter] = DoracheckDoraLinearVariant()
            accelerated += 1
    if norm_buffers:
        inference_norms.attach(_routed(model), _entry_points(model))
    else:
        inference_norms.detach(model)
    left = sum(len(where) for where in skipped.values())
    logger.info("doracheck: %d DoRA Linear adapters now run through doracheck, %d stay on PEFT's path", accelerated, left)
    for reason, where in skipped.items():
        logger.info("doracheck: %d DoRA adapters stay on PEFT's path (%s), e.g. %s", len(where), reason, where[0])
    return model


def _routed(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [
        (module, adapter)
        for module in model.modules()
        for adapter, variant in (getattr(module, "lora_variant", None) or {}).items()
        if isinstance(variant, DoracheckDoraLinearVariant)
    ]


def _entry_points(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward runs a whole inference: the model given to ``enable`` and,
    for a PEFT model, the base model (its ``generate`` calls that one)."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else None
    return [model] if base is None or base is model else [model, base]


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: PEFT's own DoRA variant classes come back, the norm buffers and hooks go
    (also through a ``torch.compile`` wrapper); returns the model. Call it before
    ``merge_and_unload()``, whose returned base model would otherwise keep the hooks."""
    inference_norms.detach(model)
    for module in getattr(model, "_orig_mod", model).modules():
        state = module.__dict__.pop(STATE, None)
        originals = None if state is None else state.originals
        if not originals:
            continue
        variants: dict = module.__dict__.get("lora_variant") or getattr(module, "lora_variant", {})
        for adapter, variant in originals.items():
            if isinstance(variants.get(adapter), DoracheckDoraLinearVariant):
                variants[adapter] = variant
    return model


def enabled_adapters(model: nn.Module) -> list[str]:
    """``module[adapter]`` names currently running through doracheck (for tests and logs)."""
    return [
        f"{name}[{adapter}]"
        for name, module in model.named_modules()
        for adapter, variant in (getattr(module, "lora_variant", None) or {}).items()
        if isinstance(variant, DoracheckDoraLinearVariant)
    ]
