"""FSDP2 training with doracheck: a LLaMA-style model with PEFT DoRA, sharded with
PyTorch's ``fully_shard``, trained against the same training on one device.

Run with torchrun, one process per GPU (NCCL) or per CPU rank (gloo):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp_train.py --mode check
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp_train.py --mode time --impl peft

Model: transformers LlamaConfig with random weights, PEFT DoRA on every linear layer of the
decoder (``--impl doracheck`` then ``doracheck.integrations.peft.enable``; ``--impl peft`` is
PEFT's own DoRA). Each decoder layer and the root are ``fully_shard``-ed (FSDP2, parameters
row-sharded as DTensors between forwards); the DoRA norm is computed in the forward on the
unsharded parameters that FSDP2 all-gathers (doracheck's norm cache stands aside under FSDP2:
doracheck/norm_cache.py says why).

``--mode check`` (fp32, no mixed precision): rank 0 first trains an unsharded copy on its own
device with the full batch; then every rank trains its shard of the same batches under FSDP2
(gradients averaged by FSDP2's reduce-scatter, so the update is the full batch's). Reports the
per-step |Δloss| (mean, max) between the two. ``--mode time``: bf16 compute through FSDP2's
MixedPrecisionPolicy (fp32 parameters), step time (forward + backward + AdamW step, median over
the steps after the first three) and peak memory per rank. Rank 0 prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, use_dora=True, target_modules=TARGETS))
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

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mode == "time" else MixedPrecisionPolicy()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def batch(args, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


def train(model, args, device, rank=0, world=1):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    losses, times = [], []
    for step in range(args.steps):
        ids = batch(args, step).to(device)
        if world > 1:
            ids = ids.chunk(world)[rank]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        value = loss.detach().float()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses, times


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
    ap.add_argument("--unsafe-keep-norm-cache", action="store_true",
                    help="for the test that shows why the cache stands aside under FSDP2: keep it on")
    args = ap.parse_args(argv)
    if args.unsafe_keep_norm_cache:
        import doracheck.norm_cache

        doracheck.norm_cache.fsdp_active = lambda: False

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    report: dict = {"mode": args.mode, "impl": args.impl, "world": world, "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}

    if args.mode == "check" and rank == 0:  # the same training on one device, full batches
        reference, _ = train(build(args, device), args, device)
        report["reference_losses"] = reference

    model = shard(build(args, device), args)
    import doracheck.norm_cache
    from doracheck.norm_cache import fsdp_active

    report["norm_cache_stands_aside"] = fsdp_active()
    report["norm_cache_on"] = doracheck.norm_cache._cacheable()
    if args.impl == "doracheck":
        from doracheck.integrations.peft import enabled_adapters

        report["enabled_layers"] = len(enabled_adapters(model))
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
    report["step_ms_median"] = statistics.median(times[3:]) if len(times) > 3 else statistics.median(times)
    if "reference_losses" in report:
        deltas = [abs(a - b) for a, b in zip(losses, report["reference_losses"])]
        report["mean_abs_dloss"] = sum(deltas) / len(deltas)
        report["max_abs_dloss"] = max(deltas)
    if rank == 0:
        print(json.dumps(report), flush=True)
    # Both ranks past their last collective before either tears gloo down: a rank that destroys
    # its connections while the other still uses them can abort the other ("terminate called
    # without an active exception", seen once in about ten CPU runs of tests/test_fsdp.py).
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
    # Leave without the interpreter's teardown as well: even after the barrier and
    # destroy_process_group, a CPU (gloo) rank still aborted at exit now and then ("terminate
    # called without an active exception" from a C++ thread destroyed unjoined, after the report
    # was printed; benchmarks/README.md, FSDP2). Everything is flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
