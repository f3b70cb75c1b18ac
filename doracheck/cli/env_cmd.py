"""``doracheck env [--json]``: versions, the device and its architecture family, and the path a call takes."""

from __future__ import annotations

import json
import platform


def collect() -> dict:
    import numpy
    import torch

    from doracheck import __version__
    from doracheck.dispatch import describe_path, triton_available
    from doracheck.properties import device_family

    info: dict = {
        "doracheck": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "triton": None,
        "cuda_available": torch.cuda.is_available(),
        "devices": [],
    }
    if triton_available():
        import triton

        info["triton"] = triton.__version__
    device = "cpu"
    if torch.cuda.is_available():
        device = "cuda"
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["devices"].append(
                {
                    "index": i,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "family": device_family(f"cuda:{i}"),
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
    info["family"] = device_family(device)
    choice = describe_path(device)
    info["path"] = {"device": device, "name": choice.name, "reason": choice.reason}
    return info


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [
        ("doracheck", info["doracheck"]),
        ("python", info["python"]),
        ("torch", info["torch"]),
        ("triton", info["triton"] or "not installed"),
        ("numpy", info["numpy"]),
        ("platform", info["platform"]),
        ("family", info["family"]),
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
    p = sub.add_parser("env", help="versions, device, architecture family and dispatch decision")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)

