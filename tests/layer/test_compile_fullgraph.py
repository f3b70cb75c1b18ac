"""torch.compile(fullgraph=True) over a PEFT decoder layer with doracheck enabled: no graph
break in training (forward and backward) or inference, and the same numbers as eager.

On the CPU the torch path runs (backend "aot_eager": the graph capture is what is under test,
not Inductor's code generation); the GPU tests compile the Triton path with Inductor."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from peft_models import dora_model  # noqa: E402

from doracheck.integrations.peft import enable  # noqa: E402


def _layer_and_inputs(dropout: float):
    model = dora_model(0, dropout=dropout)
    enable(model)
    inner = model.base_model.model.model
    hidden = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3))
    rot = inner.rotary_emb(hidden, torch.arange(12)[None].expand(2, 12))

    def run(h):
        out = inner.layers[0](h, position_embeddings=rot, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    return model, run, hidden, [p for p in inner.layers[0].parameters() if p.requires_grad]


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_decoder_layer_compiles_without_graph_breaks_and_matches_eager(mode):
    model, run, hidden, params = _layer_and_inputs(0.0)
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    if mode == "infer":
        model.eval()
        with torch.no_grad():
            assert torch.equal(compiled(hidden), run(hidden))
        return
    h_e = hidden.clone().requires_grad_()
    y_e = run(h_e)
    grads_e = torch.autograd.grad(y_e.square().sum(), [h_e, *params])
    h_c = hidden.clone().requires_grad_()
    y_c = compiled(h_c)
    grads_c = torch.autograd.grad(y_c.square().sum(), [h_c, *params])
    assert torch.equal(y_c, y_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32: summation order of the traced backward only


def test_decoder_layer_with_lora_dropout_compiles_without_graph_breaks():
    model, run, hidden, _ = _layer_and_inputs(0.1)
    model.train()
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    h = hidden.clone().requires_grad_()
    compiled(h).sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("forced", [None, "triton"])
def test_the_cuda_dispatch_fast_path_traces_without_a_graph_break(monkeypatch, forced):
    """``dispatch.backend_for``'s CUDA fast path runs in every layer call, compiled too; it must
    ask ``is_compiling()`` before anything Dynamo cannot trace (a ContextVar read broke the graph
    in every layer and made compiled decode 7x slower on the H200). The path is CUDA-only, so
    this traces it for a CUDA device object, which needs no GPU; while tracing it answers "ask
    ``choose_path``" (False), whose compiled branch is the automatic choice."""
    from doracheck import dispatch

    if forced:
        monkeypatch.setenv("DORACHECK_PATH", forced)

    def f(x):
        return x + 1 if dispatch._plain_cuda_triton(torch.device("cuda")) else x - 1

    torch._dynamo.reset()
    x = torch.zeros(2)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), x - 1)  # fullgraph: a break raises


_FIRST_TRACE = """
import torch
count = torch.cuda.device_count
torch.cuda.device_count = lambda: 1  # as on a GPU machine, while doracheck is imported
import doracheck  # noqa: F401
from doracheck.kernels import backends
torch.cuda.device_count = count
from torch._dynamo.utils import counters

def f(x):
    return x + 1 if backends.triton_backend().name == "triton" else x - 1

compiled = torch.compile(f, fullgraph=True, backend="eager")
x = torch.zeros(2)
for _ in range(3):
    assert torch.equal(compiled(x), x + 1)
print(len(backends._TRITON), counters["stats"]["unique_graphs"])
"""


def test_a_first_call_traced_on_a_gpu_machine_compiles_once():
    """Where CUDA and triton are present the Triton backend is built when doracheck is imported,
    so a first call that torch.compile traces reads it built and no guard sees it change: built
    on that traced call, the second call recompiled the whole model (kernels/backends.py,
    ``_build_at_import``). CUDA's presence is simulated (the build needs no GPU)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _FIRST_TRACE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "1"], proc.stdout  # built once, one graph for three calls


_BROKEN_TRITON = """
import torch
torch.cuda.device_count = lambda: 1  # as on a GPU machine
import doracheck
from doracheck.kernels import backends
print(len(backends._TRITON))
"""


def test_a_broken_triton_does_not_break_the_import(tmp_path):
    """The build at import is best effort: a triton that is found but fails to import (a
    half-installed wheel) leaves ``import doracheck`` working, as the lazy build did."""
    import os
    import subprocess
    import sys

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('a broken triton')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _BROKEN_TRITON], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0"], proc.stdout


@pytest.mark.parametrize("dynamic,graphs", [(None, 2), (True, 1)], ids=["automatic", "dynamic_true"])
def test_a_decoder_layer_compiled_with_dynamic_shapes_trains_over_sequence_lengths(dynamic, graphs):
    """``torch.compile(fullgraph=True)`` over a PEFT decoder layer with doracheck at sequence
    lengths 5, 12, 31 and 47: by default one static graph and one dynamic one (the backward's loop
    over token chunks once specialized the token count: a recompile per length, 4 graphs); with
    ``dynamic=True`` one graph (a global float read in the layers' autograd Functions once
    crashed dynamo, ``kernels/constants.py``; ``math.isfinite`` of a symbolic ``scaling`` broke
    the graph); eager's output and gradients either way."""
    from torch._dynamo.utils import counters

    model = dora_model(0)
    enable(model)
    inner = model.base_model.model.model
    params = [p for p in inner.layers[0].parameters() if p.requires_grad]

    def run(h, cos, sin):
        out = inner.layers[0](h, position_embeddings=(cos, sin), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(run, dynamic=dynamic, fullgraph=True, backend="aot_eager")
    for length in (5, 12, 31, 47):
        hidden = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(length))
        cos, sin = inner.rotary_emb(hidden, torch.arange(length)[None].expand(2, length))
        results = []
        for fn in (compiled, run):
            h = hidden.clone().requires_grad_()
            y = fn(h, cos, sin)
            results.append((y, *torch.autograd.grad(y.square().sum(), [h, *params])))
        assert torch.equal(results[0][0], results[1][0]), length
        for a, b in zip(results[0][1:], results[1][1:]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32: summation order of the traced backward only
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


@pytest.mark.parametrize("chunk_tokens", [None, 20], ids=["one_chunk", "chunked_past_20_tokens"])
def test_a_dora_linear_compiled_with_dynamic_true_trains_over_token_counts_with_one_graph(chunk_tokens, monkeypatch):
    """``torch.compile(layer, dynamic=True, fullgraph=True)``: ``scaling`` and the token count are
    symbolic from the first call. No graph break (``math.isfinite`` of a symbolic float broke
    it), one graph over T = 3..300, eager's output and gradients; also where eager's backward
    runs over token chunks (the chunk size made 20 tokens: a loop over chunks of a symbolic T
    specialized it)."""
    from torch._dynamo.utils import counters

    from doracheck import DoRALinear
    from doracheck.kernels import settings
    from doracheck.reference import rel_l2

    if chunk_tokens is not None:
        monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", chunk_tokens * 48 * 4)  # d_out 48, fp32

    torch.manual_seed(0)
    layer = DoRALinear.from_linear(torch.nn.Linear(64, 48, bias=True), r=8, lora_alpha=16)
    with torch.no_grad():
        for p in layer.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    params = [p for p in layer.parameters() if p.requires_grad]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True, backend="aot_eager")
    for T in (3, 16, 40, 300):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
        results = []
        for fn in (compiled, layer):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            results.append((y, *torch.autograd.grad(y.square().sum(), [xi, *params])))
        assert torch.equal(results[0][0], results[1][0]), T
        for a, b in zip(results[0][1:], results[1][1:]):
            if chunk_tokens is None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32: summation order of the traced backward only
            else:  # eager sums dB and dm over chunks, the graph over all T tokens at once: 2·γ_T in fp32
                assert rel_l2(a, b) <= 2 * T * 2.0**-24, (T, rel_l2(a, b))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
