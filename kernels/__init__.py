"""doracheck.kernels: the compute of doracheck, one op per file, no autograd.

Each op has a torch implementation (runs anywhere); Triton implementations with the same
signatures live beside them. Which one runs is decided in ``doracheck.dispatch``.
"""

from .compose_torch import compose_torch, dm_lost_rows_torch, grad_scale_dm_torch
from .norm_torch import FactoredNorm, combine_terms, factored_norm_torch, norm_chunk, norm_memory_bound

__all__ = [
    "FactoredNorm",
    "combine_terms",
    "compose_torch",
    "dm_lost_rows_torch",
    "factored_norm_torch",
    "norm_chunk",
    "norm_memory_bound",
    "grad_scale_dm_torch",
]
