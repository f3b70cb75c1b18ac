"""The Triton kernels as torch.library custom ops, so torch.compile sees ops, not Python.

Each op is a functional ``torch.library.custom_op`` (no argument mutated): torch.compile and
torch.export keep it as one node, which launches its kernels as eager code does. Its fake
(meta) implementation only allocates its outputs (``_register`` says why, and why not
``triton_op``, which ``DORACHECK_TRACE_KERNELS=1`` brings back); ``grad_scale_dm``'s fake takes
the token block of its partials from ``settings.grad_config`` as the kernel does.

In eager, ``call`` runs the implementations directly (the dispatcher and ``wrap_triton`` cost
about 0.2 ms of CPU per call, which would dominate decode (T = 1) on an H200) and writes y in
place into the base output (``lora_up_compose_``, ``lora_up_compose_save_z_``: no T×d_out
buffer); while tracing it calls the functional op, so a graph needs no mutation analysis.
Traced launches never pass one tensor as two pointer arguments (that made Inductor miscompute
the norm: ``norm_triton.rowdot_parts``); in eager an unread pointer may repeat another
(``triton_common.unused_pointer``).

Ops (namespace ``doracheck``, registered below; meanings as in ``backends``' docstring):
factored_norm ((4, d_out) fp32 rows base, cross, lora, norm), lora_up_compose,
lora_up_compose_save_z (y, z), lora_up_compose_dropout (y, z_d), grad_scale_dm (unsummed
partials flat: ``_grad_scale_dm_flat_parts``), dm_finish.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.library import triton_op

from .compose_torch import magnitude_scale
from .compose_triton import grad_scale_dm_triton, lora_up_compose_triton
from .lost_rows_triton import dm_finish_triton
from .norm_triton import norm_terms
from .settings import grad_config
from .triton_common import tracing

_TRACE_KERNELS = os.environ.get("DORACHECK_TRACE_KERNELS", "0") == "1"  # read once, at registration (``_register``)


def _factored_norm(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """The (4, d_out) fp32 rows (base, cross, lora, norm): one output tensor, as a custom op's
    outputs may not alias one another (four views of one buffer would)."""
    return norm_terms(weight, lora_A, lora_B, scaling, fan_in_fan_out)


def _lora_up_compose_(
    base: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Eager only: y written in place into ``base``, which is returned."""
    lora_up_compose_triton(base, xa, lora_B, g, scaling, bias, out=base)
    return base


def _lora_up_compose(
    base: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    y = torch.empty_like(base)
    lora_up_compose_triton(base, xa, lora_B, g, scaling, bias, out=y)
    return y


def _lora_up_compose_save_z_(
    base: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, scaling: float,
    base_has_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager only: (y written in place into ``base``, z)."""
    z = torch.empty_like(base)
    lora_up_compose_triton(base, xa, lora_B, g, scaling, bias, out=base, z_out=z, base_has_bias=base_has_bias)
    return base, z


def _lora_up_compose_save_z(
    base: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, scaling: float,
    base_has_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(base)
    z = torch.empty_like(base)
    lora_up_compose_triton(base, xa, lora_B, g, scaling, bias, out=y, z_out=z, base_has_bias=base_has_bias)
    return y, z


def _lora_up_compose_dropout(
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


def _grad_scale_dm(
    dy: torch.Tensor, saved: torch.Tensor, g: torch.Tensor, n: torch.Tensor, bias: torch.Tensor | None, from_output: bool,
    final_dm: bool = False, reduce: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    return grad_scale_dm_triton(dy, saved, g, n, bias, from_output=from_output, final_dm=final_dm, reduce=reduce)


def _dm_finish(
    parts: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, weight_rows: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor,
    g: torch.Tensor, n: torch.Tensor, scaling: float, out_dtype: torch.dtype,
) -> torch.Tensor:
    return dm_finish_triton(parts, dy, x, weight_rows, xa, lora_B, g, n, scaling, out_dtype)


# Registered forms: unsummed partials travel flat, (P·d_out,), P = ceil(T / block). With a
# symbolic T, torch's contiguity check of a (P, d_out) tensor guards on P == 1, so a graph
# recompiled between T <= block and T > block (H200: two graphs over T = 3..1030, block 64).
# A flat P·d_out is never 1 (d_out >= 2 is static): no guard.
def _grad_scale_dm_flat_parts(
    dy: torch.Tensor, saved: torch.Tensor, g: torch.Tensor, n: torch.Tensor, bias: torch.Tensor | None, from_output: bool,
    final_dm: bool = False, reduce: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    dz, sums = _grad_scale_dm(dy, saved, g, n, bias, from_output, final_dm, reduce)
    return dz, (sums if reduce else sums.reshape(-1))


def _dm_finish_flat_parts(
    parts: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, weight_rows: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor,
    g: torch.Tensor, n: torch.Tensor, scaling: float, out_dtype: torch.dtype,
) -> torch.Tensor:
    d_out = g.shape[0]
    if parts.dim() == 2:
        rows = parts
    elif d_out > 0:
        rows = parts.view(-1, d_out)  # (P·d_out,) -> (P, d_out)
    else:  # no output features: no row length to split by (view(-1, 0) raises), and nothing to sum
        rows = parts.view(0, 0)
    return dm_finish_triton(rows, dy, x, weight_rows, xa, lora_B, g, n, scaling, out_dtype)


def launch_device(args) -> int | None:
    """The CUDA device (the first tensor's) the eager launches on ``args`` must be made on, where
    it is not the current device, else None. Triton launches on the *current* device's stream,
    and accelerate's ``device_map`` runs layers on several GPUs without switching it: a layer on
    cuda:1 would run on cuda:0's stream, unordered with its inputs' producers (or fail)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cuda:
                return None
            index = a.device.index
            return index if index != torch.cuda.current_device() else None
    return None


def _guarded(body: Callable[..., Any]) -> Callable[..., Any]:
    """A registered op's body, run on its tensors' device when it launches (not while
    tracing): a graph that aot_eager or the eager backend compiled runs the bodies themselves."""

    @functools.wraps(body)
    def run(*args, **kwargs):
        if tracing():
            return body(*args, **kwargs)
        return _on_device(lambda *_: body(*args, **kwargs), args)

    return run


def _rows(weight: torch.Tensor, fan_in_fan_out: bool) -> int:
    return weight.shape[1] if fan_in_fan_out else weight.shape[0]


def _factored_norm_fake(weight, lora_A, lora_B, scaling, fan_in_fan_out):
    return weight.new_empty((4, _rows(weight, fan_in_fan_out)), dtype=torch.float32)


def _compose_fake(base, *_args):
    return torch.empty_like(base)


def _compose_pair_fake(base, *_args):
    return torch.empty_like(base), torch.empty_like(base)


def _grad_scale_dm_fake(dy, saved, g, n, bias, from_output, final_dm=False, reduce=True):
    T, d_out = dy.shape
    if not reduce:  # one row of partials per token block of the kernel's tiles (one zero row when T = 0), flat
        blocks = torch.sym_max(-(-T // grad_config(T, d_out).block_t), 1)
        return torch.empty_like(dy), dy.new_empty(blocks * d_out, dtype=torch.float32)
    return torch.empty_like(dy), dy.new_empty(d_out, dtype=torch.float32)


def _dm_finish_fake(parts, dy, x, weight_rows, xa, lora_B, g, n, scaling, out_dtype):
    return parts.new_empty(g.shape[0], dtype=out_dtype)


def _register(name: str, body: Callable[..., Any], fake: Callable[..., Any]):
    """``doracheck::name`` as a functional op with fake (meta) implementation ``fake``. Opaque by
    default (``torch.library.custom_op``: the op launches its kernels as eager code does, the TMA
    compose included); with ``DORACHECK_TRACE_KERNELS=1`` at import, ``torch.library.triton_op``,
    which Inductor traces into. Why opaque: Inductor runs Triton's front end on every traced
    ``triton_op`` launch to learn which arguments it writes (``identify_mutated_tensors``,
    uncached: 690 TTIR generations in the first compiled step of the 4-layer benchmark model, torch
    2.11), making doracheck's compile twice PEFT DoRA's; these ops mutate nothing. Why a ``fake``
    that only allocates: the body picks tiles from the shapes (T <= 16, the token blocks), and on
    symbolic shapes each choice would become a guard, a recompile per tile bucket; the output
    shapes do not depend on them (``tests/kernels/test_ops_fakes.py`` runs
    ``torch.library.opcheck`` on each op)."""
    if _TRACE_KERNELS:
        return triton_op(f"doracheck::{name}", _guarded(body), mutates_args=())
    op = torch.library.custom_op(f"doracheck::{name}", _guarded(body), mutates_args=())
    op.register_fake(fake)
    return op


def _on_device(fn: Callable[..., Any], args: tuple):
    index = launch_device(args)
    if index is None:
        return fn(*args)
    with torch.cuda.device(index):
        return fn(*args)


factored_norm_op = _register("factored_norm", _factored_norm, _factored_norm_fake)
lora_up_compose_op = _register("lora_up_compose", _lora_up_compose, _compose_fake)
lora_up_compose_save_z_op = _register("lora_up_compose_save_z", _lora_up_compose_save_z, _compose_pair_fake)
lora_up_compose_dropout_op = _register("lora_up_compose_dropout", _lora_up_compose_dropout, _compose_pair_fake)
grad_scale_dm_op = _register("grad_scale_dm", _grad_scale_dm_flat_parts, _grad_scale_dm_fake)
dm_finish_op = _register("dm_finish", _dm_finish_flat_parts, _dm_finish_fake)

_EAGER: dict[str, Callable[..., Any]] = {
    "factored_norm": _factored_norm,
    "lora_up_compose_": _lora_up_compose_,
    "lora_up_compose_save_z_": _lora_up_compose_save_z_,
    "lora_up_compose_dropout": _lora_up_compose_dropout,
    "grad_scale_dm": _grad_scale_dm,
    "dm_finish": _dm_finish,
}

_TRACED = {
    "lora_up_compose_": "lora_up_compose", "lora_up_compose_save_z_": "lora_up_compose_save_z",
}


def compose_infer_(
    base: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, magnitude: torch.Tensor, n_safe: torch.Tensor,
    bias: torch.Tensor | None, scaling: float, base_has_bias: bool = False,
) -> torch.Tensor:
    """Inference (nothing saved for a backward): y = b + g⊙(base [- b] + s·xa·Bᵀ) with g = m / n_safe
    formed inside the kernel; in eager written in place into ``base``. While tracing: g in torch
    and the functional op (then use the returned tensor)."""
    if tracing():
        g = magnitude_scale(magnitude, n_safe)
        if base_has_bias and bias is not None:
            return torch.ops.doracheck.lora_up_compose_save_z(base, xa, lora_B, g, bias, scaling, True)[0]
        return torch.ops.doracheck.lora_up_compose(base, xa, lora_B, g, bias, scaling)
    if magnitude.stride(0) != 1:  # the kernel reads m with stride 1 (a strided view is valid input)
        magnitude = magnitude.contiguous()
    _on_device(lambda *_: lora_up_compose_triton(base, xa, lora_B, magnitude, scaling, bias, out=base,
                                                 base_has_bias=base_has_bias, n_safe=n_safe), (base,))
    return base


def call(name: str, *args):
    """Run op ``name``: directly in eager (on the tensors' device, ``launch_device``); while
    tracing through ``torch.ops.doracheck``, where the in-place names map to their functional
    ops (use the returned tensors)."""
    if tracing():
        return getattr(torch.ops.doracheck, _TRACED.get(name, name))(*args)
    return _on_device(_EAGER[name], args)
