"""The magnitude gradient of features whose z the saved output no longer holds, in Triton.

Where the backward recovers g⊙z from the saved output (Triton path, no dropout, no bias),
a feature i with g_i = 0 while n_i >= eps (its magnitude is exactly 0) has y_i = 0 for every
token, so z_i is gone and the dz/dm pass can only mark dm_i as lost (NaN). This kernel
recomputes it from the operands:

    dm_i = Σ_t dy_ti·z_ti / max(n_i, eps),   z_ti = Σ_k x_tk·W_ik + s·Σ_j xa_tj·B_ij

One program per feature; a program whose feature is not lost runs no loop iteration (its
trip count is 0), so where no magnitude is 0 the kernel reads g and n and nothing else.
A lost feature costs O(T·(d_in + r)) reads; accumulation is fp32, in a fixed order
(deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fast_launch
from .constants import EPS
from .tracing import tracing
from .triton_common import interpreting, launcher

BLOCK_T = 32
BLOCK_K = 64


@triton.jit
def _dm_lost_rows_kernel(
    dm_ptr,  # in/out: fp32 (d_out,); written only where the feature is lost
    dy_ptr, stride_dyt, stride_dyd,  # (T, d_out)
    x_ptr, stride_xt, stride_xk,  # (T, d_in)
    w_ptr, stride_wo, stride_wi,  # W as (d_out, d_in) (a transposed view for fan_in_fan_out)
    xa_ptr, stride_at, stride_ar,  # x·Aᵀ (T, r)
    b_ptr, stride_bo, stride_br,  # B (d_out, r)
    g_ptr, n_ptr,  # fp32 (d_out,)
    T, d_in, r, scaling, eps,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dm_i = Σ_t dy_ti·(x_t·W_i + s·xa_t·B_i) / max(n_i, eps) where g_i = 0 and n_i >= eps."""
    i = tl.program_id(0).to(tl.int64)
    s = tl.cast(scaling, tl.float32)
    g_i = tl.load(g_ptr + i).to(tl.float32)
    n_i = tl.load(n_ptr + i).to(tl.float32)
    lost = (g_i == 0.0) & (n_i >= eps)
    t_end = tl.where(lost, T, 0)  # not lost: no iteration at all
    tt = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for t0 in range(0, t_end, BLOCK_T):
        rows = (t0 + tt).to(tl.int64)  # T·d_in may pass 2^31
        row_ok = rows < T
        z = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            cols = k0 + kk
            col_ok = cols < d_in
            xt = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xk,
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + i * stride_wo + cols * stride_wi, mask=col_ok, other=0.0).to(tl.float32)
            z += tl.sum(xt * w[None, :], axis=1)
        for j0 in range(0, r, BLOCK_K):
            cols = j0 + kk
            col_ok = cols < r
            at = tl.load(xa_ptr + rows[:, None] * stride_at + cols[None, :] * stride_ar,
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_ptr + i * stride_bo + cols * stride_br, mask=col_ok, other=0.0).to(tl.float32)
            z += s * tl.sum(at * b[None, :], axis=1)
        dy = tl.load(dy_ptr + rows * stride_dyt + i * stride_dyd, mask=row_ok, other=0.0).to(tl.float32)
        acc += dy * z
    dm_i = tl.sum(acc, axis=0) / tl.maximum(n_i, eps)
    tl.store(dm_ptr + i, dm_i, mask=lost)


def dm_lost_rows_triton(
    dm: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, weight_rows: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor,
    g: torch.Tensor, n: torch.Tensor, scaling: float, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dm with its lost features (g = 0, n >= eps) recomputed; ``out`` may be ``dm`` (in place),
    else a copy is written. ``weight_rows`` is W as (d_out, d_in), any strides."""
    result = out if out is not None else dm.clone()
    T, d_out = dy.shape
    if T == 0 or d_out == 0:
        return result
    traced = tracing()
    args = (
        result,
        dy, dy.stride(0), dy.stride(1),
        x, x.stride(0), x.stride(1),
        weight_rows, weight_rows.stride(0), weight_rows.stride(1),
        xa, xa.stride(0), xa.stride(1),
        lora_B, lora_B.stride(0), lora_B.stride(1),
        g, n,
        T, x.shape[1], xa.shape[1], float(scaling), EPS,
    )
    constexprs = dict(BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K)
    if traced or interpreting():
        launcher(_dm_lost_rows_kernel, traced)[(d_out,)](*args, **constexprs)
    else:  # eager on a GPU: once per layer and training step (kernels/fast_launch.py)
        fast_launch.launch(_dm_lost_rows_kernel, (d_out,), args, constexprs, {})
    return result
