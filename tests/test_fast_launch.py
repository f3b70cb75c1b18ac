"""kernels/fast_launch.py: which launches reuse a compiled kernel, and with which arguments.

On the CPU no Triton kernel is compiled, so these run the cache against a stand-in kernel that
records how it was launched; the GPU tests run the real kernels through it (every compose
launch in eager), and ``test_kernels_gpu.py`` checks it bitwise against Triton's own path.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from doracheck.kernels import fast_launch  # noqa: E402


class _Compiled:
    """What Triton's ``run`` returns: a launcher taking (grid, stream, function, metadata, hooks, *args)."""

    def __init__(self):
        self.launches: list[tuple] = []
        self.function, self.packed_metadata = object(), object()

    def run(self, *a):
        self.launches.append(a)


class _Kernel:
    """A JIT function as far as fast_launch uses one: ``kernel[grid](...)`` and the binder."""

    def __init__(self, binds_in_order: bool = True):
        self.compiled = _Compiled()
        self.slow: list[tuple] = []
        self.binds_in_order = binds_in_order
        self.device_caches = {-1: (None, None, None, None, self._bind)}

    def _bind(self, *args, **kwargs):
        params = {f"arg{i}": a for i, a in enumerate(args)}
        params.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
        if not self.binds_in_order:
            params = dict(reversed(list(params.items())))
        return params, None, kwargs

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return self.compiled

        return run


@pytest.fixture(autouse=True)
def _on_a_pretend_gpu(monkeypatch):
    monkeypatch.setattr(fast_launch, "interpreting", lambda: False)
    monkeypatch.setattr(fast_launch, "_stream", lambda device: 1234)
    fast_launch.clear()
    yield
    fast_launch.clear()


def _args(x, n=7):
    return (x, x.stride(0), n, 0.5)


def test_the_second_launch_with_the_same_raw_arguments_skips_triton():
    kernel, x = _Kernel(), torch.zeros(4, 8)
    const, opts = {"FLAG": True, "BLOCK": 16}, {"num_warps": 4}
    fast_launch.launch(kernel, (3,), _args(x), const, opts)
    fast_launch.launch(kernel, (3, 2), _args(x), const, opts)
    assert len(kernel.slow) == 1
    (launch,) = kernel.compiled.launches
    assert launch[:4] == (3, 2, 1, 1234) and launch[4] is kernel.compiled.function
    assert launch[6:9] == (None, None, None)  # no launch metadata, no hooks
    assert launch[9:] == (*_args(x), True, 16)  # the arguments, then the constexprs in signature order


@pytest.mark.parametrize("change", ["int", "dtype", "constexpr", "option", "misaligned", "debug"])
def test_anything_triton_specialises_on_goes_through_triton_again(change, monkeypatch):
    kernel, x = _Kernel(), torch.zeros(4, 8)
    const, opts = {"FLAG": True}, {"num_warps": 4}
    fast_launch.launch(kernel, (3,), _args(x), const, opts)
    args = _args(x)
    if change == "int":
        args = _args(x, n=16)
    elif change == "dtype":
        args = _args(x.double())
    elif change == "constexpr":
        const = {"FLAG": False}
    elif change == "option":
        opts = {"num_warps": 8}
    elif change == "debug":  # a global setting Triton's run adds to its options
        from triton import knobs

        monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    else:
        args = _args(x.view(-1)[1:].view(1, -1))  # 4 bytes past an aligned address
    fast_launch.launch(kernel, (3,), args, const, opts)
    assert len(kernel.slow) == 2 and not kernel.compiled.launches


def test_launch_hooks_send_every_launch_through_triton(monkeypatch):
    from triton import knobs

    kernel, x = _Kernel(), torch.zeros(4, 8)
    fast_launch.launch(kernel, (3,), _args(x), {}, {})
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    fast_launch.launch(kernel, (3,), _args(x), {}, {})
    assert len(kernel.slow) == 2 and not kernel.compiled.launches


def test_a_pre_run_hook_sends_every_launch_through_triton():
    kernel, x = _Kernel(), torch.zeros(4, 8)
    fast_launch.launch(kernel, (3,), _args(x), {}, {})
    kernel.pre_run_hooks = [lambda *a, **k: None]
    fast_launch.launch(kernel, (3,), _args(x), {}, {})
    assert len(kernel.slow) == 2 and not kernel.compiled.launches


def test_a_signature_that_does_not_bind_in_order_is_never_launched_directly():
    kernel, x = _Kernel(binds_in_order=False), torch.zeros(4, 8)
    for _ in range(3):
        fast_launch.launch(kernel, (3,), _args(x), {"FLAG": True}, {})
    assert len(kernel.slow) == 3 and not kernel.compiled.launches


def test_traced_or_interpreted_launches_are_refused(monkeypatch):
    monkeypatch.setattr(fast_launch, "interpreting", lambda: True)
    with pytest.raises(RuntimeError, match="eager GPU launches only"):
        fast_launch.launch(_Kernel(), (1,), _args(torch.zeros(2, 2)), {}, {})


def _desc(t, block=(2, 8)):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def test_a_descriptor_with_the_same_fields_launches_directly_and_its_own_object():
    """The compose's TMA descriptors: a new descriptor object of the same tensor layout (each call
    makes its own) hits the kept kernel, and the launch gets that new object."""
    kernel, x, y = _Kernel(), torch.zeros(4, 8), torch.zeros(4, 8)
    fast_launch.launch(kernel, (3,), (_desc(x), 5), {}, {})
    second = _desc(y)
    fast_launch.launch(kernel, (3,), (second, 5), {}, {})
    assert len(kernel.slow) == 1
    (launch,) = kernel.compiled.launches
    assert launch[9] is second and launch[10] == 5


@pytest.mark.parametrize("change", ["shape", "strides", "block", "dtype", "misaligned"])
def test_a_descriptor_that_differs_in_anything_but_its_address_goes_through_triton(change):
    kernel, x = _Kernel(), torch.zeros(4, 8)
    fast_launch.launch(kernel, (3,), (_desc(x),), {}, {})
    if change == "shape":
        other = _desc(torch.zeros(6, 8))
    elif change == "strides":
        other = _desc(torch.zeros(4, 16)[:, :8])
    elif change == "block":
        other = _desc(x, (4, 8))
    elif change == "dtype":
        other = _desc(torch.zeros(4, 8, dtype=torch.float64))
    else:  # a descriptor's own check refuses a misaligned base; the key must not rely on that
        other = _desc(x)
        other.base = x.view(-1)[1:]
    fast_launch.launch(kernel, (3,), (other,), {}, {})
    assert len(kernel.slow) == 2 and not kernel.compiled.launches
