"""The stable DoRA compose and the dm reduction, pure torch (same signatures as the Triton ones).

Compose (docs/design.md section 2): evaluated in fp32, rounded once to the output dtype:
    y = base + b + (g - 1)⊙base_d + g⊙s⊙lora        (base_d = base without dropout)
Never ``g·(base + s·lora) - base`` in low precision: near g ≈ 1 it cancels.
dm reduction: S_i = Σ_t dy_ti·z_ti in fp32, dm = S / max(n, eps) (deterministic per device).
"""

from __future__ import annotations

import torch

from .constants import eps


def compose_torch(
    base: torch.Tensor,
    lora: torch.Tensor,
    g: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    base_dropped: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = base + b + (g-1)⊙base_d + g⊙s⊙lora, fp32 math, one rounding to ``base.dtype``. ``base``,
    ``lora``, ``base_dropped``: (T, d_out); ``g``: fp32 (d_out,); ``bias``: (d_out,). ``out`` may
    alias ``base`` (in place)."""
    f32 = accumulation_dtype(base, g)
    gf = g.to(f32)
    base32 = base.to(f32)
    if base_dropped is None:
        y = gf * (base32 + float(scaling) * lora.to(f32))
    else:
        y = base32 + (gf - 1.0) * base_dropped.to(f32) + (gf * float(scaling)) * lora.to(f32)
    if bias is not None:
        y = y + bias.to(f32)
    if out is None:
        return _as(y, base.dtype)
    out.copy_(y)
    return out


def magnitude_scale(magnitude: torch.Tensor, n_safe: torch.Tensor) -> torch.Tensor:
    """g = m / max(n, eps) from n_safe = max(n, eps): one division with type promotion, so a
    16-bit m is read as fp32 by the division itself and g is never rounded to 16 bits. The one
    place g is formed outside the kernels (which form it in registers from the same operands)."""
    return torch.div(magnitude, n_safe)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The layer's one accumulation rule: fp64 where any of the given operands is fp64
    (gradcheck, mixed fp64 magnitudes), else fp32. The layer asks it with x (the compute dtype)
    and g = m / max(n, eps) (which carries the dtypes of m and of the norm)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _lora_up(xa: torch.Tensor, lora_B: torch.Tensor, acc: torch.dtype, cd: torch.dtype) -> torch.Tensor:
    """lora = xa·Bᵀ as the GEMM gives it in the compute dtype ``cd``, then read in ``acc``."""
    B = lora_B if lora_B.dtype == cd else lora_B.to(cd)
    return (xa @ B.t()).to(acc)


def lora_up_compose_torch(
    base: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, scaling: float,
    base_has_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of the fused up-projection + compose (no dropout): (y, z) with
    z = base [- b] + s·xa·Bᵀ and y = g⊙z + b in fp32 (fp64 for fp64), each rounded once to
    base.dtype. ``base_has_bias``: base is x·Wᵀ + b (a PEFT base layer's output)."""
    acc = accumulation_dtype(base, g)
    lora = _lora_up(xa, lora_B, acc, base.dtype)
    base_acc = base.to(acc)
    if base_has_bias and bias is not None:
        base_acc = base_acc - bias.to(acc)
    z = base_acc + scaling * lora
    y = g * z  # the stable form: one product, exactly invariant to row scaling
    if bias is not None:
        y = y + bias.to(acc)
    # no .to() when the dtype is already right: under torch.compile on torch 2.11 a Function whose
    # output was such an alias of an intermediate got all-zero gradients
    return _as(y, base.dtype), _as(z, base.dtype)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def lora_up_compose_dropout_torch(
    base: torch.Tensor, base_dropped: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor, g: torch.Tensor,
    bias: torch.Tensor | None, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of the dropout compose: (y, z_d) with y = base + b + (g-1)⊙base_d +
    g⊙s⊙lora_d and z_d = base_d + s·lora_d (lora_d = x_d·Aᵀ·Bᵀ), fp32 math, rounded once."""
    acc = accumulation_dtype(base, g)
    lora = _lora_up(xa, lora_B, acc, base.dtype)
    base_d = base_dropped.to(acc)
    y = base.to(acc) + (g - 1.0) * base_d + (g * scaling) * lora
    if bias is not None:
        y = y + bias.to(acc)
    return _as(y, base.dtype), _as(base_d + scaling * lora, base.dtype)


def grad_scale_dm_torch(
    dy: torch.Tensor, saved: torch.Tensor, g: torch.Tensor, n: torch.Tensor, bias: torch.Tensor | None, *, from_output: bool,
    final_dm: bool = False, reduce: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of ``grad_scale_dm_triton`` (same results up to summation order): dz =
    g⊙dy in dy.dtype, saturated where n < eps (g = m/eps there: zero rows of W and B give 0, not
    inf·0); S = Σ_t dy⊙h, h = y - b (= g⊙z) when ``from_output`` else z, in fp32 (fp64 for fp64).
    ``final_dm``: S = dm = Σ_t dy⊙z / max(n, eps) (from the output where g = 0: 0 if n < eps,
    else NaN). ``reduce=False``: S as one row of partials (1, d_out), as the kernel's."""
    acc = accumulation_dtype(dy, g)
    dy_acc = dy.to(acc)
    dz = dy_acc * g.to(acc)
    limit = torch.finfo(dy.dtype).max
    dz = torch.where((n < eps()) & (dz.abs() > limit), torch.sign(dz) * limit, dz).to(dy.dtype)
    h = saved.to(acc)
    if from_output and bias is not None:
        h = h - bias.to(acc)
    S = (dy_acc * h).sum(0)
    dm = S if not final_dm else _finish_dm(S, g, n, from_output, acc)
    return dz, dm if reduce else dm[None, :]


def _finish_dm(S: torch.Tensor, g: torch.Tensor, n: torch.Tensor, from_output: bool, acc: torch.dtype) -> torch.Tensor:
    """dm from S: S / max(n, eps), or from the output S / (g·max(n, eps)) with the g = 0 rules."""
    n_safe = n.to(acc).clamp_min(eps())
    if not from_output:
        return S / n_safe
    gf = g.to(acc)
    lost = torch.where(n_safe > eps(), torch.full_like(S, float("nan")), torch.zeros_like(S))
    return torch.where(gf == 0, lost, S / torch.where(gf == 0, torch.ones_like(gf), gf * n_safe))


def dm_lost_rows_torch(
    dm: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, weight_rows: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor,
    g: torch.Tensor, n: torch.Tensor, scaling: float, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lost-feature part of ``lost_rows_triton.dm_finish_triton``: dm_i = Σ_t dy_ti·z_ti /
    max(n_i, eps) recomputed from x, W, xa, B where g_i = 0 and n_i >= eps (z_i is not
    recoverable from the output there); other entries unchanged."""
    acc = accumulation_dtype(dy, g)
    lost = ((g == 0) & (n >= eps())).nonzero().squeeze(1)
    result = out if out is not None else dm.clone()
    if lost.numel() == 0 or dy.shape[0] == 0:
        return result
    z = x.to(acc) @ weight_rows[lost].to(acc).t() + float(scaling) * (xa.to(acc) @ lora_B[lost].to(acc).t())
    result[lost] = ((dy[:, lost].to(acc) * z).sum(0) / n[lost].to(acc).clamp_min(eps())).to(result.dtype)
    return result


def dm_finish_torch(
    parts: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, weight_rows: torch.Tensor, xa: torch.Tensor, lora_B: torch.Tensor,
    g: torch.Tensor, n: torch.Tensor, scaling: float, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The torch twin of ``lost_rows_triton.dm_finish_triton``: the rows of ``parts`` (P, d_out)
    summed in order (as the kernel adds them), the lost features (g = 0, n >= eps) recomputed
    (``dm_lost_rows_torch``), rounded once to ``out_dtype``."""
    dm = parts[0].clone() if parts.shape[0] else parts.new_zeros(parts.shape[1])
    for row in parts[1:]:
        dm += row
    if dy.shape[0] == 0:  # no tokens: a lost feature's sum is empty, 0 (as the kernel gives)
        dm[(g == 0) & (n >= eps())] = 0.0
        return dm.to(out_dtype)
    return dm_lost_rows_torch(dm, dy, x, weight_rows, xa, lora_B, g, n, scaling).to(out_dtype)
