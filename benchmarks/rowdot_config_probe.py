"""The cross term of the factored norm at N = r = 128 under several row-dot configs (H200 probe):
relative error against fp64 and whether three calls agree bitwise. Usage: python benchmarks/rowdot_config_probe.py
"""

import torch

from doracheck.kernels import norm_triton, settings
from doracheck.properties import make_case

case = make_case(4096, 4096, 128, 8, torch.bfloat16, seed=3, device="cuda")
W, A, B = case.weight, case.lora_A, case.lora_B
exact = ((W.double() @ A.double().t()) * B.double()).sum(1)
configs = {
    "default 128x128x64 w8 s4": settings.RowdotConfig(128, 128, 64, 8, 4),
    "128x128x64 w8 s3": settings.RowdotConfig(128, 128, 64, 8, 3),
    "128x128x64 w8 s2": settings.RowdotConfig(128, 128, 64, 8, 2),
    "128x128x64 w4 s4": settings.RowdotConfig(128, 128, 64, 4, 4),
    "64x128x64 w4 s4": settings.RowdotConfig(64, 128, 64, 4, 4),
    "128x128x32 w8 s4": settings.RowdotConfig(128, 128, 32, 8, 4),
    "128x64x64 w8 s4 (N split in 2 tiles)": settings.RowdotConfig(128, 64, 64, 8, 4),
}
original = norm_triton.rowdot_config
for name, cfg in configs.items():
    norm_triton.rowdot_config = lambda *a, cfg=cfg: cfg
    outs = []
    for _ in range(3):
        cross, _sq = norm_triton.rowdot_triton(W, (W.stride(0), W.stride(1)), A, B, compute_base=True)
        torch.cuda.synchronize()
        outs.append(cross.clone())
    err = float((outs[0].double() - exact).norm() / exact.norm())
    print(f"{name:40s} rel err {err:.2e}  repeatable {all(torch.equal(outs[0], o) for o in outs[1:])}", flush=True)
norm_triton.rowdot_config = original
