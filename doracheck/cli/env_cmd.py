"""``doracheck env [--json]``: versions, the device and its architecture family, and the path a call takes."""

from __future__ import annotations

import argparse
import json
import platform


def collect() -> dict:
    import numpy
    import torch

    from doracheck import __version__
    from doracheck.dispatch import describe_path, triton_available
    from doracheck.properties import device_family
    info: dict = {
        "doracheck": __version__, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "numpy": numpy.__version__, "triton": None,
        "cuda_available": torch.cuda.is_available(), "devices": [],
    }
    if triton_available():
        import triton

        info["triton"] = triton.__version__
    device = "cpu"
    if torch.cuda.is_available():
        device = "cuda"
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["devices"].append({
                "index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                "family": device_family(f"cuda:{i}"), "memory_gib": round(props.total_memory / 2**30, 1),
            })
    info["family"] = device_family(device)
    choice = describe_path(device)
    info["path"] = {"device": device, "name": choice.name, "reason": choice.reason}
    return info


def version_line() -> str:
    """``doracheck 0.1.0 (torch 2.x, triton 3.x, python 3.11.x)``: what ``doracheck --version`` prints,
    read from the installed distributions' metadata, so that nothing imports torch."""
    from importlib.metadata import PackageNotFoundError, version

    from doracheck import __version__

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    torch, triton = installed("torch"), installed("triton")
    return (f"doracheck {__version__} (torch {torch or 'not installed'}, "
            f"{f'triton {triton}' if triton else 'triton not installed'}, python {platform.python_version()})")


class VersionAction(argparse.Action):
    """``--version``: print ``version_line()`` and exit 0 (looked up only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from doracheck.cli.verify_cmd import stdout_closed
        try:
            print(version_line(), flush=True)
        except BrokenPipeError:
            parser.exit(stdout_closed())
        parser.exit(0)


def run(args) -> int:
    from doracheck.cli.verify_cmd import guarded
    return guarded("env", _run, args)


def _run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [
        ("doracheck", info["doracheck"]), ("python", info["python"]), ("torch", info["torch"]),
        ("triton", info["triton"] or "not installed"), ("numpy", info["numpy"]),
        ("platform", info["platform"]), ("family", info["family"]),
    ]
    for dev in info["devices"]:
        rows.append((f"cuda:{dev['index']}", f"{dev['name']} (sm{dev['capability'].replace('.', '')}, {dev['memory_gib']} GiB)"))
    if not info["devices"]:
        rows.append(("cuda", "no CUDA device"))
    rows.append(("path", f"{info['path']['name']} on {info['path']['device']}: {info['path']['reason']}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="versions, device, architecture family and dispatch decision",
                       description="Print the versions (doracheck, Python, torch, triton, numpy), the CUDA devices with "
                                   "their architecture family, and which path (Triton or torch) a call takes here.")
    p.add_argument("--json", action="store_true", help="print one JSON object (the same fields) instead of the text")
    p.set_defaults(run=run)

