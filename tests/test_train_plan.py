"""The training plan of a PEFT DoRA layer (doracheck/integrations/peft_train.py).

After a training call that the general path checked in full, a layer keeps a plan per adapter;
later training calls run through it while everything it was made from is unchanged. These
check, on the CPU (torch twin, and the Triton kernels under the interpreter), that training
with plans is bitwise training without them (the loop users run: gradient checkpointing, fused
AdamW, accumulation), that the plan is not used once anything it was made from changed, that
unusual calls take the general path (which handles or names them), and that a plan neither
survives a copy nor keeps the layer's tensors alive.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

pytest.importorskip("peft")

from peft_models import count_plan_runs, dora_model, enabled_biased_mlp, tokens  # noqa: E402

from doracheck.dispatch import use_path  # noqa: E402
from doracheck.integrations import peft_train  # noqa: E402
from doracheck.integrations.peft import enable  # noqa: E402
from doracheck.norm_cache import clear_norm_cache  # noqa: E402


@pytest.fixture
def plan_runs(monkeypatch):
    """Each training call a kept plan was asked about: True where it ran the call."""
    return count_plan_runs(monkeypatch, peft_train.TrainPlan)


@pytest.fixture
def plans_on(monkeypatch):
    monkeypatch.setattr(peft_train, "ENABLED", True)


def _trained(plans: bool, steps: int, checkpointing: bool = True, accumulate: int = 1, device: str = "cpu",
             dtype: torch.dtype = torch.float32):
    """(losses, trainable parameters) of an enabled DoRA model after ``steps`` fused AdamW steps."""
    clear_norm_cache()
    model = dora_model(0, dtype=dtype).to(device)
    enable(model)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    losses = []
    peft_train.ENABLED = plans
    try:
        for step in range(steps):
            for micro in range(accumulate):
                ids = tokens(seed=10 * step + micro, batch=2, length=8, device=device)
                loss = model(ids, labels=ids).loss / accumulate
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        peft_train.ENABLED = True
    return torch.stack(losses), [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.fixture
def plans_kept(monkeypatch):
    """How many times the general path kept a plan."""
    kept = []
    real = peft_train.keep_plan

    def counted(*args):
        kept.append(1)
        return real(*args)

    monkeypatch.setattr(peft_train, "keep_plan", counted)
    return kept


@pytest.mark.parametrize("checkpointing,accumulate", [(True, 1), (False, 2)], ids=["checkpointing", "accumulation"])
def test_training_with_plans_is_bitwise_training_without(plan_runs, plans_kept, checkpointing, accumulate):
    with use_path("torch"):
        want_losses, want = _trained(False, 3, checkpointing, accumulate)
        assert plan_runs == [] and plans_kept == []
        got_losses, got = _trained(True, 3, checkpointing, accumulate)
    # 14 layers: each planned once by its first call, every later call through its plan (the
    # checkpoint recompute too; it stops early, before some down_proj calls)
    assert len(plans_kept) == 14 and all(plan_runs)
    assert len(plan_runs) >= 14 * (3 * accumulate - 1)
    assert torch.equal(got_losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_bytes,fold_bytes", [(1, 4 * 2**20), (300, 1)], ids=["token_chunks", "chunks_folded"])
def test_chunked_backward_with_plans_is_bitwise_without(plan_runs, monkeypatch, dtype, chunk_bytes, fold_bytes):
    """The planned backward's token chunks (``backward.planned_backward``): one token a chunk, or
    uneven chunks with the dm partials folded after every chunk; fp32 runs the prescaled pass
    (dz·B, dB and dx's low-rank term over all tokens at once), bf16 on the CPU the per-chunk one."""
    from doracheck import backward
    from doracheck.kernels import settings

    monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(backward, "_DM_PARTS_BYTES", fold_bytes)
    with use_path("torch"):
        want_losses, want = _trained(False, 2, dtype=dtype)
        got_losses, got = _trained(True, 2, dtype=dtype)
    assert plan_runs and all(plan_runs)
    assert torch.equal(got_losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run (the GPU tests cover CUDA)")
def test_training_with_plans_is_bitwise_without_them_on_the_triton_kernels(plan_runs):
    pytest.importorskip("triton")
    with use_path("triton"):
        want_losses, want = _trained(False, 2)
        got_losses, got = _trained(True, 2)
    assert plan_runs and all(plan_runs)
    assert torch.equal(got_losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_plans_cover_fp32_adapters_on_a_bf16_model_bitwise(plan_runs):
    """PEFT's default for a bf16 model: fp32 adapters, x cast to fp32 before the variant, the
    base output in bf16 (the general path casts x back, and so does the plan's forward)."""
    with use_path("torch"):
        want_losses, want = _trained(False, 2, dtype=torch.bfloat16)
        got_losses, got = _trained(True, 2, dtype=torch.bfloat16)
    assert plan_runs and all(plan_runs)
    assert torch.equal(got_losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "plain"])
def test_gpu_training_with_plans_is_bitwise_without_them_in_bf16(plan_runs, checkpointing):
    """The Triton kernels on CUDA (norm graph replays, fast launches), bf16, fused AdamW."""
    with use_path("auto"):
        want_losses, want = _trained(False, 4, checkpointing, device="cuda", dtype=torch.bfloat16)
        got_losses, got = _trained(True, 4, checkpointing, device="cuda", dtype=torch.bfloat16)
    assert plan_runs and all(plan_runs)
    assert torch.equal(got_losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _layer_with_plan(dtype=torch.float32, **config):
    clear_norm_cache()
    model = dora_model(0, dtype=dtype, **config)
    enable(model)
    model.train()
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    x = torch.randn(2, 3, 32, dtype=dtype, requires_grad=True)
    layer(x)  # the general path checks in full and keeps a plan
    assert "default" in layer.__dict__[peft_train._TRAIN_PLANS]
    return model, layer, x


def _planned(layer, x, kwargs=None):
    """The planned call's output (None where the plan declines), on a fresh base output."""
    with torch.autocast("cpu", enabled=False):
        result = layer.base_layer(x)
    return peft_train.train_forward(layer, "default", x, result, kwargs or {})


def _second_adapter(layer):
    import peft

    model = layer  # the layer alone: a second DoRA adapter active after the first
    model.update_layer("other", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=True, use_rslora=False,
                       use_dora=True, lora_bias=False, config=peft.LoraConfig(r=4, lora_alpha=8, use_dora=True))
    model.set_adapter(["other", "default"])


@pytest.mark.parametrize("case", ["plain", "second_adapter_first", "dropout_in_training", "variant_kwargs", "trainable_base",
                                  "fp64_x", "autocast", "not_recorded", "no_grad_tensor_subclass", "fan_in_fan_out",
                                  "bias_not_a_parameter", "B_of_another_dtype", "scaling", "new_B", "new_dropout"])
def test_the_plan_declines_what_it_does_not_cover(plans_on, case):
    """Only the plain call is answered; everything else gets None, and the general path (which
    handles it or names the problem) runs."""
    _, layer, x = _layer_with_plan()
    kwargs: dict = {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast")
    if case == "second_adapter_first":
        _second_adapter(layer)
    elif case == "dropout_in_training":
        layer.lora_dropout["default"] = torch.nn.Dropout(0.1)
    elif case == "variant_kwargs":
        kwargs = {"alora_offsets": [1, 2]}
    elif case == "trainable_base":
        layer.base_layer.weight.requires_grad_(True)
    elif case == "fp64_x":
        x = x.detach().double().requires_grad_()
    elif case == "not_recorded":  # nothing requires grad: the general path's no-autograd forward
        x = x.detach()
        for p in layer.parameters():
            p.requires_grad_(False)
    elif case == "no_grad_tensor_subclass":
        x = torch.nn.Parameter(x.detach())  # not a plain tensor
    elif case == "fan_in_fan_out":
        layer.fan_in_fan_out = True
    elif case == "bias_not_a_parameter":  # as pruning or a parametrization leaves it
        del layer.base_layer._parameters["bias"]
        layer.base_layer.bias = torch.ones(64)
    elif case == "B_of_another_dtype":
        B = layer.lora_B["default"].weight
        B.data = B.data.double()
    elif case == "scaling":
        layer.scaling["default"] = 3.0
    elif case == "new_B":
        layer.lora_B["default"].weight = torch.nn.Parameter(layer.lora_B["default"].weight.detach() * 1.5)
    elif case == "new_dropout":
        layer.lora_dropout["default"] = torch.nn.Identity()
    with autocast:
        got = _planned(layer, x, kwargs) if case != "fp64_x" else _planned(layer, x.float(), kwargs)
    if case == "fp64_x":  # x of another dtype than the plan was made for (fp64: the general path)
        with torch.autocast("cpu", enabled=False):
            got = peft_train.train_forward(layer, "default", x, layer.base_layer(x.float()), {})
    assert (got is not None) == (case == "plain"), case


def test_a_planned_call_is_the_general_call_bitwise_with_a_bias(plans_on, plan_runs, monkeypatch):
    m = enabled_biased_mlp()
    x = torch.randn(5, 16, requires_grad=True)

    def run():
        y = m(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *(p for p in m.parameters() if p.requires_grad)])
        return y.detach(), grads

    first, second = run(), run()
    assert plan_runs == [True, True]
    monkeypatch.setattr(peft_train, "ENABLED", False)
    general = run()
    assert plan_runs == [True, True]
    for got in (first, second):
        assert torch.equal(got[0], general[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], general[1]))


def test_after_a_plan_a_bad_parameter_still_gets_the_named_error(plans_on):
    _, layer, x = _layer_with_plan()
    A = layer.lora_A["default"].weight
    A.data = torch.randn(A.shape[0] + 1, A.shape[1])  # the rank of A no longer that of B
    with pytest.raises(ValueError, match=r"lora_B: expected shape \(64, 9\), got \(64, 8\)"):
        layer(x)


def test_an_inplace_change_between_forward_and_backward_is_refused_through_the_plan(plans_on, plan_runs):
    _, layer, x = _layer_with_plan()
    y = layer(x)
    assert plan_runs == [True]
    with torch.no_grad():
        layer.lora_A["default"].weight.mul_(2)
    with pytest.raises(RuntimeError, match="lora_A: modified by an inplace operation"):
        y.sum().backward()


def test_plans_are_dropped_by_copies_and_keep_nothing_alive(plans_on, plan_runs):
    model, layer, x = _layer_with_plan()
    plans = layer.__dict__[peft_train._TRAIN_PLANS]
    assert copy.deepcopy(layer).__dict__[peft_train._TRAIN_PLANS] == {}
    old_B = weakref.ref(layer.lora_B["default"].weight)
    layer.lora_B["default"].weight = torch.nn.Parameter(layer.lora_B["default"].weight.detach() * 1.5)
    gc.collect()
    assert old_B() is None  # the plan refers to it weakly
    layer(x)
    assert plan_runs == [False]  # the general path ran and planned anew
    assert plans["default"] is layer.__dict__[peft_train._TRAIN_PLANS]["default"]
    layer(x)
    assert plan_runs == [False, True]


def test_plans_off_by_the_switch(plan_runs, monkeypatch):
    monkeypatch.setattr(peft_train, "ENABLED", False)
    clear_norm_cache()
    model = dora_model(0)
    enable(model)
    model.train()
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    x = torch.randn(2, 3, 32, requires_grad=True)
    layer(x)
    layer(x)
    assert plan_runs == [] and not layer.__dict__.get(peft_train._TRAIN_PLANS)


def test_a_meta_model_trains_through_its_plans():
    """Meta tensors (a model sized before it is materialised): autocast has no meta device, and a
    plan asked torch about it directly, which raised on the second call (found in review)."""
    clear_norm_cache()
    model = dora_model(0)
    enable(model)
    model.train()
    model = model.to("meta")
    ids = tokens().to("meta")
    for _ in range(2):
        assert model(ids).logits.shape == (2, 12, 96)


def test_a_parameter_written_with_an_inference_tensor_is_refused_as_by_the_general_path(plans_on, plan_runs):
    """A ``.data`` write of an inference tensor keeps the parameter object and makes it an
    inference tensor: the general path refuses to save it for the backward; the plan must not
    hold it on the ctx instead (found in review: it trained silently)."""
    _, layer, x = _layer_with_plan()
    A = layer.lora_A["default"].weight
    with torch.inference_mode():
        A.data = A.detach().clone()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        layer(x)
    assert plan_runs == [False]

