"""The direct launch path for compiled Triton kernels (kernels/fast_launch.py).

CPU: the key separates everything triton specialises on, and a hit launches the kept compiled
kernel with every argument in signature order (defaults filled in), as ``JITFunction.run``
does; the path is off under the interpreter and on request. GPU (marked): the layer's outputs
and gradients are bitwise those of launches through triton, aligned and misaligned inputs alike.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from doracheck.kernels import fast_launch
from doracheck.kernels.fast_launch import FastKernel, arg_key


def test_the_key_separates_what_triton_specialises_on():
    t = torch.zeros(8, dtype=torch.bfloat16)
    assert arg_key(t, False) == arg_key(torch.zeros(8, dtype=torch.bfloat16), False)
    assert arg_key(t, False) != arg_key(t[1:], False)  # 2-byte offset: not 16-byte aligned
    assert arg_key(t, False) != arg_key(t.float(), False)
    assert arg_key(1, False) != arg_key(17, False)  # 1 is specialised
    assert arg_key(16, False) != arg_key(17, False)  # divisibility by 16
    assert arg_key(16, False) == arg_key(32, False)
    assert arg_key(2**31 - 16, False) != arg_key(2**31, False)  # int32 against int64
    assert arg_key(2**62, False) != arg_key(2**63, False)  # int64 against uint64
    assert arg_key(True, False) != arg_key(False, False)
    assert arg_key(True, False) != arg_key(1, False)
    assert arg_key(64, True) != arg_key(128, True)  # a constexpr by its value
    assert arg_key(0.5, False) == arg_key(2.0, False)
    assert arg_key(object(), False) is NotImplemented


class _Compiled:
    def __init__(self):
        self.function, self.packed_metadata, self.launches = "fn", "meta", []

    def launch_metadata(self, grid, stream, *values):
        return None

    def run(self, *call):
        self.launches.append(call)


class _Jit:
    """What FastKernel reads of a JITFunction: ``params`` and ``kernel[grid](...)``."""

    def __init__(self):
        P = SimpleNamespace
        self.params = [P(name="out", is_constexpr=False, has_default=False, default=None),
                       P(name="n", is_constexpr=False, has_default=False, default=None),
                       P(name="FLAG", is_constexpr=True, has_default=True, default=False),
                       P(name="BLOCK", is_constexpr=True, has_default=False, default=None)]
        self.compiled, self.slow_calls = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return run


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "_raw_stream", lambda device: 77)
    hooks = SimpleNamespace(runtime=SimpleNamespace(debug=False, launch_enter_hook="enter", launch_exit_hook="exit"))
    monkeypatch.setattr(fast_launch, "_knobs", lambda: hooks)


def test_a_hit_launches_the_kept_kernel_with_every_argument_in_order(fake_device):
    jit = _Jit()
    k = FastKernel(jit)
    out = torch.zeros(32)
    k[(4,)](out, 48, BLOCK=64, num_warps=4)  # miss: through the JIT function
    assert len(jit.slow_calls) == 1
    k[(5, 2)](out, 32, BLOCK=64, num_warps=4)  # the same key: launched directly
    assert len(jit.slow_calls) == 1
    assert jit.compiled[0].launches == [(5, 2, 1, 77, "fn", "meta", None, "enter", "exit", out, 32, False, 64)]
    k[(5,)](out, 33, BLOCK=64, num_warps=4)  # 33 is not divisible by 16: another specialisation
    k[(5,)](out, 32, BLOCK=128, num_warps=4)  # another constexpr
    k[(5,)](out, 32, BLOCK=64, num_warps=8)  # another launch option
    k[(5,)](out[1:], 32, BLOCK=64, num_warps=4)  # a misaligned pointer
    assert len(jit.slow_calls) == 5


def test_off_under_the_interpreter_and_on_request(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fast_launch.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DORACHECK_TRITON_LAUNCH", "triton")
    assert not fast_launch.enabled()
    sentinel = object()
    assert fast_launch.fast(sentinel) is sentinel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_direct_launches_are_bitwise_launches_through_triton(monkeypatch, offset, dtype):
    import doracheck
    from doracheck.kernels import settings
    from doracheck.norm_cache import clear_norm_cache

    monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", 40 * 96 * 4)  # several token chunks
    gen = torch.Generator().manual_seed(3)

    def make(*shape, scale=1.0):
        flat = torch.randn(offset + torch.Size(shape).numel(), generator=gen) * scale
        return flat.to("cuda", dtype)[offset:].view(shape)  # offset 1: not 16-byte aligned on the GPU

    d_out, d_in, r, T = 96, 80, 16, 130
    W, A, B, x = make(d_out, d_in), make(r, d_in, scale=0.1), make(d_out, r, scale=0.1), make(T, d_in)
    m = (torch.rand(d_out, generator=gen) + 0.5).to("cuda", dtype)
    bias = make(d_out)

    def run():
        clear_norm_cache()
        leaves = [t.detach().clone().requires_grad_() for t in (x, A, B, m)]
        y = doracheck.dora_linear(leaves[0], W, leaves[1], leaves[2], leaves[3], 2.0, bias)
        y.backward(torch.ones_like(y))
        with torch.no_grad():
            y_infer = doracheck.dora_linear(x, W, A, B, m, 2.0, bias)
        return [y, y_infer, *(t.grad for t in leaves)]

    monkeypatch.setenv("DORACHECK_TRITON_LAUNCH", "triton")
    through_triton = run()
    monkeypatch.delenv("DORACHECK_TRITON_LAUNCH")
    run()  # the first eager calls fill the fast path's kernels; the next launch directly
    direct = run()
    for a, b in zip(through_triton, direct):
        assert torch.equal(a, b)
