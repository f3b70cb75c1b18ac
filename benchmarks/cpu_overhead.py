"""Where the host CPU time of one DoRA layer step goes, on a GPU (diagnostic only).

At T = 1 every GPU kernel is short, so a step's time is what the CPU spends issuing it. Prints
the CPU time per call of: plain nn.Linear, doracheck forward (no_grad), forward+backward; one
Triton launch of the compose kernel alone; then a cProfile of the training step sorted by own
time. Usage: python benchmarks/cpu_overhead.py [d] [r]
"""

import cProfile
import pstats
import sys
import time

import torch

import doracheck
from doracheck.kernels import compose_triton

d = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
r = int(sys.argv[2]) if len(sys.argv) > 2 else 16
dev, dt = "cuda", torch.bfloat16
layer = doracheck.DoRALinear(d, d, r, 2 * r, bias=False, device=dev, dtype=dt)
with torch.no_grad():
    layer.lora_B.normal_(0, 0.02)
lin = torch.nn.Linear(d, d, bias=False, device=dev, dtype=dt).requires_grad_(False)
x = torch.randn(1, d, device=dev, dtype=dt, requires_grad=True)
dy = torch.randn(1, d, device=dev, dtype=dt)


def train(m):
    m(x).backward(dy)
    for p in m.parameters():
        p.grad = None
    x.grad = None


def infer(m):
    with torch.no_grad():
        m(x)


base = torch.randn(1, d, device=dev, dtype=dt)
xa = torch.randn(1, r, device=dev, dtype=dt)
g = torch.ones(d, device=dev)


def launch(_m):
    compose_triton.lora_up_compose_triton(base, xa, layer.lora_B, g, 2.0, out=base)


def cpu_us(fn, m, n=300):
    for _ in range(20):
        fn(m)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(m)
    cpu = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return cpu


for name, fn, m in (("linear train", train, lin), ("linear infer", infer, lin), ("doracheck infer", infer, layer),
                    ("doracheck train", train, layer), ("compose launch only", launch, None)):
    print(f"{name:22s} {cpu_us(fn, m):8.1f} us CPU per call")
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    train(layer)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
