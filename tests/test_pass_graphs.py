"""Whole-pass CUDA graphs of a DoRA layer's training forward and backward (doracheck/pass_graphs.py).

CPU: the eager path the graph branch falls back to is bitwise the plain one; ``dx_out`` is
honoured; the policy (capture on the second sighting, the per-layer cap, a buffer someone
still holds is never overwritten, a failed capture turns graphs off) with a stand-in whose
"replay" re-runs the captured function. GPU: training loops (fused AdamW; checkpointing;
accumulation; a kept gradient; two forwards before one backward) train bitwise the same
model with pass graphs as without, and the graphs are actually replayed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from doracheck import pass_graphs
from doracheck.autograd import dora_from_base
from doracheck.backward import layer_backward
from doracheck.forward import from_base_forward
from doracheck.kernels.backends import TORCH
from doracheck.layer_state import LayerArgs, Need
from doracheck.numerics import our_numerics


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    pass_graphs.clear()
    monkeypatch.delenv("DORACHECK_PASS_GRAPHS", raising=False)
    yield
    pass_graphs.clear()


def _layer(seed=0, d_in=12, d_out=10, r=3, T=5, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    W = rand(d_out, d_in, scale=d_in ** -0.5)
    A = rand(r, d_in, scale=d_in ** -0.5).requires_grad_()
    B = rand(d_out, r, scale=0.3).requires_grad_()
    m = (1.0 + 0.1 * rand(d_out)).requires_grad_()
    x = rand(2, T, d_in).requires_grad_()
    return W, A, B, m, x


def _grads_of_one_step(layer, dy):
    W, A, B, m, x = layer
    y = dora_from_base(x, torch.nn.functional.linear(x, W), W, A, B, m, None, 1.5)
    y.backward(dy)
    out = [y.detach().clone()] + [t.grad.clone() for t in (x, A, B, m)]
    for t in (x, A, B, m):
        t.grad = None
    return out


def test_the_eager_fallback_of_the_graph_branch_is_bitwise_the_plain_path(monkeypatch):
    layer = _layer()
    dy = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(1))
    plain = _grads_of_one_step(layer, dy)
    monkeypatch.setenv("DORACHECK_PASS_GRAPHS", "1")  # on, but nothing here is CUDA: the branch runs eagerly
    assert pass_graphs.enabled()
    branch = _grads_of_one_step(layer, dy)
    for a, b in zip(plain, branch):
        assert torch.equal(a, b)
    assert pass_graphs.stats()["captures"] == 0


def test_layer_backward_writes_dx_into_dx_out():
    W, A, B, m, x = (t.detach() for t in _layer())
    a = LayerArgs(W, A, B, m, None, 1.5)
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad(), our_numerics("cpu"):
        _, saved = from_base_forward(x2 @ W.t(), x2, a, None, TORCH, need_saved=True)
        dy = torch.randn(10, 10, generator=torch.Generator().manual_seed(2))
        need = Need(True, False, True, True, True, False)
        plain = layer_backward(saved, dy, a, (10,), need)
        dx_out = torch.full((10, 12), float("nan"))
        given = layer_backward(saved, dy, a, (10,), need, dx_out=dx_out)
    assert given.dx.data_ptr() == dx_out.data_ptr()
    for p, g in zip(plain, given):
        assert (p is None and g is None) or torch.equal(p, g)


# The policy, with a stand-in for CUDA: "capture" keeps the function, "replay" runs it. -------------


class _RerunGraph:
    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def _stand_in(monkeypatch, fail=False):
    monkeypatch.setenv("DORACHECK_PASS_GRAPHS", "1")
    monkeypatch.setattr(pass_graphs, "_usable", lambda *tensors: pass_graphs.enabled())
    monkeypatch.setattr(pass_graphs, "_stream", lambda device: 0)
    monkeypatch.setattr(pass_graphs, "_warm", lambda device: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())

    def capture(fn, device, pool):
        if fail:
            raise torch.OutOfMemoryError("stand-in: out of memory at the peak")
        return _RerunGraph(fn), None

    monkeypatch.setattr(pass_graphs.norm_graphs, "capture_into_pool", capture)


def _triton_named_torch():
    """The Triton backend, under the interpreter on the CPU (the graph branch serves only it)."""
    from doracheck.kernels.backends import triton_backend

    return triton_backend()


_interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in on CPU tensors: the interpreter's Triton path")


def _forward(layer, backend, result=None):
    W, A, B, m, x = (t.detach() for t in layer)
    a = LayerArgs(W, A, B, m, None, 1.5)
    x2 = x.reshape(-1, x.shape[-1])
    r2 = x2 @ W.t() if result is None else result.copy_(x2 @ W.t())
    with torch.no_grad(), our_numerics("cpu"):
        return r2, from_base_forward(r2, x2, a, None, backend, need_saved=True)[1]


@pytest.mark.interpreter
@_interpreted
def test_a_key_is_captured_on_its_second_sighting_and_replays_match_the_eager_forward(monkeypatch):
    _stand_in(monkeypatch)
    backend = _triton_named_torch()
    layer = _layer()
    r_plain, s_plain = _forward(layer, backend)  # first sighting: eager
    assert pass_graphs.stats()["captures"] == 0
    result = torch.empty_like(r_plain)
    for _call in range(3):  # same tensors, same addresses: captured on the second sighting, then replayed
        r, saved = _forward(layer, backend, result)
        assert torch.equal(r, r_plain) and torch.equal(saved.xa, s_plain.xa) and torch.equal(saved.g, s_plain.g)
        assert torch.equal(saved.n, s_plain.n) and torch.equal(saved.n_safe, s_plain.n_safe)
        del saved
    stats = pass_graphs.stats()
    assert stats["captures"] == 1 and stats["replays"] == 2 and stats["busy"] == 0


class _Keep(torch.autograd.Function):
    """Holds ``t`` the way autograd holds a saved tensor (in C++, no Python reference)."""

    @staticmethod
    def forward(ctx, x, t):
        ctx.save_for_backward(t)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy, None


@pytest.mark.interpreter
@_interpreted
@pytest.mark.parametrize("how", ["object", "view", "saved"])
def test_a_buffer_still_held_is_never_overwritten(monkeypatch, how):
    _stand_in(monkeypatch)
    backend = _triton_named_torch()
    layer = _layer()
    result = torch.empty_like(_forward(layer, backend)[0])
    _forward(layer, backend, result)  # first sighting of this key: eager
    _forward(layer, backend, result)  # second sighting: captured and replayed
    _, held = _forward(layer, backend, result)  # replayed: its xa is the graph's buffer
    assert pass_graphs.stats()["replays"] == 2
    before = held.xa.clone()
    if how == "object":  # a hook that kept the tensor it was handed
        keep = [held.xa]
    elif how == "view":
        keep = [held.xa[1:]]
    else:  # saved for a backward that has not run yet
        keep = [_Keep.apply(torch.ones(1, requires_grad=True), held.xa)]
    del held
    with torch.no_grad():
        layer[1].add_(0.5)  # another A: another xa wherever the forward runs
    _, other = _forward(layer, backend, result)
    assert pass_graphs.stats()["busy"] == 1 and pass_graphs.stats()["replays"] == 2
    assert not torch.equal(other.xa, before)
    if how == "saved":
        (kept_xa,) = keep[0].grad_fn.saved_tensors
        assert torch.equal(kept_xa, before), "a held buffer was overwritten by a replay"
        del kept_xa
    else:
        assert torch.equal(keep[0], before[1:] if how == "view" else before), "a held buffer was overwritten by a replay"
    del keep, other
    _, again = _forward(layer, backend, result)  # nobody holds the buffers now: replayed
    assert pass_graphs.stats()["replays"] == 3


@pytest.mark.interpreter
@_interpreted
def test_a_layer_whose_tensors_move_stops_capturing_at_the_cap(monkeypatch):
    _stand_in(monkeypatch)
    monkeypatch.setattr(pass_graphs, "MAX_PER_SITE", 2)
    backend = _triton_named_torch()
    layer = _layer()
    results = []  # kept alive: every call's result is at a new address, so a new key
    for _ in range(5):
        results.append(torch.empty(10, 10))
        _forward(layer, backend, results[-1])
        _forward(layer, backend, results[-1])  # the second sighting captures, up to the cap
    assert pass_graphs.stats()["captures"] == 2


@pytest.mark.interpreter
@_interpreted
def test_a_failed_capture_turns_pass_graphs_off_with_a_warning(monkeypatch):
    _stand_in(monkeypatch, fail=True)
    backend = _triton_named_torch()
    layer = _layer()
    r_plain = _forward(layer, backend)[0]
    result = torch.empty_like(r_plain)
    _forward(layer, backend, result)
    with pytest.warns(RuntimeWarning, match="capturing a pass graph failed"):
        r, _ = _forward(layer, backend, result)
    assert torch.equal(r, r_plain)  # the call that failed ran eagerly
    assert not pass_graphs.enabled() and pass_graphs.stats()["failed"] == 1
    pass_graphs.clear()
    assert pass_graphs.enabled()


# GPU: real captures, in the loops users run ---------------------------------------------------------


def _gpu_models(seed=31, **kwargs):
    pytest.importorskip("peft")
    from peft_models import dora_model

    from doracheck.integrations.peft import enable

    plain = dora_model(seed=seed, dtype=torch.bfloat16, **kwargs).cuda()
    return enable(copy.deepcopy(plain)), enable(copy.deepcopy(plain))


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _train(model, data, monkeypatch, graphs: bool, accumulate=1, checkpointing=False, hook=None):
    monkeypatch.setenv("DORACHECK_PASS_GRAPHS", "1" if graphs else "0")
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW([p for _, p in _trainable(model)], lr=1e-3, fused=True)
    losses = []
    for i in range(0, len(data), accumulate):
        for ids in data[i:i + accumulate]:
            loss = model(ids, labels=ids).loss / accumulate
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses)


def _gpu_data(n=8):
    from peft_models import tokens

    return [tokens(seed=200 + i, batch=2, length=16, device="cuda") for i in range(n)]


def _assert_bitwise_same(eager, graphed):
    for (name, p), (_, q) in zip(_trainable(eager), _trainable(graphed)):
        assert torch.equal(p, q), f"{name} differs after training with pass graphs"


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing,accumulate", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_gpu_training_with_pass_graphs_is_bitwise_eager(monkeypatch, checkpointing, accumulate):
    from doracheck.dispatch import use_path

    with use_path("auto"):
        eager, graphed = _gpu_models()
        data = _gpu_data()
        losses_eager = _train(eager, data, monkeypatch, False, accumulate, checkpointing)
        assert pass_graphs.stats()["captures"] == 0
        losses_graphed = _train(graphed, data, monkeypatch, True, accumulate, checkpointing)
        stats = pass_graphs.stats()
        assert stats["replays"] > 0 and stats["failed"] == 0, stats
        assert torch.equal(losses_eager, losses_graphed)
        _assert_bitwise_same(eager, graphed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_replays_of_one_layer_are_bitwise_eager_and_never_overwrite_what_is_held(monkeypatch, dtype):
    """Real captures on fixed tensors: forward and backward replays equal the eager calls
    bitwise, follow a write to A that no version counter sees, and a replay never overwrites
    a buffer someone still holds (it runs eagerly instead)."""
    from doracheck.kernels.backends import triton_backend

    backend = triton_backend()
    W, A, B, m, x = (t.detach() for t in _layer(seed=5, d_in=256, d_out=192, r=16, T=64, dtype=dtype, device="cuda"))
    a = LayerArgs(W, A, B, m, None, 2.0)
    x2 = x.reshape(-1, x.shape[-1])
    result = torch.empty(x2.shape[0], W.shape[0], dtype=dtype, device="cuda")
    dy = torch.randn(result.shape, generator=torch.Generator().manual_seed(6)).to("cuda", dtype)
    need = Need(True, False, True, True, True, False)

    def both(graphs: bool):
        monkeypatch.setenv("DORACHECK_PASS_GRAPHS", "1" if graphs else "0")
        with torch.no_grad(), our_numerics("cuda"):
            result.copy_(x2 @ W.t())
            _, saved = from_base_forward(result, x2, a, None, backend, need_saved=True)
            grads = None
            if graphs:
                grads = pass_graphs.from_output_backward(saved, dy, a, (x2.shape[0],), need)
            if grads is None:
                grads = layer_backward(saved, dy, a, (x2.shape[0],), need)
        return saved, grads

    for step in range(4):
        with torch.no_grad():
            A.mul_(1.01).data.add_(1e-3)  # a write through .data, as fused optimizers make, between steps
        s_eager, g_eager = both(False)
        y_eager = result.clone()
        s_graph, g_graph = both(True)
        assert torch.equal(result, y_eager), step
        for u, v in zip((s_eager.xa, s_eager.g, s_eager.n, s_eager.n_safe), (s_graph.xa, s_graph.g, s_graph.n, s_graph.n_safe)):
            assert torch.equal(u, v), step
        for u, v in zip(g_eager, g_graph):
            assert (u is None and v is None) or torch.equal(u, v), step
        del s_eager, g_eager, s_graph, g_graph
    stats = pass_graphs.stats()
    # forward: sighting, then captured and replayed at steps 1-3; backward: its saved tensors are
    # the forward graph's buffers from step 1 on, so captured at step 2 and replayed at 2-3.
    assert stats["captures"] == 2 and stats["replays"] >= 4 and stats["busy"] == 0, stats
    assert {key[0] for key in pass_graphs._graphs} == {"forward", "backward"}
    held_saved, held_grads = both(True)  # both replayed; now hold its xa and dA
    xa, dA = held_saved.xa.clone(), held_grads.dA.clone()
    with torch.no_grad(), our_numerics("cuda"):
        again = pass_graphs.from_output_backward(held_saved, dy, a, (x2.shape[0],), need)
    assert again is None and pass_graphs.stats()["busy"] == 1  # dA is held: no replay
    with torch.no_grad():
        A.add_(0.5)
    other_saved, other_grads = both(True)
    assert pass_graphs.stats()["busy"] == 2  # xa is held: the forward ran eagerly
    assert torch.equal(held_saved.xa, xa) and torch.equal(held_grads.dA, dA)
    assert not torch.equal(other_saved.xa, xa)


@pytest.mark.gpu
def test_gpu_two_forwards_before_one_backward(monkeypatch):
    from doracheck.dispatch import use_path

    with use_path("auto"):
        data = _gpu_data(4)
        grads = {}
        for graphs, model in zip((False, True), _gpu_models(seed=33)):
            monkeypatch.setenv("DORACHECK_PASS_GRAPHS", "1" if graphs else "0")
            model.train()
            grads[graphs] = []
            for _ in range(2):  # the same batch twice, then two batches: some keys repeat, some do not
                for ids in data:
                    (model(ids, labels=ids).loss + model(data[0], labels=data[0]).loss).backward()
                    grads[graphs].append([p.grad.clone() for _, p in _trainable(model)])
                    model.zero_grad(set_to_none=True)
        assert pass_graphs.stats()["replays"] > 0
        for a, b in zip(grads[False], grads[True]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


@pytest.mark.interpreter
@_interpreted
def test_backward_replays_match_the_eager_backward(monkeypatch):
    W, A, B, m, x = (t.detach() for t in _layer(seed=3))
    a = LayerArgs(W, A, B, m, None, 1.5)
    backend = _triton_named_torch()
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad(), our_numerics("cpu"):
        _, saved = from_base_forward(x2 @ W.t(), x2, a, None, backend, need_saved=True)
        dy = torch.randn(10, 10, generator=torch.Generator().manual_seed(4))
        need = Need(True, False, True, True, True, False)
        plain = layer_backward(saved, dy, a, (10,), need)
        _stand_in(monkeypatch)
        block = torch.empty(10, 12)  # CPU malloc moves dx every call; CUDA's caching allocator would not
        monkeypatch.setattr(pass_graphs, "_new_dx", lambda T, d_in, dtype, device: torch.empty(0).set_(block))
        for _ in range(4):
            got = pass_graphs.from_output_backward(saved, dy, a, (10,), need)
            got = got if got is not None else layer_backward(saved, dy, a, (10,), need)
            for p, g in zip(plain, got):
                assert (p is None and g is None) or torch.equal(p, g)
            del got
    stats = pass_graphs.stats()
    assert stats["captures"] == 1 and stats["replays"] >= 2 and stats["busy"] == 0, stats
