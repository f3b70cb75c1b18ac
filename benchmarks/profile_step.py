"""Profile one DoRA layer step (torch.profiler): where CPU and GPU time go. Diagnostic only."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import doracheck

d, r = 8192, 384
for T in (int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,4096").split(",")):
    layer = doracheck.DoRALinear(d, d, r, 2 * r, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.02)
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    print(f"=== T={T} train, 5 steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
