"""doracheck.reference: the oracles (float64 and mpmath), naive baselines and error metrics.

Imports nothing from doracheck, doracheck.kernels or doracheck.properties: an oracle must share no
code with what it judges. The folder ``reference/`` is installed as ``doracheck.reference``
(``package-dir`` in pyproject.toml; docs/design.md section 5).
"""

from .baselines import naive_compose, peft_style_dora
from .conditions import output_conditions
from .metrics import (
    UNIT_ROUNDOFF,
    dot_error_bound,
    gamma,
    max_ulp,
    rel_l2,
    ulp_distance,
    ulp_error,
    ulp_of,
)
from .oracle_fp64 import EPS, NormTermsRef, dora_forward_ref, magnitude_scale_ref, norm_terms_ref
from .oracle_mpmath import (
    MpNormTerms,
    mp_compose,
    mp_dora_forward,
    mp_magnitude_scale,
    mp_norm_terms,
    precision,
)

__all__ = [
    "EPS",
    "MpNormTerms",
    "NormTermsRef",
    "UNIT_ROUNDOFF",
    "dora_forward_ref",
    "dot_error_bound",
    "gamma",
    "magnitude_scale_ref",
    "max_ulp",
    "mp_compose",
    "output_conditions",
    "mp_dora_forward",
    "mp_magnitude_scale",
    "mp_norm_terms",
    "naive_compose",
    "norm_terms_ref",
    "peft_style_dora",
    "precision",
    "rel_l2",
    "ulp_distance",
    "ulp_error",
    "ulp_of",
]
