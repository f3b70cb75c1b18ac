"""Profile one DoRA layer training step (torch.profiler): where CPU and GPU time go. Diagnostic only.

Usage: python benchmarks/profile_step.py [d_in,d_out,r,T ...]   (default 8192,8192,384,1 and 8192,8192,384,4096)
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import doracheck

specs = sys.argv[1:] or ["8192,8192,384,1", "8192,8192,384,4096"]
for spec in specs:
    d_in, d_out, r, T = (int(v) for v in spec.split(","))
    layer = doracheck.DoRALinear(d_in, d_out, r, 2 * r, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.02)
    x = torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    print(f"=== {d_in}x{d_out} r{r} T={T} train, 5 steps")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=60))
