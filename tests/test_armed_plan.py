"""The forward of an armed PEFT DoRA layer (doracheck/integrations/peft_armed.py).

An armed layer (inside ``generate``, or another forward the model's hook prepared without grad
mode) keeps a plan per adapter after its first full check, and later calls run through the plan
while everything it was made from is unchanged. These check, on the CPU (torch twin), that the
plan gives bitwise the general path's output, that it is dropped whenever anything it read
changes, that unusual calls take the general path, and that a plan neither survives a copy nor
keeps the layer's tensors alive. ``test_decode_plan_gpu.py`` checks the Triton launch it makes.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

pytest.importorskip("peft")

from peft_models import count_plan_runs, enabled_biased_mlp, enabled_dora_model, tokens  # noqa: E402

from doracheck import inference_norms  # noqa: E402
from doracheck.integrations import peft as integration  # noqa: E402
from doracheck.integrations import peft_armed  # noqa: E402


@pytest.fixture
def model():
    return enabled_dora_model(0)


@pytest.fixture
def plan_runs(monkeypatch):
    """How many armed calls the plans answered (not None)."""
    return count_plan_runs(monkeypatch, peft_armed.ArmedPlan)


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


def _general(monkeypatch, m, ids, call=_logits):
    """The same forward with the armed path off (every armed layer through the general path)."""
    with monkeypatch.context() as patch:
        patch.setattr(integration, "armed_forward", lambda *a: None)
        return call(m, ids)


def _layer(m):
    return m.base_model.model.model.layers[0].mlp.up_proj


def test_armed_layers_keep_a_plan_and_are_bitwise_the_general_path(model, plan_runs, monkeypatch):
    ids = tokens(18)
    first = _logits(model, ids)
    assert plan_runs == []  # the first call of each layer makes its plan
    second = _logits(model, ids)
    assert plan_runs == [True] * 14  # every layer (2 decoder layers x 7 projections) through its plan
    general = _general(monkeypatch, model, ids)
    assert torch.equal(first, general) and torch.equal(second, general)


def _armed_call(model, layer, x, kwargs=None):
    """The armed call of ``layer`` on ``x`` (its base output computed here), as a forward of the
    model prepares it."""
    holder = model.__dict__[inference_norms._HOLDER]
    with torch.no_grad():
        inference_norms._prepare(model, holder)
        try:
            result = layer.base_layer(x.float())
            return peft_armed.armed_forward(layer, "default", x, result, kwargs or {}), result
        finally:
            inference_norms._finish(holder)


@pytest.mark.parametrize("case", ["plain", "two_active", "dropout_in_training", "variant_kwargs", "trainable_base",
                                  "other_dtype", "unarmed", "non_contiguous", "bias_not_a_parameter", "autocast"])
@pytest.mark.parametrize("with_plan", [False, True], ids=["first_call", "plan_kept"])
def test_the_armed_path_declines_what_it_does_not_cover(model, case, with_plan, plan_runs):
    """Only the plain armed call is answered, with or without a plan kept from an earlier call;
    everything else gets None (the general path, which handles or names it). Under autocast a
    kept plan declines and the full checks answer (their numerics turn autocast off)."""
    layer = _layer(model)
    x = torch.randn(2, 3, 32)
    if with_plan:
        assert _armed_call(model, layer, x)[0] is not None
        assert "default" in layer.__dict__[peft_armed._PLANS]
    kwargs: dict = {}
    holder = model.__dict__[inference_norms._HOLDER]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast")
    with torch.no_grad(), autocast:
        inference_norms._prepare(model, holder)
        try:
            if case == "two_active":
                layer._active_adapter = ["default", "other"]
            elif case == "dropout_in_training":
                layer.lora_dropout["default"] = torch.nn.Dropout(0.1)
                layer.train()
            elif case == "variant_kwargs":
                kwargs = {"alora_offsets": [1, 2]}
            elif case == "trainable_base":
                layer.base_layer.weight.requires_grad_(True)
            elif case == "other_dtype":
                x = x.double()
            elif case == "unarmed":
                inference_norms._finish(holder)
            elif case == "bias_not_a_parameter":  # as pruning or a parametrization leaves it
                del layer.base_layer._parameters["bias"]
                layer.base_layer.bias = torch.ones(64)
            with torch.autocast("cpu", enabled=False):
                result = layer.base_layer(x.float())
            if case == "non_contiguous":
                result = result.transpose(0, 1).contiguous().transpose(0, 1)
            got = peft_armed.armed_forward(layer, "default", x, result, kwargs)
        finally:
            inference_norms._finish(holder)
    assert (got is not None) == (case in ("plain", "autocast"))
    assert plan_runs == ([True] if case == "plain" and with_plan else [False] if with_plan else [])


def _replace_B(layer):
    B = layer.lora_B["default"]
    B.weight = torch.nn.Parameter(B.weight.detach() * 1.5)


def _B_through_data(layer):
    B = layer.lora_B["default"].weight
    B.data = B.data * 1.5


def _m_through_data(layer):
    m = layer.lora_magnitude_vector["default"].weight
    m.data = m.data * 0.5


def _B_view_at_the_same_address(layer):  # same object, same address, other strides
    B = layer.lora_B["default"].weight
    B.data = B.data.t().contiguous().t()


def _scaling(layer):
    layer.scaling["default"] = 3.0


def _new_buffer(layer):
    name = layer.__dict__[inference_norms._NAMES]["default"]
    layer._buffers[name] = layer._buffers[name].clone()


def _replace_dropout(layer):
    layer.lora_dropout["default"] = torch.nn.Identity()


@pytest.mark.parametrize("change", [_replace_B, _B_through_data, _m_through_data, _B_view_at_the_same_address, _scaling,
                                    _new_buffer, _replace_dropout])
def test_a_plan_is_not_used_once_anything_it_was_made_from_changed(model, change, plan_runs, monkeypatch):
    """The call after the change is answered by the full checks (a new plan), bitwise the general
    path's output; the call after that by the new plan."""
    layer = _layer(model)
    x = torch.randn(2, 3, 32)
    _armed_call(model, layer, x)
    old_plan = layer.__dict__[peft_armed._PLANS]["default"]
    change(layer)
    got, _ = _armed_call(model, layer, x)
    assert plan_runs == [False]
    new_plan = layer.__dict__[peft_armed._PLANS]["default"]
    assert new_plan is not old_plan
    with monkeypatch.context() as patch:
        patch.setattr(peft_armed, "armed_forward", lambda *a: None)
        patch.setattr(integration, "armed_forward", lambda *a: None)
        holder = model.__dict__[inference_norms._HOLDER]
        with torch.no_grad():
            inference_norms._prepare(model, holder)
            try:
                want = layer(x)
            finally:
                inference_norms._finish(holder)
    assert torch.equal(got, want)
    again, _ = _armed_call(model, layer, x)
    assert plan_runs == [False, True] and torch.equal(again, want)


def test_a_layer_with_a_bias_runs_through_its_plan_bitwise(plan_runs, monkeypatch):
    m = enabled_biased_mlp()
    m.eval()
    x = torch.randn(5, 16)
    torch.set_grad_enabled(False)
    try:
        first, second = m(x), m(x)
        general = _general(monkeypatch, m, x, call=lambda m, x: m(x))
    finally:
        torch.set_grad_enabled(True)
    assert plan_runs == [True, True]
    assert torch.equal(first, second) and torch.equal(second, general)


def test_plans_are_dropped_by_copies_and_keep_nothing_alive(model):
    layer = _layer(model)
    _armed_call(model, layer, torch.randn(1, 2, 32))
    plans = layer.__dict__[peft_armed._PLANS]
    assert "default" in plans
    assert copy.deepcopy(layer).__dict__[peft_armed._PLANS] == {}
    assert copy.copy(plans) == {} and pickle.loads(pickle.dumps(plans)) == {}
    old_B = weakref.ref(layer.lora_B["default"].weight)
    _replace_B(layer)
    gc.collect()
    assert old_B() is None  # the plan refers to it weakly
    got, _ = _armed_call(model, layer, torch.randn(1, 2, 32))
    assert got is not None  # a plan whose parameter is gone does not match; the full checks answer


# --- under the Triton path (the interpreter on the CPU: conftest sets TRITON_INTERPRET=1) -----------

triton_path = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter runs (the GPU file covers CUDA)")


@triton_path
def test_a_plan_follows_the_path_dispatch_chooses_at_each_call(model, plan_runs, monkeypatch):
    """``use_path`` (and DORACHECK_PATH) decide the backend per call: a plan kept under one path
    is not used under another (it was, before a review found it: the output differed)."""
    pytest.importorskip("triton")
    from doracheck.dispatch import use_path

    layer = _layer(model)
    x = torch.randn(2, 3, 32)
    with use_path("triton"):
        _armed_call(model, layer, x)
        on_triton, _ = _armed_call(model, layer, x)
    assert plan_runs == [True] and layer.__dict__[peft_armed._PLANS]["default"].backend.name == "triton"
    on_torch, _ = _armed_call(model, layer, x)
    assert plan_runs == [True, False] and layer.__dict__[peft_armed._PLANS]["default"].backend.name == "torch"
    holder = model.__dict__[inference_norms._HOLDER]
    with torch.no_grad():
        inference_norms._prepare(model, holder)
        try:
            with monkeypatch.context() as patch:
                patch.setattr(integration, "armed_forward", lambda *a: None)
                general_torch = layer(x)
                with use_path("triton"):
                    general_triton = layer(x)
        finally:
            inference_norms._finish(holder)
    assert torch.equal(on_torch, general_torch) and torch.equal(on_triton, general_triton)


@triton_path
def test_a_plan_multiplies_x_as_the_general_path_does_whatever_its_strides(model):
    """x·Aᵀ is one mm on x.reshape(-1, d_in) in both paths, for x whose strides do not flatten too
    (the last position of a longer sequence, ``h[:, -1:, :]``; a transposed batch). A review noted
    that ``F.linear`` on such a 3-D x takes matmul's batched path (bmm) with grad mode on; without
    it (where plans run) matmul folds to the same mm, and the plan now reshapes as the general path
    does, so the two issue the same GEMM by construction."""
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    from doracheck.dispatch import backend_for, use_path
    from doracheck.forward import compose_armed

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.gemms: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) in ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"):
                self.gemms.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    layer = _layer(model)
    holder = model.__dict__[inference_norms._HOLDER]
    for x in (torch.randn(1, 9, 32)[:, -1:, :], torch.randn(3, 2, 32).transpose(0, 1)):
        with use_path("triton"), torch.no_grad():
            inference_norms._prepare(model, holder)
            try:
                peft_armed.armed_forward(layer, "default", x, layer.base_layer(x), {})  # keeps the plan
                plan = layer.__dict__[peft_armed._PLANS]["default"]
                result, general = layer.base_layer(x), layer.base_layer(x)
                with Ops() as by_plan:
                    got = plan.run(layer, "default", x, result, {})
                with Ops() as by_general:
                    want = compose_armed(general, x, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                                         layer.lora_magnitude_vector["default"].weight, layer.base_layer.bias, plan.scaling,
                                         inference_norms.norm_buffer(layer, "default"), backend_for(x))
            finally:
                inference_norms._finish(holder)
        assert got is not None and torch.equal(got, want)
        assert by_plan.gemms == by_general.gemms == ["aten.mm"]


@triton_path
def test_infer_compose_of_a_layer_with_no_outputs_does_nothing_every_call():
    """d_out = 0 (a review found the second call raising)."""
    pytest.importorskip("triton")
    from doracheck.kernels.compose_triton import InferCompose

    plan = InferCompose(0, 4, 2.0)
    base, xa = torch.empty(1, 5, 0), torch.randn(5, 4)
    for _ in range(3):
        plan(base, xa, 5, torch.empty(0, 4), torch.empty(0), None, torch.empty(0))
    assert base.shape == (1, 5, 0)
