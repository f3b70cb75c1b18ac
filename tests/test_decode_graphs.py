"""The inference forward at few tokens replayed from a CUDA graph (doracheck/decode_graphs.py).

CPU (the interpreter's Triton path): the policy with a stand-in whose "replay" re-runs the
captured function: off by default, captured on the second sighting, bitwise the eager forward
for activations at new addresses every call and after an in-place write to A, never above
MAX_TOKENS, inference tensors handled, a failed capture turns graphs off. GPU: real captures in
a PEFT model, between fused-AdamW steps, bitwise the eager model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from doracheck import decode_graphs
from doracheck.autograd import dora_from_base

_interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in on CPU tensors: the interpreter's Triton path")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setitem(decode_graphs._state, "warned", True)  # the experimental-path warning: its own test
    decode_graphs.clear()
    monkeypatch.delenv("DORACHECK_DECODE_GRAPHS", raising=False)
    yield
    decode_graphs.clear()


class _RerunGraph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def _stand_in(monkeypatch, fail=False):
    monkeypatch.setenv("DORACHECK_DECODE_GRAPHS", "1")
    monkeypatch.setattr(decode_graphs, "_usable", lambda *tensors: True)
    monkeypatch.setattr(decode_graphs, "_stream", lambda device: 0)
    monkeypatch.setattr(decode_graphs, "_warm", lambda device: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())

    def capture(fn, device, pool):
        if fail:
            raise torch.OutOfMemoryError("stand-in: out of memory")
        return _RerunGraph(fn), None

    monkeypatch.setattr(decode_graphs.norm_graphs, "capture_into_pool", capture)


def _layer(seed=0, d_in=24, d_out=20, r=4):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen) * d_in ** -0.5
    A = torch.randn(r, d_in, generator=gen) * d_in ** -0.5
    B = torch.randn(d_out, r, generator=gen) * 0.3
    m = 1.0 + 0.1 * torch.randn(d_out, generator=gen)
    return W, A, B, m


def _infer(layer, x, *, inference=False):
    W, A, B, m = layer
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode:
        return dora_from_base(x, torch.nn.functional.linear(x, W), W, A, B, m, None, 1.5)


def _tokens(T, seed):
    return torch.randn(1, T, 24, generator=torch.Generator().manual_seed(seed))


@pytest.mark.interpreter
@_interpreted
def test_off_by_default():
    from doracheck.dispatch import use_path

    with use_path("triton"):
        layer = _layer()
        for seed in range(3):
            _infer(layer, _tokens(1, seed))
    assert decode_graphs.stats()["captures"] == 0 and not decode_graphs.enabled()


@pytest.mark.interpreter
@_interpreted
@pytest.mark.parametrize("inference", [False, True])
def test_replays_are_the_eager_forward_for_moving_activations_and_follow_writes(monkeypatch, inference):
    from doracheck.dispatch import use_path

    with use_path("triton"):
        layer = _layer()
        xs = [_tokens(T, seed) for seed, T in enumerate((1, 1, 3, 1, 3, 1, 1))]
        A0 = layer[1].clone()
        expected = []
        for i, x in enumerate(xs):
            if i == 4:
                layer[1].mul_(1.5)  # an in-place write to A (an optimizer step, a .data edit)
            expected.append(_infer(layer, x.clone(), inference=inference))
        layer[1].copy_(A0)
        _stand_in(monkeypatch)
        for i, x in enumerate(xs):  # each x a new tensor: graphs read copies, not the caller's addresses
            if i == 4:
                layer[1].mul_(1.5)
            got = _infer(layer, x.clone(), inference=inference)
            assert torch.equal(got, expected[i]), i
    stats = decode_graphs.stats()
    assert stats["captures"] == 2 and stats["replays"] == 3, stats  # T = 1 from its second call, T = 3 at its second


def test_turning_the_experimental_path_on_warns_once(monkeypatch):
    monkeypatch.setitem(decode_graphs._state, "warned", False)
    monkeypatch.setenv("DORACHECK_DECODE_GRAPHS", "1")
    with pytest.warns(RuntimeWarning, match="experimental path that has not yet been run on a GPU"):
        assert decode_graphs.enabled()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_graphs.enabled()


@pytest.mark.interpreter
@_interpreted
def test_never_above_max_tokens(monkeypatch):
    from doracheck.dispatch import use_path

    _stand_in(monkeypatch)
    monkeypatch.setattr(decode_graphs, "MAX_TOKENS", 2)
    with use_path("triton"):
        layer = _layer()
        for seed in range(3):
            _infer(layer, _tokens(3, seed))
    assert decode_graphs.stats()["captures"] == 0


@pytest.mark.interpreter
@_interpreted
def test_a_failed_capture_turns_decode_graphs_off(monkeypatch):
    from doracheck.dispatch import use_path

    with use_path("triton"):
        layer = _layer()
        expected = _infer(layer, _tokens(1, 0))
        _stand_in(monkeypatch, fail=True)
        _infer(layer, _tokens(1, 0))
        with pytest.warns(RuntimeWarning, match="capturing a decode graph failed"):
            got = _infer(layer, _tokens(1, 0))
    assert torch.equal(got, expected)
    assert not decode_graphs.enabled() and decode_graphs.stats()["failed"] == 1
    decode_graphs.clear()
    assert decode_graphs.enabled()


@pytest.mark.gpu
def test_gpu_decode_graphs_between_fused_adamw_steps_are_bitwise_eager(monkeypatch):
    """A PEFT model in bf16: forwards without grad (T = 24 and 1) between fused-AdamW steps,
    with decode graphs and without, give bitwise the same logits, and the graphs replay."""
    pytest.importorskip("peft")
    from peft_models import dora_model, tokens

    from doracheck.dispatch import use_path
    from doracheck.integrations.peft import enable

    with use_path("auto"):
        plain = dora_model(seed=41, dtype=torch.bfloat16).cuda()
        models = {graphs: enable(copy.deepcopy(plain)) for graphs in (False, True)}
        logits = {}
        for graphs, model in models.items():
            monkeypatch.setenv("DORACHECK_DECODE_GRAPHS", "1" if graphs else "0")
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
            out = []
            for step in range(3):
                model.train()
                ids = tokens(seed=300 + step, device="cuda")
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                model.eval()
                with torch.no_grad():
                    for call in range(3):  # the same shapes again: captured, then replayed
                        out.append(model(tokens(seed=400 + call, device="cuda")).logits)
                        out.append(model(tokens(seed=500 + call, batch=1, length=1, device="cuda")).logits)
                with torch.inference_mode():
                    out.append(model(tokens(seed=600, batch=1, length=1, device="cuda")).logits.clone())
            logits[graphs] = out
        stats = decode_graphs.stats()
        assert stats["replays"] > 0 and stats["failed"] == 0, stats
        for i, (a, b) in enumerate(zip(logits[False], logits[True])):
            assert torch.equal(a, b), i
