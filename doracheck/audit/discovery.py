"""Find the DoRA modules in a safetensors file and work out each one's rank and scaling.

Naming schemes recognised:
- PEFT: ``<prefix><module>.lora_A.weight``, ``.lora_B.weight``, ``.lora_magnitude_vector``
  (``<prefix>`` is usually ``base_model.model.``; an adapter name may follow lora_A/lora_B).
- kohya / LyCORIS: ``<module>.lora_down.weight``, ``.lora_up.weight``, ``.dora_scale``,
  ``.alpha``. Their ``dora_scale`` is a norm over another axis (per input feature by default),
  so these modules get structural checks and a format note, not PEFT's numerics.

Scaling follows PEFT: r and lora_alpha from adapter_config.json (``config.py``), overridden per
module by ``rank_pattern`` / ``alpha_pattern`` (``pattern_key``), s = alpha / r, or
alpha / sqrt(r) with ``use_rslora``. Modules come in natural order (layers.2 before layers.10).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .config import AdapterConfig

__all__ = ["AdapterConfig", "ModuleKeys", "find_modules", "natural_key", "pattern_key", "rank_and_scaling"]

PEFT_PREFIX = "base_model.model."
_PEFT = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_PEFT_MAG = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")
_KOHYA = re.compile(r"^(?P<module>.+)\.(?P<part>lora_down\.weight|lora_up\.weight|dora_scale|alpha)$")


@dataclass
class ModuleKeys:
    name: str  # module name as in the base model (PEFT prefix removed)
    fmt: str  # "peft" or "kohya"
    keys: dict[str, str] = field(default_factory=dict)  # role -> key: A, B, magnitude, alpha


def pattern_key(patterns: dict, module: str) -> str | None:
    """PEFT's get_pattern_key: the first pattern p with re.match(rf"(.*\\.)?({p})$", module)."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except (re.error, OverflowError, RecursionError):  # checked in config.py; never fatal here
            continue
    return None


def rank_and_scaling(config: AdapterConfig | None, module: str, r_found: int) -> tuple[int | None, float | None, str]:
    """(configured r, scaling, how it was determined) for ``module`` as PEFT would set it."""
    if config is None:
        return None, None, "no adapter_config.json: scaling unknown"
    if config.r is None or config.lora_alpha is None:
        missing = " and ".join(k for k, v in (("r", config.r), ("lora_alpha", config.lora_alpha)) if v is None)
        return None, None, f"{config.source} has no {missing}: scaling unknown"
    key = pattern_key(config.rank_pattern, module)
    r = int(config.rank_pattern[key]) if key is not None else config.r
    akey = pattern_key(config.alpha_pattern, module)
    alpha = float(config.alpha_pattern[akey]) if akey is not None else config.lora_alpha
    scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
    how = f"alpha {alpha:g} / {'sqrt(r)' if config.use_rslora else 'r'} with r = {r}"
    return r, scaling, how


_DIGITS = re.compile(r"([0-9]+)")  # ASCII digits only: str.isdigit() accepts '²', which int() refuses


def natural_key(name: str) -> list:
    """Sort key that orders runs of ASCII digits by value: layers.2 < layers.10. re.split with
    one group puts the digit runs at the odd positions, so the key alternates str and int."""
    return [int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(name))]


def find_modules(keys: list[str]) -> list[ModuleKeys]:
    """Group tensor keys into DoRA (and plain LoRA) modules, in natural order of their names."""
    modules: dict[str, ModuleKeys] = {}
    for key in keys:
        m = _PEFT.match(key)
        mag = _PEFT_MAG.match(key)
        kohya = _KOHYA.match(key)
        if m:
            name, role, fmt = m["module"], m["part"][-1], "peft"
        elif mag:
            name, role, fmt = mag["module"], "magnitude", "peft"
        elif kohya:
            name, fmt = kohya["module"], "kohya"
            role = {"lora_down.weight": "A", "lora_up.weight": "B", "dora_scale": "magnitude", "alpha": "alpha"}[kohya["part"]]
        else:
            continue
        if fmt == "peft" and name.startswith(PEFT_PREFIX):
            name = name[len(PEFT_PREFIX):]
        entry = modules.setdefault(f"{fmt}:{name}", ModuleKeys(name=name, fmt=fmt))
        entry.keys[role] = key
    return sorted(modules.values(), key=lambda m: (natural_key(m.name), m.fmt))
