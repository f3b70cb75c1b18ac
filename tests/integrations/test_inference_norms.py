"""Norms as module state for inference (doracheck/inference_norms.py), through the PEFT integration.

A forward without grad mode through the model ``enable`` hooked reads each layer's max(n, eps)
from the layer's state that the pre-hook refreshed: bitwise what the layer computes itself,
refreshed whenever ``norm_rule`` says the norm changed, never in ``state_dict``,
and under torch.compile a graph with no norm in it that still follows updates of the adapters.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from peft_models import dora_model, enabled_dora_model, tokens  # noqa: E402

from doracheck import forward as forward_pass  # noqa: E402
from doracheck import inference_norms  # noqa: E402
from doracheck.integrations.peft import disable, enable  # noqa: E402
from doracheck.norm_rule import clear_norm_cache  # noqa: E402


@pytest.fixture
def model():
    return enabled_dora_model(0)


@pytest.fixture
def norm_calls(monkeypatch):
    """How often a layer computed (or looked up) its norm itself, and how often a slot refreshed."""
    calls = {"layer": 0, "slot": 0}
    layer_norm, slot_refresh = forward_pass.norm_and_scale, inference_norms.NormSlot.refresh

    def counted_layer(*args, **kwargs):
        calls["layer"] += 1
        return layer_norm(*args, **kwargs)

    def counted_slot(self, era):
        before = self.stamp
        refreshed = slot_refresh(self, era)
        calls["slot"] += self.stamp != before
        return refreshed

    monkeypatch.setattr(forward_pass, "norm_and_scale", counted_layer)
    monkeypatch.setattr(inference_norms.NormSlot, "refresh", counted_slot)
    return calls


def _states(m) -> list:
    return [module.__dict__[inference_norms.STATE] for module in m.modules() if inference_norms.STATE in module.__dict__]


def _any_armed(m) -> bool:
    return any(state.armed for state in _states(m))


def _has_norms(m) -> bool:
    """Whether any layer of ``m`` holds a refreshed max(n, eps)."""
    return any(state.norms for state in _states(m))


def _holder(m):
    return m.__dict__[inference_norms.STATE].holder


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


def _unarmed(monkeypatch, m, ids):
    """The same forward with every layer computing its own norm."""
    with monkeypatch.context() as patch:
        patch.setattr(inference_norms, "norm_buffer", lambda module, adapter: None)
        return _logits(m, ids)


def test_armed_forwards_read_the_buffers_and_are_bitwise_the_layers_own(model, norm_calls, monkeypatch):
    ids = tokens(0)
    first = _logits(model, ids)
    assert norm_calls == {"layer": 0, "slot": 14}  # 2 decoder layers x 7 adapters, computed by the hook
    second = _logits(model, ids)
    assert norm_calls == {"layer": 0, "slot": 14}  # nothing changed: nothing recomputed
    assert torch.equal(first, second)
    assert torch.equal(first, _unarmed(monkeypatch, model, ids))
    assert not _any_armed(model)


@pytest.mark.parametrize("change", ["in_place", "replaced", "module_replaced", "base_replaced", "optimizer_step", "clear"])
def test_a_buffer_follows_every_change_the_rule_sees(model, norm_calls, monkeypatch, change):
    ids = tokens(1)
    _logits(model, ids)
    lora_B = model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"]
    if change == "in_place":
        with torch.no_grad():
            lora_B.weight.mul_(1.5)
    elif change == "replaced":
        lora_B.weight = torch.nn.Parameter(lora_B.weight.detach() * 1.5)
    elif change == "module_replaced":  # a new lora_B module (the slot remembers the old one)
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        new_B = torch.nn.Linear(lora_B.in_features, lora_B.out_features, bias=False)
        with torch.no_grad():
            new_B.weight.copy_(lora_B.weight * 1.5)
        layer.lora_B["default"] = new_B
    elif change == "base_replaced":  # a new base Linear, its weight at another address
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        old_base = layer.base_layer
        new_base = torch.nn.Linear(old_base.in_features, old_base.out_features, bias=old_base.bias is not None)
        with torch.no_grad():
            new_base.weight.copy_(old_base.weight * 1.5)
        new_base.weight.requires_grad_(False)
        layer.base_layer = new_base
    elif change == "optimizer_step":
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=False)
        model(ids, labels=ids).loss.backward()
        opt.step()
        model.eval()
    else:
        with torch.no_grad():
            lora_B.weight.data.mul_(1.5)  # invisible to every counter: clear_norm_cache() is the documented remedy
        clear_norm_cache()
    before = norm_calls["slot"]
    after = _logits(model, ids)
    assert norm_calls["slot"] > before
    assert torch.equal(after, _unarmed(monkeypatch, model, ids))


def _backward_then_hand_update(m, ids, lr: float) -> None:
    """A training backward, then the tutorial update ``p.data -= lr * p.grad``: no version
    change and no optimizer step."""
    m.train()
    m(ids, labels=ids).loss.backward()
    m.eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-lr)


def test_not_armed_between_a_backward_and_the_next_step(model, norm_calls):
    """Rule 3: once a backward ran, parameters may be written by hand at any time."""
    ids = tokens(2)
    _backward_then_hand_update(model, ids, lr=1e-2)
    norm_calls["layer"] = 0
    _logits(model, ids)
    assert norm_calls["layer"] == 14  # every layer computed its norm from the parameters of the moment


def test_disarmed_after_a_forward_that_raises_and_nothing_in_the_state_dict(model):
    keys = set(dora_model(0).state_dict())
    assert set(model.state_dict()) == keys
    with pytest.raises(RuntimeError), torch.no_grad():
        model(torch.zeros(2, 3, 4, dtype=torch.long))  # 3-D ids: the embedding's output cannot enter attention
    assert not _any_armed(model)
    _logits(model, tokens(0))
    assert not _any_armed(model)


def test_disable_removes_the_hooks_and_the_buffers(model):
    _logits(model, tokens(0))
    assert _has_norms(model)
    disable(model)
    assert not _has_norms(model)
    assert not model._forward_pre_hooks and not model.get_base_model()._forward_pre_hooks


def test_compiled_inference_reads_the_buffers_and_follows_an_update(model, monkeypatch):
    """The base model's ``__call__`` compiled (what transformers' generate compiles for a static
    cache): a graph with no norm in it (no square root: the norm's is the only one), the same
    numbers as eager, and an in-place update of an adapter between calls seen by the next call."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.get_base_model().__call__, backend=recording_backend)  # as transformers' generate does
    ids = tokens(3)
    eager = _logits(model, ids)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, eager)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert targets and not [t for t in targets if "sqrt" in t and "rsqrt" not in t]  # RMSNorm's rsqrt stays
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.mul_(1.5)
        assert torch.equal(compiled(ids).logits, _unarmed(monkeypatch, model, ids))


def test_a_compiled_graph_that_reads_buffers_runs_only_when_armed(model, monkeypatch):
    """After a backward (rule 3: not armed), hand-written updates must be seen by the compiled
    model: Dynamo's guard on the armed flag sends the call to a graph that computes the norm."""
    torch._dynamo.reset()
    compiled = torch.compile(model.get_base_model().__call__, backend="aot_eager")
    ids = tokens(4)
    with torch.no_grad():
        compiled(ids)  # compiled while armed
    _backward_then_hand_update(model, ids, lr=1e-1)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, _unarmed(monkeypatch, model, ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_of_a_compiled_model_follow_an_update():
    """mode="reduce-overhead" (CUDA graphs, Triton path): the buffers are static inputs that the
    eager pre-hook rewrites in place, so a replay after an in-place adapter update computes with
    the new norm. Inductor's own kernels change the last bits, so the check is by distance, in
    fp32 (in bf16 Inductor's rounding differences were 1/14 of the whole move of this tiny
    model's logits): after the update (B·A now dominates W in two layers, so their norms move a
    lot) the replay is as close to eager as it was before the update, while a replay with the
    old norms would be about as far from it as the model moved."""
    clear_norm_cache()
    m = dora_model(0, dtype=torch.float32).cuda()
    enable(m)
    m.eval()
    torch._dynamo.reset()
    compiled = torch.compile(m.get_base_model().__call__, mode="reduce-overhead")  # as generate does
    ids = tokens(5, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            replay_before = compiled(ids).logits.float()
        before = m(ids).logits.float()
        noise = (replay_before - before).norm()
        mlp = m.base_model.model.model.layers[0].mlp
        gen = torch.Generator(device="cuda").manual_seed(6)
        for proj in (mlp.gate_proj, mlp.up_proj):
            B = proj.lora_B["default"].weight
            B.copy_(torch.randn(B.shape, generator=gen, device="cuda", dtype=torch.float32).to(B.dtype))
        after = m(ids).logits.float()
        replay = compiled(ids).logits.float()
    moved = (after - before).norm()
    assert moved > 20 * noise  # the update is far above Inductor's rounding differences
    assert (replay - after).norm() <= 3 * noise + 1e-3 * after.norm()


def test_inference_mode_then_no_grad(model, monkeypatch):
    """A buffer first filled under torch.inference_mode() is an ordinary tensor, so a later
    no_grad forward can rewrite it."""
    ids = tokens(6)
    with torch.inference_mode():
        first = model(ids).logits
    with torch.no_grad():
        model.base_model.model.model.layers[0].mlp.up_proj.lora_B["default"].weight.mul_(2.0)
    assert torch.equal(_logits(model, ids), _unarmed(monkeypatch, model, ids))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, _unarmed(monkeypatch, model, ids))
    assert not torch.equal(first, _unarmed(monkeypatch, model, ids))


def test_a_deleted_adapter_is_skipped():
    import peft
    from peft_models import TARGETS

    clear_norm_cache()
    m = dora_model(0)
    m.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=TARGETS))
    enable(m)
    m.eval()
    _logits(m, tokens(0))
    m.base_model.delete_adapter("second")
    _logits(m, tokens(0))  # the hook skips slots whose adapter is gone


def test_only_the_called_models_layers_are_armed():
    """Two enabled models: while one runs, the other's layers compute their own norms (a
    submodule of it called inside this forward must not read a buffer its own hook never
    refreshed)."""
    clear_norm_cache()
    a, b = dora_model(0), dora_model(1)
    enable(a)
    enable(b)
    a.eval()
    b.eval()
    seen = []
    layer = a.base_model.model.model.layers[0].self_attn.q_proj
    handle = layer.register_forward_hook(lambda *_: seen.append((_any_armed(a), _any_armed(b))))
    _logits(a, tokens(0))
    handle.remove()
    assert seen == [(True, False)]
    assert not _any_armed(a)


class _Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("then", ["optimizer_step", "in_place_update"])
def test_an_interrupted_forward_leaves_nothing_stale(model, monkeypatch, then):
    """Ctrl-C inside a forward skips every forward hook (torch calls ``always_call`` hooks on
    ``Exception`` only); the next eager call of either entry point, or the next era, decides again."""
    ids = tokens(7)
    layer = model.base_model.model.model.layers[1].self_attn.o_proj

    def interrupt(*_):
        raise _Interrupt

    handle = layer.register_forward_hook(interrupt)
    with pytest.raises(_Interrupt), torch.no_grad():
        model(ids)
    handle.remove()
    lora_B = model.base_model.model.model.layers[0].mlp.down_proj.lora_B["default"].weight
    if then == "optimizer_step":
        assert _any_armed(model)  # left armed by the interrupted call
        lora_B.grad = torch.ones_like(lora_B)
        torch.optim.SGD([lora_B], lr=0.5).step()  # an era ends: disarmed
        assert not _any_armed(model)
    else:
        with torch.no_grad():
            lora_B.mul_(2.0)
    inner = model.get_base_model()
    with torch.no_grad():
        got = inner(ids).logits  # the base model alone (what generate calls)
    assert torch.equal(got, _unarmed(monkeypatch, model, ids))


def test_whole_model_fullgraph_compile_trains_and_infers():
    """torch.compile(peft_model, fullgraph=True): the model's own hooks run around the compiled
    body and the base model's hooks, traced inside it, return without a graph break."""
    clear_norm_cache()
    m = dora_model(0)
    enable(m)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    ids = tokens(8)
    m.train()
    compiled(ids, labels=ids).loss.backward()
    m.eval()
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, m(ids).logits)
        m.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.mul_(1.5)
        assert torch.equal(compiled(ids).logits, m(ids).logits)  # that graph computes its norms


def test_sharded_tensors_leave_their_layer_unarmed(model):
    """A slot whose W is not the layer's matrix (FSDP1 or ZeRO-3 shards outside their unit's
    forward) is not refreshed and its layer not armed, rather than failing."""
    slot = _holder(model).slots[0]
    base = slot.module.get_base_layer()
    weight = base.weight
    try:
        base._parameters["weight"] = torch.nn.Parameter(weight.detach().flatten(), requires_grad=False)
        assert slot.refresh(0) is False
    finally:
        base._parameters["weight"] = weight


def test_disable_through_a_compile_wrapper(model):
    compiled = torch.compile(model, backend="aot_eager")
    disable(compiled)
    assert not model._forward_pre_hooks and not model.get_base_model()._forward_pre_hooks
    assert not _has_norms(model)


def test_an_interrupted_forward_then_a_compiled_base_model_call(model, monkeypatch):
    """Ctrl-C leaves the model prepared; the compiled base model (as generate compiles it) still
    decides again before its body, so an in-place update made meanwhile is seen."""
    ids = tokens(9)
    torch._dynamo.reset()
    compiled = torch.compile(model.get_base_model().__call__, backend="aot_eager")

    def interrupt(*_):
        raise _Interrupt

    handle = model.base_model.model.model.layers[0].mlp.up_proj.register_forward_hook(interrupt)
    with pytest.raises(_Interrupt), torch.no_grad():
        model(ids)
    handle.remove()
    with torch.no_grad():
        model.base_model.model.model.layers[1].mlp.gate_proj.lora_B["default"].weight.mul_(2.0)
        assert torch.equal(compiled(ids).logits, _unarmed(monkeypatch, model, ids))


def test_enable_without_norm_buffers(monkeypatch):
    clear_norm_cache()
    m = dora_model(0)
    enable(m, norm_buffers=False)
    m.eval()
    ids = tokens(10)
    assert torch.equal(_logits(m, ids), _unarmed(monkeypatch, m, ids))
    assert not m._forward_pre_hooks and not _has_norms(m)


@pytest.mark.parametrize("grad_off", ["no_grad", "inference_mode"])
def test_an_offloaded_model_runs_with_norm_buffers_on(grad_off):
    """accelerate's offload (device_map to "cpu"/"disk", cpu_offload) keeps W, A, B as meta
    tensors until the block's own hook loads them inside the forward, after the model's
    pre-hook: the buffers are not armed for those layers (refreshing them raised "unknown
    device type for autocast"), which compute their norm themselves, bitwise as without offload.
    Under inference_mode the offloaded meta tensors are inference tensors, with no version
    counter to stamp (reading it raised)."""
    pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from peft import LoraConfig, get_peft_model

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.l2(torch.relu(self.l1(x)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    torch.manual_seed(0)
    model = get_peft_model(Model(), LoraConfig(r=4, target_modules=["l1", "l2"], use_dora=True, init_lora_weights=False))
    enable(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = model(x)
    block = model.base_model.model.block
    weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
    add_hook_to_module(block, AlignDevicesHook(execution_device=torch.device("cpu"), offload=True, weights_map=weights,
                                               place_submodules=True))
    assert block.l1.lora_A["default"].weight.is_meta  # offloaded between forwards
    with getattr(torch, grad_off)():
        for _ in range(3):
            assert torch.equal(model(x), want)


@pytest.mark.parametrize("grad_off", ["no_grad", "inference_mode"])
def test_a_model_made_of_inference_tensors_runs_with_norm_buffers_on(monkeypatch, grad_off):
    """Weights created under torch.inference_mode() have no version counter: their layers stay
    unarmed and compute their own norm (the buffer check raised on them), with the same output."""
    with torch.inference_mode():
        m = dora_model(0)
    enable(m)
    m.eval()
    ids = tokens(0)
    with getattr(torch, grad_off)():
        got = m(ids).logits
        assert not _any_armed(m)
        with monkeypatch.context() as patch:
            patch.setattr(inference_norms, "norm_buffer", lambda module, adapter: None)
            assert torch.equal(got, m(ids).logits)


def test_a_replaced_base_layer_is_freed_before_the_next_forward(model):
    """The slots remember the modules that hold W, A and B only weakly: a base layer swapped out
    (for a quantized one, say) and its W are freed at once, not at the next forward."""
    import gc
    import weakref

    _logits(model, tokens(0))
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    old = weakref.ref(layer.base_layer)
    new_base = torch.nn.Linear(layer.base_layer.in_features, layer.base_layer.out_features, bias=False)
    new_base.weight.requires_grad_(False)
    layer.base_layer = new_base
    gc.collect()
    assert old() is None


# --- generate: prepared once per call ---------------------------------------------------------


def _generate(m, ids, **kwargs):
    """Greedy generation of 5 tokens with the logits of each step."""
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _unarmed_generate(monkeypatch, m, ids, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(inference_norms, "norm_buffer", lambda module, adapter: None)
        return _generate(m, ids, **kwargs)


def test_generate_is_armed_at_every_step_and_bitwise_the_unarmed_model(model, monkeypatch):
    """Every decode step is a forward without grad mode of the base model: prepared by its hook,
    armed, and the same tokens and logits, bit for bit, as every layer computing its own norm;
    nothing armed afterwards."""
    armed_steps = []
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    handle = layer.register_forward_hook(lambda *_: armed_steps.append(_any_armed(model)))
    ids = tokens(9, batch=1)
    got = _generate(model, ids)
    handle.remove()
    assert armed_steps == [True] * 5 and not _any_armed(model)
    want = _unarmed_generate(monkeypatch, model, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_write_between_two_generate_calls_is_seen(model, monkeypatch):
    ids = tokens(10, batch=1)
    first = _generate(model, ids)
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.v_proj.lora_B["default"].weight.mul_(3.0)
    got = _generate(model, ids)
    assert not torch.equal(got[1], first[1])
    assert torch.equal(got[1], _unarmed_generate(monkeypatch, model, ids)[1])


def test_an_era_ended_inside_generate_disarms_the_rest_of_it(model, monkeypatch):
    """A write from inside the call (here a logits processor) followed by
    ``clear_norm_cache()``: the remaining steps compute their own norms."""
    from transformers import LogitsProcessor, LogitsProcessorList

    lora_B = model.base_model.model.model.layers[1].self_attn.q_proj.lora_B["default"].weight

    class EditAfterFirstStep(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 1:
                lora_B.mul_(4.0)
                clear_norm_cache()
            return scores

    ids = tokens(11, batch=1)
    got = _generate(model, ids, logits_processor=LogitsProcessorList([EditAfterFirstStep()]))
    with torch.no_grad():
        lora_B.div_(4.0)
    want = _unarmed_generate(monkeypatch, model, ids, logits_processor=LogitsProcessorList([EditAfterFirstStep()]))
    assert torch.equal(got[1], want[1])


def test_compiled_generate_with_a_static_cache_reads_the_norms(model, monkeypatch):
    """transformers compiles the base model's ``__call__`` for a static cache; its hooks run
    eagerly around the compiled body, the graph reads the layers' norms (no norm in it) and gives
    the eager tokens and logits."""
    from transformers import CompileConfig

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    config = CompileConfig(fullgraph=False, backend=recording_backend, mode=None)
    config._compile_all_devices = True  # transformers' own switch for compiling off CUDA (its tests use it)
    ids = tokens(12, batch=1)
    got = _generate(model, ids, cache_implementation="static", compile_config=config)
    assert graphs, "transformers did not compile the decode step"
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert not [t for t in targets if "sqrt" in t and "rsqrt" not in t]
    want = _unarmed_generate(monkeypatch, model, ids, cache_implementation="static", disable_compile=True)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # the traced graph may reorder fp32 ops


def test_generate_of_a_deep_copy_runs_the_copy(model, monkeypatch):
    import copy

    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.base_model.model.model.layers[0].mlp.gate_proj.lora_B["default"].weight.mul_(2.0)
    ids = tokens(13, batch=1)
    assert torch.equal(_generate(copied, ids)[1], _unarmed_generate(monkeypatch, copied, ids)[1])
    assert torch.equal(_generate(model, ids)[1], _unarmed_generate(monkeypatch, model, ids)[1])
    assert not torch.equal(_generate(model, ids)[1], _generate(copied, ids)[1])


def test_an_enabled_model_can_be_pickled_whole_and_loaded(model, monkeypatch):
    """``torch.save(model)`` (pickle) of a used, enabled model and back: no weak reference, id or
    running state is pickled, and the loaded model's ``generate`` runs the loaded model. (A
    buffer of our own making, loaded with ``weights_only=False``; never a user's file.)"""
    import io

    ids = tokens(14, batch=1)
    _generate(model, ids)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        loaded.base_model.model.model.layers[1].mlp.up_proj.lora_B["default"].weight.mul_(2.0)
    got = _generate(loaded, ids)
    assert torch.equal(got[1], _unarmed_generate(monkeypatch, loaded, ids)[1])
    assert not torch.equal(got[1], _generate(model, ids)[1])


def test_another_threads_forward_during_generate_prepares_for_itself(model, monkeypatch):
    """While one thread is inside ``generate`` (held there by a logits processor), a forward of
    another thread after an adapter update sees the update (a server evaluating or loading
    weights while a request generates)."""
    import threading

    from transformers import LogitsProcessor, LogitsProcessorList

    started, release = threading.Event(), threading.Event()

    class Hold(LogitsProcessor):
        def __call__(self, input_ids, scores):
            started.set()
            release.wait(timeout=60)
            return scores

    def generate():
        _generate(model, tokens(19, batch=1), logits_processor=LogitsProcessorList([Hold()]))

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        assert started.wait(timeout=60)
        ids = tokens(20)
        with torch.no_grad():
            model.base_model.model.model.layers[0].self_attn.v_proj.lora_B["default"].weight.mul_(3.0)
            got = model(ids).logits
        with monkeypatch.context() as patch:
            patch.setattr(inference_norms, "norm_buffer", lambda module, adapter: None)
            with torch.no_grad():
                want = model(ids).logits
    finally:
        release.set()
        worker.join(timeout=60)
    assert torch.equal(got, want)
    assert not _any_armed(model)


def test_enable_leaves_generate_alone():
    clear_norm_cache()
    m = dora_model(0)
    inner = m.get_base_model()
    enable(m)
    assert "generate" not in inner.__dict__ and "generate" not in m.__dict__
    disable(m)
    assert "generate" not in inner.__dict__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_generate_follows_an_update_between_calls(monkeypatch):
    """transformers' own compiled decode on CUDA (static cache, Inductor, CUDA graphs; the hooks
    run eagerly around the compiled body): the tokens of eager generation, logits within
    Inductor's reordering, and an adapter update between two calls seen by the second (the norms
    are static inputs of the recorded graphs, rewritten in place before each forward). fp32, as the CUDA-graph
    test above, so the update stands far above Inductor's rounding."""
    clear_norm_cache()
    m = dora_model(0, dtype=torch.float32).cuda()
    enable(m)
    m.eval()
    torch._dynamo.reset()
    ids = tokens(16, batch=1, device="cuda")
    compiled = {"cache_implementation": "static"}
    eager = {"cache_implementation": "static", "disable_compile": True}
    for _ in range(2):  # the second call replays recorded graphs
        got = _generate(m, ids, **compiled)
    want = _unarmed_generate(monkeypatch, m, ids, **eager)
    noise = (got[1] - want[1]).norm()
    assert torch.equal(got[0], want[0])
    mlp = m.base_model.model.model.layers[1].mlp
    gen = torch.Generator(device="cuda").manual_seed(17)
    with torch.no_grad():
        for proj in (mlp.gate_proj, mlp.up_proj):
            B = proj.lora_B["default"].weight
            B.copy_(torch.randn(B.shape, generator=gen, device="cuda", dtype=torch.float32))
    got_after = _generate(m, ids, **compiled)
    want_after = _unarmed_generate(monkeypatch, m, ids, **eager)
    moved = (want_after[1] - want[1]).norm()
    assert moved > 20 * noise
    assert (got_after[1] - want_after[1]).norm() <= 3 * noise + 1e-3 * want_after[1].norm()
