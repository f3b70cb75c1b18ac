"""Re-evaluate the planner's current cost model on committed `doracheck bench --plan` CSVs.

For each row: the candidates the current model allows (among those measured), its choice, the
fastest measured of those, and whether the choice is within 5% of it; then the current model's
predicted over measured time of its choice, host-bound rows (T <= 256) and the rest apart. This
reproduces, from benchmarks/results/plan_*.csv alone, the figures in benchmarks/README.md.

Usage: python benchmarks/plan_reeval.py benchmarks/results/plan_h200.csv [more.csv ...]
"""

from __future__ import annotations

import csv
import json
import statistics
import sys

import torch

from doracheck.planner import plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def reevaluate(path: str) -> tuple[int, int]:
    rows = list(csv.DictReader(open(path)))
    within = 0
    ratios: dict[str, list[float]] = {"T <= 256": [], "T >= 4096": []}
    for r in rows:
        measured = json.loads(r["measured_ms"])
        p = plan(int(r["d_in"]), int(r["d_out"]), int(r["r"]), int(r["tokens"]), DTYPES[r["dtype"]], r["mode"] == "train")
        names = [v.name for v in p.candidates if v.name in measured]
        fastest = min(names, key=lambda k: measured[k])
        ratio = measured[p.variant.name] / measured[fastest]
        within += ratio <= 1.05
        ratios["T <= 256" if int(r["tokens"]) <= 256 else "T >= 4096"].append(
            p.predicted_ms[p.variant.name] / measured[p.variant.name])
        mark = "ok" if ratio <= 1.05 else f"{ratio:.2f}x"
        print(f"{r['d_in']}x{r['d_out']} r{r['r']} T{r['tokens']} {r['dtype']} {r['mode']:5s} chose {p.variant.name} "
              f"fastest {fastest} ({mark})")
    for label, values in ratios.items():
        if values:
            print(f"{path}: predicted / measured of the chosen variant, {label}: median {statistics.median(values):.2f},"
                  f" range {min(values):.2f} to {max(values):.2f}")
    return within, len(rows)


def main(argv: list[str]) -> int:
    for path in argv or ["benchmarks/results/plan_h200.csv"]:
        within, total = reevaluate(path)
        print(f"{path}: the current model's choice is within 5% of the fastest measured in {within} of {total} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
