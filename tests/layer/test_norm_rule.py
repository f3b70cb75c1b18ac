"""The norm-reuse rule of ``doracheck.norm_rule`` (its module docstring), call by call.

Counted through ``norm_cache_stats``: which forwards compute the norm (a miss) and which reuse
a stored one (a hit), and that a reused norm is never stale after the writes that version
counters do not see (fused optimizers, ``p.data``).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import doracheck
from doracheck.dispatch import use_path
from doracheck.norm_rule import clear_norm_cache, norm_cache_stats
from doracheck.reference import dora_forward_ref, rel_l2


@pytest.fixture(autouse=True)
def _torch_path():
    clear_norm_cache()
    with use_path("torch"):
        yield
    clear_norm_cache()


def params(seed=0, d_in=10, d_out=8, r=3):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=gen)
    A = (torch.randn(r, d_in, generator=gen) * 0.3).requires_grad_()
    B = (torch.randn(d_out, r, generator=gen) * 0.3).requires_grad_()
    m = (W.norm(dim=1) * 1.1).requires_grad_()
    return W, A, B, m


def call(x, W, A, B, m):
    return doracheck.dora_linear(x, W, A, B, m, 2.0)


def counts():
    stats = norm_cache_stats()
    return stats["hits"], stats["misses"]


def delta(before):
    hits, misses = counts()
    return hits - before[0], misses - before[1]


def fresh_output(x, W, A, B, m):
    return dora_forward_ref(x.double(), W.double(), A.detach().double(), B.detach().double(), m.detach().double(), 2.0)


def test_training_forwards_always_compute():
    W, A, B, m = params()
    x = torch.randn(4, 10)
    before = counts()
    call(x, W, A, B, m)
    call(x, W, A, B, m)
    assert delta(before) == (0, 2)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_reuses_its_forwards_norm(reentrant):
    W, A, B, m = params()
    x = torch.randn(4, 10, requires_grad=True)
    before = counts()
    y = checkpoint.checkpoint(lambda t: call(t, W, A, B, m), x, use_reentrant=reentrant)
    y.square().sum().backward()
    assert delta(before) == (1, 1)  # the forward computed, the recompute inside the backward reused


def test_inference_reuses_until_something_could_have_written():
    W, A, B, m = params()
    x = torch.randn(4, 10)
    with torch.no_grad():
        before = counts()
        call(x, W, A, B, m)
        call(x, W, A, B, m)
        assert delta(before) == (1, 1)


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_an_optimizer_step_ends_reuse(kind):
    W, A, B, m = params()
    x = torch.randn(4, 10)
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    opt = torch.optim.AdamW([A, B, m], lr=0.1, **options)
    with torch.no_grad():
        call(x, W, A, B, m)
    for p in (A, B, m):
        p.grad = torch.ones_like(p)
    opt.step()
    before = counts()
    with torch.no_grad():
        y = call(x, W, A, B, m)
    assert delta(before) == (0, 1)
    assert rel_l2(y, fresh_output(x, W, A, B, m)) <= 1e-6


def test_a_backward_ends_reuse_so_pdata_updates_are_seen():
    """The tutorial loop writes through ``.data`` after a backward: no counter sees it."""
    W, A, B, m = params()
    x = torch.randn(4, 10)
    with torch.no_grad():
        call(x, W, A, B, m)
    call(x, W, A, B, m).square().sum().backward()
    for p in (A, B):
        p.data -= 0.5 * p.grad
    before = counts()
    with torch.no_grad():
        y = call(x, W, A, B, m)
    assert delta(before) == (0, 1)
    assert rel_l2(y, fresh_output(x, W, A, B, m)) <= 1e-6


def test_in_place_write_under_no_grad_is_seen_by_the_version_counter():
    W, A, B, m = params()
    x = torch.randn(4, 10)
    with torch.no_grad():
        call(x, W, A, B, m)
        B.mul_(1.5)
        y = call(x, W, A, B, m)
    assert rel_l2(y, fresh_output(x, W, A, B, m)) <= 1e-6


def test_clear_norm_cache_after_a_bare_data_write():
    """The one write nothing sees (the module docstring says so): ``.data`` between two
    inference calls with no backward and no step between; ``clear_norm_cache`` is the remedy."""
    W, A, B, m = params()
    x = torch.randn(4, 10)
    with torch.no_grad():
        call(x, W, A, B, m)
    B.data.mul_(1.5)
    clear_norm_cache()
    with torch.no_grad():
        y = call(x, W, A, B, m)
    assert rel_l2(y, fresh_output(x, W, A, B, m)) <= 1e-6


def test_no_reuse_between_a_backward_and_the_next_step():
    """backward, a no-grad forward (a metric), a hand-written p.data update, another no-grad
    forward: the second must not serve the first's norm."""
    W, A, B, m = params()
    x = torch.randn(4, 10)
    call(x, W, A, B, m).square().sum().backward()
    with torch.no_grad():
        call(x, W, A, B, m)
    B.data -= 0.5 * B.grad
    with torch.no_grad():
        y = call(x, W, A, B, m)
    assert rel_l2(y, fresh_output(x, W, A, B, m)) <= 1e-6


def test_a_stored_g_is_not_read_for_another_magnitude():
    """g is formed from the magnitude at every call: after m changes in place, a forward without
    grad mode that reuses the stored norm still uses the new m."""
    W, A, B, m = params(seed=4)
    x = torch.randn(4, 10)

    def dropped(m):
        torch.manual_seed(7)  # the same keep-mask for every call
        with torch.no_grad():
            return doracheck.dora_linear(x, W, A, B, m, 2.0, dropout_p=0.3, training=True)

    before = counts()
    dropped(m)
    assert delta(before) == (0, 1)  # computed and stored
    with torch.no_grad():
        m.mul_(0.5)
    got = dropped(m)
    clear_norm_cache()
    assert torch.equal(got, dropped(m))  # as if nothing had been stored


@pytest.mark.parametrize("written", ["magnitude", "all"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_after_data_updates_between_steps_never_reads_an_earlier_step(written, reentrant):
    """Parameters updated through ``.data`` between steps (no optimizer, so no era ends) with
    checkpointing and dropout: reentrant checkpointing's first pass runs without grad after the
    previous step's backward, and its recompute inside the backward must never find an earlier
    step's norm or g (dA and dB off by 100% after one such update, and the norm
    stale by 48-64x when A and B were written)."""
    gen = torch.Generator().manual_seed(1)
    d_in, d_out, r, T, p = 12, 10, 4, 7, 0.1
    W = torch.randn(d_out, d_in, generator=gen)
    A = (torch.randn(r, d_in, generator=gen) / 3).requires_grad_()
    B = (torch.randn(d_out, r, generator=gen) / 3).requires_grad_()
    m = (1 + torch.rand(d_out, generator=gen)).requires_grad_()
    x = torch.randn(T, d_in, generator=gen).requires_grad_()
    mask = torch.rand(T, d_in, generator=gen) > p

    def layer(x):
        return doracheck.dora_linear(x, W, A, B, m, 1.5, training=True, dropout_p=p, dropout_mask=mask)

    updated = [A, B, m] if written == "all" else [m]
    for _ in range(3):
        for t in (A, B, m, x):
            t.grad = None
        checkpoint.checkpoint(layer, x, use_reentrant=reentrant).square().sum().backward()
        A2, B2, m2 = (t.detach().double().requires_grad_() for t in (A, B, m))
        xd, Wd = x.detach().double(), W.double()
        x_drop = xd * mask / (1 - p)
        n = (Wd + 1.5 * B2 @ A2).norm(dim=1).detach()
        g = m2 / n
        ref = xd @ Wd.t() + (g - 1) * (x_drop @ Wd.t()) + g * 1.5 * ((x_drop @ A2.t()) @ B2.t())
        ref.square().sum().backward()
        for got, want in zip((A.grad, B.grad, m.grad), (A2.grad, B2.grad, m2.grad)):
            assert rel_l2(got.double(), want) <= 1e-5
        for t in updated:
            t.data -= 0.3 * t.grad  # the tutorial update: no optimizer, no version change


def _ema_swap_grads(clear: bool, reentrant: bool):
    """Two micro-steps of a checkpointed layer; between the second forward and its backward an
    evaluation runs with other weights copied in through ``.data`` and restored after (an EMA
    swap, as torch_ema does). ``clear``: the reference, no norm ever reused."""
    torch.manual_seed(0)
    layer = doracheck.DoRALinear(32, 24, r=4, lora_alpha=8, dtype=torch.float32)
    with torch.no_grad():
        layer.lora_B.normal_()
        layer.magnitude.mul_(1.5)
    trained = [layer.lora_A, layer.lora_B, layer.magnitude]
    ema = [p.detach().clone() * 3 + 0.1 for p in trained]

    def loss(seed):
        if clear:
            clear_norm_cache()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        return checkpoint.checkpoint(layer, x, use_reentrant=reentrant).square().sum()

    loss(1).backward()  # micro-step 1: a backward has run in this era
    pending = loss(2)  # micro-step 2's forward (reentrant: its first pass runs without grad)
    backup = [p.detach().clone() for p in trained]
    for p, e in zip(trained, ema):
        p.data.copy_(e)
    with torch.no_grad():
        if clear:
            clear_norm_cache()
        layer(torch.randn(4, 32))  # the evaluation, on the swapped-in weights
    for p, b in zip(trained, backup):
        p.data.copy_(b)
    if clear:
        clear_norm_cache()
    pending.backward()
    return [p.grad.clone() for p in trained]


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_evaluation_on_swapped_weights_before_a_pending_backward_changes_nothing(reentrant):
    """After a backward, a forward without grad mode neither reads nor stores (found in review:
    storing there let an evaluation with EMA weights replace the value a pending recompute reads,
    41-51% wrong gradients)."""
    for got, want in zip(_ema_swap_grads(False, reentrant), _ema_swap_grads(True, reentrant)):
        assert rel_l2(got.double(), want.double()) <= 1e-6


@pytest.mark.parametrize("when", ["before_the_first_step", "before_a_pending_backward"])
def test_an_inference_mode_evaluation_never_hands_a_recompute_inference_tensors(when):
    """A norm stored by a forward under ``torch.inference_mode`` (a sanity validation before the
    first step) holds inference tensors, which autograd cannot save: a recompute inside a
    backward computes afresh instead of reading them (reentrant checkpointing
    raised 'Inference tensors cannot be saved for backward')."""
    torch.manual_seed(0)
    layer = doracheck.DoRALinear(16, 12, r=4, lora_alpha=8)

    def train():
        x = torch.randn(5, 16, requires_grad=True)
        return checkpoint.checkpoint(layer, x, use_reentrant=True).square().sum()

    def evaluate():
        with torch.inference_mode():
            layer(torch.randn(3, 16))

    if when == "before_the_first_step":
        evaluate()
        train().backward()
    else:
        train().backward()
        pending = train()
        evaluate()
        pending.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in (layer.lora_A, layer.lora_B, layer.magnitude))
