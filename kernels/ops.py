"""The Triton kernels as torch.library custom ops, so torch.compile sees ops, not Python.

``triton_op`` makes the body visible to torch.compile and torch.export; the kernels inside
are launched through ``wrap_triton``. Under fake tensors (torch.compile's tracing) the body
runs with fake inputs and the kernel launches are recorded, not run, so each op's fake
implementation is its own body: shapes and dtypes come from the same allocation code.

Ops (namespace ``doracheck``):
- ``factored_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out) -> (base, cross, lora, norm)``
- ``lora_up_compose_(base!, xa, lora_B, g, bias?, scaling)``: y written in place into base
- ``lora_up_compose_dropout(base, base_dropped, xa, lora_B, g, bias?, scaling) -> (y, z_d)``
- ``grad_scale_dm(dy, saved, g, bias?, from_output) -> (dz, dm_sum)``
"""

from __future__ import annotations

import torch
from torch.library import triton_op

from .compose_triton import grad_scale_dm_triton, lora_up_compose_triton
from .norm_triton import factored_norm_triton


@triton_op("doracheck::factored_norm", mutates_args=())
def factored_norm_op(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    result = factored_norm_triton(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)
    return result.base, result.cross, result.lora, result.norm


@triton_op("doracheck::lora_up_compose_", mutates_args={"base"})
def lora_up_compose_inplace_op(
    base: torch.Tensor,
    xa: torch.Tensor,
    lora_B: torch.Tensor,
    g: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: float,
) -> None:
    lora_up_compose_triton(base, xa, lora_B, g, scaling, bias, out=base)


@triton_op("doracheck::lora_up_compose_dropout", mutates_args=())
def lora_up_compose_dropout_op(
    base: torch.Tensor,
    base_dropped: torch.Tensor,
    xa: torch.Tensor,
    lora_B: torch.Tensor,
    g: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(base)
    z = torch.empty_like(base)
    lora_up_compose_triton(base, xa, lora_B, g, scaling, bias, base_dropped, out=y, z_out=z)
    return y, z


@triton_op("doracheck::grad_scale_dm", mutates_args=())
def grad_scale_dm_op(
    dy: torch.Tensor, saved: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, from_output: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return grad_scale_dm_triton(dy, saved, g, bias, from_output=from_output)
