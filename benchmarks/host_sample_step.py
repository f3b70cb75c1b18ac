"""The model training step (eager, gradient checkpointing, fused AdamW) run for ``--steps``
steps, for a sampling profiler (py-spy) to record: no profiler hooks inside the loop, so the
host time is what a user's loop pays (cProfile and torch.profiler inflate every Python call).

    py-spy record --nonblocking --format raw --rate 250 -o stacks.txt -- python benchmarks/host_sample_step.py --impl doracheck_bf16
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_model import build
from llama_model import add_llama_args


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The arguments of the model step (``make_step``), shared with ``host_cprofile_step.py``."""
    ap.add_argument("--impl", default="doracheck_bf16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=0)
    add_llama_args(ap)


def make_step(args):
    """The model of ``bench_model.build`` (eager, gradient checkpointing) and one training step
    of it: forward, backward, AdamW ``step()`` (fused on CUDA, foreach elsewhere), ``zero_grad``."""
    model = build(args.impl, args, checkpointing=True)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    fused = args.device == "cuda"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=fused, foreach=not fused)
    model.train()

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(ap)
    args = ap.parse_args()
    step = make_step(args)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    c1 = time.process_time()
    sync()
    t1 = time.perf_counter()
    print(f"{args.impl}: {(t1 - t0) / args.steps * 1e3:.1f} ms per step, host CPU {(c1 - c0) / args.steps * 1e3:.1f} ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
