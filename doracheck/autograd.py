"""DoRA linear as a torch.autograd.Function with a hand-written backward (DESIGN section 1).

Forward, with x_d = dropout(x) (x_d = x when no dropout), compute dtype c = x.dtype:
    n    = ||W + s·B·A|| rows  (factored, fp32; cached while W, A, B are unchanged)
    g    = m / max(n, eps)                                     fp32, never rounded to c
    base = x·Wᵀ,  base_d = x_d·Wᵀ,  xa = x_d·Aᵀ,  lora = xa·Bᵀ  GEMMs in c (autocast-like)
    y    = base + b + (g-1)⊙base_d + g⊙s⊙lora                  fp32, rounded once to c

What is saved for backward (the caller's x is referenced, not copied):
- Triton path, no dropout: the output y itself (which the next layer usually holds anyway)
  and xa (T×r); the backward recovers g⊙z = y - b, so no T×d_out tensor is added. Measured
  choice: saving z would add T×d_out (64 MiB at T = 4096, d_out = 8192 in bf16) to the
  training peak for no speed gain. Consequence: where m_i = 0 while n_i > eps, z_i is not
  recoverable from y and dm_i is NaN (loud, not silent); where n_i < eps (a zero row) dm_i = 0.
- Dropout, and the torch path: z_d = base_d + s·lora in c (T×d_out), exact in all cases.
- The bool keep-mask with dropout (x_d is recomputed from x and it).

Backward, dz = g⊙dy:
    dm = Σ_t dy⊙z_d / max(n, eps)      db = Σ_t dy
    dB = s·dzᵀ·xa                      dA = s·(dz·B)ᵀ·x_d
    dx = dz·W + s·(dz·B)·A             (no dropout)
    dx = dy·W + keep/(1-p)⊙(((g-1)⊙dy)·W + s·(dz·B)·A)   (dropout)
    dW = dzᵀ·x (no dropout);  dW = dyᵀ·x + ((g-1)⊙dy)ᵀ·x_d (dropout)   (only if W requires grad)
With ``detach_norm=False`` and c_i = (∂L/∂n_i)/n_i = -S_i·m_i/n_i³ (S = Σ_t dy⊙z_d):
    dB += s·diag(c)·(U + s·B·G)        dA += s·Bᵀ·diag(c)·W + s²·(Bᵀ·diag(c)·B)·A
No dense B·A is formed for the adapter gradients; dW is dense by nature.
"""

from __future__ import annotations

import torch

from doracheck.kernels.settings import NORM_CHUNK_BYTES

from . import norm_cache
from .dispatch import choose_path, factored_norm_full

EPS = 1e-12


def _rows(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """W as a (d_out, d_in) view (no copy)."""
    return weight.t() if fan_in_fan_out else weight


def _bt_diag_w(Bc: torch.Tensor, weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """(Bᵀ·diag(c))·W as (r, d_in) in Bc's dtype, W read in column chunks (no full upcast copy of W)."""
    W = _rows(weight, fan_in_fan_out)
    out = torch.empty(Bc.shape[1], W.shape[1], dtype=Bc.dtype, device=W.device)
    step = max(1, NORM_CHUNK_BYTES // (8 * max(W.shape[0], 1)))
    for start in range(0, W.shape[1], step):
        stop = min(start + step, W.shape[1])
        out[:, start:stop] = Bc.t() @ W[:, start:stop].to(Bc.dtype)
    return out


def _norm(weight, lora_A, lora_B, scaling, fan_in_fan_out, detach_norm):
    def compute():
        with torch.no_grad():
            return factored_norm_full(
                weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out, need_factors=not detach_norm
            )

    if not detach_norm:  # U and G are needed; not worth caching (training-only mode)
        return compute()
    return norm_cache.lookup_or_compute(weight, lora_A, lora_B, scaling, fan_in_fan_out, compute)


def _use_triton(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    if x.dtype == torch.float64 or any(t is not None and t.dtype == torch.float64 for t in tensors):
        return False  # fp64 callers (gradcheck) get the torch path in fp64
    return choose_path(x.device).name == "triton"


class DoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
        cd = x.dtype
        s = float(scaling)
        d_in = x.shape[-1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, d_in)
        W = _rows(weight, fan_in_fan_out)
        W = W if W.dtype == cd else W.to(cd)
        A = lora_A if lora_A.dtype == cd else lora_A.to(cd)
        triton_path = _use_triton(x, weight, lora_A, lora_B, magnitude, bias)
        fn = _norm(weight, lora_A, lora_B, s, fan_in_fan_out, detach_norm)
        n = fn.norm
        g = magnitude.to(n.dtype) / torch.clamp_min(n, EPS)

        keep = None
        x_d = x2
        if keep_mask is not None:
            keep = keep_mask.expand(x.shape).reshape(-1, d_in)
            x_d = x2 * keep.to(cd) / (1.0 - dropout_p)
        base = x2 @ W.t()
        xa = x_d @ A.t()
        saved_h, from_output = None, False
        if triton_path:
            if keep is None:
                torch.ops.doracheck.lora_up_compose_(base, xa, lora_B, g, bias, s)
                y = base
                saved_h, from_output = y, True
            else:
                y, saved_h = torch.ops.doracheck.lora_up_compose_dropout(base, x_d @ W.t(), xa, lora_B, g, bias, s)
        else:
            acc = n.dtype
            B = lora_B if lora_B.dtype == cd else lora_B.to(cd)
            lora = (xa @ B.t()).to(acc)
            base_d = base.to(acc) if keep is None else (x_d @ W.t()).to(acc)
            y = base.to(acc) + (g - 1.0) * base_d + (g * s) * lora
            if bias is not None:
                y = y + bias.to(acc)
            y = y.to(cd)
            saved_h = (base_d + s * lora).to(cd)

        ctx.save_for_backward(x2, keep, xa, saved_h, g, n, weight, lora_A, lora_B, magnitude, bias, fn.U, fn.G)
        ctx.scaling = s
        ctx.dropout_p = dropout_p
        ctx.detach_norm = detach_norm
        ctx.fan_in_fan_out = fan_in_fan_out
        ctx.from_output = from_output
        ctx.triton_path = triton_path
        ctx.lead = lead
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, keep, xa, saved_h, g, n, weight, lora_A, lora_B, magnitude, bias, U, G = ctx.saved_tensors
        s = ctx.scaling
        fan = ctx.fan_in_fan_out
        cd = x2.dtype
        d_out = g.shape[0]
        acc = n.dtype  # accumulation dtype: fp32, or fp64 for fp64 inputs
        dy2 = dy.reshape(-1, d_out)
        dy2 = dy2 if dy2.dtype == cd else dy2.to(cd)
        W = _rows(weight, fan)
        W = W if W.dtype == cd else W.to(cd)
        A = lora_A if lora_A.dtype == cd else lora_A.to(cd)
        B = lora_B if lora_B.dtype == cd else lora_B.to(cd)
        x_d = x2 if keep is None else x2 * keep.to(cd) / (1.0 - ctx.dropout_p)
        n_safe = torch.clamp_min(n, EPS)

        if ctx.triton_path:
            dz, dm_sum = torch.ops.doracheck.grad_scale_dm(dy2.contiguous(), saved_h, g, bias, ctx.from_output)
            if ctx.from_output:
                # dm_sum = Σ dy⊙(g⊙z): divide by g·max(n, eps) (= m). Where g = 0 z is gone:
                # 0 for a zero row (n < eps, z = 0 exactly), NaN otherwise (see module docstring).
                denom = g * n_safe
                recovered = dm_sum / torch.where(denom == 0, torch.ones_like(denom), denom)
                lost = torch.where(n < EPS, torch.zeros_like(n), torch.full_like(n, float("nan")))
                dm_sum_z = torch.where(g == 0, lost * n_safe, recovered * n_safe)
            else:
                dm_sum_z = dm_sum
        else:
            dy_acc = dy2.to(acc)
            dz = (dy_acc * g).to(cd)
            dm_sum_z = (dy_acc * saved_h.to(acc)).sum(0)

        need = ctx.needs_input_grad
        dx = dW = dA = dB = dm = db = None
        dzB = dz @ B  # (T, r)
        if need[0]:
            if keep is None:
                dx2 = torch.addmm(dz @ W, dzB, A, alpha=s)
            else:
                gm1_dy = (dy2.to(acc) * (g - 1.0)).to(cd)
                dropped = torch.addmm(gm1_dy @ W, dzB, A, alpha=s) * keep.to(cd) / (1.0 - ctx.dropout_p)
                dx2 = dy2 @ W + dropped
            dx = dx2.reshape(*ctx.lead, W.shape[1])
        if need[3]:
            dB = s * (dz.t() @ xa)
        if need[2]:
            dA = s * (dzB.t() @ x_d)
        if need[4]:
            dm = (dm_sum_z / n_safe).to(magnitude.dtype)
        if need[5] and bias is not None:
            db = dy2.to(acc).sum(0).to(bias.dtype)

        if not ctx.detach_norm:
            # c_i = (∂L/∂n_i)/n_i with ∂L/∂n_i = -S_i·m_i/n_i² where n_i > eps (g is flat in n below eps).
            m_acc = magnitude.to(acc)
            c = torch.where(n > EPS, -dm_sum_z * m_acc / (n_safe * n_safe * n_safe), torch.zeros_like(n))
            B_acc = lora_B.to(acc)
            if need[3]:
                dB = dB.to(acc) + s * c[:, None] * (U + s * (B_acc @ G))
            if need[2]:
                BcW = _bt_diag_w(B_acc * c[:, None], weight, fan)  # Bᵀ·diag(c)·W, (r, d_in)
                BcB = B_acc.t() @ (c[:, None] * B_acc)
                dA = dA.to(acc) + s * BcW + (s * s) * (BcB @ lora_A.to(acc))
        if need[1]:
            if keep is None:
                dW_rows = dz.to(acc).t() @ x2.to(acc)
            else:
                gm1_dy_acc = dy2.to(acc) * (g - 1.0)
                dW_rows = dy2.to(acc).t() @ x2.to(acc) + gm1_dy_acc.t() @ x_d.to(acc)
            if not ctx.detach_norm:
                V = _rows(weight, fan).to(acc) + s * (lora_B.to(acc) @ lora_A.to(acc))
                dW_rows = dW_rows + c[:, None] * V
            dW = (dW_rows.t() if fan else dW_rows).to(weight.dtype)
        if dA is not None:
            dA = dA.to(lora_A.dtype)
        if dB is not None:
            dB = dB.to(lora_B.dtype)
        return dx, dW, dA, dB, dm, db, None, None, None, None, None


def dora_linear_autograd(x, weight, lora_A, lora_B, magnitude, scaling, bias, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
    """Apply ``DoRALinearFunction`` (arguments already validated)."""
    if _use_triton(x, weight, lora_A, lora_B, magnitude, bias):
        from doracheck.kernels import ops  # noqa: F401  (registers torch.ops.doracheck)
    return DoRALinearFunction.apply(
        x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out
    )
