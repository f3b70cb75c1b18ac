"""Factored DoRA row norm, pure torch (the fallback every machine can run).

    n_i² = ||W_i||² + 2s·Σ_j B_ij·U_ij + s²·Σ_j (B·G)_ij·B_ij
    U = W·Aᵀ (d_out × r),  G = A·Aᵀ (r × r)

W is read in column chunks of ``chunk`` input features, upcast chunk by chunk, so nothing of size d_out ×
d_in is allocated beyond W. Every reduction accumulates in fp32, or fp64 when any input is fp64
(gradcheck). Extra memory, in bytes: 4·(d_out·r + r² + 3·d_out + r·chunk) + 8·d_out·chunk (U, G, the
three term vectors, an fp32 A chunk, the fp32 W chunk and its square). No autograd here: callers wrap it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .settings import NORM_CHUNK_BYTES


class FactoredNorm(NamedTuple):
    """fp32 (fp64 for fp64 inputs) results of the factored norm; ``U`` and ``G`` are kept for the exact backward."""

    base: torch.Tensor  # (d_out,)  ||W_i||²
    cross: torch.Tensor  # (d_out,)  <W_i, (B·A)_i> = Σ_k B_ik·U_ik
    lora: torch.Tensor  # (d_out,)  ||(B·A)_i||²   = Σ_k (B·G)_ik·B_ik
    norm: torch.Tensor  # (d_out,)  sqrt(max(base + 2s·cross + s²·lora, 0))
    U: torch.Tensor | None  # (d_out, r) W·Aᵀ (None where not materialised: the Triton path)
    G: torch.Tensor | None  # (r, r)     A·Aᵀ


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when any tensor is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def norm_chunk(d_out: int, d_in: int, budget_bytes: int = NORM_CHUNK_BYTES) -> int:
    """Input features per chunk: the fp32 W chunk and its square fit ``budget_bytes`` and take at most 1/16
    of the columns (at least 64), so 8·d_out·chunk stays at most an eighth of a dense fp32 d_out × d_in."""
    per_column = 8 * max(d_out, 1)
    return int(max(1, min(d_in, budget_bytes // per_column, max(64, d_in // 16))))


def combine_terms(base: torch.Tensor, cross: torch.Tensor, lora: torch.Tensor, scaling: float) -> torch.Tensor:
    """n = sqrt(base + 2s·cross + s²·lora), clamped at 0 before the root (rounding can make
    the sum slightly negative where W cancels s·B·A; NaN still propagates)."""
    s = float(scaling)
    squared = base + (2.0 * s) * cross + (s * s) * lora
    return torch.sqrt(torch.clamp_min(squared, 0.0))


def factored_norm_torch(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, *,
    fan_in_fan_out: bool = False, chunk: int | None = None,
) -> FactoredNorm:
    """Row norms of W + s·B·A without forming it. ``weight`` is (d_out, d_in), or
    (d_in, d_out) with ``fan_in_fan_out`` (read in place, never transposed into a copy)."""
    d_out, d_in = (weight.shape[1], weight.shape[0]) if fan_in_fan_out else weight.shape
    r = lora_A.shape[0]
    device = weight.device
    f32 = accumulation_dtype(weight, lora_A, lora_B)
    step = chunk or norm_chunk(d_out, d_in)
    base = torch.zeros(d_out, dtype=f32, device=device)
    U = torch.zeros(d_out, r, dtype=f32, device=device)
    G = torch.zeros(r, r, dtype=f32, device=device)
    for start in range(0, d_in, step):
        stop = min(start + step, d_in)
        a_chunk = lora_A[:, start:stop].to(f32)  # (r, c)
        if fan_in_fan_out:
            w_chunk = weight[start:stop, :].to(f32)  # (c, d_out): contiguous rows of the stored layout
            base += (w_chunk * w_chunk).sum(0)
            U += (a_chunk @ w_chunk).t()
        else:
            w_chunk = weight[:, start:stop].to(f32)  # (d_out, c)
            base += (w_chunk * w_chunk).sum(1)
            U += w_chunk @ a_chunk.t()
        G += a_chunk @ a_chunk.t()
        del w_chunk
    B = lora_B.to(f32)
    cross = (B * U).sum(1)
    lora = ((B @ G) * B).sum(1)
    return FactoredNorm(base, cross, lora, combine_terms(base, cross, lora, scaling), U, G)


def norm_memory_bound(d_out: int, d_in: int, r: int, chunk: int | None = None) -> int:
    """The stated bound (bytes) on the extra memory of ``factored_norm_torch``."""
    c = chunk or norm_chunk(d_out, d_in)
    # U, an fp32 copy of B, B·G and an elementwise product live together at the end: 4·d_out·r.
    return 4 * (4 * d_out * r + r * r + 3 * d_out + r * c + r * d_out) + 8 * d_out * c + 4 * 1024
