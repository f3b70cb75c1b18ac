"""hypothesis strategies for DoRA problems (built on ``problems.make_problem``).

``problems()`` draws shapes (tiny, odd, non-power-of-two), dtypes, adapter dtypes (fp32 adapters
under 16-bit activations, as PEFT defaults), scalings (alpha/r and rsLoRA's alpha/sqrt(r)), the hard
kinds of ``problems.KINDS``, fan_in_fan_out and a seed. Every example is reproducible from its arguments."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from .problems import KINDS, make_problem


@st.composite
def problems(
    draw,
    *,
    max_dim: int = 48,
    max_rank: int = 16,
    min_dim: int = 1,
    min_rank: int = 1,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    kinds=KINDS,
    tokens=(0, 1, 5, (2, 3)),
    device: str = "cpu",
):
    d_out = draw(st.integers(min_dim, max_dim))
    d_in = draw(st.integers(min_dim, max_dim))
    r = draw(st.integers(min_rank, max_rank))
    dtype = draw(st.sampled_from(dtypes))
    adapter_dtype = draw(st.sampled_from([dtype, torch.float32]))
    alpha = draw(st.sampled_from([1.0, 8.0, 16.0, 32.0]))
    rslora = draw(st.booleans())
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    return make_problem(
        d_out,
        d_in,
        r,
        draw(st.sampled_from(tokens)),
        dtype,
        adapter_dtype=adapter_dtype,
        seed=draw(st.integers(0, 2**20)),
        kind=draw(st.sampled_from(kinds)),
        scaling=scaling,
        with_bias=draw(st.booleans()),
        fan_in_fan_out=draw(st.booleans()),
        device=device,
    )
