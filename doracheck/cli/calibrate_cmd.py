"""``doracheck calibrate [--impl ...] [--dtype ...] [--cases N] [--json]``: how tight each
budget is on this device (measured error over its bound). It proposes no row: a budget is a
bound derived a priori or a baseline ratio, never a fit to the measured error."""

from __future__ import annotations

import json
import sys


def run(args) -> int:
    from doracheck.cli.verify_cmd import _device, impl_and_dtypes
    from doracheck.properties.calibrate import calibrate, device_name

    resolved = impl_and_dtypes(args, "calibrate")
    if resolved is None:
        return 2
    impl, dtypes = resolved
    if args.cases < 1:
        print("doracheck calibrate: --cases must be at least 1", file=sys.stderr)
        return 2
    device = _device()
    rows = calibrate(impl, dtypes, args.cases, device)
    failing = [r for r in rows if not r.tightness <= 1.0]
    if args.json:
        print(json.dumps({"device": device_name(device), "rows": [r.__dict__ for r in rows]}, indent=2))
        return 1 if failing else 0
    header = ("property", "dtype", "worst error", "its bound", "tightness", "cases")
    table = [(r.prop, r.dtype, f"{r.worst_error:.2e}", f"{r.bound:.2e}", f"{r.tightness:.2f}", str(r.cases)) for r in rows]
    widths = [max(len(t[i]) for t in [header, *table]) for i in range(len(header))]
    family = rows[0].family if rows else "?"
    print(f"doracheck calibrate: impl={impl.name} device={device_name(device)} family={family}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    print("\ntightness = worst error / its bound (> 1 fails). Bounds come from their derivation in")
    print("properties/budgets.py, never from these numbers; a tightness far below 1 is a loose bound.")
    return 1 if failing else 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="how tight each budget is on this device (error over bound); proposes nothing")
    p.add_argument("--impl", default="doracheck", help="doracheck, torch, peft or MODULE:CALLABLE (a dora_linear-like callable)")
    p.add_argument("--dtype", default="fp32,bf16,fp16", help="comma-separated activation dtypes: fp32, bf16, fp16")
    p.add_argument("--cases", type=int, default=16, help="random problems per dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)
