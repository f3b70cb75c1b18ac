"""``doracheck audit``: health and numerical audit of DoRA checkpoints (safetensors only).

``audit_path`` returns an ``AuditReport``, one module's tensors in memory at a time. ``AuditInputError``
means unusable input: a pickle, a hostile or corrupt file, a wrongly typed config value, or a ``base``
matching none of the adapter's DoRA modules. A plain LoRA adapter (no magnitude, no ``use_dora: true``)
is checked, and ``AuditReport.plain_lora`` plus a note say nothing DoRA-specific was audited."""

from __future__ import annotations

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
    update_memory_bound,
)
from .discovery import AdapterConfig, ModuleKeys, find_modules, natural_key, rank_and_scaling
from .reader import AuditInputError, BaseWeights, SafetensorsFile, adapter_file

__all__ = ["AuditInputError", "AuditReport", "ModuleReport", "audit_path"]

AUDITABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PLAIN_LORA_NOTICE = "this is a LoRA adapter without DoRA magnitudes: nothing DoRA-specific to audit"


@dataclass
class AuditReport:
    path: str
    fmt: str
    modules: list[ModuleReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plain_lora: bool = False

    def largest_module(self) -> ModuleReport | None:
        """The module whose dense norm needs the most scratch (the memory line's), or None."""
        sized = [m for m in self.modules if "memory_bytes" in m.stats]
        return max(sized, key=lambda m: m.stats["memory_bytes"]["dense_norm"], default=None)

    def summary(self) -> dict:
        largest = self.largest_module()
        memory = {"module": largest.name, **largest.stats["memory_bytes"]} if largest else {}
        return {
            "modules": len(self.modules),
            "dora_modules": sum(m.fmt == "peft" and "structure.not_dora" not in {c.id for c in m.checks} for m in self.modules),
            "errors": sum(m.count("error") for m in self.modules),
            "warnings": sum(m.count("warning") for m in self.modules),
            "infos": sum(m.count("info") for m in self.modules),
            "plain_lora": self.plain_lora, "memory_bytes": memory,
        }

    def as_dict(self) -> dict:
        return {
            "path": self.path, "format": self.fmt, "notes": self.notes, "plain_lora": self.plain_lora,
            "modules": [m.as_dict() for m in self.modules], "summary": self.summary(),
        }


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise AuditInputError("--device cuda: no CUDA device is available")
    return torch.device(name)


def audit_path(
    path: str | Path, base: str | Path | None = None, config: str | Path | None = None, device: str = "auto",
    progress: Callable[[int, int, str], None] | None = None, keep_arrays: bool = False,
) -> AuditReport:
    """Audit every DoRA module of the adapter at ``path`` (a file, or a folder with adapter_model.safetensors,
    usually adapter_config.json; unreadable: ``AuditInputError``). ``progress(i, total, name)`` precedes
    each module; ``keep_arrays``: per-feature vectors for plots."""
    try:
        return _audit(Path(path), base, config, _device(device), progress, keep_arrays)
    except BrokenPipeError:  # the caller's output went away (a progress callback): not an input problem
        raise
    except OSError as exc:
        where = exc.filename if exc.filename is not None else path
        raise AuditInputError(f"{where}: cannot read: {exc.strerror or exc}") from None


def _audit(path: Path, base, config, dev, progress, keep_arrays: bool) -> AuditReport:
    adapter_path = adapter_file(path)
    config_path = Path(config) if config else adapter_path.parent / "adapter_config.json"
    cfg = AdapterConfig.load(config_path) if (config or config_path.is_file()) else None
    base_weights = BaseWeights(Path(base)) if base else None
    try:
        with SafetensorsFile(adapter_path) as adapter:
            modules = find_modules(list(adapter.tensors))
            if not modules:
                raise AuditInputError(f"{adapter_path}: no LoRA/DoRA tensors (lora_A/lora_B/lora_magnitude_vector or lora_down/lora_up/dora_scale)")
            report = AuditReport(str(adapter_path), "+".join(sorted({m.fmt for m in modules})))
            peft_modules = [m for m in modules if m.fmt == "peft"]
            report.plain_lora = bool(peft_modules) and not any("magnitude" in m.keys for m in peft_modules) and not (cfg and cfg.use_dora)
            if report.plain_lora:
                report.notes.append(PLAIN_LORA_NOTICE)
            elif cfg is None:
                report.notes.append("no adapter_config.json: scaling unknown, norm and merge checks skipped")
            if base_weights is None and not report.plain_lora and peft_modules:
                report.notes.append("no --base: norm, scale, overflow and merge checks need the base weights")
            if base_weights is not None and not report.plain_lora:
                dora_modules = [m for m in peft_modules if "magnitude" in m.keys]
                _require_base_match(base_weights, dora_modules)
                _require_base_shapes(base_weights, adapter, dora_modules, bool(cfg.fan_in_fan_out) if cfg else False)
            for i, keys in enumerate(modules):
                if progress:
                    progress(i + 1, len(modules), keys.name)
                report.modules.append(_audit_module(adapter, keys, cfg, base_weights, dev, report.plain_lora, keep_arrays))
            _note_mismatch(report)
            return report
    finally:
        if base_weights is not None:
            base_weights.close()


def _require_base_match(base: BaseWeights, modules: list[ModuleKeys]) -> None:
    """A base that holds none of the adapter's DoRA weights is the wrong model: one line, exit 2."""
    if not modules or any(base.find(m.name) is not None for m in modules):
        return
    weights = sorted((k for k in base.keys() if k.endswith(".weight")), key=natural_key) or sorted(base.keys(), key=natural_key)
    theirs = f"the base has e.g. {weights[0]!r} ({len(base.keys())} tensors)" if weights else "the base holds no tensors"
    raise AuditInputError(
        f"--base {base.path}: matches none of the adapter's {len(modules)} DoRA modules: looked for e.g. "
        f"{modules[0].name + '.weight'!r}, {theirs}; is it the model this adapter was trained on?")


def _require_base_shapes(base: BaseWeights, adapter: SafetensorsFile, modules: list[ModuleKeys], fan_in_fan_out: bool) -> None:
    """Base weights shaped unlike the adapter's: another model; one line, exit 2, not a finding per module."""
    wrong, found = [], 0
    for module in modules:
        key = base.find(module.name)
        A, B = adapter.tensors.get(module.keys.get("A", "")), adapter.tensors.get(module.keys.get("B", ""))
        if key is None or A is None or B is None or len(A.shape) != 2 or len(B.shape) != 2:
            continue  # reported per module (base.missing, structure.shape)
        found += 1
        expected = (A.shape[1], B.shape[0]) if fan_in_fan_out else (B.shape[0], A.shape[1])
        got = tuple(base.info(key).shape)
        if got != expected:
            wrong.append((key, got, expected))
    if wrong:
        key, got, expected = wrong[0]
        raise AuditInputError(
            f"--base {base.path}: {len(wrong)} of the {found} DoRA modules it holds have weights of other shapes than the "
            f"adapter's, e.g. {key!r} is {got} where the adapter needs {expected}; is it the model this adapter was trained on?"
        )


def _note_mismatch(report: AuditReport) -> None:
    """One note naming the modules whose magnitudes do not belong to the base (``base.mismatch``)."""
    names = [m.name for m in report.modules if any(c.id == "base.mismatch" for c in m.checks)]
    if names:
        audited = sum(1 for m in report.modules if "base_agreement" in m.stats)
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        report.notes.append(f"--base: the magnitudes of {len(names)} of {audited} modules do not follow this base's row norms "
                            f"({shown}): is it the model this adapter was trained on?")


def _audit_module(adapter: SafetensorsFile, keys, cfg: AdapterConfig | None, base: BaseWeights | None, dev, plain_lora: bool,
                  keep_arrays: bool) -> ModuleReport:
    report = ModuleReport(name=keys.name, fmt=keys.fmt, keep_arrays=keep_arrays)
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
    A = tensors.get("A")
    r_found = int(A.shape[0]) if A is not None and A.dim() == 2 else 0
    configured_r, scaling, how = rank_and_scaling(cfg, keys.name, r_found)
    report.scaling = scaling
    if "magnitude" not in tensors and (plain_lora or (cfg is not None and cfg.use_dora is False)):
        check_structure(report, tensors, configured_r, dora=False)
        report.add("structure.not_dora", "info", "plain LoRA module (no magnitude vector): nothing DoRA-specific to audit")
        return report
    if not check_structure(report, tensors, configured_r):
        return report
    A, B, m = tensors["A"], tensors["B"], tensors["magnitude"]
    assert report.d_out is not None and report.d_in is not None and report.r is not None  # set by check_structure
    check_magnitude(report, m)
    check_memory(report, report.d_out, report.d_in, report.r, dev, A.dtype, B.dtype)
    if scaling is None:
        report.add("config.missing", "warning", how)
        return report
    if any(c.id.startswith("finite.") for c in report.checks):
        return report
    W = _base_weight(report, keys.name, base, cfg)
    if W is None:
        return report
    update_memory_bound(report, report.d_out, report.d_in, report.r, dev, A.dtype, B.dtype, W.dtype)
    fan = bool(cfg.fan_in_fan_out) if cfg else False
    g = check_norm_and_scale(report, W, A, B, m, scaling, fan, dev)
    check_merge(report, W, A, B, g, scaling, fan, dev)
    return report


def _base_weight(report: ModuleReport, name: str, base: BaseWeights | None, cfg: AdapterConfig | None) -> torch.Tensor | None:
    """The module's base weight, checked for shape, dtype and finiteness, or None (with a finding)."""
    if base is None:
        report.add("base.missing", "info", "no --base given: norm, scale and merge checks skipped")
        return None
    key = base.find(name)
    if key is None:
        report.add("base.missing", "warning", f"no weight for {name} in the base model")
        return None
    info = base.info(key)
    fan = bool(cfg.fan_in_fan_out) if cfg else False
    expected = (report.d_in, report.d_out) if fan else (report.d_out, report.d_in)
    if tuple(info.shape) != expected:
        report.add("structure.shape", "error", f"base weight {key}: expected shape {expected}, got {tuple(info.shape)}")
        return None
    W = base.get(key)
    if W.dtype not in AUDITABLE_DTYPES:
        report.add("structure.dtype", "error", f"base weight {key}: expected fp16, bf16, fp32 or fp64, got {W.dtype}")
        return None
    if not _finite(report, "weight", W):
        return None
    return W
