"""``doracheck calibrate [--json] [--cases N] [--dtype ...]``: measure error constants here and
print the budget rows this device's family would get (for a human to review and commit)."""

from __future__ import annotations

import json
import sys


def run(args) -> int:

    from doracheck.cli.verify_cmd import _device, impl_and_dtypes
    from doracheck.properties.calibrate import calibrate

    resolved = impl_and_dtypes(args, "calibrate")
    if resolved is None:
        return 2
    impl, dtypes = resolved
    if args.cases < 1:
        print("doracheck calibrate: --cases must be at least 1", file=sys.stderr)
        return 2
    device = _device()
    proposals = calibrate(impl, dtypes, args.cases, device)
    if args.json:
        print(json.dumps([p.__dict__ for p in proposals], indent=2))
        return 0
    header = ("op", "output", "dtype", "field", "observed max", "proposed", "current", "current margin")
    rows = [
        (p.op, p.output, p.dtype, p.field, f"{p.observed:.2e}", f"{p.proposed:.2e}", f"{p.current:.2e}",
         "inf" if p.observed == 0 else f"{p.current / p.observed:.1f}x")
        for p in proposals
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"doracheck calibrate: impl={impl.name} device={device} family={proposals[0].family if proposals else '?'}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print("\nproposed rows for properties/budgets.py MEASURED_ROWS (review before committing):")
    for p in proposals:
        print("    " + p.as_row())
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure error constants on this device and propose budget rows")
    p.add_argument("--impl", default="doracheck")
    p.add_argument("--dtype", default="fp32,bf16,fp16")
    p.add_argument("--cases", type=int, default=16, help="random problems per dtype")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
