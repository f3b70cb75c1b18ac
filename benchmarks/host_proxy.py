"""Host-side cost of one PEFT-path DoRA layer call on the Triton path, on a CPU (diagnostic).

Runs ``dora_from_base`` (the PEFT integration's entry) forward, forward inside a backward (the
checkpoint recompute) and backward on small CPU tensors with the Triton backend forced
(TRITON_INTERPRET=1) and every Triton launch replaced by a no-op, so what is timed is
doracheck's own Python and the torch ops it issues, not the kernels and not Triton's
launcher. Kernel outputs are garbage (uninitialised buffers); only time is read. A proxy for
the per-call host time the H200 profile shows (torch.profiler there also counts Triton's
launcher and the CUDA launch calls). Usage: TRITON_INTERPRET=1 python benchmarks/host_proxy.py [chunks]
"""

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["DORACHECK_PATH"] = "triton"

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from doracheck.autograd import dora_from_base  # noqa: E402
from doracheck.kernels import settings  # noqa: E402

launches = {"n": 0}


def _no_launch(self, *args, **kwargs):
    launches["n"] += 1


InterpretedFunction.run = _no_launch  # type: ignore[method-assign]

chunks = int(sys.argv[1]) if len(sys.argv) > 1 else 1
T, d_in, d_out, r = 64, 32, 48, 8
dt = torch.bfloat16
settings.BACKWARD_CHUNK_BYTES = max(1, T * d_out * 2 // chunks)
torch.manual_seed(0)
W = torch.randn(d_out, d_in, dtype=dt)
A = torch.randn(r, d_in, dtype=dt, requires_grad=True)
B = torch.randn(d_out, r, dtype=dt, requires_grad=True)
m = torch.rand(d_out, dtype=dt, requires_grad=True)
x = torch.randn(T, d_in, dtype=dt, requires_grad=True)
dy = torch.randn(T, d_out, dtype=dt)


def forward():
    result = x.detach() @ W.t()
    return dora_from_base(x, result, W, A, B, m, None, 2.0)


def timed(fn, n=400):
    for _ in range(30):
        fn()
    launches["n"] = 0
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6, launches["n"] / n


def no_grad_forward():
    with torch.no_grad():
        forward()


def train_step():
    y = forward()
    y.backward(dy)
    for p in (A, B, m, x):
        p.grad = None


base_us, _ = timed(lambda: x.detach() @ W.t())
infer_us, infer_l = timed(no_grad_forward)
fwd_us, fwd_l = timed(forward)
step_us, step_l = timed(train_step)
print(f"chunks={chunks}  (host µs per call, Triton launches stubbed; base GEMM alone {base_us:.1f} µs)")
print(f"inference forward     {infer_us - base_us:7.1f} µs  {infer_l:.0f} launches")
print(f"training forward      {fwd_us - base_us:7.1f} µs  {fwd_l:.0f} launches")
print(f"forward + backward    {step_us - base_us:7.1f} µs  {step_l:.0f} launches")
