"""The cross term of the factored norm across ranks under the shipped row-dot config and a
candidate (H200 probe): relative error against fp64, whether three calls agree bitwise, and
the median time. Usage: python benchmarks/rowdot_config_probe.py
"""

import torch
import triton

from doracheck.kernels import norm_triton

original = norm_triton.rowdot_config


def capped(M, N, K, x_dtype, split_lo):
    cfg = original(M, N, K, x_dtype, split_lo)
    return cfg._replace(block_n=min(cfg.block_n, 64), n_sub=1)


gen = torch.Generator(device="cuda").manual_seed(0)
for d_in, r in [(4096, 16), (4096, 64), (4096, 100), (4096, 128), (4096, 192), (4096, 256), (8192, 384), (4096, 512), (4096, 1024)]:
    d_out = 4096
    W = (torch.randn(d_out, d_in, device="cuda", generator=gen) / d_in**0.5).bfloat16()
    A = (torch.randn(r, d_in, device="cuda", generator=gen) / d_in**0.5).bfloat16()
    B = (torch.randn(d_out, r, device="cuda", generator=gen) * 0.05).bfloat16()
    exact = ((W.double() @ A.double().t()) * B.double()).sum(1)
    line = [f"d_in {d_in} r {r:5d}"]
    for name, cfg_fn in (("shipped", original), ("block_n<=64", capped)):
        norm_triton.rowdot_config = cfg_fn
        outs = []
        for _ in range(3):
            cross, _sq = norm_triton.rowdot_triton(W, (W.stride(0), W.stride(1)), A, B, compute_base=True)
            torch.cuda.synchronize()
            outs.append(cross.clone())
        err = float((outs[0].double() - exact).norm() / exact.norm())
        ms = triton.testing.do_bench(lambda: norm_triton.rowdot_triton(W, (W.stride(0), W.stride(1)), A, B, compute_base=True), rep=40)
        cfg = cfg_fn(d_out, r, d_in, W.dtype, 1)
        line.append(f"{name} [{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} sub{cfg.n_sub}] err {err:.1e} rep {all(torch.equal(outs[0], o) for o in outs[1:])} {ms*1e3:.0f}us")
    print(" | ".join(line), flush=True)
norm_triton.rowdot_config = original
