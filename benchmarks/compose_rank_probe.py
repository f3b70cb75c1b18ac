"""Is the compose kernel's LoRA term right and repeatable at every small rank? (H200 probe)

The row-dot kernel's 32-wide tiles got the norm's cross term wrong at r = 32 (triton 3.6,
benchmarks/norm_repeat_probe.py); the compose kernel's K tile follows r (16..64). For each r,
y = g⊙(base + s·xa·Bᵀ) from bf16 inputs, three calls: bitwise agreement, and the error of
(y - g⊙base) against the fp64 LoRA term g⊙s·xa·Bᵀ, relative. Usage: python benchmarks/compose_rank_probe.py
"""

import torch

from doracheck.kernels.compose_triton import lora_up_compose_triton

gen = torch.Generator(device="cuda").manual_seed(0)
T, d_out, s = 4096, 4096, 2.0
for r in (8, 16, 24, 32, 48, 64, 96, 128):
    base = torch.randn(T, d_out, device="cuda", generator=gen).bfloat16()
    xa = torch.randn(T, r, device="cuda", generator=gen).bfloat16()
    B = (torch.randn(d_out, r, device="cuda", generator=gen) * 0.05).bfloat16()
    g = 1 + 0.01 * torch.randn(d_out, device="cuda", generator=gen)
    outs = [lora_up_compose_triton(base.clone(), xa, B, g, s) for _ in range(3)]
    lora_exact = g.double() * s * (xa.double() @ B.double().t())
    y_exact = g.double() * base.double() + lora_exact
    err_y = float((outs[0].double() - y_exact).norm() / y_exact.norm())
    err_lora = float(((outs[0].double() - g.double() * base.double()) - lora_exact).norm() / lora_exact.norm())
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    print(f"r {r:4d}: rel err y {err_y:.1e}, lora part {err_lora:.1e} (bf16 rounding of y alone ~2e-3 of y), repeatable {same}", flush=True)
