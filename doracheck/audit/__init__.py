"""``doracheck audit``: health and numerical audit of DoRA checkpoints (safetensors only).

``audit_path(path, base=None, config=None, device="auto")`` returns an ``AuditReport``;
one module's tensors are in memory at a time. ``AuditInputError`` means unusable input.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checks import (
    ModuleReport,
    _finite,
    check_magnitude,
    check_memory,
    check_merge,
    check_norm_and_scale,
    check_structure,
    note_kohya,
)
from .discovery import AdapterConfig, find_modules, rank_and_scaling
from .reader import AuditInputError, BaseWeights, SafetensorsFile, iter_adapter_files

__all__ = ["AuditInputError", "AuditReport", "ModuleReport", "audit_path"]

AUDITABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class AuditReport:
    path: str
    fmt: str
    modules: list[ModuleReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        dense = sum(m.stats.get("memory_bytes", {}).get("dense_norm", 0) for m in self.modules)
        ours = sum(m.stats.get("memory_bytes", {}).get("factored_norm", 0) for m in self.modules)
        return {
            "modules": len(self.modules),
            "errors": sum(m.count("error") for m in self.modules),
            "warnings": sum(m.count("warning") for m in self.modules),
            "memory_bytes": {"dense_norm": dense, "factored_norm": ours},
        }

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "format": self.fmt,
            "notes": self.notes,
            "modules": [m.as_dict() for m in self.modules],
            "summary": self.summary(),
        }


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise AuditInputError("--device cuda: no CUDA device is available")
    return torch.device(name)


def audit_path(
    path: str | Path,
    base: str | Path | None = None,
    config: str | Path | None = None,
    device: str = "auto",
    progress: Callable[[int, int, str], None] | None = None,
) -> AuditReport:
    """Audit every DoRA module of the adapter at ``path`` (a file, or a folder holding
    adapter_model.safetensors and usually adapter_config.json)."""
    dev = _device(device)
    path = Path(path)
    adapter_file = next(iter_adapter_files(path))
    config_path = Path(config) if config else (path / "adapter_config.json" if path.is_dir() else adapter_file.parent / "adapter_config.json")
    cfg = AdapterConfig.load(config_path) if (config or config_path.is_file()) else None
    base_weights = BaseWeights(Path(base)) if base else None
    try:
        with SafetensorsFile(adapter_file) as adapter:
            modules = find_modules(list(adapter.tensors))
            if not modules:
                raise AuditInputError(f"{adapter_file}: no LoRA/DoRA tensors (lora_A/lora_B/lora_magnitude_vector or lora_down/lora_up/dora_scale)")
            fmts = sorted({m.fmt for m in modules})
            report = AuditReport(str(adapter_file), "+".join(fmts))
            if cfg is None:
                report.notes.append("no adapter_config.json: scaling unknown, norm and merge checks skipped")
            if base_weights is None:
                report.notes.append("no --base: norm, scale, overflow and merge checks need the base weights")
            for i, keys in enumerate(modules):
                if progress:
                    progress(i + 1, len(modules), keys.name)
                report.modules.append(_audit_module(adapter, keys, cfg, base_weights, dev))
            return report
    finally:
        if base_weights is not None:
            base_weights.close()


def _audit_module(adapter: SafetensorsFile, keys, cfg: AdapterConfig | None, base: BaseWeights | None, dev) -> ModuleReport:
    report = ModuleReport(name=keys.name, fmt=keys.fmt)
    tensors = {role: adapter.get(key) for role, key in keys.keys.items()}
    for role, t in tensors.items():
        name = {"A": "lora_A", "B": "lora_B"}.get(role, role)
        if t.dtype in AUDITABLE_DTYPES:
            _finite(report, name, t)
        elif t.is_floating_point():  # fp8 and friends: no isinf/isnan kernels, and no DoRA math in them
            report.add("structure.dtype", "error", f"{name}: {t.dtype} is not audited (expected fp16, bf16, fp32 or fp64)")
            return report
    if keys.fmt == "kohya":
        note_kohya(report, keys, tensors)
        return report
    if "magnitude" not in tensors and cfg is not None and cfg.use_dora is False:
        report.add("structure.not_dora", "info", "plain LoRA module (use_dora is false): not audited")
        return report
    A = tensors.get("A")
    r_found = int(A.shape[0]) if A is not None and A.dim() == 2 else 0
    configured_r, scaling, how = rank_and_scaling(cfg, keys.name, r_found)
    report.scaling = scaling
    if not check_structure(report, tensors, configured_r):
        return report
    A, B, m = tensors["A"], tensors["B"], tensors["magnitude"]
    assert report.d_out is not None and report.d_in is not None and report.r is not None  # set by check_structure
    check_magnitude(report, m)
    check_memory(report, report.d_out, report.d_in, report.r, dev)
    if scaling is None:
        report.add("config.missing", "warning", how)
        return report
    if any(c.id.startswith("finite.") for c in report.checks):
        return report
    if base is None:
        report.add("base.missing", "info", "no base weights: norm checks skipped")
        return report
    key = base.find(keys.name)
    if key is None:
        report.add("base.missing", "warning", f"no weight for {keys.name} in the base model")
        return report
    info = base.info(key)
    fan = bool(cfg.fan_in_fan_out) if cfg else False
    expected = (report.d_in, report.d_out) if fan else (report.d_out, report.d_in)
    if tuple(info.shape) != expected:
        report.add("structure.shape", "error", f"base weight {key}: expected shape {expected}, got {tuple(info.shape)}")
        return report
    W = base.get(key)
    if W.dtype not in AUDITABLE_DTYPES:
        report.add("structure.dtype", "error", f"base weight {key}: expected fp16, bf16, fp32 or fp64, got {W.dtype}")
        return report
    if not _finite(report, "weight", W):
        return report
    g = check_norm_and_scale(report, W, A, B, m, scaling, fan, dev)
    check_merge(report, W, A, B, g, scaling, fan, dev)
    return report


def default_progress(stream=sys.stderr) -> Callable[[int, int, str], None]:
    """A one-line progress indicator on a terminal (nothing when stderr is not a TTY)."""

    def show(i: int, total: int, name: str) -> None:
        if not stream.isatty():
            return
        width = 30
        filled = int(width * i / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{total} {name[:60]:<60}")
        if i == total:
            stream.write("\n")
        stream.flush()

    return show
