"""DoRA linear as a torch.autograd.Function with a hand-written backward (DESIGN section 1).

Forward, with x_d = dropout(x) (x_d = x when no dropout), compute dtype c = x.dtype:
    n    = ||W + s·B·A|| rows  (factored, fp32; see doracheck.kernels.norm_torch)
    g    = m / max(n, eps)                                     fp32, never rounded to c
    base = x·Wᵀ,  base_d = x_d·Wᵀ,  xa = x_d·Aᵀ,  lora = xa·Bᵀ  GEMMs in c
    y    = base + b + (g-1)⊙base_d + g⊙s⊙lora                  fp32, rounded once to c
Saved for backward: x (the caller's input, no new memory) and the bool keep-mask with
dropout (x_d is recomputed from them), xa (T×r), z_d = base_d + s·lora in c (T×d_out),
g and n in fp32, and U, G (d_out×r, r×r) for ``detach_norm=False``.

Backward, dz = g⊙dy:
    dm = Σ_t dy⊙z_d / max(n, eps)      db = Σ_t dy
    dB = s·dzᵀ·xa                      dA = s·(dz·B)ᵀ·x_d
    dx = dz·W + s·(dz·B)·A             (no dropout)
    dx = dy·W + keep/(1-p)⊙(((g-1)⊙dy)·W + s·(dz·B)·A)   (dropout)
    dW = dzᵀ·x (no dropout);  dW = dyᵀ·x + ((g-1)⊙dy)ᵀ·x_d (dropout)   (only if W requires grad)
With ``detach_norm=False`` and c_i = (∂L/∂n_i)/n_i = -S_i·m_i/n_i³ (S = Σ_t dy⊙z_d):
    dB += s·diag(c)·(U + s·B·G)        dA += s·Bᵀ·diag(c)·W + s²·(Bᵀ·diag(c)·B)·A
No dense B·A is formed for the adapter gradients; dW (only if W requires grad) is dense
by nature.
"""

from __future__ import annotations

import torch

from doracheck.kernels.settings import NORM_CHUNK_BYTES

from .dispatch import compose, factored_norm_full, scaled_grad_and_dm_sum

EPS = 1e-12


def _rows(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """W as a (d_out, d_in) view."""
    return weight.t() if fan_in_fan_out else weight


class DoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
        cd = x.dtype
        s = float(scaling)
        d_in = x.shape[-1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, d_in)
        W = _rows(weight, fan_in_fan_out).to(cd)
        A = lora_A.to(cd)
        B = lora_B.to(cd)
        with torch.no_grad():
            fn = factored_norm_full(weight, lora_A, lora_B, s, fan_in_fan_out=fan_in_fan_out)
        n = fn.norm
        g = magnitude.to(n.dtype) / torch.clamp_min(n, EPS)

        base = x2 @ W.t()
        if keep_mask is not None:
            keep = keep_mask.expand(x.shape).reshape(-1, d_in)
            x_d = x2 * keep.to(cd) / (1.0 - dropout_p)
            base_d = x_d @ W.t()
        else:
            keep, x_d, base_d = None, x2, None
        xa = x_d @ A.t()
        lora = xa @ B.t()
        y = compose(base, lora, g, s, bias, base_dropped=base_d)
        # z_d = base_d + s·lora: what dy multiplies in dm.
        acc = n.dtype
        z_d = ((base if base_d is None else base_d).to(acc) + s * lora.to(acc)).to(cd)

        ctx.save_for_backward(x2, keep, xa, z_d, g, n, weight, lora_A, lora_B, magnitude, fn.U, fn.G)
        ctx.scaling = s
        ctx.dropout_p = dropout_p
        ctx.detach_norm = detach_norm
        ctx.fan_in_fan_out = fan_in_fan_out
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.lead = lead
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, keep, xa, z_d, g, n, weight, lora_A, lora_B, magnitude, U, G = ctx.saved_tensors
        s = ctx.scaling
        fan = ctx.fan_in_fan_out
        cd = x2.dtype
        x_d = x2 if keep is None else x2 * keep.to(cd) / (1.0 - ctx.dropout_p)
        d_out = g.shape[0]
        dy2 = dy.reshape(-1, d_out).to(cd)
        W = _rows(weight, fan).to(cd)
        A = lora_A.to(cd)
        B = lora_B.to(cd)
        f32 = n.dtype  # the accumulation dtype: fp32, or fp64 for fp64 inputs

        dz, dm_sum = scaled_grad_and_dm_sum(dy2, z_d, g)
        n_safe = torch.clamp_min(n, EPS)
        need = ctx.needs_input_grad
        dx = dW = dA = dB = dm = db = None

        dzB = dz @ B  # (T, r)
        if need[0]:
            if keep is None:
                dx2 = dz @ W + s * (dzB @ A)
            else:
                gm1_dy = (dy2.to(f32) * (g - 1.0)).to(cd)
                dropped = (gm1_dy @ W + s * (dzB @ A)) * keep.to(cd) / (1.0 - ctx.dropout_p)
                dx2 = dy2 @ W + dropped
            dx = dx2.reshape(*ctx.lead, W.shape[1])
        if need[3]:
            dB = s * (dz.t() @ xa)
        if need[2]:
            dA = s * (dzB.t() @ x_d)
        if need[4]:
            dm = (dm_sum / n_safe).to(magnitude.dtype)
        if need[5] and ctx.has_bias:
            db = dy2.to(f32).sum(0).to(ctx.bias_dtype)

        chain_through_norm = not ctx.detach_norm
        if chain_through_norm:
            # c_i = (∂L/∂n_i)/n_i with ∂L/∂n_i = -S_i·m_i/n_i² where n_i > eps (g is flat in n below eps).
            m32 = magnitude.to(f32)
            c = torch.where(n > EPS, -dm_sum * m32 / (n_safe * n_safe * n_safe), torch.zeros_like(n))
            B32 = lora_B.to(f32)
            if need[3]:
                dB = dB.to(f32) + s * c[:, None] * (U + s * (B32 @ G))
            if need[2]:
                BcW = _bt_diag_w(B32 * c[:, None], weight, fan)  # Bᵀ·diag(c)·W, (r, d_in)
                BcB = B32.t() @ (c[:, None] * B32)
                dA = dA.to(f32) + s * BcW + (s * s) * (BcB @ lora_A.to(f32))
        if need[1]:
            if keep is None:
                dW_rows = dz.to(f32).t() @ x2.to(f32)
            else:
                gm1_dy32 = dy2.to(f32) * (g - 1.0)
                dW_rows = dy2.to(f32).t() @ x2.to(f32) + gm1_dy32.t() @ x_d.to(f32)
            if chain_through_norm:
                V = _rows(weight, fan).to(f32) + s * (lora_B.to(f32) @ lora_A.to(f32))
                dW_rows = dW_rows + c[:, None] * V
            dW = (dW_rows.t() if fan else dW_rows).to(weight.dtype)
        if dA is not None:
            dA = dA.to(lora_A.dtype)
        if dB is not None:
            dB = dB.to(lora_B.dtype)
        return dx, dW, dA, dB, dm, db, None, None, None, None, None


def _bt_diag_w(Bc: torch.Tensor, weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """(Bᵀ·diag(c))·W as (r, d_in) in Bc's dtype, W read in column chunks (no full upcast copy of W)."""
    W = _rows(weight, fan_in_fan_out)
    r = Bc.shape[1]
    out = torch.empty(r, W.shape[1], dtype=Bc.dtype, device=W.device)
    step = max(1, NORM_CHUNK_BYTES // (8 * max(W.shape[0], 1)))
    for start in range(0, W.shape[1], step):
        stop = min(start + step, W.shape[1])
        out[:, start:stop] = Bc.t() @ W[:, start:stop].to(Bc.dtype)
    return out


def dora_linear_autograd(x, weight, lora_A, lora_B, magnitude, scaling, bias, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
    """Apply ``DoRALinearFunction`` (arguments already validated)."""
    return DoRALinearFunction.apply(
        x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out
    )
