"""doracheck.kernels: the compute of doracheck, one op per file, no autograd.

Each op has a torch twin (runs anywhere) and a Triton twin with the same signature; the
backend table (``backends.py``: ``TORCH`` and ``triton_backend()``) lists them, and
``doracheck.dispatch.backend_for`` picks one per call.

The folder ``kernels/`` is installed as ``doracheck.kernels`` (``package-dir`` in pyproject.toml; the
layout and the import picture are in docs/design.md section 5).
"""

from .compose_torch import compose_torch, dm_finish_torch, dm_lost_rows_torch, grad_scale_dm_torch
from .norm_torch import FactoredNorm, combine_terms, factored_norm_torch, norm_chunk, norm_memory_bound

__all__ = [
    "FactoredNorm",
    "combine_terms",
    "compose_torch",
    "dm_finish_torch",
    "dm_lost_rows_torch",
    "factored_norm_torch",
    "norm_chunk",
    "norm_memory_bound",
    "grad_scale_dm_torch",
]
