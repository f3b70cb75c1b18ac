"""Host µs of one small bf16 GEMM by the state of cuBLAS's reduced-precision-reduction flags
(diagnostic, issue 17): GEMMs inside doracheck's calls cost 2-6x their isolated host time in a
training loop (function_gap_probe.py), and ``our_numerics`` switches those flags at every call.

    python benchmarks/gemm_flag_probe.py [--tokens 16 --d 4096 --r 384] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from host_breakdown import host_us
from row_csv import print_report

from doracheck.numerics import our_numerics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(args.tokens, args.d, device=dev, dtype=dt)
    W = torch.randn(args.d, args.d, device=dev, dtype=dt)
    A = torch.randn(args.r, args.d, device=dev, dtype=dt)
    sync = torch.cuda.synchronize
    matmul = torch.backends.cuda.matmul

    def mm():
        return torch.mm(x, A.t())

    def inside():
        with our_numerics("cuda"):
            return torch.mm(x, A.t())

    def numerics_only():
        with our_numerics("cuda"):
            pass

    def alternating():  # what a layer between PEFT's own GEMMs does: one GEMM each way
        torch.mm(x, W.t())
        with our_numerics("cuda"):
            return torch.mm(x, A.t())

    def both_default():
        torch.mm(x, W.t())
        return torch.mm(x, A.t())

    rows = [("mm, flags as torch sets them", mm), ("our_numerics enter + exit alone", numerics_only),
            ("mm inside our_numerics (enter, mm, exit)", inside), ("x·Wᵀ then x·Aᵀ, flags default", both_default),
            ("x·Wᵀ, then x·Aᵀ inside our_numerics", alternating)]
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    rows_off = [("mm, flags off for the whole loop", mm), ("x·Wᵀ then x·Aᵀ, flags off throughout", both_default)]
    lines = [f"# gemm_flag_probe.py, {torch.cuda.get_device_name()}, torch {torch.__version__}; T {args.tokens}, "
             f"d {args.d}, r {args.r}, bf16; host µs per call, median of 5 batches of {args.n}"]
    for name, fn in rows_off:
        lines.append(f"{name:48s} {host_us(fn, args.n, sync):9.1f}")
        print(lines[-1], flush=True)
    matmul.allow_bf16_reduced_precision_reduction = saved
    for name, fn in rows:
        lines.append(f"{name:48s} {host_us(fn, args.n, sync):9.1f}")
        print(lines[-1], flush=True)
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
