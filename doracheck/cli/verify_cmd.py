"""``doracheck verify``: run the property suite against an implementation on this machine.

Prints property × dtype → pass/FAIL/n/a, worst error, budget, margin, and the reason of each
n/a. Exit 0 if every property passes (n/a counts as passing: the implementation lacks that
piece), 1 if any fails, 2 for bad usage (an unknown dtype, an --impl that cannot be loaded) and
for an implementation on which nothing could be checked (n/a everywhere): no false comfort.
"""

from __future__ import annotations

import json
import sys
import time

PROFILES = ("quick", "full")
DTYPE_NAMES = ("fp32", "bf16", "fp16")


class UsageError(Exception):
    pass


def parse_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPE_NAMES]
    if bad or not names:
        raise UsageError(f"--dtype: expected a comma list of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return names


def impl_and_dtypes(args, command: str):
    """(Implementation, dtype names) from --impl and --dtype, or None after printing the usage
    error (exit code 2 for the caller); shared by verify and calibrate."""
    from doracheck.properties.implementations import ImplementationError, resolve

    try:
        return resolve(args.impl), parse_dtypes(args.dtype)
    except (UsageError, ImplementationError) as exc:
        print(f"doracheck {command}: {exc}", file=sys.stderr)
        return None


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def format_table(results) -> str:
    header = ("property", "dtype", "result", "worst", "budget", "margin")
    rows = [
        (
            r.prop,
            r.dtype,
            r.status,
            "-" if r.status == "n/a" else f"{r.worst:.3e}",
            "-" if r.status == "n/a" else f"{r.budget:.3e}",
            "-" if r.status == "n/a" else ("inf" if r.margin == float("inf") else f"{r.margin:.1f}x"),
        )
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


class terminal_progress:
    """``[k/N] step  elapsed, ETA`` on one rewritten line of stderr when it is a terminal (and not
    under CI); silent otherwise, so logs and pipes get only the table."""

    def __init__(self, command: str, total: int, start: float):
        import os

        self.command, self.total, self.start, self.count = command, max(total, 1), start, 0
        self.live = sys.stderr.isatty() and not os.environ.get("CI")

    def __call__(self, message: str) -> None:
        self.count += 1
        if not self.live:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(self.count - 1, 1) * (self.total - self.count + 1) if self.count > 1 else float("nan")
        eta_text = "" if eta != eta else f", ETA {eta:.0f} s"
        print(f"\r\033[K{self.command} [{self.count}/{self.total}] {message}  ({elapsed:.0f} s{eta_text})", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.live:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def run(args) -> int:
    from doracheck.properties import device_family, run_suite
    from doracheck.properties.suite import suite_steps

    profile = "quick" if args.quick else args.profile
    resolved = impl_and_dtypes(args, "verify")
    if resolved is None:
        return 2
    impl, dtypes = resolved
    device = _device()
    start = time.perf_counter()
    progress = None if args.json else terminal_progress("verify", suite_steps(dtypes), start)
    try:
        results = run_suite(impl, dtypes, profile, device, progress)
    except KeyboardInterrupt:
        print("\ndoracheck verify: interrupted", file=sys.stderr)
        return 130
    if progress is not None:
        progress.done()
    elapsed = time.perf_counter() - start
    failed = [r for r in results if r.status == "FAIL"]
    checked = [r for r in results if r.status != "n/a"]
    family = device_family(device)
    if not checked:
        reason = results[0].detail if results else "no property ran"
        message = f"nothing could be checked on {impl.name}: every property is n/a ({reason})"
        if args.json:
            print(json.dumps({"impl": impl.name, "profile": profile, "device": device, "family": family, "passed": False,
                              "error": message, "results": [r.as_dict() for r in results]}, indent=2))
        print(f"doracheck verify: {message}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            "impl": impl.name, "profile": profile, "device": device, "family": family, "passed": not failed,
            "seconds": round(elapsed, 2), "results": [r.as_dict() for r in results],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(f"doracheck verify: impl={impl.name} profile={profile} device={device} family={family}")
        print(format_table(results))
        na = sum(r.status == "n/a" for r in results)
        verdict = "all properties passed" if not failed else f"{len(failed)} of {len(results)} properties FAILED"
        print(f"{verdict} ({len(results)} checks, {na} n/a, {elapsed:.1f} s)")
        for r in failed:
            print(f"  FAIL {r.prop} [{r.dtype}]: {r.worst:.3e} > {r.budget:.3e}; {r.detail}")
        for r in results:
            if r.status == "n/a":
                print(f"  n/a  {r.prop} [{r.dtype}]: {r.detail.removeprefix('n/a: ')}")
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="run the property suite against an implementation")
    p.add_argument("--impl", default="doracheck", help="doracheck | torch | peft | MODULE:CALLABLE (dora_linear's signature)")
    p.add_argument("--dtype", default="fp32,bf16,fp16", help="comma list of fp32, bf16, fp16")
    p.add_argument("--profile", choices=PROFILES, default="quick")
    p.add_argument("--quick", action="store_true", help="same as --profile quick")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
