"""The norm's row-dot kernel at the model's shapes: GPU µs per launch and a digest of its output
(GPU). Run once with this checkout and once with an earlier library (``.old/``): equal digests
mean bitwise the same partials; the times compare the two libraries' kernels (written for the
thirteenth session's column-tiles-first launch order, which gave no measurable gain and was
withdrawn: benchmarks/results/rowdot_order_thirteenth_h200.txt). ``--splits`` also times
the cross-term launch with K split that many ways (the configuration forced; a probe, not
shipped). r = 384, bf16 W, A, B; W, A, B random (never zeros); median of triton's do_bench.

    python benchmarks/rowdot_order_probe.py [--csv out.csv] [--splits 1,2,4]
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import triton
from row_csv import RowWriter

from doracheck.kernels import norm_triton

SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096), (8192, 8192)]  # (d_out, d_in)


def digest(*ts) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--splits", default="1")
    ap.add_argument("--csv")
    ap.add_argument("--label", default="new")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = RowWriter(args.csv) if args.csv else None
    shipped = norm_triton.rowdot_config
    print(f"{'label':6s} {'d_out':>6s} {'d_in':>6s} {'split':>5s} {'cross µs':>9s} {'norm µs':>8s} {'TFLOP/s':>8s}  digest")
    for d_out, d_in in SHAPES:
        W = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16, generator=gen) * d_in**-0.5
        A = torch.randn(args.r, d_in, device="cuda", dtype=torch.bfloat16, generator=gen) * d_in**-0.5
        B = torch.randn(d_out, args.r, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for split in (int(s) for s in args.splits.split(",")):
            if split != 1:
                norm_triton.rowdot_config = lambda *a, _s=split: shipped(*a)._replace(split_k=_s)
            try:
                def cross():
                    return norm_triton.rowdot_parts(W, W.stride(), A, B, compute_base=True)

                part, sq = cross()
                terms = norm_triton.norm_terms(W, A, B, 2.0, False)
                torch.cuda.synchronize()
                d = digest(part, sq, terms) if split == 1 else digest(terms)
                t_cross = triton.testing.do_bench(cross, warmup=25, rep=200)
                t_norm = triton.testing.do_bench(lambda: norm_triton.norm_terms(W, A, B, 2.0, False), warmup=25, rep=200)
            finally:
                norm_triton.rowdot_config = shipped
            tflops = 2 * d_out * d_in * args.r / (t_cross * 1e-3) / 1e12
            print(f"{args.label:6s} {d_out:6d} {d_in:6d} {split:5d} {t_cross * 1e3:9.1f} {t_norm * 1e3:8.1f} {tflops:8.1f}  {d}", flush=True)
            if out:
                out.add({"label": args.label, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "triton": triton.__version__, "d_out": d_out, "d_in": d_in, "r": args.r, "dtype": "bf16",
                         "split_k": split, "cross_us": round(t_cross * 1e3, 2), "norm_us": round(t_norm * 1e3, 2),
                         "cross_tflops": round(tflops, 1), "digest": d})
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
