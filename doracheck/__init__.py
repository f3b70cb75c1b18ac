"""doracheck: fast, memory-lean and verified DoRA (weight-decomposed low-rank adaptation).

    y = doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias)
    n = doracheck.factored_norm(weight, lora_A, lora_B, scaling)          # fp32 (d_out,)
    layer = doracheck.DoRALinear.from_linear(linear, r=16, lora_alpha=32)
    p = doracheck.plan(d_in, d_out, r, tokens, torch.bfloat16, training=True)  # computation order
    doracheck.clear_norm_cache()   # after writes through .data that version counters miss (doracheck.norm_rule)

The oracles live in ``doracheck.reference``, the kernels in ``doracheck.kernels``. The public
names are imported on first use, so that ``doracheck --help`` and ``--version`` start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {  # name -> the module of doracheck that defines it
    "DoRALinear": "module",
    "NormTerms": "functional",
    "clear_norm_cache": "norm_rule",
    "compose": "functional",
    "dora_linear": "functional",
    "factored_norm": "functional",
    "plan": "planner",
}

__all__ = ["DoRALinear", "NormTerms", "__version__", "clear_norm_cache", "compose", "dora_linear", "factored_norm", "plan"]

if TYPE_CHECKING:
    from .functional import NormTerms, compose, dora_linear, factored_norm
    from .module import DoRALinear
    from .norm_rule import clear_norm_cache
    from .planner import plan


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # a subpackage or module used as an attribute (``doracheck.kernels``), as before
        if name.startswith("_"):
            raise AttributeError(f"module 'doracheck' has no attribute {name!r}")
        importlib.import_module(".functional", __name__)  # the layer's import graph, as an eager import made it
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'doracheck' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
