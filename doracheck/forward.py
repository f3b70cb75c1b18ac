"""The DoRA forward pass, for both entry points (docs/design.md section 1).

With x_d = dropout(x) (x_d = x without dropout) and the compute dtype c = x.dtype:
    n    = ||W + s·B·A|| rows  (factored, fp32; reused only as ``norm_rule`` allows)
    g    = m / max(n, eps)                                     fp32, never rounded to c
    base = x·Wᵀ,  base_d = x_d·Wᵀ,  xa = x_d·Aᵀ,  lora = xa·Bᵀ  GEMMs in c (autocast-like)
    y    = base + b + (g-1)⊙base_d + g⊙s⊙lora                  fp32, rounded once to c

``linear_forward`` computes base itself (``dora_linear``); ``from_base_forward`` starts from a
caller's base output (PEFT's LoRA Linear, ``result`` = x·Wᵀ + b). Kernels are the backend's.

What is kept for the backward (``Saved``; the caller's x is referenced, not copied):
- without dropout and bias, where the backend allows it: y itself (g⊙z = y; the next layer
  usually holds it anyway) and xa (T×r): no T×d_out tensor added (z would add 64 MiB at
  T = 4096, d_out = 8192 in bf16, for no speed gain); the backward recomputes features with
  m_i = 0 (``dm_finish``);
- with a bias, z (z from y - b loses digits in proportion to |b|/|g·z|; the baseline-ratio
  property caught it in fp16);
- with dropout, z_d = base_d + s·lora and the bool keep-mask (x_d is recomputed from x and it).
Without autograd only y is formed (``need_saved=False``), g = m / max(n, eps) inside the compose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import norm_rule, planner
from .kernels.backends import Backend
from .kernels.compose_torch import magnitude_scale
from .kernels.constants import eps
from .layer_state import LayerArgs, Saved


def dropped(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """x_d = x·keep/(1-p), in this one order everywhere (forward, backward, recompute), so a
    recomputed x_d·Aᵀ is bitwise the forward's."""
    return x if keep is None else x * keep.to(x.dtype) / (1.0 - p)


def rows(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """W as a (d_out, d_in) view (no copy)."""
    return weight.t() if fan_in_fan_out else weight


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def norm_with_floor(backend: Backend, weight, lora_A, lora_B, scaling: float, fan_in_fan_out: bool, need_factors: bool = False):
    """(FactoredNorm, max(n, eps)), without autograd."""
    with torch.no_grad():
        fn = backend.factored_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out, need_factors)
        return fn, torch.clamp_min(fn.norm, eps())


def norm_and_scale(backend: Backend, a: LayerArgs, *, need_g: bool, recording: bool):
    """(FactoredNorm, g = m / max(n, eps) or None, max(n, eps)). With the detached norm, n and
    max(n, eps) are reused as ``norm_rule`` decides (``recording``: autograd records this
    forward), g formed at every call (``need_g=False``: by the compose). The exact-norm mode
    also needs U and G and is never reused."""
    if a.detach_norm:

        def compute():
            fn, n_safe = norm_with_floor(backend, a.weight, a.lora_A, a.lora_B, a.scaling, a.fan_in_fan_out)
            return fn._replace(U=None, G=None), n_safe

        fn, n_safe = norm_rule.lookup_or_compute(a.weight, a.lora_A, a.lora_B, a.scaling, a.fan_in_fan_out, compute,
                                                 tag=backend.name, recording=recording)
    else:
        fn, n_safe = norm_with_floor(backend, a.weight, a.lora_A, a.lora_B, a.scaling, a.fan_in_fan_out, True)
    return fn, (magnitude_scale(a.magnitude, n_safe) if need_g else None), n_safe


def _contiguous_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias.contiguous() if bias is not None and not bias.is_contiguous() else bias  # kernels read b with stride 1


def _keep(keep_mask: torch.Tensor | None, x: torch.Tensor, x2: torch.Tensor, p: float):
    """(keep as (T, d_in) or None, x_d)."""
    if keep_mask is None:
        return None, x2
    keep = keep_mask.expand(x.shape).reshape(-1, x.shape[-1])
    return keep, dropped(x2, keep, p)


def _projections(x2, x_d, W, A, a: LayerArgs, variant, need_saved: bool):
    """(base, xa kept for the backward or None, xa and B for the up-projection) in the order
    the planner chose. "merged" (fp32 only): W' = W + s·B·A in the compute dtype (fp32
    accumulation, rounded once), base = x·W'ᵀ and an empty up-projection."""
    if variant.order == "merged":
        Wm = torch.addmm(W, in_dtype(a.lora_B, x2.dtype), A, alpha=a.scaling)
        base = x2 @ Wm.t()
        del Wm
        xa = x_d @ A.t() if need_saved and variant.save_xa else None
        return base, xa, base.new_empty(base.shape[0], 0), base.new_empty(base.shape[1], 0)
    base = F.linear(x2, W)  # ATen's 2-D linear without bias is matmul(x, Wᵀ): the mm of x2 @ W.t(), fewer host steps
    xa = F.linear(x_d, A)
    return base, (xa if not need_saved or variant.save_xa else None), xa, a.lora_B


def linear_forward(x: torch.Tensor, a: LayerArgs, keep_mask: torch.Tensor | None, backend: Backend, need_saved: bool = True):
    """(y as (T, d_out), Saved or None) for ``dora_linear``."""
    bias = _contiguous_bias(a.bias)
    cd = x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    W = in_dtype(rows(a.weight, a.fan_in_fan_out), cd)
    A = in_dtype(a.lora_A, cd)
    g_in_kernel = not need_saved and keep_mask is None  # inference: g = m / n inside the compose
    fn, g, n_safe = norm_and_scale(backend, a, need_g=not g_in_kernel, recording=need_saved)
    keep, x_d = _keep(keep_mask, x, x2, a.dropout_p)
    variant = planner.choose(
        x2.shape[1], W.shape[0], A.shape[0], x2.shape[0], cd, need_saved, keep is not None, a.detach_norm, x2.device
    )
    base, xa, xa_up, B_up = _projections(x2, x_d, W, A, a, variant, need_saved)
    from_output = False
    if g_in_kernel:
        return backend.compose_infer(base, xa_up, B_up, a.magnitude, n_safe, bias, a.scaling), None
    if keep is None:
        y, h, from_output = backend.compose_saving(base, xa_up, B_up, g, bias, a.scaling, False, True)
    else:
        y, h = backend.compose_dropout(base, x_d @ W.t(), xa_up, B_up, g, bias, a.scaling)
    return y, Saved(x2, keep, xa, h if need_saved else None, g, fn.norm, n_safe, fn.U, fn.G, backend, from_output, variant)


def _infer_into(r2: torch.Tensor, x2: torch.Tensor, lora_A, lora_B, magnitude, bias, scaling: float, n_safe: torch.Tensor,
                backend: Backend) -> None:
    """r2 (T, d_out) = b + g⊙(r2 - b + s·(x2·Aᵀ)·Bᵀ), g = m / n_safe formed in the compose
    (inference: nothing kept for a backward)."""
    A = in_dtype(lora_A, x2.dtype)
    _write(r2, backend.compose_infer(r2, F.linear(x2, A), lora_B, magnitude, n_safe, _contiguous_bias(bias), scaling, True))


def _write(r2: torch.Tensor, y: torch.Tensor) -> None:
    if y is not r2:  # a backend op that returned a new tensor (torch twin, or traced)
        r2.copy_(y)


def from_base_forward(result: torch.Tensor, x: torch.Tensor, a: LayerArgs, keep_mask: torch.Tensor | None, backend: Backend, *,
                      need_saved: bool, in_place: bool = True, result_is_base: bool = True, n_safe: torch.Tensor | None = None):
    """(y, Saved or None) for ``dora_from_base``: y = b + g⊙(result - b + s·(x·Aᵀ)·Bᵀ), or
    with dropout y = result + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ; into ``result`` when
    ``in_place``, else a new tensor. The output may stand for z only where ``result`` is x·Wᵀ
    exactly (``result_is_base``): the lost-row pass recomputes z from x and W. ``n_safe``: an
    armed ``inference_norms`` max(n, eps), used only when nothing is saved."""
    cd, d_out = result.dtype, result.shape[-1]
    bias = _contiguous_bias(a.bias)
    x2 = in_dtype(x.reshape(-1, x.shape[-1]), cd)
    T = x2.shape[0]
    # T from x: with d_out = 0, view(-1, 0) would be ambiguous.
    r2 = result.view(T, d_out) if in_place else result.reshape(T, d_out).clone(memory_format=torch.contiguous_format)
    out = result if in_place else r2.view(result.shape)
    g_in_kernel = not need_saved and keep_mask is None
    if n_safe is not None and not need_saved:
        fn, g = None, None if g_in_kernel else magnitude_scale(a.magnitude, n_safe)
    else:
        fn, g, n_safe = norm_and_scale(backend, a, need_g=not g_in_kernel, recording=need_saved)
    if g_in_kernel:  # inference: g = m / n inside the compose, nothing kept
        _infer_into(r2, x2, a.lora_A, a.lora_B, a.magnitude, a.bias, a.scaling, n_safe, backend)
        return out, None
    A = in_dtype(a.lora_A, cd)
    keep, x_d = _keep(keep_mask, x, x2, a.dropout_p)
    xa = F.linear(x_d, A)  # the mm of x_d @ A.t() (ATen's 2-D linear without bias), without Tensor.__matmul__'s wrapper
    from_output = False
    if keep is not None:  # result already holds b
        base_d = x_d @ in_dtype(rows(a.weight, a.fan_in_fan_out), cd).t()
        y, h = backend.compose_dropout(r2, base_d, xa, a.lora_B, g, None, a.scaling)
        r2.copy_(y)
        del y
    else:
        y, h, from_output = backend.compose_saving(r2, xa, a.lora_B, g, bias, a.scaling, True, result_is_base)
        _write(r2, y)
        if from_output:
            h = out  # saved as the output itself (a view of it would be refused)
    if not need_saved or fn is None or g is None:
        return out, None
    return out, Saved(x2, keep, xa, h, g, fn.norm, n_safe, None, None, backend, from_output, planner.DEFAULT)
