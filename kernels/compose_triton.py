"""Fused LoRA up-projection + stable DoRA compose, and the backward's dz/dm pass, in Triton.

``_lora_up_compose_kernel`` (forward): a GEMM lora = xa·Bᵀ (M = T, N = d_out, K = r) whose
epilogue reads the base output x·Wᵀ (and x_d·Wᵀ with dropout), g and b, and writes y once:
    no dropout: y = b + g⊙(base + s·lora)
    dropout:    y = b + base + (g-1)⊙base_d + g⊙s⊙lora
in fp32 registers, rounded once to the output dtype (docs/design.md section 2); ``y`` may alias
``base`` (each element is read before written, by one program); z_d = base_d + s·lora optional.

``_lora_up_compose_tma_kernel`` (forward, Hopper): the same compose without dropout or z,
persistent (one program per SM walks the tiles in grouped order, the next tile's loads overlapping
this one's epilogue), through TMA descriptors, where ``settings.compose_tma_config`` says.

``_grad_scale_dm_kernel`` (backward): one pass over dy giving dz = g⊙dy (output dtype) and fp32
partial sums over token blocks of dy⊙(y - b) (from the saved output) or dy⊙z; the partials
(n_token_blocks, d_out) are summed afterwards in a fixed order (no atomics: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .constants import eps
from .settings import compose_config, compose_tma_config, grad_config
from .triton_common import cdiv, dot_acc, interpreting, launcher, round_to, traced_launch, unused_pointer

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _tile_of(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of the tile-th tile in grouped order: GROUP_M row blocks share B's tiles in L2."""
    group = GROUP_M * n_n
    first_m = (tile // group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (tile % group) % size_m, (tile % group) // size_m


@triton.jit
def _lora_up_compose_kernel(
    y_ptr, stride_yt, stride_yd,  # out: (T, d_out), may alias base
    z_ptr, stride_zt, stride_zd,  # out (WRITE_Z): z_d = base_d + s·lora
    base_ptr, stride_bt, stride_bd,  # x·Wᵀ (T, d_out)
    based_ptr, stride_dt, stride_dd,  # x_d·Wᵀ (HAS_BASE_D)
    xa_ptr, stride_xt, stride_xr,  # x_d·Aᵀ (T, r)
    lb_ptr, stride_lm, stride_lr,  # B (d_out, r)
    g_ptr, bias_ptr,  # g fp32 (d_out,) (the magnitude m with G_FROM_M), bias (d_out,)
    nsafe_ptr,  # max(n, eps) fp32 (d_out,), read only with G_FROM_M
    T, d_out, r, scaling,
    HAS_BIAS: tl.constexpr, HAS_BASE_D: tl.constexpr, WRITE_Z: tl.constexpr, BASE_HAS_BIAS: tl.constexpr,
    G_FROM_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n_m = tl.cdiv(T, BLOCK_M)
    n_n = tl.cdiv(d_out, BLOCK_N)
    pid_m, pid_n = _tile_of(pid, n_m, n_n, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    col_ok = cols < d_out
    s = tl.cast(scaling, tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        k = k0 + kk
        k_ok = k < r
        xa = tl.load(xa_ptr + rows[:, None] * stride_xt + k[None, :] * stride_xr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        lb = tl.load(lb_ptr + cols[:, None] * stride_lm + k[None, :] * stride_lr, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = dot_acc(xa.to(DOT_DTYPE), tl.trans(lb.to(DOT_DTYPE)), acc, INTERPRET, PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if G_FROM_M:  # g = m / max(n, eps), correctly rounded: bitwise torch's division
        g = tl.math.div_rn(g, tl.load(nsafe_ptr + cols, mask=col_ok, other=1.0).to(tl.float32))
    g = g[None, :]
    base = tl.load(base_ptr + rows[:, None] * stride_bt + cols[None, :] * stride_bd, mask=mask, other=0.0).to(tl.float32)
    if HAS_BASE_D:
        base_d = tl.load(based_ptr + rows[:, None] * stride_dt + cols[None, :] * stride_dd, mask=mask, other=0.0).to(tl.float32)
        z = base_d + s * acc
        y = base + (g - 1.0) * base_d + (g * s) * acc
    else:
        if BASE_HAS_BIAS:  # base is x·Wᵀ + b (a PEFT base layer's output): take b out first
            base -= tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = base + s * acc
        y = g * z
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yd, round_to(y, y_ptr.dtype.element_ty, INTERPRET), mask=mask)
    if WRITE_Z:
        tl.store(z_ptr + rows[:, None] * stride_zt + cols[None, :] * stride_zd, round_to(z, z_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _tma_compose_half(
    y_desc, base_desc, g_ptr, bias_ptr, nsafe_ptr, acc, m0, n0, d_out, s,
    HAS_BIAS: tl.constexpr, BASE_HAS_BIAS: tl.constexpr, G_FROM_M: tl.constexpr, INTERPRET: tl.constexpr,
    HALF_N: tl.constexpr,
):
    """y[m0:, n0:n0+HALF_N] = b + g⊙(base - b·BASE_HAS_BIAS + s·acc), fp32, rounded once (the
    pointer kernel's expression, in its order). Rows and columns beyond T and d_out: TMA reads
    zeros there and drops the stores."""
    cols = n0 + tl.arange(0, HALF_N)
    col_ok = cols < d_out
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if G_FROM_M:  # g = m / max(n, eps), correctly rounded: bitwise torch's division
        g = tl.math.div_rn(g, tl.load(nsafe_ptr + cols, mask=col_ok, other=1.0).to(tl.float32))
    base = base_desc.load([m0, n0]).to(tl.float32)
    if BASE_HAS_BIAS:
        base -= tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    z = base + s * acc
    y = g[None, :] * z
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_desc.store([m0, n0], round_to(y, y_desc.dtype, INTERPRET))


@triton.jit
def _lora_up_compose_tma_kernel(
    y_desc,  # out: (T, d_out), block (BLOCK_M, BLOCK_N / 2); may alias base
    base_desc,  # x·Wᵀ (T, d_out), block (BLOCK_M, BLOCK_N / 2)
    xa_desc,  # x·Aᵀ (T, r), block (BLOCK_M, BLOCK_K)
    lb_desc,  # B (d_out, r), block (BLOCK_N, BLOCK_K)
    g_ptr, bias_ptr,  # g fp32 (d_out,) (the magnitude m with G_FROM_M), bias (d_out,)
    nsafe_ptr,  # max(n, eps) fp32 (d_out,), read only with G_FROM_M
    T, d_out, r, scaling,
    HAS_BIAS: tl.constexpr, BASE_HAS_BIAS: tl.constexpr, G_FROM_M: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    """y = b + g⊙(base + s·xa·Bᵀ) over tiles program_id, program_id + PROGRAMS, ...; with
    BASE_HAS_BIAS (base = x·Wᵀ + b) y = b + g⊙(base - b + s·xa·Bᵀ); with G_FROM_M, g = m /
    max(n, eps) here. fp32 accumulation and compose, one rounding to y's dtype. PROGRAMS =
    min(tiles, SMs) is a constexpr (as in Triton's persistent matmul tutorial): only 128-131
    tiles on an H200 compile a variant of their own."""
    n_m = tl.cdiv(T, BLOCK_M)
    n_n = tl.cdiv(d_out, BLOCK_N)
    k_tiles = tl.cdiv(r, BLOCK_K)
    s = tl.cast(scaling, tl.float32)
    for tile in tl.range(tl.program_id(0), n_m * n_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_of(tile, n_m, n_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            xa = xa_desc.load([m0, ki * BLOCK_K])
            lb = lb_desc.load([n0, ki * BLOCK_K])
            acc = dot_acc(xa, tl.trans(lb), acc, INTERPRET, "ieee")
        # two column halves: half the epilogue's registers live at a time (measured faster at 128×256)
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        _tma_compose_half(y_desc, base_desc, g_ptr, bias_ptr, nsafe_ptr, acc0, m0, n0, d_out, s,
                          HAS_BIAS, BASE_HAS_BIAS, G_FROM_M, INTERPRET, BLOCK_N // 2)
        _tma_compose_half(y_desc, base_desc, g_ptr, bias_ptr, nsafe_ptr, acc1, m0, n0 + BLOCK_N // 2, d_out, s,
                          HAS_BIAS, BASE_HAS_BIAS, G_FROM_M, INTERPRET, BLOCK_N // 2)


@triton.jit
def _grad_scale_dm_kernel(
    dz_ptr, stride_zt, stride_zd,  # out: dz = g⊙dy (T, d_out)
    part_ptr, stride_pb,  # out: (n_token_blocks, d_out) fp32 partials of Σ_t dy⊙h
    dy_ptr, stride_gt, stride_gd,  # dy (T, d_out)
    h_ptr, stride_ht, stride_hd,  # saved y (FROM_OUTPUT) or z (T, d_out)
    g_ptr, n_ptr, bias_ptr,
    T, d_out, eps,
    FROM_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL_DM: tl.constexpr, INTERPRET: tl.constexpr,
    MAX_OUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dz = g⊙dy; partial[tb, i] = Σ_{t in block tb} dy_ti·h_ti with h = y - b (= g·z) or z.

    With FINAL_DM each partial is its share of dm = Σ_t dy⊙z / max(n, eps): divided by
    max(n, eps) for h = z, by g·max(n, eps) (= m) for h = g·z, where g = 0 gives 0 for a zero
    row (n < eps, z = 0) and NaN otherwise (z is lost from y). Saves the host the finishing ops.
    Rows with n < eps have g = m/eps (up to 1e12): there dz saturates at ±MAX_OUT (the output
    dtype's largest finite value) instead of overflowing to inf, so that the zero rows of W and
    B that multiply it give 0, not inf·0 = NaN. NaN in dy still propagates."""
    pid_t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < d_out
    mask = (rows < T)[:, None] & col_ok[None, :]
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tiny = (tl.load(n_ptr + cols, mask=col_ok, other=1.0) < eps)[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gd, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * stride_ht + cols[None, :] * stride_hd, mask=mask, other=0.0).to(tl.float32)
    if FROM_OUTPUT and HAS_BIAS:
        h -= tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dz = dy * g
    dz = tl.where(tiny & (dz > MAX_OUT), MAX_OUT, tl.where(tiny & (dz < -MAX_OUT), -MAX_OUT, dz))
    tl.store(dz_ptr + rows[:, None] * stride_zt + cols[None, :] * stride_zd, round_to(dz, dz_ptr.dtype.element_ty, INTERPRET), mask=mask)
    part = tl.sum(tl.where(mask, dy * h, 0.0), axis=0)
    if FINAL_DM:
        g1 = tl.load(g_ptr + cols, mask=col_ok, other=1.0).to(tl.float32)
        n_safe = tl.maximum(tl.load(n_ptr + cols, mask=col_ok, other=1.0).to(tl.float32), eps)
        if FROM_OUTPUT:
            lost = tl.where(n_safe > eps, float("nan"), 0.0)
            part = tl.where(g1 == 0.0, lost, part / (g1 * n_safe))
        else:
            part = part / n_safe
    tl.store(part_ptr + pid_t * stride_pb + cols, part, mask=col_ok)


def lora_up_compose_triton(
    base: torch.Tensor,
    xa: torch.Tensor,
    lora_B: torch.Tensor,
    g: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    base_dropped: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    z_out: torch.Tensor | None = None,
    base_has_bias: bool = False,
    n_safe: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = compose(base, xa·Bᵀ, g) in base.dtype; ``out`` may be ``base`` itself (in place).
    ``base_has_bias``: ``base`` already holds x·Wᵀ + b (no dropout): y = g⊙(base - b + s·lora) + b.
    ``n_safe``: ``g`` is m and the kernel forms g = m / n_safe (correctly rounded): one host op less."""
    T, d_out = base.shape
    r = xa.shape[1]
    y = out if out is not None else torch.empty_like(base)
    if T == 0 or d_out == 0:
        return y
    traced = traced_launch()
    if base_dropped is None and z_out is None and not traced:
        tma_cfg = _tma_config(y, base, xa, lora_B, T, d_out, r)
        if tma_cfg is not None:
            _compose_tma(tma_cfg, y, base, xa, lora_B, g, scaling, bias, base_has_bias, n_safe)
            return y
    cfg = compose_config(T, d_out, r)
    dot_dtype = _TL_DTYPE[xa.dtype]
    grid = (cdiv(T, cfg.block_m) * cdiv(d_out, cfg.block_n),)
    bd = base_dropped if base_dropped is not None else unused_pointer(base, traced)
    z = z_out if z_out is not None else unused_pointer(y, traced)
    args = (
        y, y.stride(0), y.stride(1),
        z, z.stride(0), z.stride(1),
        base, base.stride(0), base.stride(1),
        bd, bd.stride(0), bd.stride(1),
        xa, xa.stride(0), xa.stride(1),
        lora_B, lora_B.stride(0), lora_B.stride(1),
        g, bias if bias is not None else unused_pointer(g, traced),
        n_safe if n_safe is not None else unused_pointer(g, traced),
        T, d_out, r, float(scaling),
    )
    constexprs = dict(
        HAS_BIAS=bias is not None, HAS_BASE_D=base_dropped is not None, WRITE_Z=z_out is not None,
        BASE_HAS_BIAS=base_has_bias and bias is not None and base_dropped is None, G_FROM_M=n_safe is not None,
        DOT_DTYPE=dot_dtype, PRECISION="tf32x3" if xa.dtype == torch.float32 else "ieee", INTERPRET=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    launcher(_lora_up_compose_kernel, traced)[grid](*args, **constexprs, **options)
    return y


_TMA_DTYPES = (torch.bfloat16, torch.float16)
_SM_COUNT: dict[int, int] = {}


def _tma_ready(t: torch.Tensor) -> bool:
    """A non-empty 2-D tensor a TMA descriptor can address: last stride 1, rows and base 16-byte aligned."""
    return (t.numel() > 0 and t.stride(1) == 1 and not (t.stride(0) * t.element_size()) & 15
            and not t.data_ptr() & 15)


def _sm_count(device: int) -> int:
    """Programs of the persistent compose: the SMs of ``device`` where the TMA compose was measured
    (Hopper, compute capability 9.x), else 0 (the pointer kernel). Its 128×256 tiles need about
    213 KB of shared memory: consumer Blackwell (12.x, about 101 KB a block) cannot run them, and
    data-centre Blackwell (10.x) is neither timed nor tested."""
    if device < 0:  # the interpreter on CPU tensors: a few programs, so each walks several tiles
        return 3
    n = _SM_COUNT.get(device)
    if n is None:  # a ROCm build reports its GPUs' gfx major as the capability (9 for MI300): no TMA there
        n = _SM_COUNT[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                 if torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9 else 0)
    return n


def tma_compose_available(device: torch.device | int) -> bool:
    """Whether the persistent TMA compose can be taken on ``device`` (a CUDA device of compute
    capability 9.x; see ``_sm_count``): for callers and tests that must know which kernel ran."""
    index = device if isinstance(device, int) else (device.index if device.index is not None else torch.cuda.current_device())
    return _sm_count(index) > 0


def _tma_config(y, base, xa, lora_B, T, d_out, r):
    """The TMA compose's config where it applies (eager; a shape ``compose_tma_config`` takes;
    Hopper or the interpreter; 16-bit operands, one dtype each side; TMA-addressable), else None.
    The shape is asked first: cheap arithmetic that turns away host-bound small-T calls."""
    cfg = compose_tma_config(T, d_out, r)
    if cfg is None or (xa.dtype not in _TMA_DTYPES or lora_B.dtype != xa.dtype or base.dtype not in _TMA_DTYPES
                       or y.dtype != base.dtype):
        return None
    if not _sm_count(base.get_device()) or not (_tma_ready(y) and _tma_ready(base) and _tma_ready(xa) and _tma_ready(lora_B)):
        return None
    return cfg


def _compose_tma(cfg, y, base, xa, lora_B, g, scaling, bias, base_has_bias, n_safe) -> None:
    T, d_out = base.shape
    half = cfg.block_n // 2
    programs = min(cdiv(T, cfg.block_m) * cdiv(d_out, cfg.block_n), _sm_count(base.get_device()))
    args = (
        TensorDescriptor(y, [T, d_out], [y.stride(0), 1], [cfg.block_m, half]),
        TensorDescriptor(base, [T, d_out], [base.stride(0), 1], [cfg.block_m, half]),
        TensorDescriptor(xa, [T, xa.shape[1]], [xa.stride(0), 1], [cfg.block_m, cfg.block_k]),
        TensorDescriptor(lora_B, [d_out, lora_B.shape[1]], [lora_B.stride(0), 1], [cfg.block_n, cfg.block_k]),
        g, bias if bias is not None else g, n_safe if n_safe is not None else g,
        T, d_out, xa.shape[1], float(scaling),
    )
    constexprs = dict(
        HAS_BIAS=bias is not None, BASE_HAS_BIAS=base_has_bias and bias is not None, G_FROM_M=n_safe is not None,
        INTERPRET=interpreting(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PROGRAMS=programs,
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    grid = (programs,)
    _lora_up_compose_tma_kernel[grid](*args, **constexprs, **options)


def grad_scale_dm_triton(
    dy: torch.Tensor, saved: torch.Tensor, g: torch.Tensor, n: torch.Tensor, bias: torch.Tensor | None, *, from_output: bool,
    final_dm: bool = False, reduce: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, S): dz = g⊙dy in dy.dtype (saturated where n < eps); S = Σ_t dy⊙(y - b) if
    ``from_output`` else Σ_t dy⊙z (fp32); with ``final_dm``, S = dm (see the kernel).
    ``reduce=False``: the (token blocks, d_out) partials, for a chunked caller to sum in order."""
    T, d_out = dy.shape
    dz = torch.empty_like(dy)
    cfg = grad_config(T, d_out)
    n_tb = cdiv(T, cfg.block_t) if T else 0
    if n_tb == 0 or d_out == 0:
        zeros = torch.zeros(d_out, dtype=torch.float32, device=dy.device)
        return dz, zeros if reduce else zeros[None, :]
    part = torch.empty(n_tb, d_out, dtype=torch.float32, device=dy.device)
    grid = (n_tb, cdiv(d_out, cfg.block_d))
    traced = traced_launch()
    args = (
        dz, dz.stride(0), dz.stride(1),
        part, part.stride(0),
        dy, dy.stride(0), dy.stride(1),
        saved, saved.stride(0), saved.stride(1),
        g, n, bias if bias is not None else unused_pointer(g, traced),
        T, d_out, eps(),
    )
    constexprs = dict(
        FROM_OUTPUT=from_output, HAS_BIAS=bias is not None and from_output, FINAL_DM=final_dm, INTERPRET=interpreting(),
        MAX_OUT=torch.finfo(dy.dtype).max,
        BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d,
    )
    launcher(_grad_scale_dm_kernel, traced)[grid](*args, **constexprs, num_warps=cfg.num_warps)
    if not reduce:
        return dz, part
    return dz, part.sum(0) if n_tb > 1 else part[0]
