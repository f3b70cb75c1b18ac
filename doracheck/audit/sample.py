"""A small sample DoRA adapter in PEFT's on-disk format, with its base model, for demos and tests.

``write_sample(folder)`` writes adapter_model.safetensors, adapter_config.json and
base_model.safetensors (a 2-layer toy with q/v projections, r = 8, alpha = 16) into ``folder``,
never overwriting (``AuditInputError`` names an existing file). ``fresh=True``: an untrained
adapter as PEFT initialises one (lora_B = 0, m = fp32 row norms of W); else lora_B small and
random and m 0.1% off the norm, like a trained adapter. ``defects`` plants problems to find.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save

from doracheck.reference import norm_terms_ref

from .reader import AuditInputError

LAYERS = {"model.layers.0.self_attn.q_proj": (64, 96), "model.layers.0.self_attn.v_proj": (32, 96),
          "model.layers.1.self_attn.q_proj": (64, 96), "model.layers.1.self_attn.v_proj": (32, 96)}
FILES = ("adapter_model.safetensors", "adapter_config.json", "base_model.safetensors")


def sample_tensors(r: int, alpha: float, seed: int, fresh: bool, defects: tuple[str, ...]) -> tuple[dict, dict]:
    """(adapter tensors with PEFT's keys, base tensors)."""
    gen = torch.Generator().manual_seed(seed)
    adapter: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    s = alpha / r
    for i, (name, (d_out, d_in)) in enumerate(LAYERS.items()):
        W = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(torch.bfloat16)
        A = torch.randn(r, d_in, generator=gen) / d_in**0.5
        B = torch.randn(d_out, r, generator=gen) * 0.02
        noise = 1e-3 * torch.randn(d_out, generator=gen, dtype=torch.float64)
        if fresh:  # PEFT's init: B = 0 and m = ||W + s·B·A|| = ||W|| per row, in fp32
            B = torch.zeros_like(B)
            m = torch.linalg.norm(W.float(), dim=1)
        else:
            m = (norm_terms_ref(W, A, B, s).norm * (1 + noise)).float()
        base[f"{name}.weight"] = W
        prefix = f"base_model.model.{name}"
        adapter[f"{prefix}.lora_A.weight"] = A
        adapter[f"{prefix}.lora_B.weight"] = B
        adapter[f"{prefix}.lora_magnitude_vector"] = m
        if i == 0 and "nan" in defects:
            adapter[f"{prefix}.lora_B.weight"][3, 1] = float("nan")
        if i == 1 and "zero_magnitude" in defects:
            adapter[f"{prefix}.lora_magnitude_vector"][5] = 0.0
        if i == 2 and "bad_shape" in defects:
            adapter[f"{prefix}.lora_magnitude_vector"] = m[:-1].clone()
    return adapter, base


def write_sample(
    folder: str | Path, *, r: int = 8, alpha: float = 16.0, seed: int = 0, fresh: bool = False, defects: tuple[str, ...] = ()
) -> Path:
    """Write the sample into ``folder`` (created if missing) without overwriting anything.
    defects: "nan" (NaN in one lora_B), "zero_magnitude", "bad_shape". A write that fails (or is
    interrupted) removes what this call wrote, the folders it made included, and nothing else."""
    folder = Path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise AuditInputError(f"{folder}: is a file; the sample is three files written into a folder (a new one, or one without them)")
        for name in FILES:
            if (folder / name).exists():
                raise AuditInputError(f"{folder / name}: already exists; the sample never overwrites files (choose a new or empty folder)")
        made = _missing_folders(folder)
    except OSError as exc:
        raise AuditInputError(f"{exc.filename or folder}: cannot use this folder: {exc.strerror or exc}") from None
    contents = _contents(r, alpha, seed, fresh, defects)
    written: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in contents.items():
            with open(folder / name, "xb") as f:  # "x": fail rather than replace a file that appeared meanwhile
                written.append(folder / name)
                f.write(data)
    except FileExistsError as exc:
        _remove(written, made)
        raise AuditInputError(f"{exc.filename}: already exists; the sample never overwrites files (choose a new or empty folder)") from None
    except OSError as exc:
        _remove(written, made)
        raise AuditInputError(f"{exc.filename or folder}: cannot write the sample: {exc.strerror or exc}") from None
    except BaseException:  # Ctrl-C: leave nothing half-written behind
        _remove(written, made)
        raise
    return folder


def _contents(r: int, alpha: float, seed: int, fresh: bool, defects: tuple[str, ...]) -> dict[str, bytes]:
    """The bytes of the three files."""
    adapter, base = sample_tensors(r, alpha, seed, fresh, defects)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_dora": True, "use_rslora": False,
              "target_modules": ["q_proj", "v_proj"], "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}
    return {
        "adapter_model.safetensors": save({k: v.contiguous() for k, v in adapter.items()}),
        "adapter_config.json": (json.dumps(config, indent=2) + "\n").encode(),
        "base_model.safetensors": save({k: v.contiguous() for k, v in base.items()}),
    }


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first (what mkdir(parents=True) makes)."""
    missing = []
    path = folder.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove(paths: list[Path], folders: list[Path]) -> None:
    """Remove the files this run wrote, then the folders it made (deepest first; only if empty)."""
    for path, remove in [*((p, os.remove) for p in paths), *((f, os.rmdir) for f in folders)]:
        try:
            remove(path)
        except OSError:
            pass
