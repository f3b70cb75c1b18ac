"""DoRA linear as a torch.autograd.Function with a hand-written backward (DESIGN section 1).

Forward, with x_d = dropout(x) (x_d = x when no dropout), compute dtype c = x.dtype:
    n    = ||W + s·B·A|| rows  (factored, fp32; cached while W, A, B are unchanged)
    g    = m / max(n, eps)                                     fp32, never rounded to c
    base = x·Wᵀ,  base_d = x_d·Wᵀ,  xa = x_d·Aᵀ,  lora = xa·Bᵀ  GEMMs in c (autocast-like)
    y    = base + b + (g-1)⊙base_d + g⊙s⊙lora                  fp32, rounded once to c

What is saved for backward (the caller's x is referenced, not copied):
- Triton path, no dropout, no bias: the output y itself (which the next layer usually holds
  anyway) and xa (T×r); the backward recovers g⊙z = y, so no T×d_out tensor is added.
  Measured choice: saving z would add T×d_out (64 MiB at T = 4096, d_out = 8192 in bf16) to
  the training peak for no speed gain. Where m_i = 0 while n_i > eps, z_i is not
  recoverable from y: the kernel ``dm_lost_rows`` recomputes dm_i for exactly those
  features from x, W, xa and B (where no m_i is 0 it reads g and n only); where n_i < eps
  (a zero row) dm_i = 0. With a bias, z is saved instead (the fused kernel writes it):
  recovering it from y - b loses digits in proportion to |b|/|g·z|, which the
  baseline-ratio property caught in fp16 (3.4e-3 against the naive 9.3e-4, interpreter).
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

The computation order is the planner's (doracheck.planner): "factored" as above, or, in fp32
only, "merged" (W' = W + s·B·A formed in the forward and again in the backward, dx = dz·W');
the planner also decides whether the backward is chunked and whether xa is saved or recomputed.

The backward runs over token chunks when dz (T×d_out) would be large (settings
``backward_token_chunk``). Without dropout, in fp32, and in bf16 on CUDA, what does not need dz
itself is then formed once over all tokens from dy and g, which leaves two ops a chunk (the
dz/dm pass, dx += dz·W) for the host to issue: dz·B = dy·(g⊙B) (T×r), dB = s·diag(g)·(dyᵀ·xa)
(an fp32 GEMM output, scaled and rounded once), dx = s·(dz·B)·A to start from. Otherwise (fp16,
whose range g⊙B can exceed; 16-bit off CUDA; dropout) dz·B and dB are accumulated chunk by
chunk from dz. The dm partials of all chunks are summed once, in order, at the end.
Rows with n < eps (g = m/eps, up to 1e12) get dz saturated at the dtype's largest finite
value instead of inf, so zero rows of W and B contribute 0 rather than inf·0 = NaN (fp16).
Without autograd (no_grad, or nothing requires grad) the forward runs without an
autograd.Function and computes nothing that only the backward needs (no z with a bias).
"""

from __future__ import annotations

import contextlib

import torch

from doracheck.kernels.settings import NORM_CHUNK_BYTES, backward_token_chunk

from . import norm_cache, planner
from .dispatch import choose_path, factored_norm_full

EPS = 1e-12
_DM_PARTS_BYTES = 4 * 2**20  # dm partials kept over token chunks before they are folded into one row


def _dropped(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """x_d = x·keep/(1-p), in this one order everywhere (forward, backward, recompute), so a
    recomputed x_d·Aᵀ is bitwise the forward's."""
    return x if keep is None else x * keep.to(x.dtype) / (1.0 - p)


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


_ZEROS: dict = {}


def _zero_scalar(like: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero of ``like``'s dtype and device, made once (it is only an ignored addend).
    Only for plain tensors outside any tracing: a fake or functional tensor cached here would
    break every later eager call."""
    from doracheck.kernels.tracing import tracing

    if type(like) is not torch.Tensor or tracing():
        return like.new_zeros(())
    key = (like.dtype, like.device)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = like.new_zeros(())
    return zero


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """s·(a·b) as one GEMM with alpha = s: scaled in the fp32 accumulator and rounded once,
    with no fp32 copy of the (r × d_in or d_out × r) result. beta = 0: the addend is not read."""
    return torch.addmm(_zero_scalar(a), a, b, beta=0, alpha=s)


_HAS_MM_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _fp32_out_gemm(t: torch.Tensor) -> bool:
    """Whether a 16-bit GEMM on ``t``'s device can write its fp32 accumulator as fp32 (cuBLAS,
    ``aten::mm.dtype``, torch >= 2.8)."""
    return t.device.type == "cuda" and _HAS_MM_DTYPE


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b with the fp32 accumulator written as fp32 for 16-bit a, b (callers check
    ``_fp32_out_gemm``), so nothing is rounded to 16 bits; fp32 a·b as it is."""
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a @ b


def _row_scaled_tmm(dy: torch.Tensor, xa: torch.Tensor, g: torch.Tensor, s: float, out_dtype: torch.dtype) -> torch.Tensor:
    """dB = s·diag(g)·(dyᵀ·xa) = s·dzᵀ·xa (dz = g⊙dy), over all tokens at once, in ``out_dtype``:
    one GEMM and one fp32 row scaling (addcmul), rounded once to ``out_dtype``."""
    P = _mm_fp32_out(dy.t(), xa)
    out = torch.empty(P.shape, dtype=out_dtype, device=P.device)
    return torch.addcmul(_zero_scalar(g), P, g[:, None], value=s, out=out)


def _norm_and_scale(weight, lora_A, lora_B, magnitude, scaling, fan_in_fan_out, detach_norm, path="torch", need_g=True, *,
                    recording):
    """(FactoredNorm, g = m / max(n, eps), max(n, eps)). The norm and max(n, eps) come from the
    norm cache while W, A, B are unchanged; g is recomputed each call (one small kernel),
    because the magnitude is a trained parameter that tools also write through ``.data``
    (gradcheck does), which no version counter sees. ``need_g=False`` gives g = None (the
    inference kernel divides m by max(n, eps) itself). ``recording``: autograd records this
    forward (``norm_cache.lookup_or_compute`` says what that changes)."""

    def compute():
        with torch.no_grad():
            fn = factored_norm_full(
                weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out, need_factors=not detach_norm
            )
            return fn, torch.clamp_min(fn.norm, EPS)

    if detach_norm:  # U, G are not needed then: the cache keeps the four d_out vectors and n_safe
        fn, n_safe = norm_cache.lookup_or_compute(
            weight, lora_A, lora_B, scaling, fan_in_fan_out,
            lambda: (lambda fn_ns: (fn_ns[0]._replace(U=None, G=None), fn_ns[1]))(compute()), tag=path,
            recording=recording,
        )
    else:  # U and G are needed; not worth caching (training-only mode)
        fn, n_safe = compute()
    # m / n_safe with type promotion: a 16-bit m is read as fp32 by the division itself (one op).
    return fn, (torch.div(magnitude, n_safe) if need_g else None), n_safe


def _use_triton(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    f64 = torch.float64
    if x.dtype == f64 or any(t.dtype == f64 for t in tensors if t is not None):
        return False  # fp64 callers (gradcheck) get the torch path in fp64
    return choose_path(x.device).name == "triton"


def _forward(x, weight, lora_A, lora_B, magnitude, bias, s, keep_mask, dropout_p, detach_norm, fan_in_fan_out, need_saved=True):
    """y and what the backward needs: (y2d, saved dict); ``need_saved=False`` (no autograd)
    skips whatever only the backward would use (z with a bias)."""
    from doracheck.kernels import ops

    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read b with stride 1
    cd = x.dtype
    d_in = x.shape[-1]
    x2 = x.reshape(-1, d_in)
    W = _rows(weight, fan_in_fan_out)
    W = W if W.dtype == cd else W.to(cd)
    A = lora_A if lora_A.dtype == cd else lora_A.to(cd)
    triton_path = _use_triton(x, weight, lora_A, lora_B, magnitude, bias)
    # Inference on the Triton path (no dropout, nothing saved): g = m / n is formed in the kernel.
    g_in_kernel = triton_path and not need_saved and keep_mask is None
    fn, g, n_safe = _norm_and_scale(
        weight, lora_A, lora_B, magnitude, s, fan_in_fan_out, detach_norm, "triton" if triton_path else "torch",
        need_g=not g_in_kernel, recording=need_saved,
    )
    n = fn.norm

    keep = None
    x_d = x2
    if keep_mask is not None:
        keep = keep_mask.expand(x.shape).reshape(-1, d_in)
        x_d = _dropped(x2, keep, dropout_p)
    variant = planner.choose(
        d_in, W.shape[0], A.shape[0], x2.shape[0], cd, need_saved, keep is not None, detach_norm, x2.device
    )
    if variant.order == "merged":
        # W' = W + s·B·A in cd (fp32 accumulation, rounded once; planner: fp32 compute only), then
        # y = g⊙(x·W'ᵀ) + b through the same compose with an empty up-projection.
        Wm = torch.addmm(W, lora_B if lora_B.dtype == cd else lora_B.to(cd), A, alpha=s)
        base = x2 @ Wm.t()
        del Wm
        xa = x_d @ A.t() if need_saved and variant.save_xa else None
        xa_up, B_up = base.new_empty(base.shape[0], 0), base.new_empty(base.shape[1], 0)
    else:
        base = x2 @ W.t()
        xa = xa_up = x_d @ A.t()
        B_up = lora_B
        if need_saved and not variant.save_xa:
            xa = None  # recomputed in the backward
    from_output = False
    if g_in_kernel:
        y = saved_h = ops.compose_infer_(base, xa_up, B_up, magnitude, n_safe, bias, s)
    elif triton_path:
        if keep is None and (bias is None or not need_saved):
            y = saved_h = ops.call("lora_up_compose_", base, xa_up, B_up, g, bias, s)  # in place in eager
            from_output = bias is None
        elif keep is None:  # with a bias, z from y - b loses digits where |b| >> |g·z|: save z
            y, saved_h = ops.call("lora_up_compose_save_z_", base, xa_up, B_up, g, bias, s)
        else:
            y, saved_h = ops.call("lora_up_compose_dropout", base, x_d @ W.t(), xa_up, B_up, g, bias, s)
    else:
        acc = n.dtype
        B = B_up if B_up.dtype == cd else B_up.to(cd)
        lora = (xa_up @ B.t()).to(acc)
        base_d = base.to(acc) if keep is None else (x_d @ W.t()).to(acc)
        if keep is None:  # the stable form: g·z, one product (exactly invariant to row scaling)
            y = g * (base_d + s * lora)
        else:
            y = base.to(acc) + (g - 1.0) * base_d + (g * s) * lora
        if bias is not None:
            y = y + bias.to(acc)
        y = y.to(cd)
        saved_h = (base_d + s * lora).to(cd) if need_saved else None
    saved = {
        "x2": x2, "keep": keep, "xa": xa, "saved_h": saved_h, "g": g, "n": n, "n_safe": n_safe, "U": fn.U, "G": fn.G,
        "triton_path": triton_path, "from_output": from_output, "variant": variant,
    }
    return y, saved


def _scaled_grad_chunk(dy_c, h_c, g, n, bias, *, triton_path, from_output, final_dm, reduce=True):
    """(dz_c, partial dm sum) for one token chunk: dz = g⊙dy (saturated where n < eps) and
    Σ_t dy⊙h with h = y - b (= g⊙z, when ``from_output``) or h = z; with ``final_dm`` this
    chunk's share of dm itself (Σ_t dy⊙z / max(n, eps), finished inside the kernel)."""
    if triton_path:
        from doracheck.kernels import ops

        return ops.call("grad_scale_dm", dy_c, h_c, g, n, bias, from_output, final_dm, reduce)
    from doracheck.kernels import grad_scale_dm_torch

    return grad_scale_dm_torch(dy_c, h_c, g, n, bias, from_output=from_output, final_dm=final_dm, reduce=reduce)


def _dm_lost_rows(dm, dy2, x2, W, xa, B, g, n, s, triton_path):
    """dm with the features whose z the saved output lost (g = 0 while n >= eps) recomputed
    from the operands (kernels' ``dm_lost_rows``); in place where ``dm`` is the kernel's own."""
    if triton_path:
        from doracheck.kernels import ops

        return ops.call("dm_lost_rows_", dm, dy2, x2, W, xa, B, g, n, s)
    from doracheck.kernels import dm_lost_rows_torch

    return dm_lost_rows_torch(dm, dy2, x2, W, xa, B, g, n, s)


def _dm_sum_of_z(dm_sum, g, n, from_output):
    """Σ_t dy⊙z from the accumulated sum. From the output, Σ dy⊙(g⊙z) is divided by g; where
    g = 0, z is gone: 0 for a zero row (n < eps, z = 0 exactly), NaN otherwise."""
    if not from_output:
        return dm_sum
    safe_g = torch.where(g == 0, torch.ones_like(g), g)
    lost = torch.where(n < EPS, torch.zeros_like(n), torch.full_like(n, float("nan")))
    return torch.where(g == 0, lost, dm_sum / safe_g)


def _backward(ctx_saved, dy, weight, lora_A, lora_B, magnitude, bias, s, dropout_p, detach_norm, fan_in_fan_out, lead, need,
              base_in_dx=True):
    """dx, dW, dA, dB, dm, db of the module docstring for upstream ``dy``. ``base_in_dx=False``
    (a from-base layer whose ``result`` is not x·Wᵀ + b: it carries another adapter's output)
    leaves out of dx the term through the base output (dz·W, or dy·W with dropout): that
    gradient reaches x through ``result`` instead."""
    x2, keep, xa, saved_h, g, n = (ctx_saved[k] for k in ("x2", "keep", "xa", "saved_h", "g", "n"))
    triton_path, from_output = ctx_saved["triton_path"], ctx_saved["from_output"]
    variant = ctx_saved.get("variant", planner.DEFAULT)
    cd = x2.dtype
    d_out = g.shape[0]
    d_in = x2.shape[1]
    acc = n.dtype  # accumulation dtype: fp32, or fp64 for fp64 inputs
    T = x2.shape[0]
    dy2 = dy.reshape(T, d_out)  # T from x: with d_out = 0, -1 would be ambiguous
    dy2 = (dy2 if dy2.dtype == cd else dy2.to(cd)).contiguous()
    W = _rows(weight, fan_in_fan_out)
    W = W if W.dtype == cd else W.to(cd)
    A = lora_A if lora_A.dtype == cd else lora_A.to(cd)
    B = lora_B if lora_B.dtype == cd else lora_B.to(cd)
    n_safe = ctx_saved["n_safe"]

    final_dm = detach_norm  # without the exact norm gradient only dm itself is needed from the sums
    step = backward_token_chunk(T, d_out, dy2.element_size()) if variant.chunked else max(T, 1)
    if xa is None and T > 0 and need[3]:  # variant recompute_xa (or merged without a saved xa)
        x_d_all = _dropped(x2, keep, dropout_p)
        xa = x_d_all @ A.t()
        del x_d_all
    # merged: dx = dz·W' with W' = W + s·B·A formed again here (the forward does not keep it)
    Wm = torch.addmm(W, B, A, alpha=s) if variant.order == "merged" and need[0] and T > 0 else None
    chunked = step < T
    dx2 = torch.empty(T, d_in, dtype=cd, device=x2.device) if need[0] else None
    dB_acc = dW_rows = dm_sum = None
    dm_parts: list[torch.Tensor] = []
    # Over several chunks without dropout, every product that does not need dz itself is formed
    # once over all tokens from dy and g (two ops a chunk are left: dz/dm and dx += dz·W):
    #   dz·B = dy·(g⊙B),   dB = s·diag(g)·(dyᵀ·xa),   dx = s·(dz·B)·A, then + dz·W per chunk.
    # Only where that is safe in the compute dtype: fp32, or bf16 with an fp32 output for dyᵀ·xa
    # (cuBLAS on CUDA). fp16 would overflow g⊙B to inf (g·|B| > 65504) where dz = g⊙dy stays
    # finite, and a 16-bit dyᵀ·xa over all tokens overflows or underflows before g scales it.
    prescaled = chunked and keep is None and Wm is None and (cd == torch.float32 or (cd == torch.bfloat16 and _fp32_out_gemm(x2)))
    dzB_all = None
    if prescaled:
        if need[0] or need[2]:
            gB = torch.empty_like(B)
            torch.mul(B, g[:, None], out=gB)  # fp32 product, rounded once to cd (as dz = g⊙dy is)
            dzB_all = dy2 @ gB
            del gB
        if dx2 is not None:
            torch.addmm(_zero_scalar(dx2), dzB_all, A, beta=0, alpha=s, out=dx2)
        if need[3]:
            dB_acc = _row_scaled_tmm(dy2, xa, g, s, lora_B.dtype)
    elif need[2] and chunked:
        # dz·B for every token is small (T×r): keep it and form dA = s·(dz·B)ᵀ·x_d with one GEMM after.
        dzB_all = torch.empty(T, A.shape[0], dtype=cd, device=x2.device)
    dzB = None
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        dy_c = dy2[t0:t1] if chunked else dy2
        x_c = x2[t0:t1] if chunked else x2
        keep_c = None if keep is None else (keep[t0:t1] if chunked else keep).to(cd) / (1.0 - dropout_p)
        x_d_c = _dropped(x_c, None if keep is None else (keep[t0:t1] if chunked else keep), dropout_p)
        # Over several chunks the dm partials are kept and summed once after the loop (in order:
        # deterministic), which saves the host two ops a chunk.
        dz, dm_c = _scaled_grad_chunk(
            dy_c, saved_h[t0:t1] if chunked else saved_h, g, n, bias, triton_path=triton_path, from_output=from_output,
            final_dm=final_dm, reduce=not chunked,
        )
        if chunked:
            dm_parts.append(dm_c)
            if sum(part.shape[0] for part in dm_parts) * d_out * 4 > _DM_PARTS_BYTES:  # fold, in order
                dm_parts = [torch.cat(dm_parts).sum(0, keepdim=True)]
        else:
            dm_sum = dm_c
        if prescaled:
            if dx2 is not None and base_in_dx:
                dx2[t0:t1].addmm_(dz, W)
        elif Wm is not None and not need[2]:
            dzB = None
        elif dzB_all is not None:  # written straight into its rows of the T×r buffer
            dzB = torch.mm(dz, B, out=dzB_all[t0:t1])
        else:
            dzB = dz @ B  # (t, r)
        if dx2 is not None and not prescaled:
            out = dx2[t0:t1] if chunked else dx2
            if Wm is not None:
                torch.mm(dz, Wm, out=out)
            elif keep_c is None and base_in_dx:
                torch.mm(dz, W, out=out)
                out.addmm_(dzB, A, alpha=s)
            elif keep_c is None:
                torch.addmm(_zero_scalar(out), dzB, A, beta=0, alpha=s, out=out)
            else:
                gm1_dy = (dy_c.to(acc) * (g - 1.0)).to(cd)
                dropped = torch.addmm(gm1_dy @ W, dzB, A, alpha=s).mul_(keep_c)
                if base_in_dx:
                    torch.mm(dy_c, W, out=out)
                    out += dropped
                else:
                    out.copy_(dropped)
        # Adapter gradients: one chunk -> straight from the GEMM; several -> fp32 accumulators.
        if need[3] and not prescaled:
            if not chunked:  # s applied inside the GEMM (one rounding, no fp32 copy of dB)
                dB_acc = _scaled_mm(dz.t(), xa, s)
            else:
                part = dz.t() @ xa[t0:t1]
                dB_acc = part.to(acc) if dB_acc is None else dB_acc.add_(part)
        if need[1]:
            if keep_c is None:
                part = dz.to(acc).t() @ x_c.to(acc)
            else:
                part = dy_c.to(acc).t() @ x_c.to(acc) + (dy_c.to(acc) * (g - 1.0)).t() @ x_d_c.to(acc)
            dW_rows = part if dW_rows is None else dW_rows.add_(part)
    if dm_parts:
        dm_sum = torch.cat(dm_parts).sum(0) if len(dm_parts) > 1 else dm_parts[0].sum(0)
    dA_acc = None
    if need[2] and T > 0:
        x_d = _dropped(x2, keep, dropout_p)
        dA_acc = _scaled_mm((dzB_all if chunked else dzB).t(), x_d, s)
    if T == 0:
        dm_sum = torch.zeros(d_out, dtype=acc, device=x2.device)
        dB_acc = torch.zeros(d_out, A.shape[0], dtype=acc, device=x2.device) if need[3] else None
        dA_acc = torch.zeros(A.shape[0], d_in, dtype=acc, device=x2.device) if need[2] else None
        dW_rows = torch.zeros(d_out, d_in, dtype=acc, device=x2.device) if need[1] else None
    dm = None
    if final_dm:  # the kernel finished dm (the common, detached-norm case: fewest host ops)
        dm = dm_sum if need[4] else None
    else:
        dm_raw = dm_sum.to(acc)  # Σ dy⊙(g⊙z) from the output, Σ dy⊙z otherwise
        dm_sum = _dm_sum_of_z(dm_raw, g, n, from_output)
        dm = dm_sum / n_safe if need[4] else None
    if dm is not None and from_output and T > 0 and d_out > 0:
        # Where m = 0 (g = 0, n >= eps) the output holds no z: those features are recomputed.
        xa_all = xa if xa is not None else x2 @ A.t()  # from the output means no dropout: x_d = x
        dm = _dm_lost_rows(dm, dy2, x2, W, xa_all, B, g, n, s, triton_path)
    dm = dm.to(magnitude.dtype) if dm is not None else None

    dx = dx2.reshape(*lead, d_in) if dx2 is not None else None
    # s is already in the GEMM's alpha, except for the fp32 accumulator of a chunked dB.
    dB = (dB_acc.mul_(s) if chunked and not prescaled and T > 0 else dB_acc) if dB_acc is not None else None
    dA = dA_acc
    db = dy2.to(acc).sum(0).to(bias.dtype) if (need[5] and bias is not None) else None

    if not detach_norm:
        # c_i = (∂L/∂n_i)/n_i with ∂L/∂n_i = -S_i·m_i/n_i² where n_i > eps (g is flat in n below eps).
        U, G = ctx_saved["U"], ctx_saved["G"]
        m_acc = magnitude.to(acc)
        # From the output, S·m = raw·max(n, eps) (g = m / max(n, eps)), so c needs no division by g
        # (which is 0 where m = 0): c = -raw / n².
        num = dm_raw * n_safe if from_output else dm_sum * m_acc
        c = torch.where(n > EPS, -num / (n_safe * n_safe * n_safe), torch.zeros_like(n))
        B_acc = lora_B.to(acc)
        if dB is not None:
            dB = dB + s * c[:, None] * (U + s * (B_acc @ G))
        if dA is not None:
            BcW = _bt_diag_w(B_acc * c[:, None], weight, fan_in_fan_out)  # Bᵀ·diag(c)·W, (r, d_in)
            BcB = B_acc.t() @ (c[:, None] * B_acc)
            dA = dA + s * BcW + (s * s) * (BcB @ lora_A.to(acc))
        if dW_rows is not None:
            V = _rows(weight, fan_in_fan_out).to(acc) + s * (lora_B.to(acc) @ lora_A.to(acc))
            dW_rows = dW_rows + c[:, None] * V
    dW = None
    if dW_rows is not None:
        dW = (dW_rows.t() if fan_in_fan_out else dW_rows).to(weight.dtype)
    if dA is not None:
        dA = dA.to(lora_A.dtype)
    if dB is not None:
        dB = dB.to(lora_B.dtype)
    return dx, dW, dA, dB, dm, db


@contextlib.contextmanager
def _our_numerics(device_type: str):
    """The numerics doracheck's GEMMs run with, for the duration of a forward or backward:
    - autocast off on ``device_type`` (the Functions choose every dtype themselves: GEMMs in
      the compute dtype, fp32 g and accumulators; autocast re-casting operands would break it);
    - on CUDA, cuBLAS's 16-bit reduction of split-K partials off (torch's
      ``allow_fp16/bf16_reduced_precision_reduction`` default to True): every reduction
      accumulates in fp32 (DESIGN section 2). The caller's settings are restored after.
    Nothing is changed while torch.compile traces (the compiled graph picks its own GEMMs)."""
    from doracheck.kernels.tracing import tracing

    autocast = torch.is_autocast_enabled(device_type)
    matmul = torch.backends.cuda.matmul
    flags = device_type == "cuda" and not tracing()
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction) if flags else None
    if flags:
        matmul.allow_fp16_reduced_precision_reduction = False
        matmul.allow_bf16_reduced_precision_reduction = False
    try:
        if autocast:
            with torch.autocast(device_type, enabled=False):
                yield
        else:
            yield
    finally:
        if saved is not None:
            matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer on ``x`` in, or None where autocast is off
    for x's device (or x is fp64, which autocast leaves alone)."""
    device_type = x.device.type
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


class DoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
        y, saved = _forward(x, weight, lora_A, lora_B, magnitude, bias, float(scaling), keep_mask, dropout_p, detach_norm, fan_in_fan_out)
        tensors = [saved[k] for k in ("x2", "keep", "xa", "saved_h", "g", "n", "n_safe", "U", "G")]
        ctx.save_for_backward(*tensors, weight, lora_A, lora_B, magnitude, bias)
        ctx.flags = (saved["triton_path"], saved["from_output"], saved["variant"])
        ctx.args = (float(scaling), dropout_p, detach_norm, fan_in_fan_out, x.shape[:-1])
        return y  # 2-D: reshaped by the caller, so in-place ops on the result are allowed

    @staticmethod
    def backward(ctx, dy):
        norm_cache.note_backward()
        x2, keep, xa, saved_h, g, n, n_safe, U, G, weight, lora_A, lora_B, magnitude, bias = ctx.saved_tensors
        saved = {"x2": x2, "keep": keep, "xa": xa, "saved_h": saved_h, "g": g, "n": n, "n_safe": n_safe, "U": U, "G": G}
        saved["triton_path"], saved["from_output"], saved["variant"] = ctx.flags
        s, dropout_p, detach_norm, fan_in_fan_out, lead = ctx.args
        with _our_numerics(dy.device.type):
            grads = _backward(
                saved, dy, weight, lora_A, lora_B, magnitude, bias, s, dropout_p, detach_norm, fan_in_fan_out, lead,
                ctx.needs_input_grad,
            )
        return (*grads, None, None, None, None, None)


def dora_linear_autograd(x, weight, lora_A, lora_B, magnitude, scaling, bias, keep_mask, dropout_p, detach_norm, fan_in_fan_out):
    """Apply ``DoRALinearFunction`` (arguments already validated); without autograd, the
    forward alone. Under autocast, x is first cast to autocast's dtype (an autograd op, as
    ``F.linear`` does there), so the GEMMs run and y is returned in that dtype, while the norm,
    g and the adapter gradients keep the parameters' dtypes."""
    cast_to = autocast_dtype(x)
    if cast_to is not None and x.dtype != cast_to:
        x = x.to(cast_to)
    with _our_numerics(x.device.type):
        tensors = (x, weight, lora_A, lora_B, magnitude, bias)
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
            y, _ = _forward(
                x, weight, lora_A, lora_B, magnitude, bias, float(scaling), keep_mask, dropout_p, detach_norm, fan_in_fan_out,
                need_saved=False,
            )
        else:
            y = DoRALinearFunction.apply(
                x, weight, lora_A, lora_B, magnitude, bias, scaling, keep_mask, dropout_p, detach_norm, fan_in_fan_out
            )
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _from_base_forward(result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask, dropout_p, *,
                       need_saved, in_place=True, result_is_base=True):
    """The DoRA output from ``result`` (see ``DoRAFromBaseFunction``): written into ``result``
    itself when ``in_place``, else into a new tensor. Returns (y, the tensors a backward
    needs, flags). ``need_saved=False`` (no autograd): inference on the Triton path forms
    g = m / n inside the compose kernel and nothing is kept."""
    from doracheck.kernels import ops

    s = float(scaling)
    cd = result.dtype
    d_out = result.shape[-1]
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read b with stride 1
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.dtype == cd else x2.to(cd)
    T = x2.shape[0]
    # T from x: with d_out = 0, view(-1, 0) would be ambiguous.
    r2 = result.view(T, d_out) if in_place else result.reshape(T, d_out).clone(memory_format=torch.contiguous_format)
    out = result if in_place else r2.view(result.shape)
    triton_path = _use_triton(x2, weight, lora_A, lora_B, magnitude, bias)
    g_in_kernel = triton_path and not need_saved and keep_mask is None
    fn, g, n_safe = _norm_and_scale(
        weight, lora_A, lora_B, magnitude, s, fan_in_fan_out, True, "triton" if triton_path else "torch", need_g=not g_in_kernel,
        recording=need_saved,
    )
    A = lora_A if lora_A.dtype == cd else lora_A.to(cd)
    if g_in_kernel:  # inference: y = b + g⊙(result - b + s·xa·Bᵀ), g = m / n in the kernel, in place
        y = ops.compose_infer_(r2, x2 @ A.t(), lora_B, magnitude, n_safe, bias, s, True)
        if y is not r2:  # traced: the functional op returned a new tensor
            r2.copy_(y)
        return out, (), (True, False)
    keep = None
    x_d = x2
    if keep_mask is not None:
        keep = keep_mask.expand(x.shape).reshape(-1, x.shape[-1])
        x_d = _dropped(x2, keep, dropout_p)
    xa = x_d @ A.t()
    from_output = False
    if keep is not None:
        W = _rows(weight, fan_in_fan_out)
        base_d = x_d @ (W if W.dtype == cd else W.to(cd)).t()
        if triton_path:  # y = result + (g-1)⊙base_d + g⊙s⊙lora_d (result already holds b)
            y, saved_h = ops.call("lora_up_compose_dropout", r2, base_d, xa, lora_B, g, None, s)
            r2.copy_(y)
            del y
        else:
            acc = fn.norm.dtype
            B = lora_B if lora_B.dtype == cd else lora_B.to(cd)
            lora = (xa @ B.t()).to(acc)
            r2.copy_(r2.to(acc) + (g - 1.0) * base_d.to(acc) + (g * s) * lora)
            saved_h = (base_d.to(acc) + s * lora).to(cd)
    elif triton_path and bias is None and result_is_base:
        # z = y / g only where result is x·Wᵀ exactly: the backward's lost-row pass recomputes
        # z from x and W where g = 0, which a result carrying other adapters would contradict.
        y = ops.call("lora_up_compose_", r2, xa, lora_B, g, None, s)
        if y is not r2:  # traced: the functional op returned a new tensor
            r2.copy_(y)
        saved_h, from_output = out, True  # saved as the output itself (a view of it would be refused)
    elif triton_path:
        y, saved_h = ops.call("lora_up_compose_save_z_", r2, xa, lora_B, g, bias, s, True)
        if y is not r2:
            r2.copy_(y)
    else:
        acc = fn.norm.dtype
        B = lora_B if lora_B.dtype == cd else lora_B.to(cd)
        base = r2.to(acc) - (bias.to(acc) if bias is not None else 0.0)
        z = base + s * (xa @ B.t()).to(acc)
        y = g * z + (bias.to(acc) if bias is not None else 0.0)
        r2.copy_(y)
        saved_h = z.to(cd)
    return out, (x2, keep, xa, saved_h, g, fn.norm, n_safe, None, None), (triton_path, from_output)


class DoRAFromBaseFunction(torch.autograd.Function):
    """DoRA on top of an output a caller (PEFT's LoRA Linear) already computed.

    PEFT's form, for each active adapter in turn: y = result + (g-1)⊙(result - b) + g⊙s⊙lora,
    i.e. y = g⊙(result - b + s·(x·Aᵀ)·Bᵀ) + b, with lora = (x·Aᵀ)·Bᵀ; with dropout
    (``keep_mask``, x_d = x·keep/(1-p)): y = result + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙(x_d·Aᵀ)·Bᵀ, one
    extra x_d·Wᵀ GEMM, z_d saved.

    ``result_is_base=True`` (the first active adapter: result = x·Wᵀ + b exactly): ``result``
    is rewritten in place (marked dirty), so the layer adds no T×d_out buffer and runs no
    second x·Wᵀ, and the backward returns the whole dx = dz·W + s·(dz·B)·A itself and no
    gradient to ``result``, so the base layer's own backward (another d_out×d_in GEMM) never
    runs. Only for frozen W (the caller checks).

    While torch.compile traces, y is a new tensor either way (``in_place=False``): a compiled
    region whose input ``result`` an autograd Function rewrites in place (marked dirty) was
    seen to train a different model (the variant's forward compiled as a frame of its own,
    after PEFT's Linear.forward had been skipped by an earlier compile).

    ``result_is_base=False`` (result carries an earlier adapter's output too): y is a new
    tensor (the earlier adapter may have saved ``result``), ``result`` gets its gradient
    (g⊙dy; dy with dropout), dx only this adapter's own terms, and a trainable bias the part
    this adapter adds: Σ_t (1-g)⊙dy (nothing with dropout).
    """

    @staticmethod
    def forward(ctx, result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask=None, dropout_p=0.0,
                result_is_base=True, in_place=True):
        # ``result`` comes first: when it is a view (F.linear on 3-D input), autograd rebases its
        # history through CopySlices, which takes the dirty tensor's gradient from slot 0.
        with _our_numerics(result.device.type):
            out, tensors, flags = _from_base_forward(
                result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask, dropout_p,
                need_saved=True, in_place=in_place, result_is_base=result_is_base,
            )
        if in_place:
            ctx.mark_dirty(result)
        ctx.save_for_backward(*tensors, weight, lora_A, lora_B, magnitude, bias)
        ctx.flags = (*flags, result_is_base)
        ctx.args = (float(scaling), fan_in_fan_out, x.shape[:-1], float(dropout_p))
        return out

    @staticmethod
    def backward(ctx, dy):
        norm_cache.note_backward()
        x2, keep, xa, saved_h, g, n, n_safe, U, G, weight, lora_A, lora_B, magnitude, bias = ctx.saved_tensors
        T, d_out = x2.shape[0], g.shape[0]
        saved_h = saved_h.reshape(T, d_out)
        triton_path, from_output, result_is_base = ctx.flags
        saved = {"x2": x2, "keep": keep, "xa": xa, "saved_h": saved_h, "g": g, "n": n, "n_safe": n_safe, "U": U, "G": G}
        saved["triton_path"], saved["from_output"] = triton_path, from_output
        s, fan_in_fan_out, lead, dropout_p = ctx.args
        need = ctx.needs_input_grad  # result, x, weight, lora_A, lora_B, magnitude, bias
        with _our_numerics(dy.device.type):
            dx, _dW, dA, dB, dm, db = _backward(
                saved, dy, weight, lora_A, lora_B, magnitude, bias, s, dropout_p, True, fan_in_fan_out, lead,
                (need[1], False, need[3], need[4], need[5], need[6]), base_in_dx=result_is_base,
            )
            d_result = None
            if not result_is_base:
                dy2 = dy.reshape(T, d_out)
                if keep is not None:  # y = result + (g-1)⊙(x_d·Wᵀ) + g⊙s⊙lora_d: b only through result
                    d_result = dy2
                    db = None if db is None else torch.zeros_like(db)
                else:  # ∂y/∂result = g, saturated as dz is where n < eps (g up to m/1e-12)
                    d_result = _saturated(dy2.to(n.dtype) * g, dy2.dtype)
                    if db is not None:  # ∂y/∂b = 1 - g: Σ_t (1-g)⊙dy
                        db = (db.to(n.dtype) - d_result.to(n.dtype).sum(0)).to(db.dtype)
                d_result = d_result.reshape(dy.shape) if need[0] else None
        return d_result, dx, None, dA, dB, dm, db, None, None, None, None, None, None


def _saturated(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` with ±inf from overflow clamped to the largest finite value."""
    big = torch.finfo(dtype).max
    return t.clamp(-big, big).to(dtype)


def dora_from_base(x, result, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out=False, keep_mask=None, dropout_p=0.0,
                   result_is_base=True):
    """``DoRAFromBaseFunction``: y = g⊙(result - b + s·(x·Aᵀ)·Bᵀ) + b (with a bool ``keep_mask``:
    PEFT's dropout form, see the class), written into ``result`` when ``result_is_base`` (it
    is x·Wᵀ + b exactly) and nothing traces, else into a new tensor. Returns y."""
    from doracheck.kernels.tracing import tracing

    in_place = result_is_base and not tracing()
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (result, x, lora_A, lora_B, magnitude, bias))):
        # No autograd: the forward alone, without the Function machinery (decode runs here).
        with _our_numerics(result.device.type):
            out, _, _ = _from_base_forward(result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask,
                                           dropout_p, need_saved=False, in_place=in_place, result_is_base=result_is_base)
        return out
    return DoRAFromBaseFunction.apply(
        result, x, weight, lora_A, lora_B, magnitude, bias, scaling, fan_in_fan_out, keep_mask, dropout_p, result_is_base, in_place
    )
