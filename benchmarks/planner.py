"""The planner's predictions against measurement: ``doracheck bench --plan --timed``, rows kept.

Runs the CLI (``python -m doracheck bench --plan [--timed] --json``) over ``--shapes`` x
``--tokens`` x ``--dtype`` x infer/train: in each row every computation order the planner
considers is timed side by side on shared inputs with nn.Linear (CUDA events, back-to-back
calls, median and p10/p90 of ``--reps`` samples), beside the cost model's predicted ms (made for an
H200, whatever the device). Appends one row per (shape, T, dtype, mode, variant) to
results/planner.csv: predicted and measured ms, the measured over the row's fastest
(``vs_fastest``), and which variant the cost model picked (``pick``: model / timed / fastest).
Prints the CLI's summary: in how many rows the pick is within 5% of the fastest.

    python benchmarks/planner.py [--shapes 8192x8192r384,...] [--tokens 1,256,4096,16384] [--dtype bf16]
    python benchmarks/planner.py --smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import harness

SHAPES = "4096x4096r8,4096x4096r64,4096x4096r1024,8192x8192r384,4096x14336r16,14336x4096r128"
FIELDS = ["tokens", "mode", "variant", "predicted_ms", "vs_fastest", "pick", "linear_ms"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--tokens", default="1,256,4096,16384")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-timed", action="store_true", help="leave out the planner's timing mode")
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.tokens, args.reps = "64x48r8", "1,8", 2
    device = harness.resolve_device(args, "planner")
    cmd = [sys.executable, "-m", "doracheck", "bench", "--plan", "--json", "--shapes", args.shapes, "--tokens", args.tokens,
           "--dtype", args.dtype, "--reps", str(args.reps)] + ([] if args.no_timed else ["--timed"])
    env = None
    if not device.startswith("cuda"):
        import os

        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=harness.HERE, env=env)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        return done.returncode
    doc = json.loads(done.stdout[done.stdout.index("{"):])
    results = harness.Results("planner", FIELDS, args.csv, args.smoke)
    for r in doc["rows"]:
        fastest = r["measured_ms"][r["fastest"]]
        for variant, ms in r["measured_ms"].items():
            picks = [label for label, chosen in (("model", r.get("chosen")), ("timed", r.get("timed_chosen")),
                                                 ("fastest", r["fastest"])) if chosen == variant]
            results.add({"case": r["mode"], "impl": "doracheck", "shape": f"{r['d_in']}x{r['d_out']}r{r['r']}",
                         "tokens": r["tokens"], "mode": r["mode"], "dtype": r["dtype"], "unit": "ms",
                         "variant": variant, "median": round(ms, 4), "p10": round(r["measured_p10_ms"][variant], 4),
                         "p90": round(r["measured_p90_ms"][variant], 4), "n": args.reps, "rounds": args.reps,
                         "predicted_ms": round(r["predicted_ms"][variant], 4), "vs_fastest": round(ms / fastest, 3),
                         "pick": "+".join(picks), "linear_ms": round(r["linear_ms"], 4)})
    summary = doc.get("summary", {})
    print(json.dumps(summary, indent=1))
    print(f"summary: planner pick within 5% of the fastest in {summary.get('chosen_within_5pct_of_fastest')} of "
          f"{summary.get('rows')} rows; timing mode {summary.get('timed_within_5pct_of_fastest', '-')}")
    print(f"rows appended to {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
