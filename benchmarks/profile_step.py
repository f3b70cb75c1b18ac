"""Where a training step's time goes: torch.profiler over steps with AdamW, per implementation.

Model (default): the ``llama_model.py`` model and step of ``model_step.py`` (``--mode eager_gc``:
gradient checkpointing on; ``compiled``: ``torch.compile(model)``, no checkpointing), step +
fused AdamW. ``--layer D_IN,D_OUT,R,T``: one layer of ``layer.py`` instead (its ``step`` mode;
implementations from layer.py, e.g. ``linear,peft_dora_bf16,doracheck_bf16``).
Per implementation: ``--time-steps`` unprofiled steps timed first (CUDA events: median, p10/p90),
then ``--steps`` steps under the profiler. Printed per step: host CPU (the profiler's self CPU
over all events), GPU kernel time, kernel launches, the top ops by self CPU and the top kernels
by GPU time; for ``compiled`` also graph breaks and recompiles. ``--trace DIR`` writes a Chrome
trace per implementation, ``--json-out FILE`` the whole summary.

    python benchmarks/profile_step.py --impls lora,doracheck --mode eager_gc
    python benchmarks/profile_step.py --layer 8192,8192,384,4096 --impls linear,doracheck_bf16
    python benchmarks/profile_step.py --smoke
"""

from __future__ import annotations

import argparse
import os

import harness
import llama_model as lm
import torch
from torch.profiler import ProfilerActivity, profile

FIELDS = ["mode", "host_cpu_ms", "gpu_kernel_ms", "launches", "graph_breaks", "recompiles"]
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def summary(prof, steps: int, top: int) -> dict:
    events = prof.key_averages()
    cpu_us = sum(e.self_cpu_time_total for e in events)
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    launches = sum(e.count for e in events if e.key.startswith(LAUNCHES))
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_gpu = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:top]
    return {"host_cpu_ms": cpu_us / steps / 1e3, "gpu_kernel_ms": gpu_us / steps / 1e3, "launches": launches / steps,
            "top_self_cpu": [(e.key, round(e.self_cpu_time_total / steps / 1e3, 3), e.count // steps) for e in by_cpu],
            "top_gpu": [(e.key, round(getattr(e, "self_device_time_total", 0) / steps / 1e3, 3), e.count // steps)
                        for e in by_gpu]}


def make_step(impl: str, args):
    """(step callable, shape label) for ``impl``: the model's or, with ``--layer``, one layer's."""
    if args.layer:
        import layer

        d_in, d_out, r, T = (int(v) for v in args.layer.split(","))
        model = layer.build(impl, d_in, d_out, r, args.device)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(T, d_in, generator=gen).to(args.device, torch.bfloat16)
        dy = torch.randn(T, d_out, generator=gen).to(args.device, torch.bfloat16)
        return layer.call(model, "step", x, dy), f"{d_in}x{d_out}r{r} T{T}"
    model = lm.build(impl, args, checkpointing=args.mode == "eager_gc")
    return lm.train_step(model, lm.token_ids(args, args.seq), compiled=args.mode == "compiled",
                         backend=args.backend), lm.shape_label(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="lora,doracheck,peft_dora")
    ap.add_argument("--mode", default="eager_gc", choices=["eager_gc", "compiled"])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--layer", help="D_IN,D_OUT,R,T: profile one layer's step instead of the model's")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--time-steps", type=int, default=10, help="unprofiled steps timed first")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--trace", help="a folder for Chrome traces")
    ap.add_argument("--json-out")
    lm.add_llama_args(ap)
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        lm.apply_smoke(args)
        args.steps, args.time_steps, args.top = 1, 2, 5
        args.layer = args.layer and "64,48,8,16"
        args.backend = "aot_eager"
    device = harness.resolve_device(args, "profile_step")
    results = harness.Results("profile_step", FIELDS, args.csv, args.smoke)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    report = []
    for impl in args.impls.split(","):
        name = lm.SHORT.get(impl, impl) if args.layer else lm.impl_name(impl)
        step, shape = make_step(name, args)
        from torch._dynamo.utils import counters

        counters.clear()
        stats = harness.time_fn(step, reps=args.time_steps, warmup=3, device=device)
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            harness.sync(device)
        out = {"impl": name, "mode": args.mode, "shape": shape, "step_ms": stats.row(3), **summary(prof, args.steps, args.top)}
        if args.mode == "compiled" and not args.layer:
            out["graph_breaks"] = sum(counters["graph_break"].values())
            out["recompiles"] = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        report.append(out)
        results.add({"case": "layer_step" if args.layer else f"model_step_{args.mode}", "mode": args.mode, "impl": name,
                     "shape": shape, "dtype": "bf16", "unit": "ms", **stats.row(3), "rounds": 1,
                     "host_cpu_ms": round(out["host_cpu_ms"], 3), "gpu_kernel_ms": round(out["gpu_kernel_ms"], 3),
                     "launches": round(out["launches"]), "graph_breaks": out.get("graph_breaks", ""),
                     "recompiles": out.get("recompiles", "")})
        print(f"== {name} {args.mode} {shape}: {stats} ms a step unprofiled; host CPU {out['host_cpu_ms']:.1f} ms/step, "
              f"GPU kernels {out['gpu_kernel_ms']:.1f} ms/step, {out['launches']:.0f} launches/step", flush=True)
        print("   by self CPU:")
        for key, ms, count in out["top_self_cpu"]:
            print(f"   {ms:8.3f} ms  x{count:<5d} {key[:110]}")
        print("   by GPU time:")
        for key, ms, count in out["top_gpu"]:
            print(f"   {ms:8.3f} ms  x{count:<5d} {key[:110]}")
        if "graph_breaks" in out:
            print(f"   graph breaks {out['graph_breaks']}, recompiles {out['recompiles']}")
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(f"{args.trace}/{name}_{args.mode}.json")
        del step, prof
        harness.free_memory()
    if args.json_out:
        harness.write_json(args.json_out, report)
    print(harness.table(report, ["impl", "mode", "shape", "host_cpu_ms", "gpu_kernel_ms", "launches"]))
    print(f"rows appended to {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
