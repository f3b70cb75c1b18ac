"""Where the GPU waits for the host in a model training step (diagnostic).

The eager step + fused AdamW (gradient checkpointing) of ``bench_model.build`` is host-bound for
doracheck: its step time follows the host's speed while its GPU kernel time is within 10% of
PEFT LoRA's. This finds the GPU's idle time and what the host was doing then. Per
implementation (one model at a time, in one process), after warm-up steps, ``--steps`` steps
run under torch.profiler (CPU and CUDA activities) with the phases marked (``forward``,
``backward``, ``optimizer``); the Chrome trace is then read back:

- GPU busy time is the union of kernel, memcpy and memset intervals; every gap between them
  longer than ``--min-gap-us`` is an idle gap;
- the kernel that ends a gap was launched by a runtime call (``correlation``); when that call
  came after the gap began, the GPU was waiting for the host, and the gap is charged to the
  chain of CPU ops enclosing that launch on its thread (outermost phase, then the outermost
  doracheck/PEFT-visible op, then the innermost op);
- gaps whose launch came before the gap began (the GPU idled for another reason: a sync, a
  dependency) are counted apart.

Printed per implementation: step wall time (GPU timeline), GPU busy, idle, idle by phase, and
the op chains that account for the most idle time. ``--json-out`` keeps all of it.

    python benchmarks/step_gaps.py --impls peft_lora_bf16,doracheck_bf16 --steps 2
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import tempfile
from collections import defaultdict

import torch
from bench_model import build
from llama_model import add_llama_args
from torch.profiler import ProfilerActivity, profile, record_function

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_PHASES = ("forward", "backward", "optimizer")


def _load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _busy_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


class _Stacks:
    """The CPU ops (and annotations) of each thread, to find those enclosing a timestamp. Events
    of one thread nest, so each gets its parent in one sweep; the ops enclosing t are the last
    event starting before t and its ancestors, those that have not ended by t."""

    def __init__(self, events: list[dict]):
        by_tid: dict = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
                by_tid[e["tid"]].append((float(e["ts"]), -float(e.get("dur", 0)), e["name"]))
        self.ops: dict = {}
        self.starts: dict = {}
        self.parents: dict = {}
        for tid, raw in by_tid.items():
            ops = [(s, s - neg, n) for s, neg, n in sorted(raw)]  # outer first at equal starts
            parents, stack = [], []
            for i, (s, _e, _) in enumerate(ops):
                while stack and ops[stack[-1]][1] < s:
                    stack.pop()
                parents.append(stack[-1] if stack else -1)
                stack.append(i)
            self.ops[tid], self.parents[tid], self.starts[tid] = ops, parents, [s for s, _, _ in ops]

    def enclosing(self, tid, t: float) -> list[str]:
        """Names of the events on ``tid`` that contain ``t``, outermost first."""
        ops, parents = self.ops.get(tid, []), self.parents.get(tid, [])
        j = bisect.bisect_right(self.starts.get(tid, []), t) - 1
        chain = []
        while j >= 0:
            if ops[j][1] >= t:
                chain.append(ops[j][2])
            j = parents[j]
        return chain[::-1]


def _phase_at(phases: list[tuple[float, float, str]], t: float) -> str:
    for s, e, n in phases:
        if s <= t <= e:
            return n
    return "other"


def _charge(chain: list[str]) -> str:
    """A short label for an op chain: the outermost op that names a DoRA Function or an
    optimizer, then the innermost op; else the outermost and innermost ops."""
    ours = next((n for n in chain if "DoRA" in n or "Optimizer" in n or "AdamW" in n), None)
    ops = [n for n in chain if n not in _PHASES and not n.startswith("ProfilerStep")]
    inner = ops[-1] if ops else "(no op)"
    if ours is not None:
        return f"{ours} > {inner}"
    outer = ops[0] if ops else "(no op)"
    return outer if outer == inner else f"{outer} > {inner}"


def analyse(events: list[dict], min_gap_us: float, steps: int) -> dict:
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("args", {}).get("correlation"))
           for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    gpu.sort()
    launches = {e.get("args", {}).get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation")}
    busy = _busy_union([(s, e) for s, e, _ in gpu])
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    busy_us = sum(b - a for a, b in busy)
    stacks = _Stacks(events)
    phases = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in _PHASES)
    by_label: dict = defaultdict(float)
    by_phase: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    not_host = 0.0
    # the kernel that ends each gap: the first GPU event starting at the gap's end
    starts = [s for s, _, _ in gpu]
    for (_, end_prev), (start_next, _) in zip(busy, busy[1:]):
        gap = start_next - end_prev
        if gap < min_gap_us:
            continue
        i = bisect.bisect_left(starts, start_next)
        corr = gpu[i][2] if i < len(gpu) else None
        launch = launches.get(corr)
        if launch is None or float(launch["ts"]) < end_prev:
            not_host += gap
            continue
        t = float(launch["ts"])
        phase, label = _phase_at(phases, t), _charge(stacks.enclosing(launch["tid"], t))
        # the launch call's own name (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch) says what kind of launch
        by_label[(phase, label, launch["name"])] += gap
        by_phase[phase] += gap
        counts[(phase, label, launch["name"])] += 1
    top = sorted(by_label.items(), key=lambda kv: -kv[1])[:25]
    return {
        "span_ms_per_step": span / steps / 1e3, "gpu_busy_ms_per_step": busy_us / steps / 1e3,
        "idle_ms_per_step": (span - busy_us) / steps / 1e3,
        "host_wait_idle_ms_per_step": sum(by_phase.values()) / steps / 1e3,
        "other_idle_ms_per_step": not_host / steps / 1e3,
        "idle_by_phase_ms_per_step": {k: v / steps / 1e3 for k, v in by_phase.items()},
        "top": [{"phase": p, "where": w, "launch": n, "idle_ms_per_step": v / steps / 1e3,
                 "gaps_per_step": counts[(p, w, n)] / steps} for (p, w, n), v in top],
    }


def run_impl(impl: str, args) -> dict:
    model = build(impl, args, checkpointing=True)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    model.train()

    def step():
        with record_function("forward"):
            loss = model(ids, labels=ids).loss
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        result = {"impl": impl, **analyse(_load(path), args.min_gap_us, args.steps)}
    del model, opt, prof
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="peft_lora_bf16,doracheck_bf16")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-gap-us", type=float, default=2.0)
    ap.add_argument("--json-out")
    ap.add_argument("--new-tokens", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    add_llama_args(ap)
    args = ap.parse_args(argv)
    rows = []
    for impl in args.impls.split(","):
        row = run_impl(impl, args)
        rows.append(row)
        print(f"== {impl}: GPU timeline {row['span_ms_per_step']:.1f} ms/step, busy {row['gpu_busy_ms_per_step']:.1f}, "
              f"idle {row['idle_ms_per_step']:.1f} (waiting for the host {row['host_wait_idle_ms_per_step']:.1f}, "
              f"other {row['other_idle_ms_per_step']:.1f}); by phase "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(row["idle_by_phase_ms_per_step"].items())), flush=True)
        for t in row["top"][:18]:
            print(f"   {t['idle_ms_per_step']:7.2f} ms  {t['gaps_per_step']:6.1f} gaps  {t['phase']:9s} {t['launch'][:18]:18s} {t['where'][:110]}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
