"""The fused up-projection compose at small token counts (decode, T <= 64): tile sweep (diagnostic).

At T = 1 the compose is a GEMV over B (d_out × r): its floor is reading B once (6.3 MB at
8192 × 384 in bf16, about 1.5 µs at 4.2 TB/s). The training tile (64 × 128, 4 warps) gives
d_out / 128 programs, 32 at d_out = 4096, too few to keep the H200's memory busy (12.0 µs at
d_out = 8192, benchmarks/README.md). This times, from CUDA-graph replays (no host in the loop,
which is how compiled decode runs it), each candidate tile at the decoder's shapes against the
current choice and against what LoRA runs there (cuBLAS xa·Bᵀ and a pointwise add), and checks
every candidate's output against the fp64 value (max error in bf16 ulps of the output).

    python benchmarks/compose_small_t.py [--csv FILE]
"""

from __future__ import annotations

import argparse

import torch
import triton
from row_csv import RowWriter

from doracheck.kernels import compose_triton as ct
from doracheck.kernels import settings

# (block_m, block_n, block_k, warps, stages); block_m 16 is tl.dot's least.
CANDIDATES = [(16, n, k, w, st) for n in (32, 64, 128) for k in (64, 128) for w in (2, 4) for st in (2, 3)]
SHAPES = [(T, d_out) for T in (1, 16, 64) for d_out in (1024, 4096, 14336)]
R = 384


def gpu_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def ulp_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """Max |y - exact| in units of the bf16 spacing at |exact| (2^(e-7))."""
    spacing = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1e-30))[1] - 8)
    return float(((y.double() - exact).abs() / spacing).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "r": R, "dtype": "bf16"}
    writer = RowWriter(args.csv)
    print(gpu, torch.__version__, triton.__version__, flush=True)
    torch.manual_seed(0)
    default = ct.compose_config
    summary = []
    for T, d_out in SHAPES:
        base = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
        xa = torch.randn(T, R, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(d_out, R, device="cuda", dtype=torch.bfloat16) / 20
        g = torch.rand(d_out, device="cuda") + 0.5
        out = torch.empty_like(base)
        exact = g.double() * (base.double() + 2.0 * (xa.double() @ B.double().t()))
        floor_us = (d_out * R * 2 + 2 * T * d_out * 2) / 4.2e6  # read B, base; write y, at 4.2 TB/s
        rows = {}

        def record(name, fn, err):
            us = gpu_us(fn)
            rows[name] = us
            row = {**meta, "T": T, "d_out": d_out, "config": name, "gpu_us": round(us, 2), "floor_us": round(floor_us, 2),
                   "max_ulp": round(err, 3)}
            writer.add(row)
            print(f"T {T:3d} d_out {d_out:6d} {name:34s} {us:8.2f} µs  (floor {floor_us:5.2f})  err {err:.2f} ulp", flush=True)

        def run_current():
            return ct.lora_up_compose_triton(base, xa, B, g, 2.0, None, out=out)

        run_current()
        record(f"current {tuple(default(T, d_out, R))}", run_current, ulp_error(out, exact))
        lora = torch.empty_like(base)

        def run_lora():  # what PEFT's LoRA runs here: result + (xa·Bᵀ)·s (two kernels)
            return torch.add(base, xa @ B.t(), alpha=2.0, out=lora)

        record("cuBLAS xa·Bᵀ + add (LoRA)", run_lora, float("nan"))
        for bm, bn, bk, warps, stages in CANDIDATES:
            cfg = settings.ComposeConfig(bm, bn, bk, 8, warps, stages)
            ct.compose_config = lambda *a_, _c=cfg: _c
            try:
                run_current()
                err = ulp_error(out, exact)
                record(str(tuple(cfg)), run_current, err)
            except Exception as exc:  # noqa: BLE001 (out of resources for a config)
                print("  ", cfg, type(exc).__name__, flush=True)
            finally:
                ct.compose_config = default
        cands = {k: v for k, v in rows.items() if k.startswith("(")}
        best = min(cands, key=cands.get)
        summary.append((T, d_out, rows[next(iter(rows))], rows["cuBLAS xa·Bᵀ + add (LoRA)"], best, cands[best]))
    print("\nT  d_out   current µs  LoRA µs  best candidate µs")
    for T, d_out, cur, lora_us, best, best_us in summary:
        print(f"{T:3d} {d_out:6d} {cur:10.2f} {lora_us:8.2f}  {best} {best_us:.2f}")
    writer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
