"""Which row-dot tiles compute the norm's cross term right on this GPU, and how fast (GPU probe).

The shipped tiles are 128×64 (``settings.rowdot_config``) because 128- and 256-wide tiles gave a
wrong cross term, different from call to call, on the H200 with triton 3.6 (2026-12-01); the
64-wide tiles run at 190-270 TFLOP/s at the model's shapes, against about 690 for cuBLAS's
W·Aᵀ, and are the largest kernel cost of doracheck's compiled step (thirteenth session). For
each candidate tile and shape: the relative error of Σ_j B⊙(W·Aᵀ) against fp64, whether three
calls agree bitwise, and the median GPU µs (triton's do_bench). A candidate is usable only where
it is right and repeatable at every shape and rank. Configurations are forced for the probe;
nothing here changes what ships.

    python benchmarks/rowdot_tile_probe.py [--csv out.csv]
"""

from __future__ import annotations

import argparse

import torch
import triton
from row_csv import RowWriter

from doracheck.kernels import norm_triton
from doracheck.kernels.settings import RowdotConfig

CANDIDATES = {  # name: (block_m, block_n, block_k, num_warps, num_stages, n_sub[, compute_base])
    "shipped": None,
    "128x128 w8": (128, 128, 64, 8, 3, 1),
    "128x128 w4": (128, 128, 64, 4, 3, 1),
    "64x128 w4": (64, 128, 64, 4, 3, 1),
    "128x256 w8": (128, 256, 64, 8, 3, 1),
    "256x64 w8": (256, 64, 64, 8, 3, 1),
    "64x128x3 w8": (64, 128, 64, 8, 3, 3),
    "128x64 k128 w8": (128, 64, 128, 8, 3, 1),
    # Fewer pipeline stages for wide tiles: whether the wrong, unrepeatable sums follow the
    # software pipeline (buffers still being filled while the epilogue reduces) or the tile.
    "128x128 w8 s1": (128, 128, 64, 8, 1, 1),
    "128x128 w8 s2": (128, 128, 64, 8, 2, 1),
    "64x128 w4 s1": (64, 128, 64, 4, 1, 1),
    "128x256 w8 s1": (128, 256, 64, 8, 1, 1),
    # Without the base term (Σ_k W², from the same X tile in registers): whether the wrong sums
    # follow X being both a dot operand and a register operand of the fp32 sum of squares.
    "128x128 w8 nobase": (128, 128, 64, 8, 3, 1, False),
    "128x256 w8 nobase": (128, 256, 64, 8, 3, 1, False),
    "64x128 w4 nobase": (64, 128, 64, 4, 3, 1, False),
    "shipped nobase": (128, 64, 64, 8, 3, 1, False),
    # cuBLAS instead: U = W·Aᵀ with fp32 output (aten::mm.dtype, reduced-precision reductions
    # off), then Σ_j B⊙U in torch; and the base term Σ_k W² alone (linalg.vector_norm, fp32).
    "cublas U": "cublas_u",
    "cublas U+reduce": "cublas_cross",
    "base alone": "base",
    "whole norm": "norm",  # the shipped norm_terms (Gram, two row-dot launches, finish), for scale
}
SHAPES = [(14336, 4096, 384), (4096, 14336, 384), (4096, 4096, 384), (4096, 4096, 128), (4096, 4096, 16)]  # d_out, d_in, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    ap.add_argument("--only", help="comma-separated candidate names (default: all)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # doracheck's GEMM policy
    names = set(args.only.split(",")) if args.only else set(CANDIDATES)
    shipped = norm_triton.rowdot_config
    out = RowWriter(args.csv) if args.csv else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'config':18s} {'d_out':>6s} {'d_in':>6s} {'r':>4s} {'rel err':>9s} {'repeat':>6s} {'µs':>7s} {'TFLOP/s':>8s}")
    for d_out, d_in, r in SHAPES:
        W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / d_in**0.5).bfloat16()
        A = (torch.randn(r, d_in, device="cuda", generator=gen) / d_in**0.5).bfloat16()
        B = (torch.randn(d_out, r, device="cuda", generator=gen) * 0.05).bfloat16()
        exact = ((W.double() @ A.double().t()) * B.double()).sum(1)
        for name, tile in CANDIDATES.items():
            if name not in names:
                continue
            if isinstance(tile, tuple) and tile[5] > 1 and r <= tile[1] * (tile[5] - 1):
                continue  # sub-tiles need N past (n_sub - 1) tiles
            if isinstance(tile, tuple):
                norm_triton.rowdot_config = lambda *a, _t=tile[:6]: RowdotConfig(*_t)
            with_base = not (isinstance(tile, tuple) and len(tile) > 6 and not tile[6])
            try:
                def cross():
                    if tile == "cublas_u":
                        return torch.mm(W, A.t(), out_dtype=torch.float32)[:, 0]
                    if tile == "cublas_cross":
                        return (torch.mm(W, A.t(), out_dtype=torch.float32) * B).sum(1)
                    if tile == "norm":
                        return norm_triton.norm_terms(W, A, B, 2.0, False)[3]
                    if tile == "base":
                        return torch.linalg.vector_norm(W, dim=1, dtype=torch.float32)
                    return norm_triton.rowdot_triton(W, (W.stride(0), W.stride(1)), A, B, compute_base=with_base)[0]

                outs = [cross().clone() for _ in range(3)]
                torch.cuda.synchronize()
                refs = {"cublas_u": lambda: (W.double() @ A.double().t())[:, 0], "base": lambda: W.double().norm(dim=1),
                        "norm": lambda: (W.double() + 2.0 * B.double() @ A.double()).norm(dim=1)}
                ref = refs[tile]() if tile in refs else exact
                err = float((outs[0].double() - ref).norm() / ref.norm())
                repeat = all(torch.equal(outs[0], o) for o in outs[1:])
                us = triton.testing.do_bench(cross, warmup=10, rep=60) * 1e3
            except Exception as error:  # noqa: BLE001 (a tile that does not compile is a finding too)
                print(f"{name:18s} {d_out:6d} {d_in:6d} {r:4d} failed: {type(error).__name__}: {str(error)[:80]}", flush=True)
                continue
            finally:
                norm_triton.rowdot_config = shipped
            tflops = 2 * d_out * d_in * r / (us * 1e-6) / 1e12
            print(f"{name:18s} {d_out:6d} {d_in:6d} {r:4d} {err:9.1e} {str(repeat):>6s} {us:7.1f} {tflops:8.1f}", flush=True)
            if out:
                out.add({"config": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "triton": triton.__version__, "d_out": d_out, "d_in": d_in, "r": r, "dtype": "bf16",
                         "rel_err": f"{err:.2e}", "repeatable": repeat, "median_us": round(us, 1), "tflops": round(tflops, 1)})
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
