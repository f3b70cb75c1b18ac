"""doracheck: fast, memory-lean and verified DoRA (weight-decomposed low-rank adaptation).

    y = doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias)
    n = doracheck.factored_norm(weight, lora_A, lora_B, scaling)          # fp32 (d_out,)
    layer = doracheck.DoRALinear.from_linear(linear, r=16, lora_alpha=32)
    p = doracheck.plan(d_in, d_out, r, tokens, torch.bfloat16, training=True)  # computation order
    doracheck.clear_norm_cache()   # after writes through .data that version counters miss (doracheck.norm_rule)

The oracles live in ``doracheck.reference``, the kernels in ``doracheck.kernels``.
"""

from . import measure as _measure
from . import planner as _planner
from .functional import NormTerms, compose, dora_linear, factored_norm
from .module import DoRALinear
from .norm_rule import clear_norm_cache
from .planner import plan

_planner.set_measure(_measure.measure_variants)  # timed planning measures with the layer (docs/design.md section 5)

__version__ = "0.1.0"

__all__ = ["DoRALinear", "NormTerms", "__version__", "clear_norm_cache", "compose", "dora_linear", "factored_norm", "plan"]
