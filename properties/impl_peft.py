"""PEFT 0.21's own DoRA layer behind ``doracheck.dora_linear``'s signature, so ``doracheck verify --impl
peft`` judges PEFT by the same properties and budgets. It runs PEFT's code, not a re-implementation:

* a ``peft.tuners.lora.layer.Linear`` with ``use_dora=True`` (its adapter goes through
  ``lora.variants.DoraLinearVariant`` and ``lora.dora.DoraLinearLayer``), built once per (d_in, d_out, r,
  dtypes, bias or not, device) on the meta device (no memory, no init cost) and cached;
* each call runs it through ``torch.func.functional_call``, the caller's tensors in place of its parameters
  (``base_layer.weight``, ``base_layer.bias``, ``{lora_A,lora_B,lora_magnitude_vector}.default.weight``), so
  gradients reach them; ``module.scaling["default"]`` (PEFT's LoRA-branch factor) is ``scaling``;
* ``fan_in_fan_out=True``: the weight's transpose (a view: the gradient still reaches the caller's tensor) is
  the nn.Linear weight, not a transformers ``Conv1D``; PEFT's own handling only transposes: same function;
* dropout (``training and dropout_p > 0``): ``lora_dropout["default"]`` computes ``x·keep/(1-p)`` with the
  given (or a fresh) 0/1 keep-mask, in train mode, as ``DoraLinearVariant.forward`` takes its dropout branch
  (recomputing ``x_d·Wᵀ``) only for a non-``nn.Identity`` dropout while training; else ``nn.Identity``, eval;
* PEFT's DoRA cache (``peft.tuners.lora.dora.ENABLE_DORA_CACHING``, off by default; it keeps an eval-mode
  layer's norm and B·A between calls) is cleared around every call: no value of another call's is served.

Nothing of PEFT's numerics is hidden: tensors go in the dtypes given (PEFT runs the base layer in x's dtype
and casts x to lora_A's dtype for the adapter branch); the result is PEFT's, in its dtype: the row norm
unclamped (a zero row gives NaN, doracheck 0) and always detached (DoRA paper section 4.3), so
``detach_norm=False`` raises ``Unsupported``, as does a missing peft."""

from __future__ import annotations

import threading

import torch
from torch import nn

from .unsupported import Unsupported

ADAPTER = "default"
_CACHE_LIMIT = 16
_cache: dict[tuple, nn.Module] = {}
_lock = threading.Lock()


class _KeepMaskDropout(nn.Module):
    """``lora_dropout[adapter]`` stand-in: ``x·keep/(1-p)``, fixed 0/1 keep-mask; not an ``nn.Identity``, so
    PEFT's DoRA takes its dropout branch when the layer is training."""

    def __init__(self, keep: torch.Tensor, p: float):
        super().__init__()
        self.keep = keep
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.keep.to(device=x.device, dtype=x.dtype) / (1.0 - self.p)


def _import_peft():
    try:
        from peft import LoraConfig
        from peft.tuners.lora.layer import Linear as PeftLoraLinear
    except ImportError as exc:
        raise Unsupported("peft is not installed (pip install peft)") from exc
    return LoraConfig, PeftLoraLinear


def _peft_module(d_in: int, d_out: int, r: int, base_dtype, adapter_dtype, magnitude_dtype, has_bias: bool,
                 device):
    """The cached PEFT DoRA Linear of a problem signature, on the meta device (calls swap tensors in)."""
    key = (d_in, d_out, r, base_dtype, adapter_dtype, magnitude_dtype, has_bias, str(device))
    module = _cache.get(key)
    if module is not None:
        return module
    LoraConfig, PeftLoraLinear = _import_peft()
    base = nn.Linear(d_in, d_out, bias=has_bias, device="meta", dtype=base_dtype)
    config = LoraConfig(r=r, lora_alpha=r, use_dora=True, lora_dropout=0.0, fan_in_fan_out=False)
    module = PeftLoraLinear(base, ADAPTER, config, r=r, lora_alpha=r)
    module.lora_A[ADAPTER].to(dtype=adapter_dtype)
    module.lora_B[ADAPTER].to(dtype=adapter_dtype)
    module.lora_magnitude_vector[ADAPTER].to(dtype=magnitude_dtype)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = module
    return module


def _check_shapes(x, weight, lora_A, lora_B, magnitude, bias, fan_in_fan_out: bool, dropout_p: float):
    """(d_in, d_out, r), or ValueError naming the first inconsistent argument."""
    for name, t in (
        ("x", x), ("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B), ("magnitude", magnitude),
    ):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(
                f"{name}: expected a floating torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if weight.dim() != 2 or lora_A.dim() != 2:
        raise ValueError(
            f"weight and lora_A must be 2-D, got {tuple(weight.shape)} and {tuple(lora_A.shape)}")
    d_out, d_in = (weight.shape[1], weight.shape[0]) if fan_in_fan_out else tuple(weight.shape)
    r = lora_A.shape[0]
    expected = {"lora_A": (r, d_in), "lora_B": (d_out, r), "magnitude": (d_out,)}
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B), ("magnitude", magnitude)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name}: expected shape {expected[name]}, got {tuple(t.shape)}")
    if x.dim() < 1 or x.shape[-1] != d_in:
        raise ValueError(f"x: expected shape (..., {d_in}), got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (d_out,):
        raise ValueError(f"bias: expected shape ({d_out},), got {tuple(bias.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected 0 <= p < 1, got {dropout_p}")
    return d_in, d_out, r


def _dropout_module(x: torch.Tensor, dropout_p: float, dropout_mask: torch.Tensor | None) -> nn.Module:
    """The active dropout's stand-in: the given keep-mask, or one drawn (``torch.bernoulli``, keep 1 - p)."""
    if dropout_mask is None:
        keep = torch.bernoulli(torch.full(x.shape, 1.0 - dropout_p, device=x.device))
    else:
        keep = dropout_mask.detach()
    return _KeepMaskDropout(keep, dropout_p)


def _substituted_params(weight, lora_A, lora_B, magnitude, bias, fan_in_fan_out: bool) -> dict[str, torch.Tensor]:
    """The caller's tensors under PEFT's parameter names, for ``torch.func.functional_call``."""
    base_weight = weight.t() if fan_in_fan_out else weight  # nn.Linear layout (d_out, d_in), a view
    params = {
        "base_layer.weight": base_weight, f"lora_A.{ADAPTER}.weight": lora_A,
        f"lora_B.{ADAPTER}.weight": lora_B, f"lora_magnitude_vector.{ADAPTER}.weight": magnitude,
    }
    if bias is not None:
        params["base_layer.bias"] = bias
    return params


def peft_dora_linear(
    x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    magnitude: torch.Tensor, scaling: float, bias: torch.Tensor | None = None, *, dropout_p: float = 0.0,
    training: bool = False, detach_norm: bool = True, fan_in_fan_out: bool = False,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The DoRA linear layer computed by PEFT 0.21's ``lora.Linear`` with ``use_dora=True``, with
    ``doracheck.dora_linear``'s signature and semantics (a missing ``dropout_mask`` is drawn with
    ``torch.bernoulli``): ``y = x·Wᵀ + b + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ``, ``g = m / ||W + s·B·A||``
    (row norm, detached), x_d = x·keep/(1-p) when ``training and dropout_p > 0``, else x; differentiable in
    x, weight, lora_A, lora_B, magnitude and bias. No clamp: a zero row of W + s·B·A gives NaN there. The
    result has PEFT's dtype (the base layer's output's, i.e. x's).

    Raises:
        Unsupported: ``detach_norm=False`` (PEFT always detaches the norm), or peft missing.
        ValueError: inconsistent shapes or an invalid dropout_p.
    """
    _import_peft()
    if not detach_norm:
        raise Unsupported("PEFT's DoRA always detaches the weight norm (DoRA paper section 4.3); "
                          "detach_norm=False has no PEFT equivalent")
    d_in, d_out, r = _check_shapes(x, weight, lora_A, lora_B, magnitude, bias, fan_in_fan_out,
                                   float(dropout_p))
    dropout_active = bool(training) and dropout_p > 0.0
    dropout = _dropout_module(x, float(dropout_p), dropout_mask) if dropout_active else nn.Identity()
    params = _substituted_params(weight, lora_A, lora_B, magnitude, bias, fan_in_fan_out)
    with _lock:
        module = _peft_module(d_in, d_out, r, weight.dtype, lora_A.dtype, magnitude.dtype, bias is not None,
                              x.device)
        dora_layer = module.lora_magnitude_vector[ADAPTER]
        module.scaling[ADAPTER] = float(scaling)
        module.lora_dropout[ADAPTER] = dropout
        module.train(dropout_active)
        dora_layer._cache_clear()  # ENABLE_DORA_CACHING: never serve a norm from another call
        try:
            return torch.func.functional_call(module, params, (x,), strict=True)
        finally:
            dora_layer._cache_clear()
            module.lora_dropout[ADAPTER] = nn.Identity()
            module.train(False)
