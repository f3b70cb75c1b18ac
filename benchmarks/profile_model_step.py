"""Where a model training step's time goes: torch.profiler over steps with AdamW, per implementation.

For each implementation (a fresh process is not needed: one model at a time, freed after), the
``bench_step.py`` model and step (``--mode eager_gc``: checkpointing on; ``compiled``: the model
compiled, no checkpointing), profiled over ``--steps`` steps after warm-up. Printed per step:
host CPU (the profiler's self CPU total over all events), GPU kernel time, kernel launches,
the DoRA autograd Functions' self CPU per call, the top self-CPU ops and kernels by GPU time; for ``compiled`` also graph
breaks, recompiles and unique graphs (``torch._dynamo.utils.counters``). ``--trace DIR`` writes
a Chrome trace per implementation.

    python benchmarks/profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode eager_gc
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from bench_model import build, timed
from llama_model import add_llama_args
from torch.profiler import ProfilerActivity, profile


def _summary(prof, steps: int) -> dict:
    events = prof.key_averages()
    cpu_us = sum(e.self_cpu_time_total for e in events)
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")))
    dora = {e.key: {"calls_per_step": e.count / steps, "self_cpu_us_per_call": e.self_cpu_time_total / max(e.count, 1),
                    "cpu_total_us_per_call": e.cpu_time_total / max(e.count, 1)}
            for e in events if any(name in e.key for name in ("DoRA", "doracheck", "Planned"))}
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    top_gpu = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:80]
    return {"host_cpu_ms_per_step": cpu_us / steps / 1e3, "gpu_kernel_ms_per_step": gpu_us / steps / 1e3,
            "launches_per_step": launches / steps, "dora_functions": dora,
            "top_self_cpu": [(e.key, round(e.self_cpu_time_total / steps / 1e3, 3), e.count // steps) for e in top],
            "top_gpu": [(e.key, round(getattr(e, "self_device_time_total", 0) / steps / 1e3, 3), e.count // steps)
                        for e in top_gpu]}


def profile_impl(impl: str, args) -> dict:
    model = build(impl, args, checkpointing=args.mode == "eager_gc")
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    run = torch.compile(model) if args.mode == "compiled" else model
    model.train()

    def step():
        run(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from torch._dynamo.utils import counters

    counters.clear()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # unprofiled, to tell which mode this process is in
    step_median = timed(step, args.time_steps, args.device)[0] if args.time_steps > 0 else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    out = {"impl": impl, "mode": args.mode, **_summary(prof, args.steps)}
    if step_median is not None:
        out["step_ms_median"] = round(step_median, 3)
    if args.mode == "compiled":
        out["graph_breaks"] = dict(counters["graph_break"])
        out["recompiles"] = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        out["unique_graphs"] = counters["stats"].get("unique_graphs", 0)
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}/{impl}_{args.mode}.json")
    del model, run, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="peft_lora_bf16,peft_dora_bf16,doracheck_bf16")
    ap.add_argument("--mode", default="eager_gc", choices=["eager_gc", "compiled"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", help="a folder for Chrome traces")
    ap.add_argument("--json-out")
    ap.add_argument("--top-gpu", type=int, default=12, help="how many kernels to print by GPU time")
    ap.add_argument("--new-tokens", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-steps", type=int, default=0, help="first time this many unprofiled steps (CUDA events): "
                    "the row's step_ms_median, which mode a process is in (kernel_mode_diff.py)")
    add_llama_args(ap)
    args = ap.parse_args(argv)
    rows = []
    for impl in args.impls.split(","):
        row = profile_impl(impl, args)
        rows.append(row)
        timed_note = f", {row['step_ms_median']} ms a step unprofiled" if "step_ms_median" in row else ""
        print(f"== {impl} {args.mode}{timed_note}: host CPU {row['host_cpu_ms_per_step']:.1f} ms/step, GPU kernels "
              f"{row['gpu_kernel_ms_per_step']:.1f} ms/step, {row['launches_per_step']:.0f} launches/step", flush=True)
        for name, d in row["dora_functions"].items():
            print(f"   {name}: {d['calls_per_step']:.0f} calls/step, self CPU {d['self_cpu_us_per_call']:.0f} us/call, "
                  f"CPU total {d['cpu_total_us_per_call']:.0f} us/call")
        for name, ms, count in row["top_self_cpu"][:10]:
            print(f"   {ms:8.3f} ms  x{count:<5d} {name}")
        print("   by GPU time:")
        for name, ms, count in row["top_gpu"][:args.top_gpu]:
            print(f"   {ms:8.3f} ms  x{count:<5d} {name[:110]}")
        if "graph_breaks" in row:
            print(f"   graph breaks {row['graph_breaks']}, recompiles {row['recompiles']}, unique graphs {row['unique_graphs']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
