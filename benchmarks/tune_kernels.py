"""Sweep launch configs of the Triton kernels on the current GPU (feeds kernels/settings.py).

Times each candidate with triton.testing.do_bench (CUDA events, median) on random data,
checks each candidate's result against the torch path, and prints a table. Writes CSV to
$OUT/tune.csv when OUT is set.
"""

from __future__ import annotations

import csv
import itertools
import os
import sys

import torch
import triton

from doracheck.kernels import factored_norm_torch
from doracheck.kernels import compose_triton as ct
from doracheck.kernels import norm_triton as nt
from doracheck.kernels import settings


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tune_norm(d_out, d_in, r, dtype, adtype, rows):
    W = torch.randn(d_out, d_in, device="cuda", dtype=dtype) / d_in**0.5
    A = torch.randn(r, d_in, device="cuda", dtype=adtype) / d_in**0.5
    B = torch.randn(d_out, r, device="cuda", dtype=adtype) / r**0.5
    ref = factored_norm_torch(W, A, B, 2.0).norm
    flops = 2 * d_out * d_in * r
    orig = settings.norm_config
    cands = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (3, 4)):
        if bn > max(16, triton.next_power_of_2(r)) * 2:
            continue
        cands.append(settings.NormConfig(bm, min(bn, max(16, triton.next_power_of_2(r))), bk, 32, warps, stages))
    cands = list(dict.fromkeys(cands))
    best = None
    for cfg in cands:
        nt.norm_config = lambda *a, _c=cfg: _c
        try:
            out = nt.factored_norm_triton(W, A, B, 2.0).norm
            err = float(((out - ref).norm() / ref.norm()))
            ms = bench(lambda: nt.factored_norm_triton(W, A, B, 2.0))
        except Exception as exc:  # out of resources etc.
            print(f"norm {cfg}: {type(exc).__name__}", file=sys.stderr)
            continue
        tflops = flops / ms / 1e9
        rows.append(["norm", d_out, d_in, r, str(dtype), str(adtype), str(cfg), ms * 1e3, tflops, err])
        if best is None or ms < best[0]:
            best = (ms, cfg, tflops, err)
    nt.norm_config = orig
    print(f"norm {d_out}x{d_in} r{r} {dtype} A {adtype}: best {best[0]*1e3:.1f} us {best[2]:.0f} TFLOP/s err {best[3]:.1e} {best[1]}")
    return best


def tune_compose(T, d_out, r, rows):
    base = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
    xa = torch.randn(T, r, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(d_out, r, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(d_out, device="cuda") + 0.5
    orig = ct.compose_config
    best = None
    for bm, bn, bk, gm, warps, stages in itertools.product((64, 128), (64, 128, 256), (32, 64), (8,), (4, 8), (2, 3, 4)):
        if T <= 16 and bm > 64:
            continue
        cfg = settings.ComposeConfig(bm, bn, bk, gm, warps, stages)
        ct.compose_config = lambda *a, _c=cfg: _c
        try:
            out = torch.empty_like(base)
            ms = bench(lambda: ct.lora_up_compose_triton(base, xa, B, g, 2.0, None, out=out))
        except Exception as exc:
            print(f"compose {cfg}: {type(exc).__name__}", file=sys.stderr)
            continue
        rows.append(["compose", T, d_out, r, "bf16", "bf16", str(cfg), ms * 1e3, 2 * T * d_out * r / ms / 1e9, 0.0])
        if best is None or ms < best[0]:
            best = (ms, cfg)
    ct.compose_config = orig
    byts = 2 * T * d_out * 2
    print(f"compose T{T} {d_out} r{r}: best {best[0]*1e3:.1f} us ({byts / best[0] / 1e9:.0f} GB/s r+w) {best[1]}")
    return best


def tune_grad(T, d_out, rows):
    dy = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(d_out, device="cuda") + 0.5
    orig = ct.grad_config
    best = None
    for bt, bd, warps in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8)):
        cfg = settings.GradConfig(bt, bd, warps)
        ct.grad_config = lambda *a, _c=cfg: _c
        ms = bench(lambda: ct.grad_scale_dm_triton(dy, y, g, None, from_output=True))
        rows.append(["grad", T, d_out, 0, "bf16", "bf16", str(cfg), ms * 1e3, 0.0, 0.0])
        if best is None or ms < best[0]:
            best = (ms, cfg)
    ct.grad_config = orig
    byts = 3 * T * d_out * 2
    print(f"grad T{T} {d_out}: best {best[0]*1e3:.1f} us ({byts / best[0] / 1e9:.0f} GB/s) {best[1]}")
    return best


def main():
    rows = []
    for d_out, d_in, r in ((8192, 8192, 384), (4096, 4096, 16), (4096, 4096, 128), (14336, 4096, 384), (4096, 14336, 384)):
        tune_norm(d_out, d_in, r, torch.bfloat16, torch.bfloat16, rows)
    tune_norm(8192, 8192, 384, torch.bfloat16, torch.float32, rows)
    for T, d_out, r in ((4096, 8192, 384), (4096, 4096, 16), (1, 8192, 384)):
        tune_compose(T, d_out, r, rows)
    tune_grad(4096, 8192, rows)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tune.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kernel", "a", "b", "c", "dtype", "adtype", "config", "us", "tflops", "err"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
