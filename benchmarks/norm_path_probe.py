"""The factored norm's two paths side by side at the model's shapes (GPU probe, fourteenth session).

- ``row_dot``: the row-dot kernel with the base term fused (W·Aᵀ reduced against B in its
  epilogue, 128×64 tiles), then the finish launch: what shipped before the fourteenth session;
- ``cublas``: U = W·Aᵀ by cuBLAS with fp32 output, then one launch for Σ W², Σ B⊙U and the finish
  (``norm_triton.norm_from_u``), with the shipped reduction tiles and the candidates below.
Both include the Gram product and the lora term's row-dot launch, and form n_safe and g (a
training forward's norm). For each: the relative error of n against fp64, whether three calls
agree bitwise, and the GPU µs of the whole norm from CUDA-graph replays (triton's
``do_bench_cudagraph``: no host in the loop), with the FLOP rate of its largest GEMM (W·Aᵀ).

    python benchmarks/norm_path_probe.py [--csv out.csv]
"""

from __future__ import annotations

import argparse

import torch
import triton
from row_csv import RowWriter

from doracheck.kernels import norm_triton
from doracheck.kernels.settings import NormReduceConfig

# name: None (shipped choice of tiles) or (block_m, block_k, num_warps) for the reduction
REDUCE_CANDIDATES = {
    "cublas": None,
    "cublas m16 k256": (16, 256, 4),
    "cublas m8 k512": (8, 512, 4),
    "cublas m4 k1024": (4, 1024, 4),
    "cublas m8 k1024 w8": (8, 1024, 8),
    "cublas m2 k2048": (2, 2048, 4),
}
SHAPES = [  # d_out, d_in, r, fan_in_fan_out
    (14336, 4096, 384, False), (4096, 14336, 384, False), (4096, 4096, 384, False), (1024, 4096, 384, False),
    (8192, 8192, 384, False), (4096, 4096, 16, False), (4096, 4096, 384, True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    ap.add_argument("--adapters", choices=("bf16", "fp32"), default="bf16", help="A and B's dtype (W is bf16)")
    ap.add_argument("--only", help="comma-separated paths to run (default: all)")
    args = ap.parse_args()
    adt = torch.bfloat16 if args.adapters == "bf16" else torch.float32
    names = [n for n in ("row_dot", *REDUCE_CANDIDATES) if not args.only or n in args.only.split(",")]
    # The path rule's name in this library (an older one on PYTHONPATH for an A/B has the other).
    rule = "cublas_cross_pieces" if hasattr(norm_triton, "cublas_cross_pieces") else "cross_by_cublas"
    out = RowWriter(args.csv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shipped_cfg, shipped_rule = norm_triton.norm_reduce_config, getattr(norm_triton, rule)
    print(f"{'path':20s} {'d_out':>6s} {'d_in':>6s} {'r':>4s} {'fifo':>4s} {'rel err n':>9s} {'repeat':>6s} {'µs':>7s} {'TFLOP/s':>8s}")
    for d_out, d_in, r, fifo in SHAPES:
        W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / d_in**0.5).bfloat16()
        A = (torch.randn(r, d_in, device="cuda", generator=gen) / d_in**0.5).to(adt)
        B = (torch.randn(d_out, r, device="cuda", generator=gen) * 0.05).to(adt)
        m = torch.rand(d_out, device="cuda", generator=gen) + 0.5
        stored = W.t().contiguous() if fifo else W
        exact = (W.double() + 2.0 * B.double() @ A.double()).norm(dim=1)
        for name in names:
            tiles = REDUCE_CANDIDATES.get(name)
            setattr(norm_triton, rule, (lambda *a: 0) if name == "row_dot" else shipped_rule)
            if tiles is not None:
                norm_triton.norm_reduce_config = lambda M, K, N, c, _t=tiles: (
                    NormReduceConfig(_t[0], _t[1], shipped_cfg(M, K, N, c).block_n, _t[2]) if c else shipped_cfg(M, K, N, c))
            try:
                def norm():
                    return norm_triton.norm_terms(stored, A, B, 2.0, fifo, m)

                outs = [norm().clone() for _ in range(3)]
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                norm()
                scratch_mib = (torch.cuda.max_memory_allocated() - before) / 2**20  # one eager call's transient memory
                err = float((outs[0][3].double() - exact).norm() / exact.norm())
                repeat = all(torch.equal(outs[0], o) for o in outs[1:])
                us = triton.testing.do_bench_cudagraph(norm, rep=100, return_mode="median") * 1e3
            except Exception as error:  # noqa: BLE001 (a configuration that fails is a finding too)
                print(f"{name:20s} {d_out:6d} {d_in:6d} {r:4d} {fifo!s:>4s} failed: {type(error).__name__}: {str(error)[:80]}", flush=True)
                continue
            finally:
                norm_triton.norm_reduce_config = shipped_cfg
                setattr(norm_triton, rule, shipped_rule)
            tflops = 2 * d_out * d_in * r / (us * 1e-6) / 1e12
            print(f"{name:20s} {d_out:6d} {d_in:6d} {r:4d} {fifo!s:>4s} {err:9.1e} {str(repeat):>6s} {us:7.1f} {tflops:8.1f} {scratch_mib:7.1f} MiB", flush=True)
            out.add({"path": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "d_out": d_out, "d_in": d_in, "r": r, "fan_in_fan_out": fifo, "dtype": "bf16", "adapters": args.adapters, "rel_err_norm": f"{err:.2e}",
                     "repeatable": repeat, "median_us": round(us, 1), "tflops_wa": round(tflops, 1),
                     "scratch_mib": round(scratch_mib, 1)})
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
