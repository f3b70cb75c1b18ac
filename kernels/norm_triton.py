"""Factored DoRA row norm in Triton (and cuBLAS): nothing of size d_out × d_in written.

    n_i² = base_i + 2s·cross_i + s²·lora_i
    base_i  = Σ_k W_ik²                   (fp32)
    cross_i = Σ_j B_ij·(W·Aᵀ)_ij          (GEMM M = d_out, N = r, K = d_in)
    lora_i  = Σ_j B_ij·(B·G)_ij, G = A·Aᵀ (GEMM M = d_out, N = r, K = r; reduced in its epilogue)

Two paths for base and cross (``terms_from_gram``):
- 16-bit W (``settings.cublas_cross_pieces``): U = W·Aᵀ by cuBLAS with fp32 output (``cross_product_u``), then
  ``_norm_from_u_kernel`` reads W (base), U and B (cross) and the lora partials and finishes in one launch
  (d_out × r or 2r fp32 of U: no d_out × d_in).
- fp32 W: the row-dot kernel on (W, A, B) (tf32x3), base from the same W tiles, then ``_norm_finish_kernel``.

Kernels: ``_rowdot_kernel`` ((X, Y, C) = (B, G, B) for lora, (W, A, B) on the fp32 path), ``_gram_kernel``,
``_norm_finish_kernel`` / ``_norm_from_u_kernel``. Partials are summed in a fixed order, no atomics, and
cuBLAS is bitwise reproducible with a fixed workspace configuration: the norm is bitwise deterministic.

Precision: 16-bit X runs on tensor cores with fp32 accumulation (cuBLAS's U too: exact products, fp32
accumulation and split-K partials); fp32 X uses ``tf32x3`` (about fp32 accuracy). A Y of another dtype is
split into pieces of X's dtype, not rounded: fp32 (or fp16-under-bf16) A into two (hi + lo: 16 bits in bf16),
G into three with bf16 B (about all 24 bits; K = r, so cheap). With fp16 B the lora GEMM runs in fp32
(tf32x3): fp16 pieces of G would overflow or fall into subnormals. ``fan_in_fan_out`` is read through strides.

Why two paths (H200, bf16, r = 384; figures in ``settings.cublas_cross_pieces``): the row-dot kernel is right
only with 64-wide tiles when it also sums W², and the fused base term slows it, while cuBLAS's W·Aᵀ is fast
(the whole training norm at 8192²: 244.1 → 158.6 µs). An epilogue forming B·G inside the W·Aᵀ kernel cost
110-140 µs more (register pressure), hence the separate (B, G, B) launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from .norm_torch import FactoredNorm
from .settings import cublas_cross_pieces, gram_config, norm_reduce_config, rowdot_config
from .triton_common import cdiv, dot_acc, interpreting, launcher

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _tile_dot(
    x_ptr, stride_xm, stride_xk, y_ptr, stride_yn, stride_yk, rows, cols, M, N, k_start, k_stop,
    DOT_DTYPE: tl.constexpr, SPLIT_LO: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    COMPUTE_SQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(acc, sq): acc = X[rows, k_start:k_stop]·Y[cols, k_start:k_stop]ᵀ (fp32) and, with
    COMPUTE_SQ, sq = Σ_k X[rows, k]² (fp32)."""
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_stop
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(y_ptr + cols[:, None] * stride_yn + k[None, :] * stride_yk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if COMPUTE_SQ:
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
        y_hi = y.to(DOT_DTYPE)
        acc = dot_acc(x.to(DOT_DTYPE), tl.trans(y_hi), acc, INTERPRET, PRECISION)
        if SPLIT_LO > 1:
            rest = y.to(tl.float32) - y_hi.to(tl.float32)
            y_mid = rest.to(DOT_DTYPE)
            acc = dot_acc(x.to(DOT_DTYPE), tl.trans(y_mid), acc, INTERPRET, PRECISION)
            if SPLIT_LO > 2:
                y_lo = (rest - y_mid.to(tl.float32)).to(DOT_DTYPE)
                acc = dot_acc(x.to(DOT_DTYPE), tl.trans(y_lo), acc, INTERPRET, PRECISION)
    return acc, sq


@triton.jit
def _tile_dot_sub(
    x_ptr, stride_xm, stride_xk, y_ptr, stride_yn, stride_yk, rows, cols0, M, N, k_start, k_stop,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, N_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(acc0, acc1, acc2, sq): acc_i = X[rows]·Y[cols0 + i·BLOCK_N + (0..BLOCK_N)]ᵀ for the first N_SUB (2
    or 3) sub-tiles, from one load of each X tile (N = 384 takes three 128-wide tiles, not one padded to
    512), and sq = Σ_k X[rows, k]². Y is X's dtype (no split)."""
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    cols1 = cols0 + BLOCK_N
    cols2 = cols1 + BLOCK_N
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_stop
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        xd = x.to(DOT_DTYPE)
        y0 = tl.load(y_ptr + cols0[:, None] * stride_yn + k[None, :] * stride_yk, mask=(cols0 < N)[:, None] & k_ok[None, :], other=0.0)
        acc0 = dot_acc(xd, tl.trans(y0.to(DOT_DTYPE)), acc0, INTERPRET, PRECISION)
        y1 = tl.load(y_ptr + cols1[:, None] * stride_yn + k[None, :] * stride_yk, mask=(cols1 < N)[:, None] & k_ok[None, :], other=0.0)
        acc1 = dot_acc(xd, tl.trans(y1.to(DOT_DTYPE)), acc1, INTERPRET, PRECISION)
        if N_SUB > 2:
            y2 = tl.load(y_ptr + cols2[:, None] * stride_yn + k[None, :] * stride_yk, mask=(cols2 < N)[:, None] & k_ok[None, :], other=0.0)
            acc2 = dot_acc(xd, tl.trans(y2.to(DOT_DTYPE)), acc2, INTERPRET, PRECISION)
    return acc0, acc1, acc2, sq


@triton.jit
def _rowdot_store(part_ptr, stride_pn, slot, c_ptr, stride_cm, stride_cn, rows, cols, acc, M, N):
    """part[slot, rows] = Σ_{j in cols} C[rows, j]·acc[rows, j]."""
    row_ok = rows < M
    c = tl.load(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, mask=row_ok[:, None] & (cols < N)[None, :], other=0.0)
    tl.store(part_ptr + slot * stride_pn + rows, tl.sum(c.to(tl.float32) * acc, axis=1), mask=row_ok)


@triton.jit
def _rowdot_kernel(
    part_ptr, stride_pn,  # out: (SPLIT_K · n_slots, M) fp32 partials of Σ_j C⊙(X·Yᵀ)
    sq_ptr, stride_sq,  # out (COMPUTE_BASE): (SPLIT_K, M) fp32 partials of Σ_k X²
    x_ptr, stride_xm, stride_xk,  # X (M, K)
    y_ptr, stride_yn, stride_yk,  # Y (N, K)
    c_ptr, stride_cm, stride_cn,  # C (M, N)
    M, N, K, k_per_split, n_slots,
    DOT_DTYPE: tl.constexpr, SPLIT_LO: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    COMPUTE_BASE: tl.constexpr, N_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """part[ks·n_slots + pn·N_SUB + i, rows] = Σ_{j in sub-tile i of tile pn} C_ij·(X·Yᵀ)_ij over the ks-th
    range of k (split K, program axis 2); sq[ks, i] = Σ_{k in that range} X_ik² (from the pn = 0 programs).
    N_SUB > 1 (no split of Y): one program covers N_SUB tiles of BLOCK_N columns from one load of X."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * (BLOCK_N * N_SUB) + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    with_sq = COMPUTE_BASE and pid_n == 0
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    if N_SUB == 1:
        acc, sq = _tile_dot(
            x_ptr, stride_xm, stride_xk, y_ptr, stride_yn, stride_yk, rows, cols, M, N, k_start, k_stop,
            DOT_DTYPE, SPLIT_LO, PRECISION, INTERPRET, COMPUTE_BASE, BLOCK_M, BLOCK_N, BLOCK_K,
        )
        _rowdot_store(part_ptr, stride_pn, pid_k * n_slots + pid_n, c_ptr, stride_cm, stride_cn, rows, cols, acc, M, N)
    else:
        acc0, acc1, acc2, sq = _tile_dot_sub(
            x_ptr, stride_xm, stride_xk, y_ptr, stride_yn, stride_yk, rows, cols, M, N, k_start, k_stop,
            DOT_DTYPE, PRECISION, INTERPRET, N_SUB, BLOCK_M, BLOCK_N, BLOCK_K,
        )
        slot = pid_k * n_slots + pid_n * N_SUB
        _rowdot_store(part_ptr, stride_pn, slot, c_ptr, stride_cm, stride_cn, rows, cols, acc0, M, N)
        _rowdot_store(part_ptr, stride_pn, slot + 1, c_ptr, stride_cm, stride_cn, rows, cols + BLOCK_N, acc1, M, N)
        if N_SUB > 2:
            _rowdot_store(part_ptr, stride_pn, slot + 2, c_ptr, stride_cm, stride_cn, rows, cols + 2 * BLOCK_N, acc2, M, N)
    if with_sq:
        tl.store(sq_ptr + pid_k * stride_sq + rows, sq, mask=row_ok)


@triton.jit
def _store_terms(terms_ptr, stride_tr, rows, ok, base, cross, lora, s):
    """terms[0..3, rows] = base, cross, lora, norm = sqrt(max(base + 2s·cross + s²·lora, 0)) in fp32."""
    squared = base + (2.0 * s) * cross + (s * s) * lora
    squared = tl.where(squared < 0.0, 0.0, squared)  # rounding below 0 where W cancels s·B·A; NaN stays
    norm = tl.sqrt_rn(squared)
    tl.store(terms_ptr + rows, base, mask=ok)
    tl.store(terms_ptr + stride_tr + rows, cross, mask=ok)
    tl.store(terms_ptr + 2 * stride_tr + rows, lora, mask=ok)
    tl.store(terms_ptr + 3 * stride_tr + rows, norm, mask=ok)


@triton.jit
def _norm_finish_kernel(
    terms_ptr, stride_tr,  # out: (4, M) fp32 rows base, cross, lora, norm
    cross_part_ptr, stride_cp, n_cross,  # (n_cross, M) fp32 partials of the cross term
    sq_ptr, stride_sp, n_sq,  # (n_sq, M) fp32 partials of the base term
    lora_part_ptr, stride_lp, n_lora,  # (n_lora, M) fp32 partials of the lora term
    M, scaling, BLOCK: tl.constexpr,
):
    """base = Σ_p sq[p], cross = Σ_p cross_part[p], lora = Σ_p lora_part[p] (p in order), and
    norm (``_store_terms``), stored as the rows of ``terms`` (one output: no aliased pointers)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < M
    s = tl.cast(scaling, tl.float32)
    cross = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(0, n_cross):
        cross += tl.load(cross_part_ptr + p * stride_cp + rows, mask=ok, other=0.0)
    lora = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(0, n_lora):
        lora += tl.load(lora_part_ptr + p * stride_lp + rows, mask=ok, other=0.0)
    base = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(0, n_sq):
        base += tl.load(sq_ptr + p * stride_sp + rows, mask=ok, other=0.0)
    _store_terms(terms_ptr, stride_tr, rows, ok, base, cross, lora, s)


@triton.jit
def _norm_from_u_kernel(
    terms_ptr, stride_tr,  # out: (4, M) fp32 rows base, cross, lora, norm
    w_ptr, stride_wm, stride_wk,  # W rows (M, K), read through strides (fan_in_fan_out too)
    u_ptr, stride_um, stride_un,  # U = W·Aᵀ (M, N) fp32; (M, 2N) with PIECES = 2: W·A_hiᵀ, then W·A_loᵀ
    b_ptr, stride_bm, stride_bn,  # B (M, N)
    lora_part_ptr, stride_lp, n_lora,  # (n_lora, M) fp32 partials of the lora term
    M, N, K, scaling,
    PIECES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """base = Σ_k W_ik², cross = Σ_j B_ij·U_ij (PIECES = 2: Σ_j B_ij·(U_ij + U_i,N+j)), lora = Σ_p
    lora_part[p]; fp32 sums in a fixed order (element-wise into a BLOCK-wide accumulator, then one tree
    sum), stored like ``_norm_finish_kernel``; W streamed (cuBLAS cannot reduce in its epilogue)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        w = tl.load(w_ptr + rows[:, None] * stride_wm + k[None, :] * stride_wk, mask=ok[:, None] & (k < K)[None, :], other=0.0)
        wf = w.to(tl.float32)
        sq += wf * wf
    base = tl.sum(sq, axis=1)
    jj = tl.arange(0, BLOCK_N)
    prod = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, N, BLOCK_N):
        j = j0 + jj
        both = ok[:, None] & (j < N)[None, :]
        u = tl.load(u_ptr + rows[:, None] * stride_um + j[None, :] * stride_un, mask=both, other=0.0)
        if PIECES == 2:
            u += tl.load(u_ptr + rows[:, None] * stride_um + (j + N)[None, :] * stride_un, mask=both, other=0.0)
        b = tl.load(b_ptr + rows[:, None] * stride_bm + j[None, :] * stride_bn, mask=both, other=0.0)
        prod += u * b.to(tl.float32)
    cross = tl.sum(prod, axis=1)
    lora = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for p in range(0, n_lora):
        lora += tl.load(lora_part_ptr + p * stride_lp + rows, mask=ok, other=0.0)
    _store_terms(terms_ptr, stride_tr, rows, ok, base, cross, lora, tl.cast(scaling, tl.float32))


@triton.jit
def _gram_kernel(
    g_part_ptr, stride_gs, stride_gi, stride_gj,  # out: (SPLIT, r, r) fp32 partials of A·Aᵀ
    a_ptr, stride_ar, stride_ak,  # A (r, d_in)
    r, d_in, k_per_split,
    DOT_DTYPE: tl.constexpr, SPLIT_LO: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """G_part[s] = Σ_{k in split s} A[i, k]·A[j, k] (with SPLIT_LO: A_i·(A_hi + A_lo)_jᵀ)."""
    pid_i = tl.program_id(0).to(tl.int64)
    pid_j = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    ii = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = pid_j * BLOCK_I + tl.arange(0, BLOCK_I)
    k_start = pid_s * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, d_in)
    acc, sq = _tile_dot(
        a_ptr, stride_ar, stride_ak, a_ptr, stride_ar, stride_ak, ii, jj, r, r, k_start, k_stop,
        DOT_DTYPE, SPLIT_LO, PRECISION, INTERPRET, False, BLOCK_I, BLOCK_I, BLOCK_K,
    )
    out = g_part_ptr + pid_s * stride_gs + ii[:, None] * stride_gi + jj[None, :] * stride_gj
    tl.store(out, acc, mask=(ii[:, None] < r) & (jj[None, :] < r))


def _dot_setup(x_dtype: torch.dtype, y_dtype: torch.dtype, pieces: int = 2):
    """(DOT_DTYPE, SPLIT_LO, PRECISION) for an X·Yᵀ product: SPLIT_LO = how many pieces of
    X's dtype a Y of another dtype is split into (1 = none: Y is already exact in it)."""
    if x_dtype == torch.float32:
        return tl.float32, 1, "tf32x3"
    return _TL_DTYPE[x_dtype], (pieces if y_dtype != x_dtype else 1), "ieee"


def gram_triton(lora_A: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """G = A·Aᵀ in fp32 (r, r), deterministic split-K: exact products for 16-bit A (fp32 accumulation),
    tf32x3 for fp32 A; into ``out`` if given (same bits). Triton, not cuBLAS: 4-7 µs slower on a whole
    norm, but n is 4.6e-6 off fp64 with cuBLAS, 8.8e-7 with Triton (d_in = 4096, H200, bf16, r = 384)."""
    r, d_in = lora_A.shape
    dot_dtype, split_lo, precision = _dot_setup(lora_A.dtype, lora_A.dtype)
    cfg = gram_config(r, d_in)
    k_per_split = cdiv(cdiv(max(d_in, 1), cfg.splits), cfg.block_k) * cfg.block_k
    splits = max(1, cdiv(d_in, k_per_split))
    part = torch.empty(splits, r, r, dtype=torch.float32, device=lora_A.device)
    if d_in == 0:
        return part.zero_()[0] if out is None else out.zero_()
    grid = (cdiv(r, cfg.block_i), cdiv(r, cfg.block_i), splits)
    launcher(_gram_kernel)[grid](
        part, part.stride(0), part.stride(1), part.stride(2),
        lora_A, lora_A.stride(0), lora_A.stride(1),
        r, d_in, k_per_split,
        DOT_DTYPE=dot_dtype, SPLIT_LO=split_lo, PRECISION=precision, INTERPRET=interpreting(),
        BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if out is not None:
        return torch.sum(part, 0, out=out) if splits > 1 else out.copy_(part[0])
    return part.sum(0) if splits > 1 else part[0]


def rowdot_parts(
    X: torch.Tensor, x_strides, Y: torch.Tensor, C: torch.Tensor, *, compute_base: bool, pieces: int = 2
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unsummed fp32 partials: Σ_j C⊙(X·Yᵀ) per row (split K × column tiles, M), Σ_k X² (split K, M)/None."""
    M, N = C.shape
    K = Y.shape[1]
    dot_dtype, split_lo, precision = _dot_setup(X.dtype, Y.dtype, pieces)
    cfg = rowdot_config(M, N, K, X.dtype, split_lo)
    n_sub = cfg.n_sub if split_lo == 1 else 1
    n_tiles = cdiv(N, cfg.block_n * n_sub) if N else 1
    k_per_split = cdiv(cdiv(max(K, 1), cfg.split_k), cfg.block_k) * cfg.block_k
    splits = max(1, cdiv(K, k_per_split))
    launch = M > 0 and N > 0
    # Every partial (and sq) is written by the kernel; zeros only when nothing is launched.
    alloc = torch.empty if launch else torch.zeros
    part = alloc(splits * n_tiles * n_sub, M, dtype=torch.float32, device=X.device)
    sq = alloc(splits, M, dtype=torch.float32, device=X.device) if compute_base else None
    if launch:
        grid = (cdiv(M, cfg.block_m), n_tiles, splits)
        # An unwritten sq_ptr still gets its own buffer: passing ``part`` twice made Inductor
        # return a lora term of zeros (H200, torch 2.11: rel_l2 1.0 against eager).
        sq_arg = sq if sq is not None else torch.empty(1, 1, dtype=torch.float32, device=X.device)
        launcher(_rowdot_kernel)[grid](
            part, part.stride(0), sq_arg, sq_arg.stride(0),
            X, x_strides[0], x_strides[1],
            Y, Y.stride(0), Y.stride(1),
            C, C.stride(0), C.stride(1),
            M, N, K, k_per_split, n_tiles * n_sub,
            DOT_DTYPE=dot_dtype, SPLIT_LO=split_lo, PRECISION=precision, INTERPRET=interpreting(),
            COMPUTE_BASE=compute_base, N_SUB=n_sub, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return part, sq


def norm_finish(cross_part: torch.Tensor, sq: torch.Tensor, lora_part: torch.Tensor, scaling: float) -> torch.Tensor:
    """(4, M) fp32 rows (base, cross, lora, norm) from the row-dot partials (``sq``: (splits, M)):
    one launch for the ordered sums and ``combine_terms`` (six host ops)."""
    M = sq.shape[1]
    terms = torch.empty(4, M, dtype=torch.float32, device=sq.device)
    if M:
        block = 1024 if not interpreting() else 32
        launcher(_norm_finish_kernel)[(cdiv(M, block),)](
            terms, terms.stride(0),
            cross_part, cross_part.stride(0), cross_part.shape[0],
            sq, sq.stride(0), sq.shape[0],
            lora_part, lora_part.stride(0), lora_part.shape[0],
            M, float(scaling),
            BLOCK=block, num_warps=4,
        )
    return terms


def cross_product_u(weight_rows: torch.Tensor, lora_A: torch.Tensor, pieces: int = 1) -> torch.Tensor:
    """U = W·Aᵀ in fp32 for 16-bit W: (d_out, r), or with ``pieces`` = 2 (A of another dtype) (d_out, 2r),
    W·A_hiᵀ then W·A_loᵀ, A_hi = A rounded to W's dtype and A_lo = (A − A_hi) rounded to it (to nearest, as
    the row-dot kernel splits; the difference is exact in fp32). cuBLAS with fp32 output
    (``aten::mm.dtype``: exact products, fp32 accumulation and split-K partials; reduced-precision flags do
    not apply). Interpreted (CPU, no such overload): d_out × d_in fp32 copies, same arithmetic."""
    # Outside autograd: under grad mode a Parameter A would record a graph node at every norm
    # (under no_grad nothing is recorded, and a detach would be one more host op).
    if torch.is_grad_enabled():
        lora_A = lora_A.detach() if lora_A.requires_grad else lora_A
        weight_rows = weight_rows.detach() if weight_rows.requires_grad else weight_rows
    if pieces == 2:
        r = lora_A.shape[0]
        split = torch.empty(2 * r, lora_A.shape[1], dtype=weight_rows.dtype, device=lora_A.device)
        # Without forward-mode AD: a dual A would make the split dual, and torch.sub has no
        # forward AD with out= (it raised); the norm carries no tangent anyway.
        with _set_fwd_grad_enabled(False):
            split[:r] = lora_A
            # A − A_hi computed in A's dtype (or fp32, by promotion: exact) and rounded once as
            # it is stored: no r × d_in temporary of A's dtype.
            torch.sub(lora_A, split[:r], out=split[r:])
        lora_A = split
    if weight_rows.device.type == "cuda":
        return torch.mm(weight_rows, lora_A.t(), out_dtype=torch.float32)
    return torch.mm(weight_rows.float(), lora_A.float().t())


def norm_from_u(weight_rows: torch.Tensor, U: torch.Tensor, lora_B: torch.Tensor, lora_part: torch.Tensor, scaling: float,
                pieces: int = 1) -> torch.Tensor:
    """(4, d_out) fp32 rows (base, cross, lora, norm) from W's rows (Σ W²), U = W·Aᵀ (Σ B⊙U;
    ``pieces`` = 2: U of 2r columns) and the lora row-dot partials: one ``_norm_from_u_kernel``."""
    M, K = weight_rows.shape
    N = U.shape[1] // pieces
    terms = torch.empty(4, M, dtype=torch.float32, device=U.device)
    if M:
        cfg = norm_reduce_config(M, K, N, weight_rows.stride(1) == 1 or K == 1)
        launcher(_norm_from_u_kernel)[(cdiv(M, cfg.block_m),)](
            terms, terms.stride(0),
            weight_rows, weight_rows.stride(0), weight_rows.stride(1),
            U, U.stride(0), U.stride(1),
            lora_B, lora_B.stride(0), lora_B.stride(1),
            lora_part, lora_part.stride(0), lora_part.shape[0],
            M, N, K, float(scaling),
            PIECES=pieces, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
        )
    return terms


def terms_from_gram(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, G: torch.Tensor, scaling: float, fan_in_fan_out: bool,
) -> torch.Tensor:
    """(4, d_out) fp32 rows (base, cross, lora, norm) given G = A·Aᵀ: the launches after the
    Gram product, by the two paths of the module docstring."""
    W_rows = weight.t() if fan_in_fan_out else weight
    # lora_i = Σ_j B_ij·(B·G)_ij: row-dot with X = B, Y = G (split in pieces), C = B. fp16 pieces of G
    # overflow once ||A_i||² > 65504, so fp16 B runs in fp32 (tf32x3; K = r, cheap); bf16 has fp32's range.
    B_dot = lora_B if lora_B.dtype != torch.float16 else lora_B.float()
    lora_part, _ = rowdot_parts(B_dot, (B_dot.stride(0), B_dot.stride(1)), G, B_dot, compute_base=False, pieces=3)
    pieces = cublas_cross_pieces(weight.dtype, lora_A.dtype)
    if pieces:
        U = cross_product_u(W_rows, lora_A, pieces)
        return norm_from_u(W_rows, U, lora_B, lora_part, scaling, pieces)
    cross_part, sq = rowdot_parts(weight, W_rows.stride(), lora_A, lora_B, compute_base=True)
    assert sq is not None  # compute_base=True always returns the base term
    return norm_finish(cross_part, sq, lora_part, scaling)


def norm_terms(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> torch.Tensor:
    """(4, d_out) fp32 rows (base, cross, lora, norm): every launch of the norm, the Gram product included."""
    return terms_from_gram(weight, lora_A, lora_B, gram_triton(lora_A), scaling, fan_in_fan_out)


def factored_norm_triton(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, *,
    fan_in_fan_out: bool = False,
) -> FactoredNorm:
    """Same contract as ``factored_norm_torch`` (fp32 terms); ``U`` and ``G`` are not kept (None)."""
    base, cross, lora, norm = norm_terms(weight, lora_A, lora_B, scaling, fan_in_fan_out).unbind(0)
    return FactoredNorm(base, cross, lora, norm, None, None)
