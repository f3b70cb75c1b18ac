"""FSDP2 training with doracheck: PEFT DoRA + ``enable`` under ``fully_shard``, against one device.

One process per GPU (NCCL) or per CPU rank (gloo), under torchrun:
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp.py --mode check
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp.py --mode time --impl peft
    python benchmarks/fsdp.py --smoke        # starts torchrun itself: 2 CPU ranks over gloo, 3 steps

Model: a LLaMA-style decoder (transformers, random weights; tiny by default), PEFT DoRA on every
linear layer, lora_B non-zero; ``--impl doracheck`` applies ``doracheck.integrations.peft.enable``,
``--impl peft`` keeps PEFT's DoRA. Each decoder layer and the root are ``fully_shard``-ed; the
norm is computed in the forward on the parameters FSDP2 has all-gathered.
``--mode check`` (fp32, no mixed precision): rank 0 first trains an unsharded copy on its own
device with the full batches; then every rank trains its shard of the same batches under FSDP2.
Reports the per-step |Δloss| between the two (mean, max). ``--mode time``: bf16 compute through
FSDP2's MixedPrecisionPolicy (fp32 parameters), step time (forward + backward + AdamW; median and
p10/p90 over the steps after the first three) and peak MiB above resident per rank.
Rank 0 prints one JSON line last and appends a row to results/fsdp.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import harness
import torch
import torch.distributed as dist

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIELDS = ["mode", "world", "steps", "mean_abs_dloss", "max_abs_dloss", "peak_mib_per_rank", "routed_layers"]


def build(args, device):
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
    )
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, use_dora=True,
                                                       target_modules=TARGETS))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if args.impl == "doracheck":
        from doracheck.integrations.peft import enable

        enable(model)
    return model


def shard(model, args):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mode == "time"
          else MixedPrecisionPolicy())
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def batch(args, step):
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1000 + step))


def train(model, args, device, rank=0, world=1):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    losses, times = [], []
    for step in range(args.steps):
        ids = batch(args, step).to(device)
        if world > 1:
            ids = ids.chunk(world)[rank]
        harness.sync(device.type)
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        harness.sync(device.type)
        times.append((time.perf_counter() - t0) * 1e3)
        value = loss.detach().float()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses, times


def norm_rule_report(model) -> dict:
    """Whether doracheck's norm cache stands aside under FSDP2 (the norm rule's own answer, where
    this version of doracheck has one) and how many layers run through doracheck."""
    import llama_model

    out: dict = {"enabled_layers": llama_model.count_routed(model)}
    try:
        from doracheck import norm_rule

        aside = bool(norm_rule.fsdp_active())
        out.update(norm_cache_stands_aside=aside, norm_cache_on=not aside, norm_cache_stats=norm_rule.norm_cache_stats())
    except (ImportError, AttributeError):
        pass
    return out


def smoke() -> int:
    """2 CPU ranks over gloo under torchrun, ``--mode check``, 3 steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--device", "cpu", "--mode", "check", "--steps", "3", "--smoke-rank"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["check", "time"], default="check")
    ap.add_argument("--impl", choices=["doracheck", "peft"], default="doracheck")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--csv", help="append rank 0's row here instead of benchmarks/results/fsdp.csv")
    ap.add_argument("--smoke", action="store_true", help="start 2 CPU ranks under torchrun, check mode, 3 steps")
    ap.add_argument("--smoke-rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        return smoke()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    report: dict = {"mode": args.mode, "impl": args.impl, "world": world, "device": str(device)}
    if args.mode == "check" and rank == 0:  # the same training on one device, full batches
        report["reference_losses"], _ = train(build(args, device), args, device)

    model = shard(build(args, device), args)
    report.update(norm_rule_report(model))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    losses, times = train(model, args, device, rank, world)
    if device.type == "cuda":
        peak = torch.tensor([(torch.cuda.max_memory_allocated(device) - resident) / 2**20], device=device)
        peaks = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
        report["peak_mib_above_resident_per_rank"] = [round(float(p), 1) for p in peaks]
    report["losses"] = losses
    stats = harness.Stats.of(times[3:] if len(times) > 3 else times)
    report["step_ms_median"] = stats.median
    if "reference_losses" in report:
        deltas = [abs(a - b) for a, b in zip(losses, report["reference_losses"])]
        report["mean_abs_dloss"] = sum(deltas) / len(deltas)
        report["max_abs_dloss"] = max(deltas)
    if rank == 0:
        results = harness.Results("fsdp", FIELDS, args.csv, smoke=args.smoke_rank)
        results.add({"case": args.mode, "mode": args.mode, "impl": args.impl, "world": world, "steps": args.steps,
                     "shape": f"llama h{args.hidden} i{args.intermediate} L{args.layers} r{args.rank} seq{args.seq} "
                              f"batch{args.batch}",
                     "dtype": "bf16 mixed" if args.mode == "time" else "fp32", "unit": "ms", **stats.row(3), "rounds": 1,
                     "mean_abs_dloss": report.get("mean_abs_dloss", ""), "max_abs_dloss": report.get("max_abs_dloss", ""),
                     "peak_mib_per_rank": " ".join(map(str, report.get("peak_mib_above_resident_per_rank", []))),
                     "routed_layers": report["enabled_layers"]})
        print(json.dumps(report), flush=True)
    # Both ranks past their last collective before either tears gloo down: a rank that destroys its
    # connections while the other still uses them can abort the other.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # print the rank's own error, then leave without gloo's teardown abort
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Leave without the interpreter's teardown as well: a CPU (gloo) rank still aborted at exit now
    # and then ("terminate called without an active exception", a C++ thread destroyed unjoined),
    # after the report was printed. Everything is flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
