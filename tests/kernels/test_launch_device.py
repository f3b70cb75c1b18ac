"""Triton launches on the device of their tensors, whatever device is current."""

from __future__ import annotations

import pytest
import torch

import doracheck


def test_eager_launches_are_made_on_the_tensors_device_when_it_is_not_current(monkeypatch):
    """Triton launches on the current device: a layer that accelerate's device_map put on
    cuda:1 while cuda:0 is current must have its launches made under cuda:1 (policy, with
    stand-ins for the CUDA calls; the two-GPU test below runs it for real)."""
    from doracheck.kernels import ops

    class OnCuda(torch.Tensor):  # a CPU tensor that says it lives on a CUDA device
        index = 1

        @property
        def is_cuda(self):
            return True

        @property
        def device(self):
            return torch.device("cuda", self.index)

    entered = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append(-1)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    on_1 = torch.zeros(2).as_subclass(OnCuda)
    assert ops.launch_device((None, 2.0, on_1)) == 1
    assert ops._on_device(lambda *a: "ran", (on_1,)) == "ran" and entered == [1, -1]
    OnCuda.index = 0
    entered.clear()
    assert ops.launch_device((on_1,)) is None and ops._on_device(lambda *a: "ran", (on_1,)) == "ran" and entered == []
    assert ops.launch_device((torch.zeros(2),)) is None and ops.launch_device((1.0, None)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_a_layer_on_another_gpu_than_the_current_one_gives_the_same_bits():
    """A DoRA layer on cuda:1 called while cuda:0 is current (accelerate's device_map) trains
    and infers bitwise as when cuda:1 is current."""
    torch.manual_seed(0)
    dev = torch.device("cuda", 1)
    W = torch.randn(96, 64, device=dev, dtype=torch.bfloat16)
    A = (torch.randn(16, 64, device=dev) * 0.1).to(torch.bfloat16).requires_grad_()
    B = (torch.randn(96, 16, device=dev) * 0.1).to(torch.bfloat16).requires_grad_()
    m = (torch.rand(96, device=dev) + 0.5).requires_grad_()
    x = torch.randn(4, 32, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def run(current):
        with torch.cuda.device(current):
            y = doracheck.dora_linear(x, W, A, B, m, 2.0)
            y.float().square().sum().backward()
            with torch.no_grad():
                y_infer = doracheck.dora_linear(x, W, A, B, m, 2.0)
        torch.cuda.synchronize(dev)
        grads = [t.grad.clone() for t in (x, A, B, m)]
        for t in (x, A, B, m):
            t.grad = None
        return [y.detach(), y_infer, *grads]

    on_1, on_0 = run(1), run(0)
    assert all(torch.equal(a, b) for a, b in zip(on_1, on_0))


def test_registered_op_bodies_launch_on_their_tensors_device(monkeypatch):
    """A graph compiled with aot_eager (or the eager backend) runs the registered op bodies
    themselves, not ``ops.call``: they take the same device guard (stand-ins for CUDA)."""
    from doracheck.kernels import ops

    seen = []
    monkeypatch.setattr(ops, "launch_device", lambda args: seen.append(args) or None)
    body = ops._guarded(lambda base, scale=1.0: base * scale)
    x = torch.ones(3)
    assert torch.equal(body(x, scale=2.0), x * 2.0) and seen == [(x,)]
