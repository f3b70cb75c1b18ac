"""The backend table: the same op set in a torch twin and a Triton twin (docs/design.md section 5).

A ``Backend`` is a NamedTuple of functions, one signature per op. The layer holds one per call
(``dispatch.backend_for``) and never asks which it holds. Adding a kernel is one file beside its
torch twin and one entry in each backend below (docs/design.md section 7).

Ops (``cd``: the compute dtype of ``base``; ``g`` = m / max(n, eps) in fp32; ``s`` the scaling):
- ``factored_norm(weight, lora_A, lora_B, s, fan_in_fan_out, need_factors) -> FactoredNorm``;
  ``need_factors``: U = W·Aᵀ and G = A·Aᵀ too (exact-norm backward; torch twin only).
- ``compose_infer(base, xa, lora_B, m, n_safe, bias, s, base_has_bias) -> y``: inference,
  y = b + g⊙(base [- b] + s·xa·Bᵀ) with g = m / n_safe formed by the op.
- ``compose_saving(base, xa, lora_B, g, bias, s, base_has_bias, output_may_stand_for_z)
  -> (y, h, from_output)``: training, y as above and h = z for the backward, or h = y and
  ``from_output`` True where the op allows it (Triton, no bias) and the caller says so (g⊙z = y).
- ``compose_dropout(base, base_dropped, xa, lora_B, g, bias, s) -> (y, z_d)``.
- ``grad_scale_dm(dy, h, g, n, bias, from_output, final_dm, reduce) -> (dz, dm partials)``.
- ``dm_finish(parts, dy, x, weight_rows, xa, lora_B, g, n, s, out_dtype) -> dm``: the (P, d_out)
  partials summed in order, the features the saved output lost recomputed, rounded once.
Ops that may write into ``base`` in eager return the tensor to use; callers use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .compose_torch import (
    dm_finish_torch,
    grad_scale_dm_torch,
    lora_up_compose_dropout_torch,
    lora_up_compose_torch,
    magnitude_scale,
)
from .norm_torch import FactoredNorm, factored_norm_torch


class Backend(NamedTuple):
    name: str
    factored_norm: Callable[..., FactoredNorm]
    compose_infer: Callable[..., torch.Tensor]
    compose_saving: Callable[..., tuple[torch.Tensor, torch.Tensor, bool]]
    compose_dropout: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    grad_scale_dm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    dm_finish: Callable[..., torch.Tensor]


def _norm_torch(weight, lora_A, lora_B, scaling, fan_in_fan_out, need_factors=False) -> FactoredNorm:
    return factored_norm_torch(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)


def _compose_infer_torch(base, xa, lora_B, magnitude, n_safe, bias, scaling, base_has_bias=False) -> torch.Tensor:
    g = magnitude_scale(magnitude, n_safe)
    return lora_up_compose_torch(base, xa, lora_B, g, bias, scaling, base_has_bias)[0]


def _compose_saving_torch(base, xa, lora_B, g, bias, scaling, base_has_bias, output_may_stand_for_z):
    # The torch path always keeps z: dm from y/g would round differently from the oracle's order.
    y, z = lora_up_compose_torch(base, xa, lora_B, g, bias, scaling, base_has_bias)
    return y, z, False


def _grad_scale_dm_torch(dy, h, g, n, bias, from_output, final_dm, reduce):
    return grad_scale_dm_torch(dy, h, g, n, bias, from_output=from_output, final_dm=final_dm, reduce=reduce)


TORCH = Backend(
    name="torch",
    factored_norm=_norm_torch,
    compose_infer=_compose_infer_torch,
    compose_saving=_compose_saving_torch,
    compose_dropout=lora_up_compose_dropout_torch,
    grad_scale_dm=_grad_scale_dm_torch,
    dm_finish=dm_finish_torch,
)

_TRITON: list[Backend] = []


def triton_backend() -> Backend:
    """The Triton backend (imported and built on first use: triton may be absent); its kernels
    go through ``ops.call`` (launched in eager, torch.library ops while torch.compile traces)."""
    if not _TRITON:
        _TRITON.append(_build_triton_backend())
    return _TRITON[0]


def by_name(name: str) -> Backend:
    """The backend called ``name`` ("torch" or "triton"): a backward finds its forward's here."""
    return TORCH if name == "torch" else triton_backend()


def _build_triton_backend() -> Backend:
    from . import ops

    def norm(weight, lora_A, lora_B, scaling, fan_in_fan_out, need_factors=False) -> FactoredNorm:
        if need_factors:  # U and G: only the torch twin forms them
            return _norm_torch(weight, lora_A, lora_B, scaling, fan_in_fan_out)
        base, cross, lora, n = ops.call("factored_norm", weight, lora_A, lora_B, float(scaling), fan_in_fan_out).unbind(0)
        return FactoredNorm(base, cross, lora, n, None, None)

    def compose_saving(base, xa, lora_B, g, bias, scaling, base_has_bias, output_may_stand_for_z):
        if bias is None and output_may_stand_for_z:  # y = g⊙z: the backward reads y itself
            y = ops.call("lora_up_compose_", base, xa, lora_B, g, None, scaling)
            return y, y, True
        y, z = ops.call("lora_up_compose_save_z_", base, xa, lora_B, g, bias, scaling, base_has_bias)
        return y, z, False

    def compose_dropout(base, base_dropped, xa, lora_B, g, bias, scaling):
        return ops.call("lora_up_compose_dropout", base, base_dropped, xa, lora_B, g, bias, scaling)

    def grad_scale_dm(dy, h, g, n, bias, from_output, final_dm, reduce):
        return ops.call("grad_scale_dm", dy, h, g, n, bias, from_output, final_dm, reduce)

    def dm_finish(*args: Any) -> torch.Tensor:
        return ops.call("dm_finish", *args)

    def compose_infer(*args: Any) -> torch.Tensor:
        return ops.compose_infer_(*args)

    return Backend("triton", norm, compose_infer, compose_saving, compose_dropout, grad_scale_dm, dm_finish)


def _build_at_import() -> None:
    """Build the Triton backend at import where CUDA and triton are both present, so a first
    call that torch.compile traces finds it built: built inside that trace, the emptiness of
    ``_TRITON`` became a guard and the second call recompiled the whole model (12 s of a 57 s
    compile for the 4-layer benchmark model, 25-29 s with kernels traced; H200, torch 2.11).
    Elsewhere a traced call takes the torch path. ``torch.cuda.device_count()`` asks NVML, so
    importing doracheck does not initialise the CUDA driver (processes forked after that could
    not use CUDA). A triton that fails to import leaves the build to first use, so ``import
    doracheck`` and the torch path keep working."""
    import importlib.util
    if importlib.util.find_spec("triton") is None or torch.cuda.device_count() == 0:
        return
    try:
        triton_backend()
    except Exception as exc:  # noqa: BLE001  (any failure here is reported again at first use)
        import logging

        logging.getLogger("doracheck").debug("Triton backend not built at import: %s", exc)


_build_at_import()
