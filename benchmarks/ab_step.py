"""Eager step + fused AdamW (gradient checkpointing), several configurations interleaved in ONE
process: the lent hosts differ by ±30% in host speed, and this step is host-bound, so two
configurations are compared only within one process, round by round.

Configurations: ``lora`` (PEFT LoRA, bf16 adapters) and ``dc:graphs=G,chunk=C`` (doracheck on
the same PEFT DoRA model, CUDA-graph norm replays on (1) or off (0), backward chunk budget C MiB
(default: the library's settings.BACKWARD_CHUNK_BYTES; until the twenty-second pass it was 16),
``plans=0`` without the layers' training plans, ``doracheck.integrations.peft_train``;
``groups=0`` each planned layer's norm alone instead of its group's one refresh (``doracheck.norm_groups``);
``bare=1`` the planned call replaced by ``bare_layer_probe.BareFunction`` (a yardstick of the
same GPU work without the library's Python; not correct in general; ``bare=fwd`` / ``bare=bwd``
only that pass bare; ``bare=general`` the planned call as it was before the straight-line one);
``tma=0`` the compose's pointer kernel at every shape instead of the persistent TMA kernel,
``settings.compose_tma_config``: its host descriptors cost host time per launch);
either with ``mt=0`` runs its backward on the calling thread (``set_multithreading_enabled(False)``),
and with ``gc=off`` with Python's gc disabled over its timed steps (collected before and after).
Each round runs every configuration for ``--steps`` timed steps after one untimed step; the
row is the median over all rounds (CUDA events), with the host CPU time per step (process CPU
time, all threads) beside it, and how many cudaMalloc / cudaFree calls the caching allocator made
over that configuration's timed steps (a cudaFree synchronises the device).

    python benchmarks/ab_step.py --configs 'lora;dc:graphs=1,chunk=16;dc:graphs=0,chunk=16' --csv out.csv
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import bare_layer_probe
import torch
from bench_model import build
from llama_model import add_llama_args
from row_csv import RowWriter

from doracheck import norm_groups
from doracheck.integrations import peft_train
from doracheck.kernels import norm_graphs, settings
from doracheck.timing import quantile

TMA_MIN_TOKENS = settings.COMPOSE_TMA_MIN_TOKENS


DEFAULT_CHUNK_BYTES = settings.BACKWARD_CHUNK_BYTES


def parse_configs(text: str) -> list[tuple[str, dict]]:
    """'lora;dc:graphs=1,chunk=16' (';' between configurations) -> [(name, settings)]."""
    out = []
    for part in text.split(";"):
        kind, _, rest = part.partition(":")
        opts = dict(kv.split("=", 1) for kv in rest.split(",")) if rest else {}
        out.append((part, {"kind": kind, **opts}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(ap)
    ap.add_argument("--configs", default="lora;dc:graphs=1,chunk=16;dc:graphs=0,chunk=16;dc:graphs=1,chunk=32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--csv")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=0)
    ap.add_argument("--blocked", action="store_true", help="each configuration's rounds back to back")
    args, _ = ap.parse_known_args(argv)
    configs = parse_configs(args.configs)
    models = {}
    for kind, impl in (("lora", "peft_lora_bf16"), ("dc", "doracheck_bf16")):
        if any(c["kind"] == kind for _, c in configs):
            model = build(impl, args, checkpointing=True)
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            models[kind] = (model, torch.optim.AdamW(params, lr=1e-5, fused=True))
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)

    def step(kind, single_thread=False):
        model, opt = models[kind]
        loss = model(ids, labels=ids).loss
        # mt=0: the backward on the calling thread (torch.autograd.set_multithreading_enabled(False)),
        # not handed to autograd's per-device thread (function_gap_probe.py: 1.17 ms against 1.90 ms
        # for one layer's forward + backward on the H200).
        with torch.autograd.set_multithreading_enabled(not single_thread):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def apply(c):
        os.environ["DORACHECK_NORM_GRAPHS"] = c.get("graphs", "1")
        # chunk=C MiB overrides the backward chunk budget; without it, the library's default
        settings.BACKWARD_CHUNK_BYTES = int(float(c["chunk"]) * 2**20) if "chunk" in c else DEFAULT_CHUNK_BYTES
        peft_train.ENABLED = c.get("plans", "1") == "1"
        norm_groups.ENABLED = c.get("groups", "1") == "1"
        settings.COMPOSE_TMA_MIN_TOKENS = TMA_MIN_TOKENS if c.get("tma", "1") == "1" else 1 << 62
        bare_layer_probe.install(c.get("bare", "0"))

    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    gpu_ms = {name: [] for name, _ in configs}
    cpu_ms = {name: [] for name, _ in configs}
    # cudaMalloc / cudaFree calls of the caching allocator over the timed steps (each cudaFree
    # synchronises the device, which would stall a host-bound step), per configuration
    mallocs = {name: [0, 0] for name, _ in configs}

    def device_allocs() -> tuple[int, int]:
        if not cuda:
            return 0, 0
        st = torch.cuda.memory_stats()
        return st.get("num_device_alloc", 0), st.get("num_device_free", 0)
    # Interleaved (default): every configuration in each round, so host drift hits all alike.
    # --blocked: each configuration's rounds back to back, the loop a user runs (one model
    # stepping again and again); still one process.
    rounds = [[(name, c)] * args.rounds for name, c in configs] if args.blocked else [configs] * args.rounds
    for batch in rounds:
        for name, c in batch:
            apply(c)
            step(c["kind"], c.get("mt") == "0")  # untimed: the first step after a switch
            sync()
            # gc=off: Python's cyclic gc disabled over this configuration's timed steps (a gen-2
            # collection of a process holding a transformers model takes a large fraction of a step;
            # collected after them, untimed)
            gc_off = c.get("gc") == "off" and gc.isenabled()
            if gc_off:
                gc.collect()
                gc.disable()
            a0 = device_allocs()
            for _ in range(args.steps):
                c0, w0 = time.process_time(), time.perf_counter()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                step(c["kind"], c.get("mt") == "0")
                if cuda:
                    end.record()
                c1 = time.process_time()
                sync()
                gpu_ms[name].append(start.elapsed_time(end) if cuda else (time.perf_counter() - w0) * 1e3)
                cpu_ms[name].append((c1 - c0) * 1e3)
            if gc_off:
                gc.enable()
            a1 = device_allocs()
            mallocs[name][0] += a1[0] - a0[0]
            mallocs[name][1] += a1[1] - a0[1]
    writer = RowWriter(args.csv) if args.csv else None
    import peft
    import triton

    versions = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "triton": triton.__version__,
                "peft": peft.__version__}
    base = None
    print(f"{'config':32s} {'ms':>8s} {'p20':>8s} {'p80':>8s} {'host cpu ms':>12s} {'x lora':>7s} {'mallocs/frees':>14s}")
    for name, _ in configs:
        t, h = sorted(gpu_ms[name]), sorted(cpu_ms[name])
        med = quantile(t, 0.5)
        base = med if name == "lora" else base
        ratio = med / base if base else float("nan")
        allocs = f"{mallocs[name][0]}/{mallocs[name][1]}"
        print(f"{name:32s} {med:8.2f} {quantile(t, 0.2):8.2f} {quantile(t, 0.8):8.2f} {quantile(h, 0.5):12.2f} {ratio:7.3f} {allocs:>14s}")
        if writer:
            writer.add({"config": name, "mode": "eager_gc_blocked" if args.blocked else "eager_gc", "optimizer": "adamw_fused", "value": round(med, 3),
                        "p20": round(quantile(t, 0.2), 3), "p80": round(quantile(t, 0.8), 3), "unit": "ms",
                        "host_cpu_ms": round(quantile(h, 0.5), 2), "ratio_to_lora": round(ratio, 3),
                        "samples": len(t), "seq": args.seq, "rank": args.rank, "layers": args.layers,
                        "device_mallocs": mallocs[name][0], "device_frees": mallocs[name][1], "dtype": "bf16", **versions})
    if writer:
        writer.close()
    print("norm graphs:", norm_graphs.stats(), "norm groups:", norm_groups.stats(), file=sys.stderr)
    planned = sum(bool(m.__dict__.get(peft_train._TRAIN_PLANS)) for model, _ in models.values() for m in model.modules())
    print(f"layers holding a training plan: {planned}", file=sys.stderr)
    if cuda:
        print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
