"""Launch-policy and memory-policy constants, in one place; each says where it came from. Figures: NVIDIA
H200, torch 2.11, triton 3.6; probe scripts and raw results in ``benchmarks/`` at commit 152454a.

NORM_CHUNK_BYTES: the torch factored norm's fp32 W chunk (and its square), far below a dense d_out × d_in
temporary with large chunk GEMMs (at d_out = 8192: 512-column chunks). Triton configs are fixed (no
``triton.autotune``: it would trial on real arguments, the interpreter cannot time); small when interpreted.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch

NORM_CHUNK_BYTES = 32 * 1024 * 1024


def _interpreting() -> bool:
    """Whether the kernels are interpreted: the kernel modules' own answer (fixed when triton
    decorated them), else the environment, which may have changed since and would hand
    interpreter tiles to compiled kernels (tiles narrower than 64 got the norm wrong, below)."""
    common = sys.modules.get("doracheck.kernels.triton_common")
    if common is not None:
        return common.interpreting()
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


class RowdotConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    n_sub: int = 1  # BLOCK_N-wide column tiles per program, from one load of each X tile
    split_k: int = 1  # programs along K (partials summed in order afterwards)


class NormReduceConfig(NamedTuple):
    block_m: int
    block_k: int
    block_n: int
    num_warps: int


class GramConfig(NamedTuple):
    block_i: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


class ComposeConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class GradConfig(NamedTuple):
    block_t: int
    block_d: int
    num_warps: int


# Sub-tiled, split-K row-dot configs (RowdotConfig.n_sub, .split_k) for 256 < N <= 384; H200, 8192², r = 384,
# bf16, graph replays: three 128-wide sub-tiles, K split in two, 64×128×64, 8 warps, 3 stages 132.7 µs; padded
# 128×256 134.6-136.1 (within the spread); 128×128 163.6 (split in two 145.8); 64-row sub-tiles, 4 warps
# 239.7; 128-row (register-bound) 268.8. Not adopted: the gain is noise, never run under compute-sanitizer on
# the GPU, and tiles wider than 64 get the cross term wrong (below). CI interprets both.


def rowdot_config(M: int, N: int, K: int, x_dtype, split_lo: int) -> RowdotConfig:
    """Tiles of the norm GEMMs (X·Yᵀ with a row-reduction epilogue). H200, M = K = 8192, N = 384,
    bf16: 127 µs (the padded 128×256×64 tile, 134.6-136.1 µs above, gets the cross term wrong)."""
    if _interpreting():
        # Three 16-wide sub-tiles where N needs them and K split in two past 32, so CI runs both.
        return RowdotConfig(16, 16, 16, 1, 1, 3 if (split_lo == 1 and 32 < N <= 48) else 1, 2 if K > 32 else 1)
    # BLOCK_N exactly 64. 128/256-wide tiles (8 warps) got the cross term wrong, unrepeatably (4096 rows,
    # K = 4096, r = 100..1024: 3e-2..5e-1 relative; they, not cuBLAS, broke the layer's bitwise determinism
    # test at r = 128); 64-wide matched fp64 to 4.4e-6, bitwise repeatable at r = 16..1024, in 35-132 µs vs
    # 34-131. 32-wide (N = 25..32): 0.4-1.3% wrong, unrepeatable at r = 32 (640×384 and 4096²:
    # 5.8e-3 / 4.8e-3; 64-wide 3.6e-7 / 4.4e-6, repeatable at r = 8..96); masked columns cost little at
    # r <= 32. Model shapes (14336x4096, 4096x14336, 4096² at r 384/128/16): 128x128 (8 warps), 128x256,
    # 64x128 and 64x128 in three sub-tiles 0.9-68% wrong; 128x128, 4 warps, right, unrepeatable at 14336 rows;
    # right and repeatable everywhere only 128x64 (this), 256x64 and 128x64 with BLOCK_K 128, neither faster.
    block_n = 64
    stages = 3 if (N > 128 or split_lo > 1 or x_dtype.itemsize == 4) else 4
    block_k = 32 if x_dtype.itemsize == 4 else 64
    return RowdotConfig(128, block_n, block_k, 8, stages)


HAS_MM_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # cuBLAS GEMM with fp32 output from 16-bit inputs (torch >= 2.8)


def cublas_cross_pieces(weight_dtype: torch.dtype, lora_A_dtype: torch.dtype) -> int:
    """How the norm's cross term is formed: 0, by the row-dot kernel (fp32 W, or no cuBLAS fp32-output
    GEMM); 1, from U = W·Aᵀ by cuBLAS with fp32 output and a row reduction (``norm_triton.norm_from_u``), A
    of W's 16-bit dtype; 2, the same with A of another dtype (fp32 adapters on 16-bit W, PEFT's default)
    split into hi + lo pieces of W's dtype, U = W·[A_hi; A_lo]ᵀ as one GEMM of 2r columns
    (``norm_triton.cross_product_u``). H200, bf16, r = 384, µs: the row-dot kernel with the base term fused
    (128×64 tiles, the only ones right with it) 195.8 / 213.8 / 69.3 at 14336×4096 / 4096×14336 / 4096²;
    cuBLAS's W·Aᵀ alone 75.5 / 67.0 / 26.8 (597-673 TFLOP/s), the base term alone 47.5 / 55.1 / 24.2; the
    same tiles without the fused base term 137.9 / 141.0 / 62.4, the wide tiles (right only without it)
    114.5-140.6. Two pieces (fp32 adapters on bf16 W), whole training-form norm, graph replays, row-dot →
    cuBLAS µs: 14336×4096 570.3 → 313.9, 4096×14336 618.6 → 296.2, 4096² 224.1 → 129.9, 8192² 551.1 →
    317.8, fan_in_fan_out 4096² 339.0 → 162.0; n against fp64 1.6-1.7e-7 both ways; one eager call's
    scratch 36.8 MiB at 8192² (9.6 on the row-dot path: the pieces and U of 2r columns)."""
    if not HAS_MM_DTYPE or weight_dtype not in (torch.bfloat16, torch.float16):
        return 0
    return 1 if lora_A_dtype == weight_dtype else 2


def norm_reduce_config(M: int, K: int, N: int, rows_contiguous: bool) -> NormReduceConfig:
    """Tiles of ``_norm_from_u_kernel``: a streaming read of W (Σ W² per row) and of U and B. Rows along K
    contiguous: BLOCK_M × BLOCK_K = 4096 elements a load, BLOCK_M at most 8 and as large as leaves at least
    512 programs (about four per SM on an H200's 132); fan_in_fan_out (rows contiguous across M): 64 × 64
    tiles, so a load still reads 128 contiguous bytes. H200, bf16, r = 384, whole training-form norm, graph
    replays, µs with BLOCK_M 16 / 8 / 4 / 2: 8192²: 173.1 / 158.6 / 164.2 / 168.5; 14336×4096:
    169.7 / 168.2 / 177.6 / 177.8; 4096×14336: 185.6 / 144.4 / 142.9 / 144.9; 1024×4096:
    45.6 / 39.3 / 38.8 / 37.5. fan_in_fan_out 4096²: 91.7 (the row-dot path: 257.7)."""
    block_n = _pow2_at_least(N, 16, 128)
    if _interpreting():
        return NormReduceConfig(4, 16, 16, 1)
    if not rows_contiguous:
        return NormReduceConfig(64, 64, block_n, 4)
    block_m = 8
    while block_m > 2 and -(-M // block_m) < 512:
        block_m //= 2
    return NormReduceConfig(block_m, _pow2_at_least(K, 16, 4096 // block_m), block_n, 4)


def gram_config(r: int, d_in: int) -> GramConfig:
    """G = A·Aᵀ: M = N = r, long K = d_in, so split K to fill the SMs (partials summed after)."""
    if _interpreting():
        return GramConfig(16, 16, 3, 1, 1)
    tiles = -(-r // 128) ** 2
    splits = max(1, min(64, 132 // max(tiles, 1), -(-d_in // 512)))
    return GramConfig(128, 64, splits, 8, 3)


def compose_config(T: int, d_out: int, r: int) -> ComposeConfig:
    if _interpreting():
        return ComposeConfig(16, 16, 16, 4, 1, 1)
    # H200, T = 4096, d_out = 8192, r = 384, bf16: 64×128×64, 4 warps, 3 stages: 90.3 µs; 128×64×64: 96.2;
    # 128×256×64 (8 warps): 107.8; 128×128×64 (8 warps): 129.5; 128×128×32: 156.8. T = 1: 12.0 µs.
    block_k = _pow2_at_least(r, 16, 64)
    if T <= 16:
        # Decode: 64×128 tiles give d_out/128 programs, too few to stream B at full rate. H200, r = 384, bf16,
        # CUDA-graph replays, µs at T = 1 / 16 for d_out 1024, 4096, 14336: 64×128: 4.54 4.67 4.83 / 4.61 4.70
        # 4.84; 16×64×64 (4 warps, 3 stages): 3.0-4.1 on all six (sum 20.4 against 28.2); cuBLAS xa·Bᵀ + add
        # (LoRA's two kernels) 4.0-5.6. At T = 64 it loses at d_out 14336 (8.2 against 5.3).
        return ComposeConfig(16, 64, block_k, 8, 4, 3)
    return ComposeConfig(64, 128, block_k, 8, 4, 3)


# The persistent TMA compose where measured faster: H200, bf16, CUDA-graph replays (y bitwise the pointer
# kernel's), µs pointer kernel (64×128×64) -> TMA 128×256×64, 8 warps, 3 stages, one program per SM, at
# r = 384: T 4096 × d_out 8192: 93.7 -> 75.4; × 14336: 170.7 -> 130.4; × 4096: 48.4 -> 39.2; × 1024:
# 12.5 -> 9.8; T 1024 × 4096: 12.5 -> 9.9. Slower with too few tiles to fill the SMs (T 512 × 4096, 64 tiles:
# 7.1 -> 8.9; T 256 × 1024: 4.9 -> 8.7) and at r = 16 (T 4096²: 22.6 -> 29.5), where the epilogue is all the
# work; r between 16 and 384 unmeasured (threshold 128). Other TMA tiles: 2 stages 89.9, 256×128 76.8, 64×128
# (1 or 2 programs per SM) 81.2-135.7; 4 stages or 128-wide K exceed the shared memory. Pointer loads, same
# persistent 128×256 structure: 81.6-83.3. T < 1024 with d_out wide enough for 128 tiles: unmeasured.
COMPOSE_TMA_MIN_TILES = 128
COMPOSE_TMA_MIN_RANK = 128
COMPOSE_TMA_MIN_TOKENS = 1024


def compose_tma_config(T: int, d_out: int, r: int) -> ComposeConfig | None:
    """The persistent TMA compose's tiles for this shape, or None where the pointer kernel is
    faster (or unmeasured). Under the interpreter small tiles at every T > 16 (so CI runs it)."""
    if _interpreting():
        return ComposeConfig(16, 32, 16, 2, 4, 1) if T > 16 else None
    tiles = -(-T // 128) * -(-d_out // 256)
    if T < COMPOSE_TMA_MIN_TOKENS or r < COMPOSE_TMA_MIN_RANK or tiles < COMPOSE_TMA_MIN_TILES:
        return None
    return ComposeConfig(128, 256, _pow2_at_least(r, 16, 64), 8, 8, 3)


def grad_config(T: int, d_out: int) -> GradConfig:
    if _interpreting():
        return GradConfig(16, 16, 1)
    # H200, bf16, GPU µs from CUDA-graph replays, 64×64 tokens×features with 4 warps against 64×128 with 8:
    # 34.7 vs 41.7 at T 2048 × d_out 8192, 32.7 vs 40.6 at 1170 × 14336, 33.2 vs 39.8 at 4096², 9.8 vs 12.3
    # at 4096 × 1024; dz bitwise the same, dm within 1e-6 relative. Others: 128×64 (8 warps) 35.0-36.9; 32×128
    # 41.9-43.9; 64×128 (4 warps) 50-58; 128×128 51-53; 64×256 56-70 (an independent sweep agrees).
    return GradConfig(64, 64, 4)


# Backward: dz = g⊙dy a token chunk at a time when the whole would exceed this many bytes, so the training
# peak stays near plain nn.Linear's (y + dx). H200, 8192², r = 384, T = 4096, bf16: unchunked with an
# out-of-place addmm the fwd+bwd peak is 262 MiB above resident (nn.Linear: 128). Each chunk costs two host
# calls (the dz/dm launch, dx += dz·W). Same layer: peak 158 / 174 / 204 MiB at 16 / 32 / 64 MiB against the
# 192 MiB bound of tests/kernels/test_kernels_gpu.py (1.25 × 128 + 32); model step + fused AdamW, host CPU per
# step at 16 / 32 MiB: 98.1 / 93.1 ms, on another host 107.4 / 98.5 ms (one process each, interleaved).
BACKWARD_CHUNK_BYTES = 32 * 1024 * 1024


def backward_token_chunk(T: int, d_out: int, itemsize: int) -> int:
    """Tokens per backward chunk (T itself when dz is small)."""
    per_token = max(d_out * itemsize, 1)
    return max(1, min(T, BACKWARD_CHUNK_BYTES // per_token)) if T * per_token > BACKWARD_CHUNK_BYTES else max(T, 1)


def triton_norm_memory_bound(d_out: int, d_in: int, r: int, lora_B_dtype: torch.dtype | None = None,
                             split_adapters: bool = False) -> int:
    """Bytes the Triton factored norm allocates: the Gram partials (splits, r, r) and G, the per-column-tile
    partials of cross and lora (2 × n_tiles × d_out), Σ W², the four term vectors and four d_out vectors of
    slack (the layer's max(n, eps) and g); an fp32 B (d_out × r) for fp16 B (``norm_triton.terms_from_gram``);
    U = W·Aᵀ in fp32 (d_out × r) on 16-bit W (counted beside the cross partials, whichever path runs).
    ``split_adapters`` (A's dtype not W's): A's two 16-bit pieces (2 × r × d_in) and U of 2r columns."""
    cfg = gram_config(r, d_in)
    n_tiles = -(-r // 64) if r else 1  # partial rows per term: 64-wide row-dot tiles (rowdot_config), split K = 1
    b_copy = d_out * r if lora_B_dtype == torch.float16 else 0
    u = d_out * r * (2 if split_adapters else 1)
    pieces = r * d_in if split_adapters else 0  # the two 16-bit pieces of A: 2 × r × d_in 16-bit values
    return 4 * (r * r * (cfg.splits + 1) + d_out * (2 * n_tiles + 9) + u + pieces + b_copy)
