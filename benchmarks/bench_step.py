"""The training step and decode as users run them: one (implementation, mode) per process.

Every training figure includes ``optimizer.step()`` (AdamW fused, the transformers Trainer
default, or foreach). Model: the LLaMA-style decoder of ``llama_model.py`` (bf16 activations,
random weights, adapters on every linear layer, lora_B non-zero).

Modes (``--mode``):
- ``eager_gc``: eager, gradient checkpointing on (non-reentrant), forward + backward + step;
- ``compiled``: ``torch.compile(model)`` without checkpointing, forward + backward + step;
- ``decode_eager``: greedy decode with the dynamic KV cache, tokens/s;
- ``decode_compiled``: greedy decode with a static KV cache and the forward compiled with
  ``mode="reduce-overhead"`` (CUDA graphs), tokens/s; no weights merged.
Implementations (``--impl``): peft_lora_bf16, peft_dora_bf16, peft_dora_fp32 (PEFT's default fp32
adapters), doracheck_bf16, doracheck_fp32 (the same PEFT DoRA model after ``enable``).

    python benchmarks/bench_step.py --impl doracheck_bf16 --mode eager_gc --optimizer adamw_fused --csv-append out.csv
    python benchmarks/bench_step.py --all --csv out.csv      # every row, each in a fresh process

A row: median ms (or tok/s) with p20/p80, peak GiB over the step, compile seconds (first
call) for compiled modes, the GPU and library versions.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time

import torch
from bench_model import _sync, build, timed
from llama_model import add_llama_args
from row_csv import RowWriter

from doracheck.timing import quantile

IMPLS = ["peft_lora_bf16", "peft_dora_bf16", "peft_dora_fp32", "doracheck_bf16", "doracheck_fp32"]
MODES = ["eager_gc", "compiled", "decode_eager", "decode_compiled"]


def train_row(impl: str, mode: str, args) -> dict:
    model = build(impl, args, checkpointing=mode == "eager_gc")
    dev = args.device
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = args.optimizer == "adamw_fused"
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=not fused)
    run = torch.compile(model) if mode == "compiled" else model
    model.train()

    def step():
        run(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    _sync(dev)
    first_s = time.perf_counter() - t0
    for _ in range(2):
        step()
    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    times = sorted(timed(step, args.reps, dev)[1])
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")
    return {"value": quantile(times, 0.5), "p20": quantile(times, 0.2), "p80": quantile(times, 0.8), "unit": "ms",
            "peak_gib": round(peak, 3), "first_call_s": round(first_s, 1)}


def decode_row(impl: str, mode: str, args) -> dict:
    model = build(impl, args, checkpointing=False)
    model.eval()
    dev = args.device
    prompt = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1)).to(dev)
    kwargs: dict = {"do_sample": False}
    if mode == "decode_compiled":
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    rates = []
    n = args.new_tokens
    with torch.no_grad():
        # Warm-up with the very arguments that are timed: a static cache of another length
        # would be compiled (and its CUDA graphs recorded) inside the first timed run.
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        _sync(dev)
        first_s = time.perf_counter() - t0
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        for _ in range(max(3, args.reps // 2)):
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
            _sync(dev)
            rates.append((out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t0))
    rates.sort()
    return {"value": quantile(rates, 0.5), "p20": quantile(rates, 0.2), "p80": quantile(rates, 0.8), "unit": "tok/s",
            "peak_gib": float("nan"), "first_call_s": round(first_s, 1)}


def one_row(args) -> dict:
    import peft
    import transformers
    import triton

    fn = decode_row if args.mode.startswith("decode") else train_row
    if args.backward_chunk_mib is not None:
        from doracheck.kernels import settings

        settings.BACKWARD_CHUNK_BYTES = int(args.backward_chunk_mib * 2**20)
    row = {"impl": args.impl + (f"@chunk{args.backward_chunk_mib:g}MiB" if args.backward_chunk_mib is not None else ""),
           "mode": args.mode, "optimizer": args.optimizer if not args.mode.startswith("decode") else "-"}
    row.update(fn(args.impl, args.mode, args))
    row.update(gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__, peft=peft.__version__, transformers=transformers.__version__,
               layers=args.layers, hidden=args.hidden, rank=args.rank, seq=args.seq)
    for k in ("value", "p20", "p80"):
        row[k] = round(row[k], 3)
    gc.collect()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=IMPLS)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--all", action="store_true", help="every --impls x --modes row, each in a fresh process")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--optimizer", default="adamw_fused", choices=["adamw_fused", "adamw_foreach"])
    add_llama_args(ap)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--csv", help="--all: write the rows here")
    ap.add_argument("--row-out", help="one row: append it to this CSV (header if new)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backward-chunk-mib", type=float, help="experiment: doracheck's backward token-chunk budget "
                    "(kernels/settings.BACKWARD_CHUNK_BYTES) for this run; recorded in the row")
    args, rest = ap.parse_known_args(argv)
    if args.all:
        out = RowWriter(args.csv)
        for impl in args.impls.split(","):
            for mode in args.modes.split(","):
                tmp = f"/tmp/bench_step_{os.getpid()}.csv"
                cmd = [sys.executable, __file__, "--impl", impl, "--mode", mode, "--row-out", tmp, *(argv or sys.argv[1:])]
                cmd = [c for c in cmd if c != "--all"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{impl} {mode}: failed\n{proc.stderr[-2000:]}", flush=True)
                    continue
                import csv

                with open(tmp) as f:
                    row = next(csv.DictReader(f))
                os.unlink(tmp)
                out.add(row)
                print(f"{impl:16s} {mode:16s} {row['value']:>10s} {row['unit']:6s} (p20 {row['p20']}, p80 {row['p80']}) "
                      f"first call {row['first_call_s']} s", flush=True)
        out.close()
        return 0
    if not (args.impl and args.mode):
        ap.error("--impl and --mode (or --all)")
    row = one_row(args)
    if args.row_out:
        writer = RowWriter(args.row_out, append=True)
        writer.add(row)
        writer.close()
    print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
