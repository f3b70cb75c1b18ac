"""Where the host time of one model training step goes, by Python function (diagnostic).

Builds the model of ``bench_model.build`` (eager, gradient checkpointing, fused AdamW: the
``eager_gc`` row of bench_step.py), runs three warm-up steps, then cProfiles ``--steps`` steps
(forward + backward + optimizer.step()) and prints, per step, the functions with the most own
time and doracheck's entry points with their inclusive time. cProfile slows Python down, so
read the shares, not the absolute figures; torch.profiler (profile_model_step.py) gives those.

    python benchmarks/host_cprofile_step.py --impl doracheck_bf16 [--steps 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from host_sample_step import add_step_args, make_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(ap)
    ap.set_defaults(steps=5, warmup=3)
    args = ap.parse_args()
    step = make_step(args)
    for _ in range(args.warmup):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    if args.device == "cuda":
        torch.cuda.synchronize()
    print(f"{args.impl}: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms per step under cProfile")
    for key, n in (("tottime", 40), ("cumtime", 60)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(n)
        print(f"== by {key} (totals over {args.steps} steps)\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
