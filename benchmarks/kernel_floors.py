"""The kernels against their floors: the factored norm, the fused compose, the dz/dm backward pass.

(Named kernel_floors.py, not kernels.py: a ``kernels`` module beside the drivers would shadow the
PyPI package of that name, which transformers imports.)

First the device's ceilings, measured in the same run: copy bandwidth (bytes read + written of a
1 GiB device copy) and the bf16 GEMM rate (8192³). Then each op at the model's shapes (d_in =
d_out = 8192, r = 384, T = 4096; ``--d``, ``--r``, ``--tokens``), its Triton kernel beside its torch
twin (the same signature, unfused) and its floor:
  norm      factored_norm (n = ||W + s·B·A|| by rows, fp32, bf16 and fp32 adapters); floor: the FLOPs
            of its W·Aᵀ GEMM (2·d_out·d_in·r) at the GEMM ceiling; also cuBLAS W·Aᵀ alone and the
            dense PEFT-style ``linalg.norm(W + s·B@A, dim=1)``
  compose   y = g ⊙ (base + s·(x·Aᵀ)·Bᵀ), the up-projection fused with the compose; floor: reading
            base and writing y (2·T·d_out·2 bytes) at the copy ceiling, or the up-projection's
            FLOPs at the GEMM ceiling, whichever is longer; also cuBLAS (x·Aᵀ)·Bᵀ alone
  backward  dz = g ⊙ dy and dm partials Σ_t dy ⊙ y; floor: reading dy and y and writing dz
            (3·T·d_out·2 bytes) at the copy ceiling
GPU µs come from CUDA-graph replays (``harness.graph_time``: no host in the loop); the
host-inclusive µs (events around each call) are beside them. ``of_floor`` = floor / GPU time.

    python benchmarks/kernel_floors.py [--d 8192 --r 384 --tokens 1,16,4096]
    python benchmarks/kernel_floors.py --smoke
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

import harness
import torch

FIELDS = ["op", "tokens", "host_us", "work", "rate", "rate_unit", "floor_us", "of_floor"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=8192, help="d_in = d_out")
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", default="1,16,4096")
    ap.add_argument("--reps", type=int, default=30)
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.d, args.r, args.tokens, args.reps = 64, 8, "1,16", 3
    device = harness.resolve_device(args, "kernel_floors")
    cuda = device.startswith("cuda")
    results = harness.Results("kernel_floors", FIELDS, args.csv, args.smoke)
    printed: list[dict] = []
    ceilings: dict[str, float] = {}
    kernels = None
    if cuda:  # the Triton twins' modules (doracheck.kernels exports the torch twins by name)
        kernels = tuple(importlib.import_module(f"doracheck.kernels.{m}") for m in ("norm_triton", "compose_triton"))
    from doracheck.kernels import compose_torch, factored_norm_torch, grad_scale_dm_torch

    def measure(op: str, impl: str, fn: Callable[[], object], *, shape: str, dtype: str, tokens="", flops=0.0,
                nbytes=0.0) -> float | None:
        """One row; GPU µs (graph replays on a GPU, the host clock on a CPU), or None if it failed."""
        try:
            host = harness.time_fn(fn, reps=args.reps, warmup=3, device=device)
        except Exception as exc:  # noqa: BLE001 (a kernel's API or resources: report, go on)
            print(f"{op:9s} {impl:44s} skipped: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return None
        gpu = host
        if cuda:
            try:
                gpu = harness.graph_time(fn, reps=args.reps)
            except Exception as exc:  # noqa: BLE001 (not capturable: a host sync inside, say)
                impl += " (host-inclusive: no graph)"
                print(f"{op:9s} {impl:44s} CUDA graph capture failed: {type(exc).__name__}", flush=True)
        us = gpu.median * 1e3
        floor_us = max(nbytes / ceilings["copy"] if nbytes and "copy" in ceilings else 0.0,
                       flops / ceilings["gemm"] if flops and "gemm" in ceilings else 0.0) * 1e6
        rate, unit = (nbytes / us / 1e3, "GB/s") if nbytes else (flops / us / 1e6, "TFLOP/s") if flops else (0.0, "")
        row = results.add({"case": op, "op": op, "impl": impl, "shape": shape, "dtype": dtype, "tokens": tokens,
                           "unit": "us", "median": round(us, 2), "p10": round(gpu.p10 * 1e3, 2),
                           "p90": round(gpu.p90 * 1e3, 2), "n": gpu.n, "rounds": 1,
                           "host_us": round(host.median * 1e3, 2), "work": flops or nbytes, "rate": round(rate, 1),
                           "rate_unit": unit, "floor_us": round(floor_us, 2) if floor_us else "",
                           "of_floor": round(floor_us / us, 3) if floor_us else ""})
        printed.append(row)
        print(f"{op:9s} {impl:44s} {us:9.1f} us GPU {row['host_us']:9.1f} us with host  {rate:7.1f} {unit:7s} "
              f"floor {row['floor_us']} us ({row['of_floor']})", flush=True)
        return us

    # ceilings
    n = (1 << 29) if cuda else (1 << 16)
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    us = measure("ceiling", "copy (bytes read + written)", lambda: b.copy_(a), shape=f"{n}", dtype="bf16", nbytes=4 * n)
    if us:
        ceilings["copy"] = 4 * n / (us * 1e-6)
    del a, b
    s = 8192 if cuda else 64
    m = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    us = measure("ceiling", f"GEMM {s}^3", lambda: m @ m, shape=f"{s}^3", dtype="bf16", flops=2 * s**3)
    if us:
        ceilings["gemm"] = 2 * s**3 / (us * 1e-6)
    del m

    d, r, scale = args.d, args.r, 2.0
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, std=1.0, dtype=torch.bfloat16):  # never zeros: a zero B makes the norm trivial
        return (torch.randn(*shape, generator=gen) * std).to(device, dtype)

    W = rand(d, d, std=d**-0.5)
    shape = f"{d}x{d}r{r}"
    for adt in (torch.bfloat16, torch.float32):
        tag = "bf16" if adt == torch.bfloat16 else "fp32"
        A, B = rand(r, d, std=d**-0.5, dtype=adt), rand(d, r, std=0.02, dtype=adt)
        flops = 2 * d * d * r
        if kernels:
            measure("norm", "factored_norm, Triton", lambda: kernels[0].factored_norm_triton(W, A, B, scale),
                    shape=shape, dtype=tag, flops=flops)
        measure("norm", "factored_norm, torch twin", lambda: factored_norm_torch(W, A, B, scale),
                shape=shape, dtype=tag, flops=flops)
        Ab, Bb = A.to(torch.bfloat16), B.to(torch.bfloat16)
        measure("norm", "cuBLAS W @ A.T alone (bf16)", lambda: W @ Ab.t(), shape=shape, dtype=tag, flops=flops)
        measure("norm", "dense PEFT-style ||W + s*B@A|| rows", lambda: torch.linalg.norm(W + scale * (Bb @ Ab), dim=1),
                shape=shape, dtype=tag, flops=flops)

    Bb = rand(d, r, std=0.02)
    g = (torch.rand(d, generator=gen) + 0.5).to(device)
    nrm = (torch.rand(d, generator=gen) + 0.5).to(device)
    for T in (int(t) for t in args.tokens.split(",")):
        base, xa, dy = rand(T, d), rand(T, r), rand(T, d)
        out = torch.empty_like(base)
        nbytes, flops = 2 * T * d * 2, 2 * T * r * d
        if kernels:
            measure("compose", "lora_up_compose, Triton",
                    lambda: kernels[1].lora_up_compose_triton(base, xa, Bb, g, scale, None, out=out),
                    shape=shape, dtype="bf16", tokens=T, flops=flops, nbytes=nbytes)
        measure("compose", "compose torch twin (+ xa @ B.T)",
                lambda: compose_torch(base, xa @ Bb.t(), g, scale),
                shape=shape, dtype="bf16", tokens=T, flops=flops, nbytes=nbytes)
        measure("compose", "cuBLAS xa @ B.T alone", lambda: xa @ Bb.t(), shape=shape, dtype="bf16", tokens=T, flops=flops)
        nbytes = 3 * T * d * 2
        if kernels:
            measure("backward", "grad_scale_dm, Triton",
                    lambda: kernels[1].grad_scale_dm_triton(dy, base, g, nrm, None, from_output=True),
                    shape=shape, dtype="bf16", tokens=T, nbytes=nbytes)
        measure("backward", "grad_scale_dm torch twin",
                lambda: grad_scale_dm_torch(dy, base, g, nrm, None, from_output=True),
                shape=shape, dtype="bf16", tokens=T, nbytes=nbytes)
    print(harness.table(printed, ["op", "impl", "dtype", "tokens", "median", "host_us", "rate", "rate_unit", "of_floor"]))
    print(f"rows appended to {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
