"""Factored DoRA row norm in Triton: one pass over W, nothing of size d_out × d_in written.

    n_i² = base_i + 2s·cross_i + s²·lora_i
    base_i  = Σ_k W_ik²                       (fp32, accumulated from the W tiles the GEMM loads)
    cross_i = Σ_j B_ij·U_ij,  U = W·Aᵀ        (GEMM M = d_out, N = r, K = d_in, fp32 accumulator)
    lora_i  = Σ_j (B·G)_ij·B_ij,  G = A·Aᵀ    (G from ``_gram_kernel``; B·G in the epilogue)

Kernels:
- ``_gram_kernel``: split-K partials of G = A·Aᵀ (SPLIT, r, r) in fp32, summed after in a
  fixed order (deterministic, no atomics).
- ``_factored_norm_kernel``: program (pm, pn) computes the (BLOCK_M × BLOCK_N) tile of U,
  the base term of its rows (only pn = 0 stores it), and the per-tile partial sums of cross
  and lora, stored to (n_tiles_n, d_out) buffers and reduced after in a fixed order.

Precision: with 16-bit W the U dot runs on bf16/fp16 tensor cores. fp32 adapters are split
into hi + lo halves in W's dtype (A = A_hi + A_lo, two dots), so A is not rounded to 8 bits:
U then carries about 16 significant bits per product, accumulated in fp32. fp32 dots use
``tf32x3`` (about fp32 accuracy). ``fan_in_fan_out`` is handled by strides (no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .norm_torch import FactoredNorm, combine_terms
from .settings import gram_config, norm_config
from .triton_common import dot_acc, interpreting

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _gram_kernel(
    g_part_ptr, stride_gs, stride_gi, stride_gj,  # out: (SPLIT, r, r) fp32 partials of A·Aᵀ
    a_ptr, stride_ar, stride_ak,  # A (r, d_in)
    r, d_in, k_per_split,
    DOT_DTYPE: tl.constexpr, SPLIT_LO: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """G_part[s] = Σ_{k in split s} A[i, k]·A[j, k]; with SPLIT_LO, A = hi + lo (DOT_DTYPE halves)
    and the product is hi·hiᵀ + hi·loᵀ + lo·hiᵀ (lo·loᵀ is below fp32 rounding)."""
    pid_i = tl.program_id(0).to(tl.int64)
    pid_j = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    ii = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, d_in)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + kk
        kmask = k < k_stop
        ai = tl.load(a_ptr + ii[:, None] * stride_ar + k[None, :] * stride_ak, mask=(ii[:, None] < r) & kmask[None, :], other=0.0)
        aj = tl.load(a_ptr + jj[:, None] * stride_ar + k[None, :] * stride_ak, mask=(jj[:, None] < r) & kmask[None, :], other=0.0)
        ai_hi = ai.to(DOT_DTYPE)
        aj_hi = aj.to(DOT_DTYPE)
        acc = dot_acc(ai_hi, tl.trans(aj_hi), acc, INTERPRET, PRECISION)
        if SPLIT_LO:
            ai_lo = (ai - ai_hi.to(tl.float32)).to(DOT_DTYPE)
            aj_lo = (aj - aj_hi.to(tl.float32)).to(DOT_DTYPE)
            acc = dot_acc(ai_hi, tl.trans(aj_lo), acc, INTERPRET, PRECISION)
            acc = dot_acc(ai_lo, tl.trans(aj_hi), acc, INTERPRET, PRECISION)
    out = g_part_ptr + pid_s * stride_gs + ii[:, None] * stride_gi + jj[None, :] * stride_gj
    tl.store(out, acc, mask=(ii[:, None] < r) & (jj[None, :] < r))


@triton.jit
def _factored_norm_kernel(
    base_ptr,  # out: (d_out,) fp32
    cross_part_ptr, lora_part_ptr, stride_part,  # out: (n_tiles_n, d_out) fp32 partials
    w_ptr, stride_wm, stride_wk,  # W viewed as (d_out, d_in) through strides
    a_ptr, stride_ar, stride_ak,  # A (r, d_in)
    b_ptr, stride_bm, stride_br,  # B (d_out, r)
    g_ptr, stride_gi, stride_gj,  # G = A·Aᵀ (r, r) fp32
    d_out, d_in, r,
    DOT_DTYPE: tl.constexpr, SPLIT_LO: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Tile (pm, pn): U = W[rows]·A[cols]ᵀ; base = Σ W[rows]²; cross/lora partials over cols."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < d_out
    col_ok = cols < r
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    base = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + kk
        k_ok = k < d_in
        w = tl.load(w_ptr + rows[:, None] * stride_wm + k[None, :] * stride_wk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + cols[:, None] * stride_ar + k[None, :] * stride_ak, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if pid_n == 0:
            wf = w.to(tl.float32)
            base += tl.sum(wf * wf, axis=1)
        a_hi = a.to(DOT_DTYPE)
        acc = dot_acc(w.to(DOT_DTYPE), tl.trans(a_hi), acc, INTERPRET, PRECISION)
        if SPLIT_LO:
            a_lo = (a.to(tl.float32) - a_hi.to(tl.float32)).to(DOT_DTYPE)
            acc = dot_acc(w.to(DOT_DTYPE), tl.trans(a_lo), acc, INTERPRET, PRECISION)
    # Epilogue: cross over this tile's columns, and (B·G)[rows, cols] for the lora term.
    b_tile = tl.load(b_ptr + rows[:, None] * stride_bm + cols[None, :] * stride_br, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    cross = tl.sum(b_tile * acc, axis=1)
    bg = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    jr = tl.arange(0, BLOCK_R)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + jr
        j_ok = j < r
        bj = tl.load(b_ptr + rows[:, None] * stride_bm + j[None, :] * stride_br, mask=row_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
        gj = tl.load(g_ptr + j[:, None] * stride_gi + cols[None, :] * stride_gj, mask=j_ok[:, None] & col_ok[None, :], other=0.0)
        bg = dot_acc(bj, gj, bg, INTERPRET, "tf32x3")
    lora = tl.sum(bg * b_tile, axis=1)
    tl.store(cross_part_ptr + pid_n * stride_part + rows, cross, mask=row_ok)
    tl.store(lora_part_ptr + pid_n * stride_part + rows, lora, mask=row_ok)
    if pid_n == 0:
        tl.store(base_ptr + rows, base, mask=row_ok)


def _dot_setup(weight: torch.Tensor, lora_A: torch.Tensor):
    """(DOT_DTYPE, SPLIT_LO, PRECISION) for this weight/adapter pair."""
    if weight.dtype == torch.float32:
        return tl.float32, False, "tf32x3"
    split = lora_A.dtype == torch.float32  # fp32 adapters: do not round A to 8/11 bits
    return _TL_DTYPE[weight.dtype], split, "ieee"


def gram_triton(lora_A: torch.Tensor, dot_dtype, split_lo: bool, precision: str) -> torch.Tensor:
    """G = A·Aᵀ in fp32 (r, r), deterministic split-K."""
    r, d_in = lora_A.shape
    cfg = gram_config(r, d_in)
    splits = max(1, min(cfg.max_split, triton.cdiv(d_in, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(d_in, splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(d_in, k_per_split) if d_in else 1
    part = torch.empty(splits, r, r, dtype=torch.float32, device=lora_A.device)
    grid = (triton.cdiv(r, cfg.block_i), triton.cdiv(r, cfg.block_i), splits)
    wrap_triton(_gram_kernel)[grid](
        part, part.stride(0), part.stride(1), part.stride(2),
        lora_A, lora_A.stride(0), lora_A.stride(1),
        r, d_in, k_per_split,
        DOT_DTYPE=dot_dtype, SPLIT_LO=split_lo, PRECISION=precision, INTERPRET=interpreting(),
        BLOCK_I=cfg.block_i, BLOCK_J=cfg.block_i, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return part.sum(0) if splits > 1 else part[0]


def factored_norm_triton(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    fan_in_fan_out: bool = False,
) -> FactoredNorm:
    """Same contract as ``factored_norm_torch`` (fp32 results; U is not materialised here:
    the ``U`` field is None, ``G`` is the fp32 Gram matrix)."""
    if fan_in_fan_out:
        d_in, d_out = weight.shape
        stride_wm, stride_wk = weight.stride(1), weight.stride(0)
    else:
        d_out, d_in = weight.shape
        stride_wm, stride_wk = weight.stride(0), weight.stride(1)
    r = lora_A.shape[0]
    dev = weight.device
    dot_dtype, split_lo, precision = _dot_setup(weight, lora_A)
    G = gram_triton(lora_A, dot_dtype, split_lo, precision)
    cfg = norm_config(d_out, d_in, r, weight.dtype)
    n_tiles = triton.cdiv(r, cfg.block_n)
    base = torch.empty(d_out, dtype=torch.float32, device=dev)
    cross_part = torch.empty(n_tiles, d_out, dtype=torch.float32, device=dev)
    lora_part = torch.empty(n_tiles, d_out, dtype=torch.float32, device=dev)
    if d_out > 0:
        grid = (triton.cdiv(d_out, cfg.block_m), n_tiles)
        wrap_triton(_factored_norm_kernel)[grid](
            base, cross_part, lora_part, cross_part.stride(0),
            weight, stride_wm, stride_wk,
            lora_A, lora_A.stride(0), lora_A.stride(1),
            lora_B, lora_B.stride(0), lora_B.stride(1),
            G, G.stride(0), G.stride(1),
            d_out, d_in, r,
            DOT_DTYPE=dot_dtype, SPLIT_LO=split_lo, PRECISION=precision, INTERPRET=interpreting(),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    cross = cross_part.sum(0) if n_tiles > 1 else cross_part[0]
    lora = lora_part.sum(0) if n_tiles > 1 else lora_part[0]
    return FactoredNorm(base, cross, lora, combine_terms(base, cross, lora, scaling), None, G)
