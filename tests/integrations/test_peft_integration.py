"""``doracheck.integrations.peft``: PEFT models run through doracheck and behave as PEFT.

On a tiny LLaMA-style model built from a transformers config (CPU, fp32): logits of an
enabled model against plain PEFT (cosine >= 0.99999), 200 AdamW steps side by side (mean
|Δloss| <= 1e-3, final adapters close), save with one and load with the other, and PEFT's
own DoRA behaviours with enable on: merge/unmerge, several adapters with set_adapter,
disable_adapter, dropout, fan_in_fan_out (GPT-2 Conv1D), and what stays on PEFT's path.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft_models import TARGETS, cosine, dora_model, tiny_llama, tokens  # noqa: E402

from doracheck.dispatch import use_path  # noqa: E402
from doracheck.integrations.peft import disable, enable, enabled_adapters  # noqa: E402
from doracheck.reference import rel_l2  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_path():
    with use_path("torch"):
        yield


def test_enable_routes_every_dora_linear_and_disable_restores():
    model = dora_model()
    enable(model)
    assert len(enabled_adapters(model)) == 2 * len(TARGETS)
    disable(model)
    assert enabled_adapters(model) == []


def test_logits_match_plain_peft():
    plain = dora_model()
    ours = enable(copy.deepcopy(plain))
    ids = tokens()
    with torch.no_grad():
        a = plain(ids).logits
        b = ours(ids).logits
    assert cosine(a, b) >= 0.99999
    assert rel_l2(b, a) <= 1e-5


def test_training_200_steps_matches_plain_peft():
    plain = dora_model(seed=3)
    ours = enable(copy.deepcopy(plain))
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (plain, ours)]
    deltas = []
    for step in range(200):
        ids = tokens(seed=step, batch=2, length=10)
        losses = []
        for model, opt in zip((plain, ours), opts):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(float(loss))
        deltas.append(abs(losses[0] - losses[1]))
    assert sum(deltas) / len(deltas) <= 1e-3, max(deltas)
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        if p.requires_grad:
            assert rel_l2(q, p) <= 1e-3, name


def test_save_with_one_load_with_the_other(tmp_path):
    ours = enable(dora_model(seed=5))
    ids = tokens(seed=1)
    with torch.no_grad():
        expected = ours(ids).logits
    ours.save_pretrained(str(tmp_path / "a"))
    loaded = peft.PeftModel.from_pretrained(tiny_llama(5), str(tmp_path / "a"))
    with torch.no_grad():
        assert rel_l2(loaded(ids).logits, expected) <= 1e-5
    # and the other way round: saved by plain PEFT, loaded and enabled
    plain = dora_model(seed=6)
    plain.save_pretrained(str(tmp_path / "b"))
    reloaded = enable(peft.PeftModel.from_pretrained(tiny_llama(6), str(tmp_path / "b")))
    with torch.no_grad():
        assert rel_l2(reloaded(ids).logits, plain(ids).logits) <= 1e-5
    assert set(plain.state_dict()) == set(ours.state_dict())


def test_merge_unmerge_disable_adapter():
    model = enable(dora_model(seed=7))
    ids = tokens(seed=2)
    with torch.no_grad():
        unmerged = model(ids).logits
        model.merge_adapter()
        merged = model(ids).logits
        model.unmerge_adapter()
        again = model(ids).logits
        with model.disable_adapter():
            base_only = model(ids).logits
    base = tiny_llama(7)
    with torch.no_grad():
        expected_base = base(ids).logits
    assert rel_l2(merged, unmerged) <= 1e-5
    assert rel_l2(again, unmerged) <= 1e-6
    assert rel_l2(base_only, expected_base) <= 1e-6


def test_several_adapters_and_set_adapter():
    plain = dora_model(seed=8)
    plain.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=["q_proj", "v_proj"], use_rslora=True))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B.second" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    ours = enable(copy.deepcopy(plain))
    assert any("[second]" in a for a in enabled_adapters(ours))
    ids = tokens(seed=3)
    for adapter in ("default", "second"):
        plain.set_adapter(adapter)
        ours.set_adapter(adapter)
        with torch.no_grad():
            assert rel_l2(ours(ids).logits, plain(ids).logits) <= 1e-5, adapter


def test_dropout_in_training_matches_peft_mask_for_mask():
    """Accelerated dropout draws PEFT's own keep-mask (same RNG use): forward and gradients agree."""
    plain = dora_model(seed=9, dropout=0.1)
    ours = enable(copy.deepcopy(plain))
    plain.train()
    ours.train()
    ids = tokens(seed=4)
    torch.manual_seed(11)
    a = plain(ids, labels=ids)
    torch.manual_seed(11)
    b = ours(ids, labels=ids)
    assert rel_l2(b.logits, a.logits) <= 1e-5
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        if p.requires_grad:
            assert rel_l2(q.grad, p.grad) <= 1e-4, name
    plain.eval()
    ours.eval()
    with torch.no_grad():
        assert rel_l2(ours(ids).logits, plain(ids).logits) <= 1e-5


def test_fan_in_fan_out_conv1d():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    gpt2 = transformers.GPT2LMHeadModel(config)
    plain = peft.get_peft_model(gpt2, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    ours = enable(copy.deepcopy(plain))
    assert enabled_adapters(ours)
    ids = tokens(seed=5)
    with torch.no_grad():
        assert rel_l2(ours(ids).logits, plain(ids).logits) <= 1e-5
    xs = ids
    la = plain(xs, labels=xs).loss
    lb = ours(xs, labels=xs).loss
    la.backward()
    lb.backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        if p.requires_grad:
            assert rel_l2(q.grad, p.grad) <= 1e-4, name


def test_embedding_dora_stays_on_peft_path_with_one_log_line(caplog):
    model = peft.get_peft_model(tiny_llama(1), peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["embed_tokens", "q_proj"]))
    with caplog.at_level(logging.INFO, logger="doracheck"):
        enable(model)
    assert any("stay on PEFT's path" in r.message for r in caplog.records)
    assert all("embed_tokens" not in a for a in enabled_adapters(model))
    assert any("q_proj" in a for a in enabled_adapters(model))


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the Triton path natively")
def test_logits_match_plain_peft_on_the_triton_path():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on machines without CUDA)")
    plain = dora_model(seed=12)
    ours = enable(copy.deepcopy(plain))
    ids = tokens(seed=6, batch=1, length=6)
    with torch.no_grad():
        expected = plain(ids).logits
        with use_path("triton"):
            got = ours(ids).logits
    assert cosine(got, expected) >= 0.99999
    assert rel_l2(got, expected) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the Triton path natively")
def test_dropout_training_on_the_triton_path():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on machines without CUDA)")
    plain = dora_model(seed=13, dropout=0.2)
    ours = enable(copy.deepcopy(plain))
    plain.train()
    ours.train()
    ids = tokens(seed=7, batch=1, length=6)
    torch.manual_seed(3)
    a = plain(ids, labels=ids)
    torch.manual_seed(3)
    with use_path("triton"):
        b = ours(ids, labels=ids)
        b.loss.backward()
    a.loss.backward()
    assert rel_l2(b.logits, a.logits) <= 1e-5
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        if p.requires_grad:
            assert rel_l2(q.grad, p.grad) <= 1e-4, name


def test_readme_with_peft_snippet_runs_as_written(tmp_path, caplog):
    """The README's "PEFT" block, executed as it stands, with a tiny model, two Trainer
    steps and a small data set in place of the names the reader supplies (up to ``disable``)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index("## PEFT"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    block = block[:block.index("doracheck.integrations.peft.disable")]  # checked enabled below
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)
    ds = [{"input_ids": ids[0], "labels": ids[0]} for ids in (tokens(seed=i, batch=1) for i in range(4))]
    namespace = {"base_model": tiny_llama(3), "args": args, "ds": ds}
    with caplog.at_level(logging.INFO, logger="doracheck"):
        exec(compile(block, "README.md", "exec"), namespace)
    assert enabled_adapters(namespace["model"])
    assert any("now run through doracheck" in r.message for r in caplog.records)
