"""Where a compiled decode token goes (diagnostic): host, graph breaks, kernels.

Builds one implementation's model (``bench_model.build``), decodes greedily with a static KV
cache and the forward compiled with ``mode="reduce-overhead"`` as ``bench_step.py`` does, and
after two warm-up runs reports, over one more run of ``--new-tokens`` tokens: wall ms per
token, Dynamo's counters (graph breaks and their reasons, frames compiled) gathered over the
warm-up, and torch.profiler's tables by self CPU time and by CUDA time (ops and kernels), with
the CUDA kernel time per token. One implementation per process.

    python benchmarks/profile_decode.py --impl doracheck_bf16 [--new-tokens 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_model import build
from host_breakdown import cprofile_text
from llama_model import add_llama_args
from row_csv import print_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(ap)
    ap.add_argument("--impl", default="doracheck_bf16")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--eager", action="store_true", help="the dynamic cache and no compile (eager decode)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile one more generate (Python functions by own and "
                    "cumulative time; host-bound eager decode)")
    ap.add_argument("--graph-logs", action="store_true", help="log Inductor's CUDA-graph decisions, perf hints and "
                    "recompiles to stderr (compiled decode measured in two modes, about 288 and 358-410 tok/s: "
                    "a skipped or re-recorded graph would show there)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    if args.graph_logs:
        torch._logging.set_logs(cudagraphs=True, perf_hints=True, recompiles=True)
    model = build(args.impl, args, checkpointing=False).eval()

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    prompt = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1)).to(args.device)
    n = args.new_tokens
    kwargs: dict = {"do_sample": False, "max_new_tokens": n, "min_new_tokens": n}
    if not args.eager:
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    lines = [f"# profile_decode.py {args.impl} {'eager' if args.eager else 'compiled'}, {n} new tokens, "
             f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}"]
    with torch.no_grad():
        for _ in range(2):
            model.generate(prompt, **kwargs)
        sync()
        lines.append("dynamo counters after warm-up:")
        for group in ("graph_break", "stats", "inductor"):
            for key, value in sorted(counters[group].items(), key=lambda kv: -kv[1])[:12]:
                lines.append(f"  {group}: {str(key)[:150]} = {value}")
        t0 = time.perf_counter()
        model.generate(prompt, **kwargs)
        sync()
        lines.append(f"wall ms per token, unprofiled: {(time.perf_counter() - t0) * 1e3 / n:.3f}")
        if args.cprofile:
            lines.append(f"== cProfile of one generate of {n} tokens, by own time, then cumulative")
            for sort in ("tottime", "cumtime"):
                lines.append(cprofile_text(lambda: model.generate(prompt, **kwargs), 1, sync, sort, 45))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(prompt, **kwargs)
            sync()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu_us = sum(e.self_cpu_time_total for e in events)
    lines.append(f"profiled: CUDA self time {kernel_us / n:.1f} µs per token; CPU self time {cpu_us / n:.1f} µs per token")
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    lines.append(events.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70))
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
