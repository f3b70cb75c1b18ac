"""Where the compiled step's first call goes: cold caches, one implementation per process.

Issue 17 asks for a compile time within 1.5x of PEFT DoRA's. ``bench_step.py --mode compiled``
records the first call, but its rows ran one after another on one machine, so a later row
found the Triton and Inductor caches warm from an earlier one (the sixteenth pass measured the
library before it at 43.6 s after this one at 61.5 s: the same kernels, cached). Here each
process gets empty cache directories (set before torch is imported), then runs the first
compiled training step (forward, backward, fused AdamW ``step()``) of ``bench_model.build``'s
model, and prints:

- the first call's wall seconds, and the second call's (a recompile shows there), and a rough
  warm step (median of 5 wall-clock steps; ``bench_step.py`` is the benchmark);
- ``torch._dynamo.utils.compile_times()`` (dynamo, AOT and Inductor phases, seconds);
- the number of graphs, graph breaks and recompiles (``torch._dynamo.utils.counters``);
- with ``--cprofile FILE``: cProfile of the first call, the top functions by cumulative and by
  own time written to FILE (the profile slows Python-heavy phases; read it for shares).

    python benchmarks/compile_time_probe.py --impl doracheck_bf16 --cprofile /tmp/prof.txt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _cold_caches() -> str:
    """Point Inductor's and Triton's caches at a fresh directory (before torch is imported)."""
    root = tempfile.mkdtemp(prefix="compile_probe_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", required=True)
    ap.add_argument("--cprofile", help="write the first call's cProfile summary here")
    ap.add_argument("--json", help="append one JSON line with the figures here")
    ap.add_argument("--warm", action="store_true", help="keep the machine's caches (default: empty ones)")
    ap.add_argument("--device", default="cuda")
    from llama_model import add_llama_args

    add_llama_args(ap)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    cache_root = None if args.warm else _cold_caches()

    import torch
    from bench_model import _sync, compiled_train_step

    step = compiled_train_step(args.impl, args)

    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    step()
    _sync(args.device)
    first_s = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    t0 = time.perf_counter()
    step()
    _sync(args.device)
    second_s = time.perf_counter() - t0
    # A rough warm step (median of 5, wall clock around each): a check that the compiled step
    # still runs at speed, not a benchmark (bench_step.py --mode compiled times it properly).
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        warm.append(time.perf_counter() - t0)
    warm_ms = sorted(warm)[2] * 1e3

    from torch._dynamo.utils import compile_times, counters

    phases = compile_times(repr="str")
    stats = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles", "inductor")}
    row = {"impl": args.impl, "cold_caches": cache_root is not None, "first_call_s": round(first_s, 2),
           "second_call_s": round(second_s, 3), "warm_step_ms": round(warm_ms, 2),
           "trace_kernels": os.environ.get("DORACHECK_TRACE_KERNELS", "0"), "counters": stats,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    print(f"== {args.impl}: first call {first_s:.1f} s, second {second_s * 1e3:.1f} ms, warm step {warm_ms:.1f} ms "
          f"({'cold' if cache_root else 'warm'} caches, DORACHECK_TRACE_KERNELS={row['trace_kernels']})")
    print(phases)
    print(json.dumps(stats, default=str)[:3000])
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        buf.write(f"# {args.impl}: cProfile of the first compiled step ({first_s:.1f} s under the profiler)\n")
        stats_obj = pstats.Stats(prof, stream=buf)
        buf.write("## by cumulative time\n")
        stats_obj.sort_stats("cumulative").print_stats(80)
        buf.write("## by own time\n")
        stats_obj.sort_stats("tottime").print_stats(50)
        with open(args.cprofile, "w") as f:
            f.write(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
