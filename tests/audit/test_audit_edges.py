"""Audit of an fp8 base layer, with JSON that never holds Infinity."""

from __future__ import annotations

import json

import pytest
import torch


def test_audit_fp8_base_and_json_without_infinity(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from doracheck.audit.sample import write_sample
    from doracheck.cli.main import main

    folder = write_sample(tmp_path / "s")
    with safe_open(str(folder / "base_model.safetensors"), "pt") as f:
        base = {k: f.get_tensor(k).to(torch.float8_e4m3fn) for k in f.keys()}
    save_file(base, str(folder / "base_model.safetensors"))
    code = main(["audit", str(folder), "--base", str(folder / "base_model.safetensors"), "--json", "--device", "cpu"])
    out = capsys.readouterr().out
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert code == 1
    assert "structure.dtype" in {c["id"] for m in doc["modules"] for c in m["checks"]}
