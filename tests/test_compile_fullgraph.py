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
