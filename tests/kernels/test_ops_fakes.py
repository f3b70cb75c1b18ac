"""The registered ops' fake (meta) implementations: right outputs, and no guard from a tile choice.

Each ``torch.ops.doracheck`` op has a fake that only allocates its outputs (kernels/ops.py,
``_register``). ``torch.library.opcheck`` checks each fake against the real op (shapes, dtypes,
strides; the op under ``torch.compile`` with dynamic shapes); the recompile test checks the reason
for lean fakes: a compiled graph with a symbolic token count that crosses the kernels' tile buckets
(decode vs prefill tiles, one vs several token blocks) compiles once. On the GPU these run the real
kernels; without one, under TRITON_INTERPRET=1 at small shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = [
    pytest.mark.gpu if ON_GPU else pytest.mark.interpreter,
    pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="without CUDA the kernels run under TRITON_INTERPRET=1 only"),
    pytest.mark.skipif(os.environ.get("DORACHECK_TRACE_KERNELS") == "1",
                       reason="DORACHECK_TRACE_KERNELS=1 registers triton_op, whose fake is the traced body"),
]
triton = pytest.importorskip("triton")

import doracheck.kernels.ops  # noqa: E402, F401  (registers torch.ops.doracheck)

D_IN, D_OUT, R, S = 24, 20, 4, 0.5


def _tensors(T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of every op for T tokens; never zeros, g and n positive (no lost feature)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    n = rnd(D_OUT, dtype=torch.float32).abs() + 0.5
    return dict(
        W=rnd(D_OUT, D_IN), A=rnd(R, D_IN, scale=0.3), B=rnd(D_OUT, R, scale=0.3),
        base=rnd(T, D_OUT), base_d=rnd(T, D_OUT), x=rnd(T, D_IN), xa=rnd(T, R), dy=rnd(T, D_OUT),
        g=rnd(D_OUT, dtype=torch.float32).abs() + 0.5, n=n, bias=rnd(D_OUT), parts=rnd(3, D_OUT, dtype=torch.float32),
    )


def _calls(T: int) -> dict[str, tuple]:
    """(op, args) for each op, every flag combination the library uses."""
    t = _tensors(T)
    ops = torch.ops.doracheck
    return {
        "factored_norm": (ops.factored_norm.default, (t["W"], t["A"], t["B"], S, False)),
        "factored_norm_fan_in_fan_out": (ops.factored_norm.default, (t["W"].t().contiguous(), t["A"], t["B"], S, True)),
        "lora_up_compose": (ops.lora_up_compose.default, (t["base"], t["xa"], t["B"], t["g"], None, S)),
        "lora_up_compose_bias": (ops.lora_up_compose.default, (t["base"], t["xa"], t["B"], t["g"], t["bias"], S)),
        "lora_up_compose_save_z": (ops.lora_up_compose_save_z.default, (t["base"], t["xa"], t["B"], t["g"], t["bias"], S, True)),
        "lora_up_compose_dropout": (ops.lora_up_compose_dropout.default,
                                    (t["base"], t["base_d"], t["xa"], t["B"], t["g"], None, S)),
        "grad_scale_dm": (ops.grad_scale_dm.default, (t["dy"], t["base"], t["g"], t["n"], None, False, False, True)),
        "grad_scale_dm_final": (ops.grad_scale_dm.default, (t["dy"], t["base"], t["g"], t["n"], t["bias"], True, True, True)),
        "grad_scale_dm_partials": (ops.grad_scale_dm.default, (t["dy"], t["base"], t["g"], t["n"], None, False, False, False)),
        "dm_finish": (ops.dm_finish.default, (t["parts"], t["dy"], t["x"], t["W"], t["xa"], t["B"], t["g"], t["n"], S,
                                              torch.bfloat16)),
        "dm_finish_flat_parts": (ops.dm_finish.default, (t["parts"].reshape(-1), t["dy"], t["x"], t["W"], t["xa"], t["B"],
                                                         t["g"], t["n"], S, torch.bfloat16)),
    }


NAMES = list(_calls(1))


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("T", [5, 40])
@pytest.mark.parametrize("name", NAMES)
def test_each_fake_matches_its_op(name, T):
    """opcheck (schema, fake tensors, AOT dispatch with static and dynamic shapes), and the fake's
    outputs on meta tensors have the real outputs' shapes, dtypes and strides."""
    op, args = _calls(T)[name]
    torch.library.opcheck(op, args)
    real = _flat(op(*args))
    fake = _flat(op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)))
    assert [(f.shape, f.dtype, f.stride()) for f in fake] == [(r.shape, r.dtype, r.stride()) for r in real]
    assert all(f.device.type == "meta" for f in fake)


def test_no_output_features_pass_partials_from_grad_scale_dm_to_dm_finish():
    """d_out = 0: grad_scale_dm's flat partials are (0,), and dm_finish takes them (there is no
    row length to split a flat buffer by) and returns an empty dm; real and fake agree."""
    T, d_in = 5, D_IN
    dy = torch.randn(T, 0).to(torch.bfloat16).to(DEVICE)
    empty = torch.empty(0, dtype=torch.float32, device=DEVICE)
    x = torch.randn(T, d_in).to(torch.bfloat16).to(DEVICE)
    W = torch.empty(0, d_in, dtype=torch.bfloat16, device=DEVICE)
    xa = torch.randn(T, R).to(torch.bfloat16).to(DEVICE)
    B = torch.empty(0, R, dtype=torch.bfloat16, device=DEVICE)
    ops = torch.ops.doracheck
    for args_of in (lambda t: t, lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t):
        dz, parts = ops.grad_scale_dm.default(*map(args_of, (dy, dy, empty, empty, None, False, False, False)))
        assert dz.shape == (T, 0) and parts.shape == (0,)
        dm = ops.dm_finish.default(*map(args_of, (parts, dy, x, W, xa, B, empty, empty, S, torch.bfloat16)))
        assert dm.shape == (0,) and dm.dtype == torch.bfloat16


def test_a_symbolic_token_count_compiles_once():
    """Forward compose and backward dz/dm at token counts across the tile buckets (T <= 16 takes
    the decode tiles on a GPU; past one token block the dm partials are summed): one graph with
    dynamic shapes, its results bitwise eager's. A fake that ran the body made each bucket a guard."""
    from torch._dynamo.utils import counters

    ops = torch.ops.doracheck

    def step(base, xa, B, g, n, dy):
        y = ops.lora_up_compose(base, xa, B, g, None, S)
        dz, dm = ops.grad_scale_dm(dy, y, g, n, None, True, False, True)
        return y, dz, dm

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, dynamic=True, backend="aot_eager", fullgraph=True)
    for T in (3, 8, 24, 40, 72) + ((300,) if ON_GPU else ()):
        t = _tensors(T, seed=T)
        args = (t["base"], t["xa"], t["B"], t["g"], t["n"], t["dy"])
        got, want = compiled(*(a.clone() for a in args)), step(*(a.clone() for a in args))
        for a, b in zip(got, want):
            assert torch.equal(a, b), T
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the next test, on CUDA tensors")
def test_compiled_layers_on_the_triton_path_train_over_varying_token_counts_with_one_graph(monkeypatch):
    """The next test's model, small, on the CPU with the Triton path taken while tracing (on CPU
    tensors a compiled graph would take the torch path): the backward's registered ops return
    the dm partials flat, so no guard on the number of token blocks being one (a (P, d_out)
    tensor's contiguity check made T <= 16 and T > 16 two graphs here, T <= 64 and T > 64 on the
    H200); one graph over T = 3..300 with ``dynamic=True``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    import doracheck
    from doracheck import dispatch

    monkeypatch.setattr(dispatch, "choose_path", lambda device: dispatch.PathChoice("triton", "test: the kernels"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        doracheck.DoRALinear.from_linear(torch.nn.Linear(24, 40, bias=True), r=8, lora_alpha=16),
        doracheck.DoRALinear.from_linear(torch.nn.Linear(40, 24, bias=False), r=8, lora_alpha=16),
    ).to(dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    params = [p for p in model.parameters() if p.requires_grad]
    targets: set[str] = set()

    def record(gm, _inputs):
        targets.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    for T in (3, 16, 40, 300):
        x = torch.randn(T, 24, dtype=torch.bfloat16, requires_grad=True)
        torch.autograd.grad(compiled(x), [x, *params], torch.randn(T, 24, dtype=torch.bfloat16))
    assert {"doracheck.grad_scale_dm.default", "doracheck.dm_finish.default"} <= targets, sorted(targets)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.skipif(not ON_GPU, reason="on CPU tensors a compiled layer takes the torch path (no doracheck op)")
def test_compiled_layers_train_over_varying_token_counts_with_one_graph():
    """Two DoRALinear layers (a graph applies the autograd Function twice, where a global float
    once crashed dynamo) trained compiled with ``dynamic=True``, at token counts on both sides of
    the decode tiles and of the TMA compose's threshold (on Hopper, T = 1030 at r = 128 and
    d_out = 4096 takes it, kernels/settings.py): one graph, and the same output and gradients as
    eager up to the rounding of the torch ops around the kernels (the check is the graph count;
    the compile tests judge the numbers against the oracle)."""
    from torch._dynamo.utils import counters

    import doracheck
    from doracheck.reference import rel_l2

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        doracheck.DoRALinear.from_linear(torch.nn.Linear(1024, 4096, bias=True), r=128, lora_alpha=256),
        doracheck.DoRALinear.from_linear(torch.nn.Linear(4096, 1024, bias=False), r=128, lora_alpha=256),
    ).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True, backend="aot_eager", fullgraph=True)
    for T in (3, 16, 40, 300, 1030):
        x = torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16)
        results = []
        for fn in (compiled, model):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            results.append((y, *torch.autograd.grad(y, [xi, *(p for _, p in named)], dy)))
        for name, a, b in zip(("y", "dx", *(n for n, _ in named)), *results):
            assert rel_l2(a.float(), b.float()) <= 1e-2, (T, name)  # a few bf16 roundings (u = 2^-8), no more
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
