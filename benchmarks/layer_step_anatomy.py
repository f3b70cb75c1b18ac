"""Where one layer's training step goes (issue 17; diagnostic, GPU): host µs per phase, implicit
syncs, and torch.profiler's ops, for the ``bench_layer.py`` layers and step.

The layer step of ``bench_layer.py --modes step`` (forward, ``backward(dy)``, fused AdamW
``optimizer.step()``, ``zero_grad``) at 8192², r 384, for T = 1 and 4096. Per implementation:

- host µs of each phase, timestamps taken without synchronising inside a batch of ``--steps``
  steps (median over 5 batches): what the CPU spends issuing the phase;
- wall µs per step over the batch (CUDA events; the device drained between batches): the larger
  of the host's and the GPU's path, as ``bench_layer`` measures it (without its L2 flush);
- GPU kernel µs per step and the top ops by self CPU (torch.profiler over ``--steps`` steps);
- whether a step synchronises the host with the device anywhere (``torch.cuda.set_sync_debug_mode``).

    python benchmarks/layer_step_anatomy.py [--tokens 1,4096] [--impls linear,doracheck_bf16] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings

import torch
from bench_layer import build, trainable
from torch.profiler import ProfilerActivity, profile


def make_step(model, x, dy):
    params = trainable(model)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True) if params else None
    xg = x.detach().requires_grad_(True)
    stamps = [0.0] * 5

    def step():
        stamps[0] = time.perf_counter()
        y = model(xg)
        stamps[1] = time.perf_counter()
        y.backward(dy)
        stamps[2] = time.perf_counter()
        if opt is not None:
            opt.step()
        stamps[3] = time.perf_counter()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        xg.grad = None
        stamps[4] = time.perf_counter()

    return step, stamps


def phases(step, stamps, steps: int) -> dict:
    names = ("forward", "backward", "optimizer.step", "zero_grad")
    per_batch = {k: [] for k in (*names, "host_total", "wall")}
    for _ in range(5):
        torch.cuda.synchronize()
        sums = [0.0] * 4
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
            for i in range(4):
                sums[i] += stamps[i + 1] - stamps[i]
        host = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        for name, s in zip(names, sums):
            per_batch[name].append(s / steps * 1e6)
        per_batch["host_total"].append(host / steps * 1e6)
        per_batch["wall"].append(start.elapsed_time(end) / steps * 1e3)
    return {k: statistics.median(v) for k, v in per_batch.items()}


def syncs(step) -> list[str]:
    """The warnings torch raises for each host-device synchronisation in one step."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's one-time notice that the debug mode is a prototype also says "synchronization": not a sync
    # (the sixteenth session's file counts it once, for the first implementation run)
    return [str(w.message).splitlines()[0][:120] for w in caught
            if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message).lower()]


def profiled(step, steps: int, top: int) -> str:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events) / steps
    # key_averages lists a kernel and the ops and ranges that launched it, each with that device
    # time: the sum counts kernels more than once (an upper bound, not the GPU's busy time).
    gpu = sum(getattr(e, "self_device_time_total", 0) for e in events) / steps
    kernels = sorted((e for e in events if getattr(e, "self_device_time_total", 0) > 0),
                     key=lambda e: -e.self_device_time_total)[:12]
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    lines = [f"  profiler: self CPU {cpu:.0f} µs per step (inflated by the profiler), device time summed over events "
             f"{gpu:.0f} µs per step (kernels counted with the ops that launch them: an upper bound)",
             "  top ops by self CPU (µs per step, calls per step):"]
    lines += [f"    {e.self_cpu_time_total / steps:8.1f}  {e.count / steps:5.1f}  {e.key[:90]}" for e in ops]
    lines.append("  events by device time, kernels and the ops launching them both listed (µs per step, calls per step):")
    lines += [f"    {e.self_device_time_total / steps:8.1f}  {e.count / steps:5.1f}  {e.key[:90]}" for e in kernels]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4096")
    ap.add_argument("--impls", default="linear,doracheck_bf16,doracheck_fp32")
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_step_anatomy: needs a CUDA device", file=sys.stderr)
        return 2
    out = open(args.out, "w") if args.out else None

    def emit(text: str) -> None:
        print(text, flush=True)
        if out:
            out.write(text + "\n")

    emit(f"# layer_step_anatomy.py, {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.d}², r {args.r}, "
         "bf16 x; µs per step; host phases without synchronising inside a batch, medians of 5 batches")
    table = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, args.d, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, args.d, device="cuda", dtype=torch.bfloat16)
        for impl in args.impls.split(","):
            model = build(impl, args.d, args.d, args.r)
            model.train()
            step, stamps = make_step(model, x, dy)
            for _ in range(20):
                step()
            p = phases(step, stamps, args.steps)
            found = syncs(step)
            emit(f"== {impl} T {T}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()))
            emit(f"  host-device syncs in one step: {len(found)}" + "".join(f"\n    {s}" for s in found))
            emit(profiled(step, min(args.steps, 20), args.top))
            table.append((impl, T, p))
            del model, step
            gc.collect()
            torch.cuda.empty_cache()
    emit("impl              T     forward  backward  opt.step  zero_grad  host_total  wall  (µs per step)")
    for impl, T, p in table:
        emit(f"{impl:16s} {T:5d}  {p['forward']:8.1f} {p['backward']:8.1f} {p['optimizer.step']:8.1f} {p['zero_grad']:9.1f}"
             f" {p['host_total']:10.1f} {p['wall']:6.1f}")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
