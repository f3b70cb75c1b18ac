"""``doracheck calibrate [--impl ...] [--dtype ...] [--cases N] [--json]``: how tight each
budget is on this device (measured error over its bound). It proposes no row: a budget is a
bound derived a priori or a baseline ratio, never a fit to the measured error. Exit 0 when
every tightness is at most 1, 1 otherwise, 2 for bad usage, 130 when interrupted."""

from __future__ import annotations

import json
import sys


def run(args) -> int:
    from doracheck.cli.verify_cmd import guarded
    return guarded("calibrate", _run, args)


def _run(args) -> int:
    from doracheck.cli.progress import Progress
    from doracheck.cli.verify_cmd import _device, impl_and_dtypes
    from doracheck.properties import device_family
    from doracheck.properties.calibrate import calibrate, device_name
    if args.cases < 1:
        print("doracheck calibrate: --cases must be at least 1", file=sys.stderr)
        return 2
    resolved = impl_and_dtypes(args, "calibrate")
    if resolved is None:
        return 2
    impl, dtypes = resolved
    device = _device()
    if not args.json:
        print(f"doracheck calibrate: impl={impl.name} device={device_name(device)} family={device_family(device)}", flush=True)
    with Progress("calibrate", args.cases * len(dtypes), json_output=args.json, unit="case") as progress:
        rows = calibrate(impl, dtypes, args.cases, device, progress)
    failing = [r for r in rows if not r.tightness <= 1.0]
    if args.json:
        print(json.dumps({"device": device_name(device), "rows": [r.__dict__ for r in rows]}, indent=2))
        return 1 if failing else 0
    header = ("property", "dtype", "worst error", "its bound", "tightness", "cases")
    table = [(r.prop, r.dtype, f"{r.worst_error:.2e}", f"{r.bound:.2e}", f"{r.tightness:.2f}", str(r.cases)) for r in rows]
    widths = [max(len(t[i]) for t in [header, *table]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
    print("\ntightness = worst error / its bound (> 1 fails). Bounds come from their derivation in")
    print("properties/budgets.py, never from these numbers; a tightness far below 1 is a loose bound.")
    return 1 if failing else 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="how tight each budget is on this device (error over bound); proposes nothing",
                       description="Run random problems per dtype and report, per property, the worst measured error "
                                   "over its a-priori bound (the tightness). Nothing is proposed or written: a budget "
                                   "is a bound, never a fit to these numbers.",
                       epilog="exit codes: 0 every tightness <= 1, 1 some bound exceeded, 2 bad usage, 130 interrupted")
    p.add_argument("--impl", default="doracheck",
                   help="what to measure: doracheck (this package, the default), torch (doracheck's pure-PyTorch path), "
                        "peft (PEFT's DoRA layer), or MODULE:CALLABLE (any function with dora_linear's signature)")
    p.add_argument("--dtype", default="fp32,bf16,fp16",
                   help="comma list of activation dtypes to measure, from fp32, bf16, fp16 (default: all three)")
    p.add_argument("--cases", type=int, default=16, help="random problems per dtype, at least 1 (default: 16)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the device and one row per property and dtype) instead of the table")
    p.set_defaults(run=run)
