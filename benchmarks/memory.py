"""Peak memory of one layer per call, above what is resident, against nn.Linear's and the bound.

The layers and calls of ``layer.py`` (bf16 activations, frozen bf16 weight, random non-zero
adapters): ``infer``, ``train`` (forward + backward) and ``step`` (+ fused AdamW). A row is
``max_memory_allocated`` during one call (after three warm-up calls) minus what was allocated
before it (weights, adapters, optimizer state, x, dy): MiB. The bound the GPU tests hold
doracheck to is 1.25 x nn.Linear's peak + 32 MiB (``bound_mib``, ``within``).
``--chunk-mib 16,32,64`` repeats the doracheck rows at those backward token-chunk budgets
(``doracheck.kernels.settings.BACKWARD_CHUNK_BYTES``; the library's default otherwise).

    python benchmarks/memory.py [--shapes 8192x8192r384] [--tokens 4096] [--modes infer,train,step]
    python benchmarks/memory.py --smoke       (the CPU has no allocator statistics: no figures)
"""

from __future__ import annotations

import argparse

import harness
import layer
import torch

FIELDS = ["tokens", "mode", "chunk_mib", "linear_mib", "bound_mib", "within"]


def peak_mib(fn, device: str) -> float:
    for _ in range(3):  # warm-up: caches, the allocator's pools
        fn()
    return harness.peak_bytes(fn, device) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x8192r384,4096x14336r384")
    ap.add_argument("--tokens", default="1,4096")
    ap.add_argument("--impls", default="linear,peft_lora_bf16,peft_dora_bf16,peft_dora_fp32,doracheck_bf16,doracheck_fp32")
    ap.add_argument("--modes", default="infer,train,step")
    ap.add_argument("--chunk-mib", default="", help="backward chunk budgets to repeat the doracheck rows at")
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.tokens, args.chunk_mib = "64x48r8", "16", "1"
    device = harness.resolve_device(args, "memory")
    results = harness.Results("memory", FIELDS, args.csv, args.smoke)
    chunks: list[float | None] = [None] + [float(c) for c in args.chunk_mib.split(",") if c]
    printed = []
    for d_in, d_out, r in layer.parse_shapes(args.shapes):
        for T in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator().manual_seed(T)
            x = torch.randn(T, d_in, generator=gen).to(device, torch.bfloat16)
            dy = torch.randn(T, d_out, generator=gen).to(device, torch.bfloat16)
            for mode in args.modes.split(","):
                linear_mib = float("nan")
                for impl in args.impls.split(","):
                    for chunk in chunks if impl.startswith("doracheck") else [None]:
                        settings = None
                        if chunk is not None:
                            from doracheck.kernels import settings

                            default, settings.BACKWARD_CHUNK_BYTES = settings.BACKWARD_CHUNK_BYTES, int(chunk * 2**20)
                        try:
                            model = layer.build(impl, d_in, d_out, r, device)
                            mib = peak_mib(layer.call(model, mode, x, dy), device)
                        finally:
                            if settings is not None:
                                settings.BACKWARD_CHUNK_BYTES = default
                        del model
                        harness.free_memory()
                        linear_mib = mib if impl == "linear" else linear_mib
                        bound = 1.25 * linear_mib + 32
                        row = results.add({"case": mode, "impl": impl, "shape": f"{d_in}x{d_out}r{r}", "tokens": T,
                                           "mode": mode, "dtype": impl.rsplit("_", 1)[-1] if impl != "linear" else "-",
                                           "unit": "MiB", "median": round(mib, 1), "n": 1, "rounds": 1,
                                           "chunk_mib": chunk if chunk is not None else "default",
                                           "linear_mib": round(linear_mib, 1), "bound_mib": round(bound, 1),
                                           "within": "" if mib != mib or bound != bound else mib <= bound})
                        printed.append(row)
                        print(f"{d_in}x{d_out} r{r} T{T} {mode:5s} {impl:15s} chunk {row['chunk_mib']!s:8s} {mib:9.1f} MiB "
                              f"(nn.Linear {linear_mib:.1f}, bound {bound:.1f})", flush=True)
    print(harness.table(printed, ["shape", "tokens", "mode", "impl", "chunk_mib", "median", "linear_mib", "bound_mib",
                                  "within"]))
    print(f"rows appended to {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
