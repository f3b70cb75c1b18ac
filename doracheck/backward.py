"""The DoRA backward pass (docs/design.md section 1), for both entry points.

With dz = g⊙dy (saturated at the dtype's largest finite value where n < eps, so zero rows
of W and B contribute 0 rather than inf·0):
    dm = Σ_t dy⊙z_d / max(n, eps)      db = Σ_t dy
    dB = s·dzᵀ·xa                      dA = s·(dz·B)ᵀ·x_d
    dx = dz·W + s·(dz·B)·A             (no dropout)
    dx = dy·W + keep/(1-p)⊙(((g-1)⊙dy)·W + s·(dz·B)·A)   (dropout)
    dW = dzᵀ·x (no dropout);  dW = dyᵀ·x + ((g-1)⊙dy)ᵀ·x_d (dropout)   (only if W requires grad)
With ``detach_norm=False`` and c_i = (∂L/∂n_i)/n_i = -S_i·m_i/n_i³ (S = Σ_t dy⊙z_d):
    dB += s·diag(c)·(U + s·B·G)        dA += s·Bᵀ·diag(c)·W + s²·(Bᵀ·diag(c)·B)·A
No dense B·A is formed for the adapter gradients; dW is dense by nature.

Order ("merged": dx = dz·W' with W' = W + s·B·A formed again) and chunking come from the
planner's variant, saved by the forward. Over token chunks (``backward_token_chunk``) without
dropout, in fp32, and in bf16 where a GEMM can write fp32 (CUDA), what does not need dz is
formed once over all tokens ("prescaled"): dz·B = dy·(g⊙B) (T×r), dB = s·diag(g)·(dyᵀ·xa)
(fp32 GEMM output, scaled and rounded once), dx = s·(dz·B)·A; two ops a chunk remain (the
dz/dm pass, dx += dz·W). In fp16 g⊙B would overflow where dz stays finite, so there (and with
dropout) dz·B and dB accumulate chunk by chunk. The dm partials are summed once, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .forward import dropped, in_dtype, rows
from .kernels.compose_torch import accumulation_dtype
from .kernels.constants import eps
from .kernels.settings import HAS_MM_DTYPE, NORM_CHUNK_BYTES, backward_token_chunk
from .kernels.tracing import tracing
from .layer_state import Grads, LayerArgs, Need, Saved

_DM_PARTS_BYTES = 4 * 2**20  # dm partials kept over token chunks before they are folded into one row
_ZEROS: dict = {}


def _zero_scalar(like: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero of ``like``'s dtype and device, made once (an ignored addend). Only for
    plain tensors outside tracing (a cached fake or functional tensor would break later eager
    calls) and outside CUDA-graph capture (where the fill is recorded, not run)."""
    if type(like) is not torch.Tensor or tracing():
        return like.new_zeros(())
    key = (like.dtype, like.device)
    zero = _ZEROS.get(key)
    if zero is None:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return like.new_zeros(())  # a capture only records the fill: never cache that memory
        zero = like.new_zeros(())
        if like.is_cuda:  # filled before any stream may read it (the cache serves every stream)
            torch.cuda.current_stream(like.device).synchronize()
        _ZEROS[key] = zero
    return zero


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """s·(a·b) as one GEMM, alpha = s (scaled in the fp32 accumulator, rounded once; beta = 0)."""
    return torch.addmm(_zero_scalar(a), a, b, beta=0, alpha=s)


def _fp32_out_gemm(t: torch.Tensor) -> bool:
    """Whether a 16-bit GEMM on ``t``'s device can write fp32 (cuBLAS ``aten::mm.dtype``)."""
    return t.device.type == "cuda" and HAS_MM_DTYPE


def _row_scaled_tmm(dy: torch.Tensor, xa: torch.Tensor, g: torch.Tensor, s: float, out_dtype: torch.dtype) -> torch.Tensor:
    """dB = s·diag(g)·(dyᵀ·xa) = s·dzᵀ·xa over all tokens at once, in ``out_dtype``: one GEMM
    writing fp32 (16-bit inputs, cuBLAS) and one fp32 row scaling, rounded once."""
    P = torch.mm(dy.t(), xa, out_dtype=torch.float32) if dy.dtype in (torch.float16, torch.bfloat16) else dy.t() @ xa
    out = torch.empty(P.shape, dtype=out_dtype, device=P.device)
    return torch.addcmul(_zero_scalar(g), P, g[:, None], value=s, out=out)


def _bt_diag_w(Bc: torch.Tensor, weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """(Bᵀ·diag(c))·W as (r, d_in) in Bc's dtype, W read in column chunks (no full upcast copy of W)."""
    W = rows(weight, fan_in_fan_out)
    out = torch.empty(Bc.shape[1], W.shape[1], dtype=Bc.dtype, device=W.device)
    step = max(1, NORM_CHUNK_BYTES // (8 * max(W.shape[0], 1)))
    for start in range(0, W.shape[1], step):
        stop = min(start + step, W.shape[1])
        out[:, start:stop] = Bc.t() @ W[:, start:stop].to(Bc.dtype)
    return out


def saturated(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` with ±inf from overflow clamped to the largest finite value."""
    big = torch.finfo(dtype).max
    return t.clamp(-big, big).to(dtype)


@dataclass
class _Pass:
    """One backward's operands in the compute dtype ``cd`` and what the token pass builds."""

    saved: Saved
    a: LayerArgs
    need: Need
    dy2: torch.Tensor
    W: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    # Below: tensors or None, set as the pass goes (Any: each use is guarded by ``need`` or the variant).
    xa: Any
    Wm: Any  # merged: W + s·B·A
    base_in_dx: bool
    step: int
    prescaled: bool = False
    dx2: Any = None
    dzB_all: Any = None
    dzB: Any = None
    dB: Any = None
    dW_rows: Any = None
    dm_sum: Any = None
    dm_parts: list = field(default_factory=list)

    @property
    def acc(self) -> torch.dtype:
        """The accumulation dtype: fp64 where x or g (m, n) is fp64, else fp32 (docs/design.md section 2)."""
        return accumulation_dtype(self.saved.x2, self.saved.g)

    @property
    def chunked(self) -> bool:
        return self.step < self.dy2.shape[0]


def _setup(saved: Saved, dy: torch.Tensor, a: LayerArgs, need: Need, base_in_dx: bool) -> _Pass:
    x2 = saved.x2
    cd, T, d_out = x2.dtype, x2.shape[0], saved.g.shape[0]
    dy2 = in_dtype(dy.reshape(T, d_out), cd).contiguous()  # T from x: with d_out = 0, -1 would be ambiguous
    W, A, B = in_dtype(rows(a.weight, a.fan_in_fan_out), cd), in_dtype(a.lora_A, cd), in_dtype(a.lora_B, cd)
    variant = saved.variant
    # Traced, one chunk: a chunk loop would specialize a symbolic T (dynamo reports it as an
    # int), a recompile per sequence length; a compiled graph's buffers are Inductor's to plan.
    chunked = variant.chunked and not tracing()
    step = backward_token_chunk(T, d_out, dy2.element_size()) if chunked else max(T, 1)
    xa = saved.xa
    if xa is None and T > 0 and need.dB:  # variant recompute_xa (or merged without a saved xa)
        xa = dropped(x2, saved.keep, a.dropout_p) @ A.t()
    Wm = torch.addmm(W, B, A, alpha=a.scaling) if variant.order == "merged" and need.dx and T > 0 else None
    p = _Pass(saved, a, need, dy2, W, A, B, xa, Wm, base_in_dx, step)
    p.dx2 = torch.empty(T, x2.shape[1], dtype=cd, device=x2.device) if need.dx else None
    p.prescaled = p.chunked and saved.keep is None and Wm is None and (
        cd == torch.float32 or (cd == torch.bfloat16 and _fp32_out_gemm(x2)))
    return p


def _prescale(p: _Pass) -> None:
    """Over several chunks: dz·B, dx's low-rank term and dB over all tokens at once, or a
    T×r buffer dz·B is written into chunk by chunk (dA is one GEMM after the pass)."""
    s, g = p.a.scaling, p.saved.g
    if p.prescaled:
        if p.need.dx or p.need.dA:
            gB = torch.empty_like(p.B)
            torch.mul(p.B, g[:, None], out=gB)  # fp32 product, rounded once to cd (as dz = g⊙dy is)
            p.dzB_all = torch.mm(p.dy2, gB)
            del gB
        if p.dx2 is not None:
            torch.addmm(_zero_scalar(p.dx2), p.dzB_all, p.A, beta=0, alpha=s, out=p.dx2)
        if p.need.dB:
            p.dB = _row_scaled_tmm(p.dy2, p.xa, g, s, p.a.lora_B.dtype)
    elif p.need.dA and p.chunked:
        p.dzB_all = torch.empty(p.dy2.shape[0], p.A.shape[0], dtype=p.dy2.dtype, device=p.dy2.device)


def _dx_chunk(p: _Pass, t0: int, t1: int, dz: torch.Tensor, dy_c: torch.Tensor, keep_c: torch.Tensor | None) -> None:
    out = p.dx2[t0:t1] if p.chunked else p.dx2
    s, g = p.a.scaling, p.saved.g
    if p.Wm is not None:
        torch.mm(dz, p.Wm, out=out)
    elif keep_c is None and p.base_in_dx:
        torch.mm(dz, p.W, out=out)
        out.addmm_(p.dzB, p.A, alpha=s)
    elif keep_c is None:
        torch.addmm(_zero_scalar(out), p.dzB, p.A, beta=0, alpha=s, out=out)
    else:
        gm1_dy = (dy_c.to(p.acc) * (g - 1.0)).to(dy_c.dtype)
        dropped_part = torch.addmm(gm1_dy @ p.W, p.dzB, p.A, alpha=s).mul_(keep_c)
        if p.base_in_dx:
            torch.mm(dy_c, p.W, out=out)
            out += dropped_part
        else:
            out.copy_(dropped_part)


def _chunk(p: _Pass, t0: int, t1: int) -> None:
    """One token chunk: dz and dm partials, dz·B, dx rows, dB and dW contributions."""
    sv, a, need = p.saved, p.a, p.need
    ch = p.chunked
    dy_c = p.dy2[t0:t1] if ch else p.dy2
    x_c = sv.x2[t0:t1] if ch else sv.x2
    keep_rows = None if sv.keep is None else (sv.keep[t0:t1] if ch else sv.keep)
    keep_c = None if keep_rows is None else keep_rows.to(dy_c.dtype) / (1.0 - a.dropout_p)
    h = sv.h  # z, z_d or the output: every training forward keeps one
    assert h is not None
    # Unreduced where ``_dm`` finishes dm in one pass (the partials summed there, in order)
    dz, dm_c = sv.backend.grad_scale_dm(dy_c, h[t0:t1] if ch else h, sv.g, sv.n, a.bias, sv.from_output, a.detach_norm,
                                        not ch and not _finished_in_one_pass(p))
    if ch:  # kept and summed once after the pass, in order (deterministic, two host ops fewer a chunk)
        p.dm_parts.append(dm_c)
        if sum(part.shape[0] for part in p.dm_parts) * sv.g.shape[0] * 4 > _DM_PARTS_BYTES:  # fold, in order
            p.dm_parts = [torch.cat(p.dm_parts).sum(0, keepdim=True)]
    else:
        p.dm_sum = dm_c
    if p.prescaled:
        if p.dx2 is not None and p.base_in_dx:
            p.dx2[t0:t1].addmm_(dz, p.W)
    elif p.Wm is not None and not need.dA:
        p.dzB = None
    elif p.dzB_all is not None:  # written straight into its rows of the T×r buffer
        p.dzB = torch.mm(dz, p.B, out=p.dzB_all[t0:t1])
    else:
        p.dzB = torch.mm(dz, p.B)  # 2-D: the mm of dz @ B, without Tensor.__matmul__'s Python wrapper
    if p.dx2 is not None and not p.prescaled:
        _dx_chunk(p, t0, t1, dz, dy_c, keep_c)
    if need.dB and not p.prescaled:  # one chunk: s inside the GEMM; several: an fp32 accumulator
        if not ch:
            p.dB = _scaled_mm(dz.t(), p.xa, a.scaling)
        else:
            part = dz.t() @ p.xa[t0:t1]
            p.dB = part.to(p.acc) if p.dB is None else p.dB.add_(part)
    if need.dW:
        acc = p.acc
        if keep_c is None:
            part = dz.to(acc).t() @ x_c.to(acc)
        else:
            x_d_c = dropped(x_c, keep_rows, a.dropout_p)
            part = dy_c.to(acc).t() @ x_c.to(acc) + (dy_c.to(acc) * (sv.g - 1.0)).t() @ x_d_c.to(acc)
        p.dW_rows = part if p.dW_rows is None else p.dW_rows.add_(part)


def _finished_in_one_pass(p: _Pass) -> bool:
    """Whether ``dm_finish`` forms dm straight from the dz/dm pass's partials (detached norm, z
    read from the output: the common training call): one launch instead of three host ops a
    layer (the sum, the lost-row launch, the cast) on the host-bound step."""
    T, d_out = p.dy2.shape
    return p.a.detach_norm and p.saved.from_output and p.need.dm and T > 0 and d_out > 0


def _dm(p: _Pass) -> tuple[Any, Any]:
    """(dm in m's dtype or fp32, or None; Σ dy⊙z as the exact-norm terms need it or None)."""
    sv, a = p.saved, p.a
    T, d_out = p.dy2.shape
    if _finished_in_one_pass(p):
        parts = (torch.cat(p.dm_parts) if len(p.dm_parts) > 1 else p.dm_parts[0]) if p.dm_parts else p.dm_sum
        xa_all = p.xa if p.xa is not None else sv.x2 @ p.A.t()  # from the output means no dropout: x_d = x
        return sv.backend.dm_finish(parts, p.dy2, sv.x2, p.W, xa_all, p.B, sv.g, sv.n, a.scaling, a.magnitude.dtype), None
    if p.dm_parts:
        p.dm_sum = torch.cat(p.dm_parts).sum(0) if len(p.dm_parts) > 1 else p.dm_parts[0].sum(0)
    raw = None
    if a.detach_norm:  # the kernel finished dm (the common case: fewest host ops)
        dm = p.dm_sum if p.need.dm else None
    else:
        raw = p.dm_sum.to(p.acc)  # Σ dy⊙(g⊙z) from the output, Σ dy⊙z otherwise
        p.dm_sum = _sum_of_z(raw, sv.g, sv.n, sv.from_output)
        dm = p.dm_sum / sv.n_safe if p.need.dm else None
    if dm is not None and sv.from_output and T > 0 and d_out > 0:
        # Where m = 0 (g = 0, n >= eps) the output holds no z: those features are recomputed.
        xa_all = p.xa if p.xa is not None else sv.x2 @ p.A.t()  # from the output means no dropout: x_d = x
        dm = sv.backend.dm_finish(dm[None], p.dy2, sv.x2, p.W, xa_all, p.B, sv.g, sv.n, a.scaling, dm.dtype)
    return dm, raw


def _sum_of_z(dm_sum: torch.Tensor, g: torch.Tensor, n: torch.Tensor, from_output: bool) -> torch.Tensor:
    """Σ_t dy⊙z from the accumulated sum. From the output, Σ dy⊙(g⊙z) is divided by g; where
    g = 0, z is gone: 0 for a zero row (n < eps, z = 0 exactly), NaN otherwise."""
    if not from_output:
        return dm_sum
    safe_g = torch.where(g == 0, torch.ones_like(g), g)
    lost = torch.where(n < eps(), torch.zeros_like(n), torch.full_like(n, float("nan")))
    return torch.where(g == 0, lost, dm_sum / safe_g)


def _exact_norm_terms(p: _Pass, raw: Any, dA, dB, dW_rows):
    """The gradient through n (``detach_norm=False``): c_i = (∂L/∂n_i)/n_i with
    ∂L/∂n_i = -S_i·m_i/n_i² where n_i > eps (g is flat in n below eps)."""
    sv, a = p.saved, p.a
    acc, n, n_safe, s = p.acc, sv.n, sv.n_safe, a.scaling
    # From the output, S·m = raw·max(n, eps) (g = m / max(n, eps)): c = -raw / n², no division by g.
    num = raw * n_safe if sv.from_output else p.dm_sum * a.magnitude.to(acc)
    c = torch.where(n > eps(), -num / (n_safe * n_safe * n_safe), torch.zeros_like(n))
    B_acc = a.lora_B.to(acc)
    if dB is not None:
        U, G = sv.U, sv.G  # formed by the forward whenever the norm is not detached
        assert U is not None and G is not None
        dB = dB + s * c[:, None] * (U + s * (B_acc @ G))
    if dA is not None:
        BcW = _bt_diag_w(B_acc * c[:, None], a.weight, a.fan_in_fan_out)  # Bᵀ·diag(c)·W, (r, d_in)
        BcB = B_acc.t() @ (c[:, None] * B_acc)
        dA = dA + s * BcW + (s * s) * (BcB @ a.lora_A.to(acc))
    if dW_rows is not None:
        V = rows(a.weight, a.fan_in_fan_out).to(acc) + s * (B_acc @ a.lora_A.to(acc))
        dW_rows = dW_rows + c[:, None] * V
    return dA, dB, dW_rows


def layer_backward(saved: Saved, dy: torch.Tensor, a: LayerArgs, lead: tuple, need: Need, base_in_dx: bool = True) -> Grads:
    """dx, dW, dA, dB, dm, db of the module docstring for upstream ``dy``. ``base_in_dx=False``
    (a from-base ``result`` that carries another adapter's output) leaves the base output's term
    (dz·W, or dy·W with dropout) out of dx: it reaches x through ``result``."""
    p = _setup(saved, dy, a, need, base_in_dx)
    T, d_out = p.dy2.shape
    acc, dev, d_in, r = p.acc, saved.x2.device, saved.x2.shape[1], p.A.shape[0]
    _prescale(p)
    if p.step >= T:  # one chunk; no loop over range(T): a symbolic T (a compiled graph with dynamic shapes) would specialize
        if T > 0:
            _chunk(p, 0, T)
    else:
        for t0 in range(0, T, p.step):
            _chunk(p, t0, min(T, t0 + p.step))
    dA = None
    if need.dA and T > 0:
        dA = _scaled_mm((p.dzB_all if p.chunked else p.dzB).t(), dropped(saved.x2, saved.keep, a.dropout_p), a.scaling)
    if T == 0:
        p.dm_sum = torch.zeros(d_out, dtype=acc, device=dev)
        p.dB = torch.zeros(d_out, r, dtype=acc, device=dev) if need.dB else None
        dA = torch.zeros(r, d_in, dtype=acc, device=dev) if need.dA else None
        p.dW_rows = torch.zeros(d_out, d_in, dtype=acc, device=dev) if need.dW else None
    dm, raw = _dm(p)
    # s is already in the GEMM's alpha, except for the fp32 accumulator of a chunked dB.
    dB = p.dB.mul_(a.scaling) if p.dB is not None and p.chunked and not p.prescaled and T > 0 else p.dB
    db = p.dy2.to(acc).sum(0).to(a.bias.dtype) if (need.db and a.bias is not None) else None
    dW_rows = p.dW_rows
    if not a.detach_norm:
        dA, dB, dW_rows = _exact_norm_terms(p, raw, dA, dB, dW_rows)
    dW = None if dW_rows is None else in_dtype(dW_rows.t() if a.fan_in_fan_out else dW_rows, a.weight.dtype)
    # in_dtype: a same-dtype ``.to`` still costs a dispatcher call (a few µs of host time each)
    return Grads(
        p.dx2.reshape(*lead, d_in) if p.dx2 is not None else None,
        dW,
        None if dA is None else in_dtype(dA, a.lora_A.dtype),
        None if dB is None else in_dtype(dB, a.lora_B.dtype),
        None if dm is None else in_dtype(dm, a.magnitude.dtype),
        db,
    )
