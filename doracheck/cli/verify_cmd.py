"""``doracheck verify``: run the checks against an implementation on this machine.

Prints check × dtype → pass/fail, worst error, budget, margin. Exit 0 if every check
passes, 1 if any fails, 2 for bad usage (an unknown dtype, an --impl that cannot be loaded).
"""

from __future__ import annotations

import importlib
import json
import sys
import time

PROFILES = ("quick", "full")
DTYPE_NAMES = ("fp32", "bf16", "fp16")


class UsageError(Exception):
    pass


def resolve_impl(spec: str):
    """'doracheck' / 'torch' / 'MODULE:CALLABLE' -> (name, dora_linear-like callable, norm callable or None)."""
    if spec in ("doracheck", "torch"):
        import doracheck

        if spec == "torch":
            from doracheck.dispatch import forced_path

            return spec, forced_path("torch", doracheck.dora_linear), forced_path("torch", doracheck.factored_norm)
        return spec, doracheck.dora_linear, doracheck.factored_norm
    if ":" not in spec:
        raise UsageError(f"--impl: expected doracheck, torch or MODULE:CALLABLE, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--impl: cannot import module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"--impl: {module_name!r} has no callable {attr!r}")
    return spec, fn, None


def parse_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPE_NAMES]
    if bad or not names:
        raise UsageError(f"--dtype: expected a comma list of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return names


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_checks(impl_spec: str, dtypes: list[str], profile: str, device: str, progress=None):
    from doracheck.properties import check_forward_backward, check_norm, device_family

    name, impl, norm_impl = resolve_impl(impl_spec)
    family = device_family(device)
    results = []
    for i, dt in enumerate(dtypes):
        if progress:
            progress(f"[{i + 1}/{len(dtypes)}] {dt}: forward and backward against the fp64 oracle")
        results.extend(check_forward_backward(impl, dt, family, device=device, profile=profile))
        if norm_impl is not None:
            results.extend(check_norm(norm_impl, dt, family, device=device, profile=profile))
    return name, family, results


def _format_table(results) -> str:
    header = ("check", "dtype", "result", "worst rel err", "budget", "margin")
    rows = [
        (
            r.prop,
            r.dtype,
            "pass" if r.passed else "FAIL",
            f"{r.worst:.3e}",
            f"{r.budget:.3e}",
            "inf" if r.margin == float("inf") else f"{r.margin:.1f}x",
        )
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def run(args) -> int:
    profile = "quick" if args.quick else args.profile
    try:
        dtypes = parse_dtypes(args.dtype)
        device = _device()
        start = time.perf_counter()
        progress = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
        name, family, results = run_checks(args.impl, dtypes, profile, device, progress)
    except UsageError as exc:
        print(f"doracheck verify: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.passed]
    if args.json:
        print(
            json.dumps(
                {
                    "impl": name,
                    "profile": profile,
                    "device": device,
                    "family": family,
                    "passed": not failed,
                    "seconds": round(elapsed, 2),
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
            )
        )
    else:
        print(f"doracheck verify: impl={name} profile={profile} device={device} family={family}")
        print(_format_table(results))
        verdict = "all checks passed" if not failed else f"{len(failed)} of {len(results)} checks FAILED"
        print(f"{verdict} ({len(results)} checks, {elapsed:.1f} s)")
        for r in failed:
            print(f"  FAIL {r.prop} [{r.dtype}]: {r.worst:.3e} > budget {r.budget:.3e}; {r.detail}")
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check an implementation against the fp64 oracle and the budgets")
    p.add_argument("--impl", default="doracheck", help="doracheck | torch | MODULE:CALLABLE (dora_linear's signature)")
    p.add_argument("--dtype", default="fp32,bf16,fp16", help="comma list of fp32, bf16, fp16")
    p.add_argument("--profile", choices=PROFILES, default="quick")
    p.add_argument("--quick", action="store_true", help="same as --profile quick")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
