"""Which kernels' GPU time differs between processes of the same compiled step (diagnostic).

The compiled step + fused AdamW of one library ran at 53 ms in one process and 64 ms in another
on the same host, each process steady (twentieth session, ``compiled_step_twentieth_h200.csv``),
and is not host-bound (``compiled_step_modes.py``). Given the JSON rows of
``profile_model_step.py --mode compiled --time-steps N --json-out F`` from several processes of
one implementation, this prints each process's unprofiled step time and profiled GPU time, then
the kernels (by the profiler's self device time per step) whose time spreads most across the
processes, fastest and slowest process side by side.

    python benchmarks/kernel_mode_diff.py run1.json run2.json run3.json [--impl doracheck_bf16] [--top 15]
"""

from __future__ import annotations

import argparse
import json


def rows_of(paths: list[str], impl: str) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [dict(r, source=path) for r in json.load(f) if r["impl"] == impl]
    return rows


def spread_table(rows: list[dict], top: int) -> list[str]:
    """Lines: per process, then the kernels with the largest max - min of ms per step."""
    lines = [f"{'process':40s} {'step ms':>9s} {'GPU ms/step (profiled)':>24s}"]
    for r in rows:
        lines.append(f"{r['source'][-40:]:40s} {r.get('step_ms_median', float('nan')):9.3f} {r['gpu_kernel_ms_per_step']:24.3f}")
    order = sorted(range(len(rows)), key=lambda i: rows[i].get("step_ms_median", 0.0))
    fast, slow = rows[order[0]], rows[order[-1]]
    per_kernel: dict[str, list[float]] = {}
    for i, r in enumerate(rows):
        for name, ms, _count in r["top_gpu"]:
            per_kernel.setdefault(name, [0.0] * len(rows))[i] = ms
    spread = sorted(per_kernel.items(), key=lambda kv: max(kv[1]) - min(kv[1]), reverse=True)[:top]
    lines.append(f"\nkernels by spread across processes (ms per step; fastest process {fast['source']}, slowest {slow['source']})")
    lines.append(f"{'spread':>8s} {'fastest':>8s} {'slowest':>8s}  kernel")
    i_fast, i_slow = order[0], order[-1]
    for name, values in spread:
        lines.append(f"{max(values) - min(values):8.3f} {values[i_fast]:8.3f} {values[i_slow]:8.3f}  {name[:100]}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--impl", default="doracheck_bf16")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    rows = rows_of(args.paths, args.impl)
    if len(rows) < 2:
        print(f"need rows of {args.impl} from two or more processes, found {len(rows)}")
        return 2
    print("\n".join(spread_table(rows, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
