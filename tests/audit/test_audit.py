"""``doracheck audit`` on adapters written by PEFT's own save_pretrained and on damaged files.

- Norms the audit reports equal the fp64 oracle within the norm budget (with base weights,
  rsLoRA, rank_pattern/alpha_pattern), for a plain file, a folder and a sharded base folder.
- A healthy adapter exits 0; NaN, a zeroed magnitude and a mismatched shape exit 1 with the
  right check ids; kohya/LyCORIS naming is recognised and not mis-audited.
- Hostile files (truncated, corrupt or oversized headers, overlapping offsets, wrong dtypes,
  missing pieces) exit 2 with a one-line message naming the file, never a traceback.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from doracheck.audit import AuditInputError, audit_path
from doracheck.audit.sample import write_sample
from doracheck.cli.main import main
from doracheck.properties import budget_for, device_family
from doracheck.reference import norm_terms_ref, rel_l2


def run_cli(*args: str, capsys=None) -> tuple[int, str, str]:
    code = main(["audit", *args])
    out, err = capsys.readouterr() if capsys else ("", "")
    return code, out, err


# --- adapters written by PEFT ------------------------------------------------------------


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"q_proj": torch.nn.Linear(24, 16), "v_proj": torch.nn.Linear(24, 8, bias=False)}) for _ in range(2)
        )

    def forward(self, x):
        return x


def _peft_adapter(tmp_path: Path, **config) -> tuple[Path, Path, dict]:
    """Save a PEFT DoRA adapter with random non-zero B and magnitude; returns (folder, base file, {module: (W, A, B, m, s)})."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = Toy()
    base_file = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(base_file))
    cfg = peft.LoraConfig(use_dora=True, target_modules=["q_proj", "v_proj"], **config)
    pm = peft.get_peft_model(model, cfg)
    expected = {}
    gen = torch.Generator().manual_seed(1)
    for name, module in pm.named_modules():
        if hasattr(module, "lora_magnitude_vector") and "default" in getattr(module, "lora_A", {}):
            with torch.no_grad():
                module.lora_B["default"].weight.normal_(0, 0.1, generator=gen)
                mag = module.lora_magnitude_vector["default"].weight
                mag.mul_(1 + 0.01 * torch.randn(mag.shape, generator=gen))
            short = name.removeprefix("base_model.model.")
            expected[short] = (
                module.base_layer.weight.detach().clone(),
                module.lora_A["default"].weight.detach().clone(),
                module.lora_B["default"].weight.detach().clone(),
                module.lora_magnitude_vector["default"].weight.detach().clone(),
                module.scaling["default"],
            )
    folder = tmp_path / "adapter"
    pm.save_pretrained(str(folder))
    return folder, base_file, expected


@pytest.mark.parametrize(
    "config",
    [
        {"r": 4, "lora_alpha": 8},
        {"r": 4, "lora_alpha": 8, "use_rslora": True},
        {"r": 4, "lora_alpha": 8, "rank_pattern": {"layers.1.q_proj": 2}, "alpha_pattern": {"v_proj": 3}},
    ],
    ids=["plain", "rslora", "patterns"],
)
def test_norms_match_fp64_oracle(tmp_path, config):
    folder, base_file, expected = _peft_adapter(tmp_path, **config)
    report = audit_path(folder, base=base_file, device="cpu")
    assert report.summary()["errors"] == 0, [c for m in report.modules for c in m.checks if c.severity == "error"]
    budget = budget_for("norm", "norm", "fp32", device_family("cpu")).rel_l2
    assert {m.name for m in report.modules} == set(expected)
    for module in report.modules:
        W, A, B, m, s = expected[module.name]
        assert module.scaling == pytest.approx(s, rel=1e-12), (module.name, module.scaling, s)
        assert module.r == A.shape[0]
        ref = norm_terms_ref(W, A, B, s).norm
        assert module.norm is not None and rel_l2(module.norm, ref) <= budget
        assert any(c.id == "merge.ulp" for c in module.checks)


def test_without_base_structure_only(tmp_path, capsys):
    folder, _, _ = _peft_adapter(tmp_path, r=4, lora_alpha=8)
    code, out, _ = run_cli(str(folder), capsys=capsys)
    assert code == 0
    assert "no --base" in out


def test_json_shape(tmp_path, capsys):
    folder = write_sample(tmp_path / "s")
    code, out, _ = run_cli(str(folder), "--base", str(folder / "base_model.safetensors"), "--json", "--device", "cpu", capsys=capsys)
    assert code == 0
    doc = json.loads(out)
    assert set(doc) >= {"path", "format", "modules", "summary"}
    assert doc["format"] == "peft" and doc["summary"] == {**doc["summary"], "modules": 4, "errors": 0, "warnings": 0}
    for module in doc["modules"]:
        assert set(module) >= {"name", "r", "d_in", "d_out", "scaling", "checks"}
        assert all(set(c) == {"id", "severity", "message"} and c["severity"] in ("error", "warning", "info") for c in module["checks"])


@pytest.mark.parametrize(
    "defect,check_id",
    [("nan", "finite.lora_B"), ("zero_magnitude", "magnitude.nonpositive"), ("bad_shape", "structure.shape")],
)
def test_damaged_adapter_exits_1_with_check_id(tmp_path, capsys, defect, check_id):
    folder = write_sample(tmp_path / defect, defects=(defect,))
    code, out, _ = run_cli(str(folder), "--base", str(folder / "base_model.safetensors"), "--json", "--device", "cpu", capsys=capsys)
    assert code == 1
    ids = {c["id"] for m in json.loads(out)["modules"] for c in m["checks"] if c["severity"] == "error"}
    assert check_id in ids


def test_sharded_base_and_explicit_config(tmp_path):
    folder = write_sample(tmp_path / "s")
    from safetensors import safe_open

    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    weight_map = {}
    with safe_open(str(folder / "base_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for i, key in enumerate(keys):
            shard = f"model-{i % 2:05d}-of-00002.safetensors"
            weight_map[key] = shard
        for shard in set(weight_map.values()):
            save_file({k: f.get_tensor(k) for k in keys if weight_map[k] == shard}, str(shard_dir / shard))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = tmp_path / "elsewhere.json"
    config.write_text((folder / "adapter_config.json").read_text())
    report = audit_path(folder / "adapter_model.safetensors", base=shard_dir, config=config, device="cpu")
    assert report.summary()["errors"] == 0 and all(m.norm is not None for m in report.modules)


def test_kohya_naming_is_recognised_not_misaudited(tmp_path, capsys):
    path = tmp_path / "kohya.safetensors"
    save_file(
        {
            "lora_unet_block_0_proj.lora_down.weight": torch.randn(4, 12),
            "lora_unet_block_0_proj.lora_up.weight": torch.randn(10, 4),
            "lora_unet_block_0_proj.dora_scale": torch.rand(1, 12),
            "lora_unet_block_0_proj.alpha": torch.tensor(4.0),
        },
        str(path),
    )
    code, out, _ = run_cli(str(path), "--json", capsys=capsys)
    doc = json.loads(out)
    assert code == 0 and doc["format"] == "kohya"
    checks = doc["modules"][0]["checks"]
    assert any(c["id"] == "format.kohya" and "per input feature" in c["message"] for c in checks)
    assert not any(c["id"].startswith(("norm.", "merge.")) for c in checks)


def test_zero_row_and_cancellation_are_reported(tmp_path):
    folder = write_sample(tmp_path / "s")
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(folder / "base_model.safetensors"), "pt") as f:
        base = {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.0.self_attn.q_proj"
    prefix = f"base_model.model.{name}"
    base[f"{name}.weight"][2] = 0
    tensors[f"{prefix}.lora_B.weight"][2] = 0
    A, B = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
    base[f"{name}.weight"][4] = (-2.0 * (B[4:5] @ A)).to(torch.bfloat16)[0]  # W row cancels s·B·A (s = 2)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    save_file(base, str(folder / "base_model.safetensors"))
    report = audit_path(folder, base=folder / "base_model.safetensors", device="cpu")
    ids = {c.id for c in report.modules[0].checks}
    assert {"norm.zero", "norm.cancellation"} <= ids


# --- hostile input ---------------------------------------------------------------------


def _valid_bytes(tmp_path: Path) -> bytes:
    folder = write_sample(tmp_path / "valid")
    return (folder / "adapter_model.safetensors").read_bytes()


def _with_header(data: bytes, mutate) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def _first(h):
    return next(k for k in h if k != "__metadata__")


MUTATIONS = {
    "empty": lambda d: b"",
    "short": lambda d: d[:5],
    "truncated_data": lambda d: d[: len(d) - 17],
    "truncated_header": lambda d: d[:40],
    "huge_header_len": lambda d: struct.pack("<Q", 2**62) + d[8:],
    "header_past_end": lambda d: struct.pack("<Q", len(d)) + d[8:],
    "not_json": lambda d: struct.pack("<Q", 16) + b"{not json at all" + d[24:],
    "json_list": lambda d: struct.pack("<Q", 2) + b"[]" + d[10:],
    "bad_utf8": lambda d: struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc" + d[12:],
    "unknown_dtype": lambda d: _with_header(d, lambda h: h[_first(h)].__setitem__("dtype", "Q99")),
    "negative_shape": lambda d: _with_header(d, lambda h: h[_first(h)].__setitem__("shape", [-1, 4])),
    "shape_size_mismatch": lambda d: _with_header(d, lambda h: h[_first(h)].__setitem__("shape", [3, 3])),
    "offsets_past_end": lambda d: _with_header(d, lambda h: h[_first(h)].__setitem__("data_offsets", [0, 10**12])),
    "offsets_reversed": lambda d: _with_header(d, lambda h: h[_first(h)].__setitem__("data_offsets", [8, 0])),
    "overlap": lambda d: _with_header(
        d, lambda h: [h[k].__setitem__("data_offsets", [0, h[k]["data_offsets"][1] - h[k]["data_offsets"][0]]) for k in list(h)[:2]]
    ),
    "bad_metadata": lambda d: _with_header(d, lambda h: h.__setitem__("__metadata__", {"a": 1})),
    "no_lora_tensors": lambda d: _with_header(d, lambda h: [h.__setitem__(k.replace("lora", "xx"), h.pop(k)) for k in list(h)]),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_hostile_file_exits_2_with_one_line(tmp_path, capsys, name):
    data = MUTATIONS[name](_valid_bytes(tmp_path))
    bad = tmp_path / "adapter_model.safetensors"
    bad.write_bytes(data)
    tracemalloc.start()
    code, out, err = run_cli(str(bad), capsys=capsys)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert code == 2, (name, code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in err
    assert peak < len(data) + 4 * 2**20, f"{name}: Python peak {peak} bytes for a {len(data)}-byte file"


def test_integer_tensor_is_a_dtype_finding(tmp_path, capsys):
    """A well-formed file whose lora_A is int32 (same byte size as fp32): exit 1, structure.dtype."""
    data = _with_header(_valid_bytes(tmp_path), lambda h: h["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].__setitem__("dtype", "I32"))
    path = tmp_path / "int.safetensors"
    path.write_bytes(data)
    code, out, _ = run_cli(str(path), "--json", capsys=capsys)
    assert code == 1
    assert "structure.dtype" in {c["id"] for m in json.loads(out)["modules"] for c in m["checks"]}


def test_missing_paths_and_files(tmp_path, capsys):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    for args in ([str(empty_dir)], [str(tmp_path / "nope.safetensors")]):
        code, _, err = run_cli(*args, capsys=capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1
    folder = write_sample(tmp_path / "s")
    code, _, err = run_cli(str(folder), "--base", str(tmp_path / "nobase"), capsys=capsys)
    assert code == 2 and "nobase" in err
    (folder / "adapter_config.json").write_text("{r: 4")
    code, _, err = run_cli(str(folder), capsys=capsys)
    assert code == 2 and "adapter_config.json" in err


def test_missing_magnitude_is_an_error(tmp_path, capsys):
    folder = write_sample(tmp_path / "s")
    data = (folder / "adapter_model.safetensors").read_bytes()
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "layers.1.self_attn.v_proj.lora_magnitude" not in k}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    assert len(data) > 0
    code, out, _ = run_cli(str(folder), "--json", capsys=capsys)
    assert code == 1
    ids = {c["id"] for m in json.loads(out)["modules"] for c in m["checks"]}
    assert "structure.missing" in ids


def test_random_byte_flips_never_raise(tmp_path, capsys):
    """Mutation fuzz: flip bytes anywhere in the header; every case exits 0, 1 or 2, never raises."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    data = _valid_bytes(tmp_path)
    (n,) = struct.unpack("<Q", data[:8])
    bad = tmp_path / "fuzz.safetensors"

    @hypothesis.given(st.lists(st.tuples(st.integers(0, 8 + n - 1), st.integers(0, 255)), min_size=1, max_size=6))
    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    def flip(edits):
        mutated = bytearray(data)
        for pos, value in edits:
            mutated[pos] = value
        bad.write_bytes(bytes(mutated))
        code, _, err = run_cli(str(bad), capsys=capsys)
        assert code in (0, 1, 2)
        if code == 2:
            assert len(err.strip().splitlines()) == 1

    flip()


def test_audit_input_error_is_one_line(tmp_path):
    with pytest.raises(AuditInputError) as info:
        audit_path(tmp_path / "missing")
    message = str(info.value)
    assert "\n" not in message and "missing" in message  # one line, naming what the user passed


def test_streaming_reads_only_matched_base_weights(tmp_path, monkeypatch):
    """The base model is read one matched weight at a time; unrelated tensors (here a 16 MiB
    embedding) are never loaded."""
    from safetensors import safe_open

    from doracheck.audit import reader

    folder = write_sample(tmp_path / "s")
    with safe_open(str(folder / "base_model.safetensors"), "pt") as f:
        base = {k: f.get_tensor(k) for k in f.keys()}
    base["model.embed_tokens.weight"] = torch.zeros(4096, 1024)
    save_file(base, str(folder / "base_model.safetensors"))
    read = []
    original = reader.BaseWeights.get

    def spy(self, key):
        read.append(key)
        return original(self, key)

    monkeypatch.setattr(reader.BaseWeights, "get", spy)
    report = audit_path(folder, base=folder / "base_model.safetensors", device="cpu")
    assert report.summary()["errors"] == 0
    assert sorted(read) == sorted(f"{m.name}.weight" for m in report.modules)
