"""The refresh after an optimizer step (``doracheck.norm_cache.refresh_after_step``).

After ``optimizer.step()`` a step post-hook recomputes the norm and g of every layer trained in
the step just ended, so the next training forward reads them instead of computing them on the
host-bound forward path (issue 17). What must hold, checked here call by call and loop by loop:
- training with the refresh is bitwise training without it (its value is the forward's own),
  with fused, foreach and for-loop optimizers, checkpointing and gradient accumulation, on the
  torch path and on the Triton kernels (under the interpreter on the CPU);
- the forward after a step reads the refreshed value (a hit, no miss) and only for the layers
  the step held; an evaluation-only layer is not refreshed;
- a write after the step that a version counter sees (in place under no_grad, a new tensor)
  makes the forward compute afresh; a bare ``.data`` write is the documented blind spot, which
  ``clear_norm_cache()`` closes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import doracheck
from doracheck import norm_cache
from doracheck.dispatch import use_path
from doracheck.norm_cache import clear_norm_cache, norm_cache_stats
from doracheck.reference import dora_forward_ref, rel_l2

SCALING = 2.0


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_norm_cache()
    yield
    clear_norm_cache()


@pytest.fixture
def refresh_off(monkeypatch):
    monkeypatch.setitem(norm_cache._REFRESH, "on", False)


def layer(seed=0, d_in=24, d_out=20, r=4):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen)
    A = torch.nn.Parameter(torch.randn(r, d_in, generator=gen) * 0.3)
    B = torch.nn.Parameter(torch.randn(d_out, r, generator=gen) * 0.3)
    m = torch.nn.Parameter(W.norm(dim=1) * 1.1)
    return W, A, B, m


def forward(x, W, A, B, m, *, checkpointed=False):
    run = lambda t: doracheck.dora_linear(t, W, A, B, m, SCALING)  # noqa: E731
    return checkpoint.checkpoint(run, x, use_reentrant=False) if checkpointed else run(x)


def stats():
    s = norm_cache_stats()
    return s["hits"], s["misses"], s["refreshed"]


def since(before):
    return tuple(now - then for now, then in zip(stats(), before))


def oracle(x, W, A, B, m):
    return dora_forward_ref(x.double(), W.double(), A.detach().double(), B.detach().double(), m.detach().double(), SCALING)


OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True),
    "foreach AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
    "for-loop SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False),
}


def train(steps, optimizer, *, checkpointed=False, accumulate=1, seed=0):
    """(every loss, the parameters after ``steps`` optimizer steps) of one layer."""
    W, A, B, m = layer(seed)
    opt = OPTIMIZERS[optimizer]([A, B, m])
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        for _ in range(accumulate):
            x = torch.randn(6, W.shape[1], generator=gen, requires_grad=checkpointed)
            loss = forward(x, W, A, B, m, checkpointed=checkpointed).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), [p.detach().clone() for p in (A, B, m)]


def trained_both_ways(monkeypatch, **kwargs):
    before = norm_cache_stats()["refreshed"]
    with_refresh = train(**kwargs)
    refreshed = norm_cache_stats()["refreshed"] - before
    monkeypatch.setitem(norm_cache._REFRESH, "on", False)
    clear_norm_cache()
    without = train(**kwargs)
    return with_refresh, without, refreshed


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("checkpointed, accumulate", [(False, 1), (True, 1), (True, 2)])
def test_training_with_the_refresh_is_bitwise_training_without_it(monkeypatch, optimizer, checkpointed, accumulate):
    with use_path("torch"):
        (losses, params), (losses_off, params_off), refreshed = trained_both_ways(
            monkeypatch, steps=4, optimizer=optimizer, checkpointed=checkpointed, accumulate=accumulate
        )
    assert refreshed == 4  # one layer, one refresh per optimizer step
    assert torch.equal(losses, losses_off)
    for p, q in zip(params, params_off):
        assert torch.equal(p, q)


def test_the_triton_kernels_train_bitwise_the_same_with_the_refresh(monkeypatch):
    """The Triton twin's own norm (under the interpreter on the CPU, the kernels themselves)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or the Triton interpreter")
    with use_path("triton"):
        (losses, params), (losses_off, params_off), refreshed = trained_both_ways(
            monkeypatch, steps=3, optimizer="foreach AdamW", checkpointed=True
        )
    assert refreshed == 3
    assert torch.equal(losses, losses_off)
    for p, q in zip(params, params_off):
        assert torch.equal(p, q)


def one_step(W, A, B, m, opt, x):
    forward(x, W, A, B, m).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_forward_after_a_step_reads_the_refreshed_value(optimizer):
    with use_path("torch"):
        W, A, B, m = layer()
        opt = OPTIMIZERS[optimizer]([A, B, m])
        x = torch.randn(6, W.shape[1])
        one_step(W, A, B, m, opt, x)
        before = stats()
        y = forward(x, W, A, B, m)
        assert since(before) == (1, 0, 0)  # read, not computed: the step's hook had refreshed it
        assert rel_l2(y, oracle(x, W, A, B, m)) <= 1e-6


def test_the_refresh_happens_in_the_step_and_only_for_the_layers_it_holds():
    with use_path("torch"):
        first, second = layer(0), layer(1)
        opt_first = torch.optim.AdamW(list(first[1:]), lr=0.05)
        opt_second = torch.optim.AdamW(list(second[1:]), lr=0.05)
        x = torch.randn(6, first[0].shape[1])
        (forward(x, *first).square().mean() + forward(x, *second).square().mean()).backward()
        before = stats()
        opt_first.step()
        assert since(before) == (0, 0, 1)  # only the first layer's parameters were stepped
        # The second optimizer's step starts another era: the first layer's value is of the last
        # one, so its forward computes; the second's was refreshed by this step.
        opt_second.step()
        before = stats()
        forward(x, *first)
        forward(x, *second)
        assert since(before) == (1, 1, 0)


def test_an_evaluation_only_layer_is_not_refreshed():
    with use_path("torch"):
        W, A, B, m = layer()
        opt = torch.optim.AdamW([A, B, m], lr=0.05)
        x = torch.randn(6, W.shape[1])
        with torch.no_grad():
            forward(x, W, A, B, m)
        for p in (A, B, m):
            p.grad = torch.ones_like(p)
        before = stats()
        opt.step()
        assert since(before) == (0, 0, 0)
        with torch.no_grad():
            y = forward(x, W, A, B, m)
        assert since(before) == (0, 1, 0)
        assert rel_l2(y, oracle(x, W, A, B, m)) <= 1e-6


def test_refresh_off_leaves_the_forward_to_compute(refresh_off):
    with use_path("torch"):
        W, A, B, m = layer()
        opt = torch.optim.AdamW([A, B, m], lr=0.05)
        x = torch.randn(6, W.shape[1])
        one_step(W, A, B, m, opt, x)
        before = stats()
        forward(x, W, A, B, m)
        assert since(before) == (0, 1, 0)


def test_the_environment_variable_turns_the_refresh_off():
    code = "from doracheck import norm_cache; print(norm_cache._REFRESH['on'])"
    env = {**os.environ, "DORACHECK_NORM_REFRESH": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("write", ["add_ under no_grad", "a new tensor", "the magnitude in place"])
def test_a_write_after_the_step_that_a_version_counter_sees_is_seen(write):
    with use_path("torch"):
        W, A, B, m = layer()
        opt = torch.optim.AdamW([A, B, m], lr=0.05)
        x = torch.randn(6, W.shape[1])
        one_step(W, A, B, m, opt, x)
        with torch.no_grad():
            if write == "add_ under no_grad":
                B.add_(0.25)
            elif write == "a new tensor":
                B = torch.nn.Parameter(B.detach() * 1.5)
            else:
                m.mul_(0.5)
        before = stats()
        y = forward(x, W, A, B, m)
        assert since(before) == (0, 1, 0)
        assert rel_l2(y, oracle(x, W, A, B, m)) <= 1e-6


def test_a_bare_data_write_after_the_step_is_the_documented_blind_spot():
    """``p.data`` written between ``optimizer.step()`` and the next forward: nothing can see it
    (norm_cache's docstring, README); ``clear_norm_cache()`` after such a write is the remedy.
    If this starts failing because the write is seen, update the docs: the blind spot is gone."""
    with use_path("torch"):
        W, A, B, m = layer()
        opt = torch.optim.AdamW([A, B, m], lr=0.05)
        x = torch.randn(6, W.shape[1])
        one_step(W, A, B, m, opt, x)
        B.data.mul_(1.5)
        stale = forward(x, W, A, B, m)
        assert rel_l2(stale, oracle(x, W, A, B, m)) > 1e-3
        clear_norm_cache()
        assert rel_l2(forward(x, W, A, B, m), oracle(x, W, A, B, m)) <= 1e-6


def test_a_step_under_cuda_graph_capture_or_compile_stores_nothing(monkeypatch):
    """While torch.compile traces (or FSDP2 manages modules) nothing is cached, so nothing is
    refreshed either."""
    with use_path("torch"):
        W, A, B, m = layer()
        opt = torch.optim.AdamW([A, B, m], lr=0.05)
        x = torch.randn(6, W.shape[1])
        forward(x, W, A, B, m).square().mean().backward()
        monkeypatch.setattr(norm_cache, "_cacheable", lambda: False)
        before = stats()
        opt.step()
        assert since(before) == (0, 0, 0)


def _peft_training(monkeypatch, refresh: bool, device: str, dtype: torch.dtype, steps: int = 4):
    """(losses, trainable parameters, refreshes) of an ``enable``d PEFT DoRA model trained the
    Trainer's way: fused AdamW, non-reentrant gradient checkpointing."""
    peft_models = pytest.importorskip("peft_models")
    from doracheck.integrations.peft import enable

    monkeypatch.setitem(norm_cache._REFRESH, "on", refresh)
    clear_norm_cache()
    model = enable(peft_models.dora_model(seed=5, dtype=dtype).to(device))
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW([p for _, p in peft_models.trainable(model)], lr=1e-3, fused=True)
    before = norm_cache_stats()["refreshed"]
    losses = []
    for i in range(steps):
        ids = peft_models.tokens(seed=40 + i, device=device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
    params = [p.detach().clone() for _, p in peft_models.trainable(model)]
    return torch.stack(losses), params, norm_cache_stats()["refreshed"] - before


def _assert_peft_training_unchanged_by_the_refresh(monkeypatch, device, dtype):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    losses, params, refreshed = _peft_training(monkeypatch, True, device, dtype)
    losses_off, params_off, refreshed_off = _peft_training(monkeypatch, False, device, dtype)
    layers = sum(1 for _ in params) // 3  # lora_A, lora_B, magnitude per adapted layer
    assert refreshed == 4 * layers and refreshed_off == 0
    assert torch.equal(losses, losses_off)
    for p, q in zip(params, params_off):
        assert torch.equal(p, q)


def test_a_peft_model_trains_bitwise_the_same_with_the_refresh(monkeypatch):
    with use_path("torch"):
        _assert_peft_training_unchanged_by_the_refresh(monkeypatch, "cpu", torch.float32)


@pytest.mark.gpu
def test_gpu_a_peft_model_trains_bitwise_the_same_with_the_refresh_in_bf16(monkeypatch):
    """On the Triton path with the norm's CUDA graphs: the refresh replays them in the hook."""
    with use_path("auto"):
        _assert_peft_training_unchanged_by_the_refresh(monkeypatch, "cuda", torch.bfloat16)
