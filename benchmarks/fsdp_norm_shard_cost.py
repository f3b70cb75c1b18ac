"""What computing the DoRA norm per row shard under FSDP2 could save, measured on one GPU.

Under FSDP2 every rank computes the DoRA norm of all d_out rows on the unsharded parameters in
every forward (what doracheck does now). The alternative: each rank computes the norm of its
own d_out/world rows from its shards (plus the all-gathered A, which is r × d_in) and the
ranks all-gather the d_out norms. This prints, per shape, the Triton norm's time on all rows
and on d_out/world rows: the first minus the second is the most the alternative can save per
layer and forward, before the cost of the extra collective.

Usage: python benchmarks/fsdp_norm_shard_cost.py [--world 2] [--shapes 4096x4096r64,...]
"""

from __future__ import annotations

import argparse

import torch

import doracheck
from doracheck.timing import quantile, time_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shapes", default="2048x2048r64,2048x5632r64,5632x2048r64,4096x4096r384,4096x14336r384")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fsdp_norm_shard_cost: needs a CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}, world {args.world}: Triton norm, median µs")
    for item in args.shapes.split(","):
        dims, r = item.split("r")
        d_in, d_out = (int(v) for v in dims.split("x"))
        gen = torch.Generator().manual_seed(0)
        W = torch.randn(d_out, d_in, generator=gen).to("cuda", torch.bfloat16)
        A = (torch.randn(int(r), d_in, generator=gen) / d_in**0.5).to("cuda", torch.bfloat16)
        B = (torch.randn(d_out, int(r), generator=gen) * 0.02).to("cuda", torch.bfloat16)
        rows = -(-d_out // args.world)
        full = quantile(time_ms(lambda: doracheck.factored_norm(W, A, B, 2.0), "cuda", 50), 0.5) * 1e3
        part = quantile(time_ms(lambda: doracheck.factored_norm(W[:rows], A, B[:rows], 2.0), "cuda", 50), 0.5) * 1e3
        print(f"{d_in}x{d_out} r{r}: all rows {full:8.1f}  {rows} rows {part:8.1f}  at most {full - part:8.1f} saved")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
