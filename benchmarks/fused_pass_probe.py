"""The two element-wise-heavy kernels of a training step, swept over tile configs (GPU probe, fifteenth session).

- compose (``_lora_up_compose_kernel``, forward): the up-projection GEMM xa·Bᵀ (K = r) with the
  stable DoRA compose in its epilogue (reads base, writes y), at T = 4096 and the model's d_out;
- dz/dm (``_grad_scale_dm_kernel``, backward): reads dy and y, writes dz and per-token-block
  partials of Σ dy⊙y, at the token counts a backward chunk has (``settings.backward_token_chunk``:
  2048 tokens at d_out 8192, 1170 at 14336, 4096 below).
Floors in the same run: cuBLAS xa·Bᵀ alone (bf16 output) and one element-wise pass moving the
same bytes (``torch.mul(a, b, out=c)``: two reads, one write). For every candidate: GPU µs from
CUDA-graph replays (median, q20, q80), GB/s of the tensors it must move, and whether its outputs
are the shipped launch's (compose: y bitwise, the candidates being tiles of the pointer kernel, the
TMA compose set aside while they run; dz/dm: dz bitwise, dm within 1e-6 relative: the
partials are summed over other token blocks).

    python benchmarks/fused_pass_probe.py [--csv out.csv] [--only compose|grad]

Run with an older library on PYTHONPATH for an A/B of the kernels themselves.
"""

from __future__ import annotations

import argparse

import torch
import triton
from row_csv import RowWriter

from doracheck.kernels import compose_triton as ct
from doracheck.kernels import settings

# (block_m, block_n, block_k, group_m, warps, stages); the first is the shipped one
COMPOSE_CANDIDATES = [
    None, (64, 128, 64, 8, 4, 4), (64, 128, 128, 8, 4, 3), (64, 128, 64, 16, 4, 3), (64, 128, 64, 4, 4, 3),
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3), (128, 64, 64, 8, 4, 3),
    (128, 256, 64, 8, 8, 3), (64, 64, 64, 8, 4, 3), (64, 128, 64, 8, 8, 3),
    # sixteenth session: two stages (more programs per SM for the epilogue's base load) and 32-wide K
    (64, 128, 64, 8, 4, 2), (128, 128, 64, 8, 8, 2), (64, 256, 64, 8, 8, 2), (64, 128, 32, 8, 4, 4), (128, 128, 32, 8, 8, 3),
]
COMPOSE_SHAPES = [(4096, 8192, 384), (4096, 14336, 384), (4096, 4096, 384), (4096, 1024, 384)]
# (block_t, block_d, warps); the first is the shipped one. (The fifteenth session's first run also
# had a T_ITERS loop over token blocks, withdrawn: results/fused_pass_fifteenth_h200.csv.)
GRAD_CANDIDATES = [
    None, (64, 128, 4), (128, 128, 8), (32, 128, 4), (64, 64, 4), (128, 64, 8), (64, 256, 8), (32, 256, 4), (16, 512, 4),
    (8, 1024, 4), (32, 512, 8),
]
GRAD_SHAPES = [(2048, 8192), (1170, 14336), (4096, 4096), (4096, 1024)]


def timed(fn):
    med, lo, hi = triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=[0.5, 0.2, 0.8])
    return med * 1e3, lo * 1e3, hi * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv")
    ap.add_argument("--only", choices=("compose", "grad"))
    args = ap.parse_args()
    out = RowWriter(args.csv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "dtype": "bf16",
            "library": ct.__file__}
    print(meta)

    def report(kernel, shape, config, times, nbytes, same):
        med, lo, hi = times
        print(f"{kernel:8s} {shape:18s} {config:34s} {med:8.1f} us  q20 {lo:7.1f} q80 {hi:7.1f}  "
              f"{nbytes / med / 1e3:7.0f} GB/s  same={same}", flush=True)
        out.add({**meta, "kernel": kernel, "shape": shape, "config": config, "median_us": round(med, 2), "q20_us": round(lo, 2),
                 "q80_us": round(hi, 2), "gb_per_s": round(nbytes / med / 1e3, 1), "same_as_shipped": same})

    if args.only in (None, "compose"):
        shipped = ct.compose_config
        for T, d_out, r in COMPOSE_SHAPES:
            shape = f"T{T} d_out{d_out} r{r}"
            base = torch.randn(T, d_out, device="cuda", generator=gen).bfloat16()
            xa = torch.randn(T, r, device="cuda", generator=gen).bfloat16()
            B = (torch.randn(d_out, r, device="cuda", generator=gen) * 0.05).bfloat16()
            g = torch.rand(d_out, device="cuda", generator=gen) + 0.5
            y = torch.empty_like(base)
            nbytes = 2 * T * d_out * 2  # base read, y written
            report("floor", shape, "cuBLAS xa@B.T bf16 out", timed(lambda: torch.mm(xa, B.t(), out=y)), nbytes, "")
            report("floor", shape, "mul(base, base) 2 reads 1 write", timed(lambda: torch.mul(base, base, out=y)), 3 * T * d_out * 2, "")
            want = ct.lora_up_compose_triton(base, xa, B, g, 2.0).clone()  # the shipped launch (TMA where it is taken)
            report("compose", shape, "shipped launch", timed(lambda: ct.lora_up_compose_triton(base, xa, B, g, 2.0, out=y)),
                   nbytes, True)
            tma_config = getattr(ct, "_tma_config", None)  # absent from libraries before the TMA compose
            for cand in COMPOSE_CANDIDATES:
                cfg = shipped(T, d_out, r) if cand is None else settings.ComposeConfig(*cand)
                ct.compose_config = lambda *a_, _c=cfg: _c
                if tma_config is not None:  # the candidates are the pointer kernel's tiles
                    ct._tma_config = lambda *a_: None
                try:
                    got = ct.lora_up_compose_triton(base, xa, B, g, 2.0).clone()
                    times = timed(lambda: ct.lora_up_compose_triton(base, xa, B, g, 2.0, out=y))
                except Exception as error:  # noqa: BLE001 (out of resources is a finding)
                    print("compose", shape, tuple(cfg), type(error).__name__, str(error)[:80])
                    continue
                finally:
                    ct.compose_config = shipped
                    if tma_config is not None:
                        ct._tma_config = tma_config
                report("compose", shape, ("pointer kernel, shipped " if cand is None else "pointer kernel ") + str(tuple(cfg)), times,
                       nbytes, bool(torch.equal(got, want)))
            del base, xa, B, y
    if args.only in (None, "grad"):
        shipped = ct.grad_config
        for T, d_out in GRAD_SHAPES:
            shape = f"T{T} d_out{d_out}"
            dy = torch.randn(T, d_out, device="cuda", generator=gen).bfloat16()
            h = torch.randn(T, d_out, device="cuda", generator=gen).bfloat16()
            g = torch.rand(d_out, device="cuda", generator=gen) + 0.5
            n = torch.rand(d_out, device="cuda", generator=gen) + 0.5
            c = torch.empty_like(dy)
            nbytes = 3 * T * d_out * 2
            report("floor", shape, "mul(dy, h) 2 reads 1 write", timed(lambda: torch.mul(dy, h, out=c)), nbytes, "")
            want = None
            for cand in GRAD_CANDIDATES:
                cfg = shipped(T, d_out) if cand is None else settings.GradConfig(*cand)
                ct.grad_config = lambda *a_, _c=cfg: _c
                try:
                    dz, dm = ct.grad_scale_dm_triton(dy, h, g, n, None, from_output=True)
                    times = timed(lambda: ct.grad_scale_dm_triton(dy, h, g, n, None, from_output=True))
                except Exception as error:  # noqa: BLE001
                    print("grad", shape, tuple(cfg), type(error).__name__, str(error)[:80])
                    continue
                finally:
                    ct.grad_config = shipped
                want = (dz.clone(), dm.clone()) if want is None else want
                same = bool(torch.equal(dz, want[0])) and float((dm - want[1]).norm() / want[1].norm()) < 1e-6
                report("grad", shape, ("shipped " if cand is None else "") + str(tuple(cfg)), times, nbytes, same)
            del dy, h, c
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
