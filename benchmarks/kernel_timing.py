"""Kernel-level timings on the GPU against their floors (benchmarks/kernel_bench.sh runs it).

- ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192³ GEMM rate;
- the factored norm at 8192×8192, r = 384 (bf16 and fp32 adapters), its parts (Gram, the
  W·Aᵀ row-dot GEMM, the B·G row-dot GEMM), cuBLAS W·Aᵀ and the dense PEFT-style norm;
- config sweeps of the fused up-projection compose and of the dz/dm pass (T = 4096, d_out = 8192).
Prints a table; ``--csv FILE`` writes every row.
"""

from __future__ import annotations

import argparse
import csv

import torch
import triton

from doracheck.kernels import compose_triton as ct
from doracheck.kernels import norm_triton as nt
from doracheck.kernels import settings

# Compose and dz/dm candidates: those kept from a wider first sweep (benchmarks/README.md, Kernels).
# (block_m, block_n, block_k, warps, stages)
COMPOSE_CANDIDATES = ((64, 128, 64, 4, 3), (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                      (64, 256, 64, 8, 3), (128, 64, 64, 4, 3), (128, 128, 64, 4, 4))
# (block_m, block_n, block_k, warps, stages, n_sub, split_k): the 128×256 tile (r = 384 padded to
# 512), 128-wide tiles (no padding), three 128-wide sub-tiles per program, and K split in 2 or 3.
ROWDOT_CANDIDATES = ((128, 256, 64, 8, 3, 1, 1), (128, 256, 64, 8, 3, 1, 2), (128, 128, 64, 8, 3, 1, 1),
                     (128, 128, 64, 8, 3, 1, 2), (128, 128, 64, 8, 4, 1, 2), (128, 128, 64, 4, 4, 1, 2),
                     (128, 128, 64, 8, 3, 1, 3), (256, 128, 64, 8, 3, 1, 2), (64, 128, 64, 4, 3, 3, 1),
                     (64, 128, 64, 4, 3, 3, 2), (64, 128, 64, 8, 3, 3, 2), (128, 128, 64, 8, 2, 3, 1))
# (block_t, block_d, warps)
GRAD_CANDIDATES = ((32, 256, 4), (64, 128, 8), (64, 256, 8), (128, 256, 8), (16, 512, 4), (32, 512, 8), (8, 1024, 4))


def bench_host(fn):
    """µs per call with the host in the loop (events around each call): what a caller waits."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def bench(fn):
    """(GPU µs, host-inclusive µs). The GPU time comes from replays of a captured CUDA graph
    (many launches, no host in the loop), so a slow host's launch cost stays out of a kernel's
    rate; the host-inclusive time is reported beside it."""
    gpu = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return gpu, bench_host(fn)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    args = ap.parse_args(argv)
    rows = []

    def row(kind, name, times, work, unit):
        """times: (GPU µs, host-inclusive µs); work: FLOPs (unit TFLOP/s) or bytes (unit GB/s)
        done in the GPU time."""
        us, host_us = times
        rate = (work / us / 1e6 if unit == "TFLOP/s" else work / us / 1e3) if work else 0.0
        rows.append({"kind": kind, "name": name, "us": round(us, 2), "host_us": round(host_us, 2), "rate": round(rate, 1),
                     "unit": unit})
        print(f"{kind:8s} {name:62s} {us:9.1f} us GPU {host_us:9.1f} us with host  {rate:8.1f} {unit}", flush=True)

    gpu = torch.cuda.get_device_name()
    print(gpu, torch.__version__, triton.__version__)
    a = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    row("ceiling", "copy 1 GiB bf16 (read+write bytes)", bench(lambda: b.copy_(a)), 2 * a.numel() * 2, "GB/s")
    del a, b
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    row("ceiling", "bf16 GEMM 8192^3", bench(lambda: m @ m), 2 * 8192**3, "TFLOP/s")
    del m

    d_out = d_in = 8192
    r = 384
    flops = 2 * d_out * d_in * r
    W = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) / 90
    for adt in (torch.bfloat16, torch.float32):
        A = (torch.randn(r, d_in, device="cuda") / 90).to(adt)
        B = (torch.randn(d_out, r, device="cuda") / 20).to(adt)
        tag = f"8192^2 r384 W bf16 A {str(adt)[6:]}"
        row("norm", f"factored_norm_triton {tag}", bench(lambda: nt.factored_norm_triton(W, A, B, 2.0)), flops, "TFLOP/s")
        row("norm", f"  gram A·Aᵀ {tag}", bench(lambda: nt.gram_triton(A)), 2 * r * r * d_in, "TFLOP/s")
        if adt != torch.float32:
            row("norm", f"  gram cuBLAS A·Aᵀ, fp32 output {tag}", bench(lambda: torch.mm(A, A.t(), out_dtype=torch.float32)),
                2 * r * r * d_in, "TFLOP/s")
        row("norm", f"  rowdot W·Aᵀ (+base, cross) {tag}",
            bench(lambda: nt.rowdot_triton(W, W.stride(), A, B, compute_base=True)), flops, "TFLOP/s")
        G = nt.gram_triton(A)
        row("norm", f"  rowdot B·G (lora) {tag}",
            bench(lambda: nt.rowdot_triton(B, B.stride(), G, B, compute_base=False, pieces=3)), 2 * d_out * r * r, "TFLOP/s")
        Ab = A.to(torch.bfloat16)
        row("norm", f"  cuBLAS W @ A.T (bf16, reference) {tag}", bench(lambda: W @ Ab.t()), flops, "TFLOP/s")
        Bb = B.to(torch.bfloat16)
        row("norm", f"  dense PEFT-style ||W + s·B@A|| {tag}",
            bench(lambda: torch.linalg.norm(W + 2.0 * (Bb @ Ab), dim=1)), flops, "TFLOP/s")

    # The W·Aᵀ row-dot GEMM over a few tile configs (bf16 W and A; GPU time from graph replays).
    A = (torch.randn(r, d_in, device="cuda") / 90).to(torch.bfloat16)
    B = (torch.randn(d_out, r, device="cuda") / 20).to(torch.bfloat16)
    orig = nt.rowdot_config
    for candidate in ROWDOT_CANDIDATES:
        cfg = settings.RowdotConfig(*candidate)
        nt.rowdot_config = lambda *a_, _c=cfg: _c
        try:
            times = bench(lambda: nt.rowdot_triton(W, W.stride(), A, B, compute_base=True))
        except Exception as exc:  # noqa: BLE001 (out of resources for a config)
            print("rowdot", cfg, type(exc).__name__)
            continue
        row("rowdot", f"W·Aᵀ 8192^2 r384 bf16 {tuple(cfg)}", times, flops, "TFLOP/s")
    nt.rowdot_config = orig

    T = 4096
    base = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
    xa = torch.randn(T, r, device="cuda", dtype=torch.bfloat16)
    Bb = torch.randn(d_out, r, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(d_out, device="cuda") + 0.5
    out = torch.empty_like(base)
    byts = 2 * T * d_out * 2  # read base, write y (bf16)
    orig = ct.compose_config
    best = None
    for bm, bn, bk, warps, stages in COMPOSE_CANDIDATES:
        cfg = settings.ComposeConfig(bm, bn, bk, 8, warps, stages)
        ct.compose_config = lambda *a_, _c=cfg: _c
        try:
            us = bench(lambda: ct.lora_up_compose_triton(base, xa, Bb, g, 2.0, None, out=out))
        except Exception as exc:  # noqa: BLE001 (out of resources for a config)
            print("compose", cfg, type(exc).__name__)
            continue
        row("compose", f"T4096 d_out8192 r384 {tuple(cfg)}", us, byts, "GB/s")
        best = min(best or (us[0], cfg), (us[0], cfg))
    ct.compose_config = orig
    print("best compose", best)
    for T1 in (1, 16):
        b1 = torch.randn(T1, d_out, device="cuda", dtype=torch.bfloat16)
        x1 = torch.randn(T1, r, device="cuda", dtype=torch.bfloat16)
        row("compose", f"T{T1} default config", bench(lambda: ct.lora_up_compose_triton(b1, x1, Bb, g, 2.0, None, out=b1)), 0, "")

    dy = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
    byts = 3 * T * d_out * 2  # read dy, y; write dz
    orig = ct.grad_config
    best = None
    for bt, bd, warps in GRAD_CANDIDATES:
        cfg = settings.GradConfig(bt, bd, warps)
        ct.grad_config = lambda *a_, _c=cfg: _c
        us = bench(lambda: ct.grad_scale_dm_triton(dy, base, g, g, None, from_output=True))
        row("grad", f"T4096 d_out8192 {tuple(cfg)}", us, byts, "GB/s")
        best = min(best or (us[0], cfg), (us[0], cfg))
    ct.grad_config = orig
    print("best grad", best)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["gpu", "torch", "triton", *rows[0]])
            w.writeheader()
            for rr in rows:
                w.writerow({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, **rr})


if __name__ == "__main__":
    main()
