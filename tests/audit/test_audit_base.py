"""``doracheck audit --base`` knows its base: the magnitudes of a DoRA adapter must follow the
row norms of the base it was trained on (``base.mismatch``), a base of other shapes is unusable
input (exit 2, one line), and files of the wrong kind are named for what they are."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from cli_run import one_line, run_clean, run_cli  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from doracheck.audit import audit_path  # noqa: E402


def tiny_llama(seed: int, dtype: torch.dtype, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).to(dtype)


def save_base(model: LlamaForCausalLM, path) -> None:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def trained_adapter(folder, dtype: torch.dtype, steps: int):
    """A DoRA adapter on every linear layer of a tiny LLaMA (seed 0) after ``steps`` AdamW steps
    (lr 1e-3: the magnitudes move by a median 2-5%), saved by PEFT; its base beside it."""
    base = tiny_llama(0, dtype)
    save_base(base, folder / "base.safetensors")
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 32), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(folder / "adapter"))
    return folder / "adapter"


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def trained(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    adapter = trained_adapter(folder, request.param, steps=100)
    save_base(tiny_llama(1, request.param), folder / "other_seed.safetensors")
    save_base(tiny_llama(0, request.param, hidden=96), folder / "other_shapes.safetensors")
    return folder, adapter


def mismatches(report) -> list[str]:
    return [m.name for m in report.modules for c in m.checks if c.id == "base.mismatch"]


def test_the_right_base_passes_a_trained_adapter(trained):
    folder, adapter = trained
    report = audit_path(adapter, base=folder / "base.safetensors", device="cpu")
    assert len(report.modules) == 14 and not mismatches(report)
    medians = [m.stats["base_agreement"]["median_abs_g_minus_1"] for m in report.modules]
    assert min(medians) > 0.02  # trained far enough that the correlation, not the g ≈ 1 guard, decides


def test_the_right_base_passes_a_fresh_adapter(tmp_path):
    adapter = trained_adapter(tmp_path, torch.bfloat16, steps=0)
    report = audit_path(adapter, base=tmp_path / "base.safetensors", device="cpu")
    assert not mismatches(report) and report.summary()["errors"] == 0


def test_a_base_of_another_seed_is_an_error_naming_the_modules(trained):
    folder, adapter = trained
    report = audit_path(adapter, base=folder / "other_seed.safetensors", device="cpu")
    named = mismatches(report)
    assert len(named) >= 12, named  # of 14; a module may pass by chance (a shuffle's noise at d_out = 32)
    assert any("do not follow this base's row norms" in note and named[0] in note for note in report.notes)
    proc = run_clean(["audit", str(adapter), "--base", str(folder / "other_seed.safetensors"), "--device", "cpu"], folder)
    assert proc.returncode == 1 and "base.mismatch" in proc.stdout


def test_a_base_of_other_shapes_is_one_line_and_exit_2(trained):
    folder, adapter = trained
    proc = run_cli(["audit", str(adapter), "--base", str(folder / "other_shapes.safetensors"), "--device", "cpu"], folder)
    line = one_line(proc)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "14 of the 14 DoRA modules it holds have weights of other shapes" in line and "where the adapter needs" in line


def test_files_of_the_wrong_kind_are_named_for_what_they_are(trained):
    folder, adapter = trained
    config = adapter / "adapter_config.json"
    proc = run_cli(["audit", str(config)], folder)
    assert proc.returncode == 2 and "this is a JSON file" in one_line(proc) and "header length" not in proc.stderr
    proc = run_cli(["audit", str(adapter), "--base", "/dev/null"], folder)
    assert proc.returncode == 2 and "is a device or special file" in one_line(proc)


def test_the_legend_comes_after_the_findings_and_is_off_under_ci_or_quiet(trained):
    folder, adapter = trained
    args = ["audit", str(adapter), "--base", str(folder / "other_seed.safetensors"), "--device", "cpu"]
    shown = run_clean(args, folder, env={"CI": ""}).stdout
    assert shown.count("legend:") == 1 and shown.index("findings:") < shown.index("legend:")
    assert "legend:" not in run_clean(args, folder).stdout  # run_cli sets CI=1, as CI runners do
    assert "legend:" not in run_clean([*args, "--quiet"], folder, env={"CI": ""}).stdout


def one_module_adapter(folder, W, delta: float, seed: int = 0):
    """A one-module DoRA adapter over ``W`` whose magnitudes moved by a relative ``delta`` (normal)
    from PEFT's init, saved with its config and base; returns the audit of it against that base."""
    import json

    import doracheck

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    d_out, d_in = W.shape
    A = torch.randn(8, d_in, generator=gen) * 0.01
    B = torch.randn(d_out, 8, generator=gen) * 0.001
    m = doracheck.factored_norm(W, A, B, 2.0) * (1 + delta * torch.randn(d_out, generator=gen))
    prefix = "base_model.model.layer.proj"
    save_file({f"{prefix}.lora_A.weight": A, f"{prefix}.lora_B.weight": B, f"{prefix}.lora_magnitude_vector": m},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "use_dora": True, "peft_type": "LORA",
                                                            "target_modules": ["proj"]}))
    save_file({"layer.proj.weight": W}, str(folder / "base.safetensors"))
    return audit_path(folder, base=folder / "base.safetensors", device="cpu").modules[0]


@pytest.mark.parametrize("case", ["wide_random", "orthonormal_rows", "identity_rows"])
def test_the_right_base_whose_rows_cannot_tell_bases_apart_is_inconclusive_never_a_mismatch(tmp_path, case):
    """Row norms spread less than training moved the magnitudes (a wide random layer, an orthogonal
    init, equal rows): the right base cannot be told from another, so no error is raised."""
    gen = torch.Generator().manual_seed(1)
    W = {"wide_random": lambda: torch.randn(256, 8192, generator=gen) * 0.02,
         "orthonormal_rows": lambda: torch.linalg.qr(torch.randn(1024, 256, generator=gen))[0].T.contiguous(),
         "identity_rows": lambda: torch.eye(16, 64)}[case]()
    module = one_module_adapter(tmp_path, W, delta=0.1)
    ids = {c.id for c in module.checks}
    assert "base.mismatch" not in ids and "base.inconclusive" in ids, ids
