"""A small sample DoRA adapter in PEFT's on-disk format, with its base model, for demos and tests.

``write_sample(folder)`` writes adapter_model.safetensors, adapter_config.json and
base_model.safetensors (a 2-layer toy with q/v projections, r = 8, alpha = 16); the
``defects`` argument plants problems the audit must find.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from doracheck.reference import norm_terms_ref

LAYERS = {"model.layers.0.self_attn.q_proj": (64, 96), "model.layers.0.self_attn.v_proj": (32, 96),
          "model.layers.1.self_attn.q_proj": (64, 96), "model.layers.1.self_attn.v_proj": (32, 96)}


def write_sample(folder: str | Path, *, r: int = 8, alpha: float = 16.0, seed: int = 0, defects: tuple[str, ...] = ()) -> Path:
    """Write the sample; defects: "nan" (NaN in one lora_B), "zero_magnitude", "bad_shape"."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    adapter: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    s = alpha / r
    for i, (name, (d_out, d_in)) in enumerate(LAYERS.items()):
        W = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(torch.bfloat16)
        A = torch.randn(r, d_in, generator=gen) / d_in**0.5
        B = torch.randn(d_out, r, generator=gen) * 0.02
        n = norm_terms_ref(W, A, B, s).norm
        m = (n * (1 + 1e-3 * torch.randn(d_out, generator=gen, dtype=torch.float64))).float()
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
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / "adapter_model.safetensors"))
    save_file({k: v.contiguous() for k, v in base.items()}, str(folder / "base_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_dora": True, "use_rslora": False,
              "target_modules": ["q_proj", "v_proj"], "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
