"""The forward compose kernel's structure, not its tile config (GPU probe, seventeenth session).

Every tile config of the shipped ``_lora_up_compose_kernel`` has been swept (fused_pass_probe.py):
the best is 93 µs at T 4096 × d_out 8192, r 384, bf16, against cuBLAS's xa·Bᵀ alone at 50 and one
element-wise pass at 34. Counting says what a fused kernel could reach there: the GEMM is 25.8 GFLOP
(33 µs at 784 TFLOP/s), the epilogue moves 128 MiB (base read, y written: 32 µs at 4.2 TB/s), so
with the two overlapped about 40-50 µs. This probe times kernels that differ in structure:

- ``pointer``: the pointer kernel ``_lora_up_compose_kernel`` at its shipped tiles (the reference
  output; in the first two runs, before the TMA compose shipped, this row was called ``shipped``);
- ``shipped``: ``lora_up_compose_triton`` as the library launches it now (TMA where it applies);
- ``early``: the same tiles, the epilogue's base, g loads issued before the K loop, so their latency
  hides behind the MMAs (first run only);
- ``persist``: persistent like ``tma`` but with pointer loads (no descriptors, so no alignment
  conditions and Triton's plain launch path);
- ``tma``: persistent (one program per SM, or two), xa, B, base and y through TMA descriptors
  (``triton.tools.tensor_descriptor``), tiles walked in grouped order, optionally the loop over
  tiles flattened so the next tile's loads are issued during this tile's epilogue, optionally the
  epilogue in two column halves (less register pressure at 128×256).

All compute y = g⊙(base + s·xa·Bᵀ) in fp32, rounded once to bf16, no bias (the training forward's
compose). For each: GPU µs from CUDA-graph replays (median, q20, q80), GB/s of the 128 MiB the
epilogue must move, and the largest difference from the shipped kernel's y in bf16 ulps (the GEMM's
summation order may differ between tile shapes; the compose itself is the same fp32 expression).
The first two runs' ``shipped`` rows are the pointer kernel (the library before the TMA compose).

    python benchmarks/compose_variants_probe.py [--csv out.csv]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from fused_pass_probe import timed
from row_csv import RowWriter
from triton.tools.tensor_descriptor import TensorDescriptor

from doracheck.kernels import compose_triton as ct

SHAPES = [(4096, 8192, 384), (4096, 14336, 384), (4096, 4096, 384), (4096, 1024, 384), (1024, 4096, 384), (512, 4096, 384),
          (256, 1024, 384), (4096, 4096, 16)]


@triton.jit
def _early_kernel(y_ptr, base_ptr, xa_ptr, lb_ptr, g_ptr, T, d_out, r, scaling,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = g⊙(base + s·xa·Bᵀ), contiguous operands; the epilogue's loads issued before the K loop."""
    pid_m, pid_n = ct._tile_of(tl.program_id(0).to(tl.int64), tl.cdiv(T, BLOCK_M), tl.cdiv(d_out, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    col_ok = cols < d_out
    mask = row_ok[:, None] & col_ok[None, :]
    base = tl.load(base_ptr + rows[:, None] * d_out + cols[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        k = k0 + kk
        k_ok = k < r
        xa = tl.load(xa_ptr + rows[:, None] * r + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        lb = tl.load(lb_ptr + cols[:, None] * r + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xa, tl.trans(lb), acc)
    s = tl.cast(scaling, tl.float32)
    y = g[None, :] * (base.to(tl.float32) + s * acc)
    tl.store(y_ptr + rows[:, None] * d_out + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _compose_half(y_desc, base_desc, g_ptr, acc, m0, n0, d_out, s, BLOCK_N: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    g = tl.load(g_ptr + cols, mask=cols < d_out, other=0.0)
    base = base_desc.load([m0, n0]).to(tl.float32)
    y = g[None, :] * (base + s * acc)
    y_desc.store([m0, n0], y.to(y_desc.dtype))


@triton.jit
def _tma_kernel(y_desc, base_desc, xa_desc, lb_desc, g_ptr, T, d_out, r, scaling,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr):
    """Persistent y = g⊙(base + s·xa·Bᵀ) over TMA descriptors; PROGRAMS programs walk the tiles."""
    start = tl.program_id(0)
    n_m = tl.cdiv(T, BLOCK_M)
    n_n = tl.cdiv(d_out, BLOCK_N)
    k_tiles = tl.cdiv(r, BLOCK_K)
    s = tl.cast(scaling, tl.float32)
    for tile in tl.range(start, n_m * n_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = ct._tile_of(tile, n_m, n_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            xa = xa_desc.load([m0, ki * BLOCK_K])
            lb = lb_desc.load([n0, ki * BLOCK_K])
            acc = tl.dot(xa, lb.T, acc)
        if SUBTILE:
            halves = tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2))
            halves = tl.permute(halves, (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            _compose_half(y_desc, base_desc, g_ptr, acc0, m0, n0, d_out, s, BLOCK_N // 2)
            _compose_half(y_desc, base_desc, g_ptr, acc1, m0, n0 + BLOCK_N // 2, d_out, s, BLOCK_N // 2)
        else:
            _compose_half(y_desc, base_desc, g_ptr, acc, m0, n0, d_out, s, BLOCK_N)


@triton.jit
def _compose_half_ptr(y_ptr, base_ptr, g_ptr, acc, m0, n0, T, d_out, s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < d_out
    mask = (rows < T)[:, None] & col_ok[None, :]
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0)
    base = tl.load(base_ptr + rows[:, None] * d_out + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = g[None, :] * (base + s * acc)
    tl.store(y_ptr + rows[:, None] * d_out + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _persist_kernel(y_ptr, base_ptr, xa_ptr, lb_ptr, g_ptr, T, d_out, r, scaling,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr):
    """Persistent y = g⊙(base + s·xa·Bᵀ) with pointer loads (no TMA), contiguous operands."""
    start = tl.program_id(0)
    n_m = tl.cdiv(T, BLOCK_M)
    n_n = tl.cdiv(d_out, BLOCK_N)
    s = tl.cast(scaling, tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for tile in tl.range(start, n_m * n_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = ct._tile_of(tile, n_m, n_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, r, BLOCK_K):
            k = k0 + kk
            k_ok = k < r
            xa = tl.load(xa_ptr + rows[:, None] * r + k[None, :], mask=(rows < T)[:, None] & k_ok[None, :], other=0.0)
            lb = tl.load(lb_ptr + cols[:, None] * r + k[None, :], mask=(cols < d_out)[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(xa, tl.trans(lb), acc)
        if SUBTILE:
            halves = tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2))
            halves = tl.permute(halves, (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            _compose_half_ptr(y_ptr, base_ptr, g_ptr, acc0, m0, n0, T, d_out, s, BLOCK_M, BLOCK_N // 2)
            _compose_half_ptr(y_ptr, base_ptr, g_ptr, acc1, m0, n0 + BLOCK_N // 2, T, d_out, s, BLOCK_M, BLOCK_N // 2)
        else:
            _compose_half_ptr(y_ptr, base_ptr, g_ptr, acc, m0, n0, T, d_out, s, BLOCK_M, BLOCK_N)


def persist(base, xa, B, g, s, y, bm, bn, bk, gm, warps, stages, per_sm, flatten, subtile):
    T, d_out = base.shape
    tiles = triton.cdiv(T, bm) * triton.cdiv(d_out, bn)
    programs = min(tiles, per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    _persist_kernel[(programs,)](y, base, xa, B, g, T, d_out, xa.shape[1], s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 GROUP_M=gm, PROGRAMS=programs, FLATTEN=flatten, SUBTILE=subtile, num_warps=warps,
                                 num_stages=stages)


def early(base, xa, B, g, s, y, bm, bn, bk, gm, warps, stages):
    T, d_out = base.shape
    grid = (triton.cdiv(T, bm) * triton.cdiv(d_out, bn),)
    _early_kernel[grid](y, base, xa, B, g, T, d_out, xa.shape[1], s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                        num_warps=warps, num_stages=stages)


def tma(base, xa, B, g, s, y, bm, bn, bk, gm, warps, stages, per_sm, flatten, subtile):
    T, d_out = base.shape
    en = bn // 2 if subtile else bn
    descs = (TensorDescriptor.from_tensor(y, [bm, en]), TensorDescriptor.from_tensor(base, [bm, en]),
             TensorDescriptor.from_tensor(xa, [bm, bk]), TensorDescriptor.from_tensor(B, [bn, bk]))
    tiles = triton.cdiv(T, bm) * triton.cdiv(d_out, bn)
    programs = min(tiles, per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    _tma_kernel[(programs,)](*descs, g, T, d_out, xa.shape[1], s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                             PROGRAMS=programs, FLATTEN=flatten, SUBTILE=subtile, num_warps=warps, num_stages=stages)


# (name, function, config); configs are (block_m, block_n, block_k, group_m, warps, stages[, per_sm, flatten, subtile])
# The first run (results/compose_variants_seventeenth_h200.csv) had early loads at 64×128, 128×128 and
# 128×256 (no gain) and TMA at 64×128 / 128×128 with one or two programs per SM; 128×256 with
# 8 warps, 3 stages, flattened, in two halves was best (75.5 against 94.6 µs at 4096 × 8192).
VARIANTS = [
    ("tma", tma, (128, 256, 64, 8, 8, 3, 1, True, True)),
    ("tma", tma, (128, 256, 64, 8, 8, 4, 1, True, True)),
    ("tma", tma, (128, 256, 64, 8, 8, 2, 1, True, True)),
    ("tma", tma, (128, 256, 64, 4, 8, 3, 1, True, True)),
    ("tma", tma, (128, 256, 64, 16, 8, 3, 1, True, True)),
    ("tma", tma, (256, 128, 64, 8, 8, 3, 1, True, True)),
    ("tma", tma, (128, 256, 128, 8, 8, 2, 1, True, True)),
    ("persist", persist, (128, 256, 64, 8, 8, 3, 1, True, True)),
    ("persist", persist, (128, 256, 64, 8, 8, 4, 1, True, True)),
    ("persist", persist, (128, 256, 64, 8, 8, 3, 1, False, True)),
    ("persist", persist, (128, 128, 64, 8, 8, 3, 1, True, False)),
    ("persist", persist, (64, 128, 64, 8, 4, 3, 2, True, False)),
]


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of bf16's ulp at |want| (2^(e-7))."""
    w = want.float()
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(2.0**-126))[1] - 8)
    return float(((got.float() - w).abs() / ulp).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    args = ap.parse_args()
    out = RowWriter(args.csv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "dtype": "bf16"}
    print(meta)

    def report(shape, name, config, times, nbytes, diff):
        med, lo, hi = times
        print(f"{shape:18s} {name:8s} {config:44s} {med:7.1f} us  q20 {lo:7.1f} q80 {hi:7.1f}  "
              f"{nbytes / med / 1e3:6.0f} GB/s  ulps={diff}", flush=True)
        out.add({**meta, "shape": shape, "variant": name, "config": config, "median_us": round(med, 2), "q20_us": round(lo, 2),
                 "q80_us": round(hi, 2), "gb_per_s": round(nbytes / med / 1e3, 1), "max_ulps_vs_shipped": diff})

    for T, d_out, r in SHAPES:
        shape = f"T{T} d_out{d_out} r{r}"
        base = torch.randn(T, d_out, device="cuda", generator=gen).bfloat16()
        xa = torch.randn(T, r, device="cuda", generator=gen).bfloat16()
        B = (torch.randn(d_out, r, device="cuda", generator=gen) * 0.05).bfloat16()
        g = torch.rand(d_out, device="cuda", generator=gen) + 0.5
        y = torch.empty_like(base)
        nbytes = 2 * T * d_out * 2
        report(shape, "floor", "cuBLAS xa@B.T bf16 out", timed(lambda: torch.mm(xa, B.t(), out=y)), nbytes, "")
        report(shape, "floor", "mul(base, base) 2 reads 1 write", timed(lambda: torch.mul(base, base, out=y)), nbytes, "")
        # The reference: the pointer kernel at its shipped tiles (the TMA compose set aside where the
        # library has it), then the shipped launch as it is (TMA where settings take it).
        tma_config = getattr(ct, "_tma_config", None)
        if tma_config is not None:
            ct._tma_config = lambda *a_: None
        try:
            want = ct.lora_up_compose_triton(base, xa, B, g, 2.0).clone()
            report(shape, "pointer", str(tuple(ct.compose_config(T, d_out, r))),
                   timed(lambda: ct.lora_up_compose_triton(base, xa, B, g, 2.0, out=y)), nbytes, 0.0)
        finally:
            if tma_config is not None:
                ct._tma_config = tma_config
        shipped = ct.lora_up_compose_triton(base, xa, B, g, 2.0)
        report(shape, "shipped", "launch as shipped", timed(lambda: ct.lora_up_compose_triton(base, xa, B, g, 2.0, out=y)),
               nbytes, round(ulps(shipped, want), 3))
        for name, fn, cfg in VARIANTS:
            try:
                y.zero_()
                fn(base, xa, B, g, 2.0, y, *cfg)
                diff = round(ulps(y, want), 3)
                times = timed(lambda fn=fn, cfg=cfg: fn(base, xa, B, g, 2.0, y, *cfg))
            except Exception as error:  # noqa: BLE001 (out of resources, an unsupported feature: findings)
                print(shape, name, cfg, type(error).__name__, str(error)[:160], flush=True)
                continue
            report(shape, name, str(cfg), times, nbytes, diff)
        del base, xa, B, y
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
