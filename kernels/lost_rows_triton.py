"""The magnitude gradient's last pass, in Triton: the partial sums added up, the features whose
z the saved output no longer holds recomputed, the result rounded once to m's dtype.

Where the backward recovers g⊙z from the saved output (Triton path, no dropout, no bias), a
feature i with g_i = 0 while n_i >= eps (magnitude exactly 0) has y_i = 0 for every token: z_i
is gone and the dz/dm pass can only mark dm_i as lost (NaN). This pass forms

    dm_i = Σ_p part_pi                                   (fp32, in the order p = 0, 1, ...)
    dm_i = Σ_t dy_ti·z_ti / max(n_i, eps)  where lost,   z_ti = Σ_k x_tk·W_ik + s·Σ_j xa_tj·B_ij

rounded once to the output's dtype: one launch instead of three host operations (the sum, the
lost-row kernel, the cast) on a host-bound training step. One program per BLOCK_D features, the
partials read coalesced; a block with no lost feature (the common case) recomputes nothing. A
lost feature costs O(T·(d_in + r)) reads; fp32, fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import eps
from .triton_common import cdiv, interpreting, launcher, round_to, traced_launch

BLOCK_T = 32
BLOCK_K = 64
BLOCK_D = 128


@triton.jit
def _dm_finish_kernel(
    dm_ptr,  # out: (d_out,) in m's dtype (or fp32)
    part_ptr, stride_pp,  # fp32 (P, d_out) partial sums of dm, features contiguous
    dy_ptr, stride_dyt, stride_dyd,  # (T, d_out)
    x_ptr, stride_xt, stride_xk,  # (T, d_in)
    w_ptr, stride_wo, stride_wi,  # W as (d_out, d_in) (a transposed view for fan_in_fan_out)
    xa_ptr, stride_at, stride_ar,  # x·Aᵀ (T, r)
    b_ptr, stride_bo, stride_br,  # B (d_out, r)
    g_ptr, n_ptr,  # fp32 (d_out,)
    P, T, d_in, r, d_out, scaling, eps,
    INTERPRET: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dm = Σ_p part_p, with dm_i = Σ_t dy_ti·(x_t·W_i + s·xa_t·B_i) / max(n_i, eps) where
    g_i = 0 and n_i >= eps; rounded once to dm's dtype."""
    pid = tl.program_id(0).to(tl.int64)
    s = tl.cast(scaling, tl.float32)
    eps = tl.cast(eps, tl.float32)  # Inductor passes fp64 scalars: dm must stay fp32 through the loop
    jj = tl.arange(0, BLOCK_D)
    cols = pid * BLOCK_D + jj
    ok = cols < d_out
    dm = tl.zeros([BLOCK_D], dtype=tl.float32)
    part = part_ptr + cols  # pointer arithmetic is 64-bit: P·d_out may pass 2^31
    for _ in range(0, P):
        dm += tl.load(part, mask=ok, other=0.0)
        part += stride_pp
    g = tl.load(g_ptr + cols, mask=ok, other=1.0).to(tl.float32)
    n = tl.load(n_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    lost = ok & (g == 0.0) & (n >= eps)
    if tl.sum(lost.to(tl.int32), axis=0) > 0:
        tt = tl.arange(0, BLOCK_T)
        kk = tl.arange(0, BLOCK_K)
        for j in range(0, BLOCK_D):
            mine = jj == j
            lost_j = tl.sum((mine & lost).to(tl.int32), axis=0) > 0
            n_j = tl.sum(tl.where(mine, n, 0.0), axis=0)
            i = pid * BLOCK_D + j
            t_end = tl.where(lost_j, T, 0)  # not lost: no iteration at all
            acc = tl.zeros([BLOCK_T], dtype=tl.float32)
            for t0 in range(0, t_end, BLOCK_T):
                rows = (t0 + tt).to(tl.int64)  # T·d_in may pass 2^31
                row_ok = rows < T
                z = tl.zeros([BLOCK_T], dtype=tl.float32)
                for k0 in range(0, d_in, BLOCK_K):
                    kc = k0 + kk
                    kc_ok = kc < d_in
                    xt = tl.load(x_ptr + rows[:, None] * stride_xt + kc[None, :] * stride_xk,
                                 mask=row_ok[:, None] & kc_ok[None, :], other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + i * stride_wo + kc * stride_wi, mask=kc_ok, other=0.0).to(tl.float32)
                    z += tl.sum(xt * w[None, :], axis=1)
                for j0 in range(0, r, BLOCK_K):
                    kc = j0 + kk
                    kc_ok = kc < r
                    at = tl.load(xa_ptr + rows[:, None] * stride_at + kc[None, :] * stride_ar,
                                 mask=row_ok[:, None] & kc_ok[None, :], other=0.0).to(tl.float32)
                    b = tl.load(b_ptr + i * stride_bo + kc * stride_br, mask=kc_ok, other=0.0).to(tl.float32)
                    z += s * tl.sum(at * b[None, :], axis=1)
                dy = tl.load(dy_ptr + rows * stride_dyt + i * stride_dyd, mask=row_ok, other=0.0).to(tl.float32)
                acc += dy * z
            dm_j = tl.sum(acc, axis=0) / tl.maximum(n_j, eps)
            dm = tl.where(mine & lost, dm_j, dm)
    tl.store(dm_ptr + cols, round_to(dm, dm_ptr.dtype.element_ty, INTERPRET), mask=ok)


def dm_finish_triton(
    parts: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, weight_rows: torch.Tensor, xa: torch.Tensor,
    lora_B: torch.Tensor, g: torch.Tensor, n: torch.Tensor, scaling: float, out_dtype: torch.dtype,
) -> torch.Tensor:
    """dm (d_out,) in ``out_dtype``: the rows of ``parts`` (P, d_out) fp32 summed in order, the
    lost features (g = 0, n >= eps) recomputed, rounded once. ``weight_rows``: W as (d_out, d_in),
    any strides; g and n contiguous."""
    P, d_out = parts.shape
    out = torch.empty(d_out, dtype=out_dtype, device=parts.device)
    if d_out == 0:
        return out
    if parts.stride(1) != 1:
        parts = parts.contiguous()
    traced = traced_launch()
    args = (
        out,
        parts, parts.stride(0),
        dy, dy.stride(0), dy.stride(1),
        x, x.stride(0), x.stride(1),
        weight_rows, weight_rows.stride(0), weight_rows.stride(1),
        xa, xa.stride(0), xa.stride(1),
        lora_B, lora_B.stride(0), lora_B.stride(1),
        g, n,
        P, dy.shape[0], x.shape[1], xa.shape[1], d_out, float(scaling), eps(),
    )
    constexprs = dict(INTERPRET=interpreting(), BLOCK_D=BLOCK_D, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K)
    grid = (cdiv(d_out, BLOCK_D),)
    launcher(_dm_finish_kernel, traced)[grid](*args, **constexprs)
    return out
