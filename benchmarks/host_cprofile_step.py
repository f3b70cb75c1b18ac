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
from bench_model import build
from llama_model import add_llama_args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="doracheck_bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=0)
    add_llama_args(ap)
    args = ap.parse_args()
    model = build(args.impl, args, checkpointing=True)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    model.train()

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"{args.impl}: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms per step under cProfile")
    for key, n in (("tottime", 40), ("cumtime", 60)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(n)
        print(f"== by {key} (totals over {args.steps} steps)\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
