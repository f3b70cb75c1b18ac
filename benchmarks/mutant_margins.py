"""Margins both ways for the small planted errors of tests/mutants.py, on this device.

For each mutant: the property that must catch it, the mutant's worst error over that
property's budget (> 1: caught) and doracheck's own (< 1: passes), from the same quick-profile
suite ``doracheck verify --dtype DT`` runs. Prints a Markdown table (for properties/verified/).

Usage: PYTHONPATH=tests python benchmarks/mutant_margins.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys

import torch
from mutants import implementations

from doracheck.properties import run_suite
from doracheck.properties.implementations import doracheck_implementation


def worst_over_budget(results, prop):
    r = next(r for r in results if r.prop == prop)
    return r.worst / r.budget if r.budget else float("inf"), r.status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    ours = {dt: run_suite(doracheck_implementation(), [dt], "quick", args.device) for dt in ("bf16", "fp16")}
    print("| mutant | dtype | catching property | mutant worst / budget | doracheck worst / budget |")
    print("|---|---|---|---|---|")
    ok = True
    for name, (impl, dt, prop) in sorted(implementations().items()):
        mutant, status = worst_over_budget(run_suite(impl, [dt], "quick", args.device), prop)
        correct, own_status = worst_over_budget(ours[dt], prop)
        ok &= status == "FAIL" and own_status == "pass"
        print(f"| {name} | {dt} | {prop} | {mutant:.2f} ({status}) | {correct:.2f} ({own_status}) |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
