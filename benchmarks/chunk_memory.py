"""fwd+bwd peak above resident of one DoRALinear (8192², r 384, T 4096, bf16) at several backward
token-chunk budgets, against nn.Linear's and the bound tests/test_kernels_gpu.py holds it to
(1.25 x nn.Linear + 32 MiB). Usage: python benchmarks/chunk_memory.py 16 32 64
"""

import sys

import torch

import doracheck
from doracheck.kernels import settings

d, r, T = 8192, 384, 4096
layer = doracheck.DoRALinear(d, d, r, 2 * r, bias=False, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    layer.lora_B.normal_(0, 0.02)
lin = torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)


def peak(fn):
    for _ in range(3):  # the norm's graph is captured on the second call
        fn()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    result = torch.cuda.max_memory_allocated() - start
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    return result / 2**20


linear_mib = peak(lambda: lin(x).backward(dy))
print(f"nn.Linear fwd+bwd peak {linear_mib:.1f} MiB; bound {1.25 * linear_mib + 32:.1f} MiB")
for mib in [float(a) for a in sys.argv[1:]] or [16.0]:
    settings.BACKWARD_CHUNK_BYTES = int(mib * 2**20)
    dora = peak(lambda: layer(x).backward(dy))
    print(f"chunk {mib:5.0f} MiB: doracheck fwd+bwd peak {dora:.1f} MiB ({'within' if dora <= 1.25 * linear_mib + 32 else 'OVER'} the bound)")
