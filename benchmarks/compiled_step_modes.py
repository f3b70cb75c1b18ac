"""Why the compiled step's time differs from process to process: host time against GPU time, per step.

The compiled step + fused AdamW of ``bench_step.py`` (``--mode compiled``) gave doracheck medians
of 53.3 and 64.4 ms for the same library in two processes on one host, each with a tight p20-p80,
and 58.4 ms with p20 52.9 / p80 60.6 in a third, while PEFT LoRA stayed at 47.3 (twentieth
session, ``compiled_step_twentieth_h200.csv``). This probe asks whether those modes are the host's:
for each of ``--steps`` steps it records the host's time to issue the step (``perf_counter`` from
the call until ``step()`` returns, before any sync) and the step's elapsed time (CUDA events around
it, synchronized after). A step whose host time is close to its elapsed time is host-bound: the GPU
waited for launches. The same again with Python's garbage collector off (``gc.disable()``), since a
collection inside a step costs host time that only a host-bound step shows. Printed per
implementation: medians and p20/p80 of both, the share of host-bound steps, and the CPU the process
ran on.

    python benchmarks/compiled_step_modes.py --impl doracheck_bf16 --steps 30 --csv out.csv
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
from bench_model import compiled_train_step
from llama_model import add_llama_args
from row_csv import RowWriter

from doracheck.timing import quantile


def _cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat), -1 where unknown."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def _steps(step, n: int) -> tuple[list[float], list[float]]:
    host, elapsed = [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        elapsed.append(start.elapsed_time(end))
    return host, elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--csv")
    ap.add_argument("--label", default="")
    add_llama_args(ap)
    ap.add_argument("--new-tokens", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    step = compiled_train_step(args.impl, args)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    out = RowWriter(args.csv, append=True) if args.csv else None
    for gc_on in (True, False):
        if not gc_on:
            gc.collect()
            gc.disable()
        host, elapsed = _steps(step, args.steps)
        gc.enable()
        bound = sum(h >= 0.9 * e for h, e in zip(host, elapsed)) / len(host)
        es, hs = sorted(elapsed), sorted(host)  # quantile() reads sorted lists
        row = {
            "impl": args.impl, "label": args.label, "gc": "on" if gc_on else "off", "steps": args.steps,
            "elapsed_ms": round(quantile(es, 0.5), 3), "elapsed_p20": round(quantile(es, 0.2), 3),
            "elapsed_p80": round(quantile(es, 0.8), 3), "host_ms": round(quantile(hs, 0.5), 3),
            "host_p20": round(quantile(hs, 0.2), 3), "host_p80": round(quantile(hs, 0.8), 3),
            "host_bound_share": round(bound, 2), "cpu": _cpu(), "affinity": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        }
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        print("  elapsed:", " ".join(f"{e:.1f}" for e in elapsed), flush=True)
        print("  host:   ", " ".join(f"{h:.1f}" for h in host), flush=True)
        if out is not None:
            out.add(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
