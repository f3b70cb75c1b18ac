"""Launch-policy and memory-policy constants, in one place. Each says where it came from.

NORM_CHUNK_BYTES: budget for the fp32 W chunk (and its square) of the torch factored norm.
  Keeps the fallback's extra memory far below a dense d_out × d_in temporary while keeping
  each chunk GEMM large (at d_out = 8192 a 32 MiB budget gives 512-column chunks).

Triton configs are chosen ahead of time (no ``triton.autotune``: its trials would run on
real arguments, and under the interpreter it cannot benchmark). Under TRITON_INTERPRET=1
the same functions return small blocks so CPU runs stay quick.
"""

from __future__ import annotations

import os
from typing import NamedTuple

NORM_CHUNK_BYTES = 32 * 1024 * 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


class NormConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    block_r: int
    num_warps: int
    num_stages: int


class GramConfig(NamedTuple):
    block_i: int
    block_k: int
    max_split: int
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


def norm_config(d_out: int, d_in: int, r: int, weight_dtype) -> NormConfig:
    if _interpreting():
        return NormConfig(16, 16, 16, 16, 1, 1)
    block_n = _pow2_at_least(r, 16, 128)
    return NormConfig(128, block_n, 64, 32, 8, 3)


def gram_config(r: int, d_in: int) -> GramConfig:
    if _interpreting():
        return GramConfig(16, 16, 4, 1, 1)
    return GramConfig(64, 64, 32, 4, 3)


def compose_config(T: int, d_out: int, r: int) -> ComposeConfig:
    if _interpreting():
        return ComposeConfig(16, 16, 16, 4, 1, 1)
    block_k = _pow2_at_least(r, 16, 64)
    return ComposeConfig(128, 128, block_k, 8, 8, 3)


def grad_config(T: int, d_out: int) -> GradConfig:
    if _interpreting():
        return GradConfig(16, 16, 1)
    return GradConfig(64, 256, 8)
