"""Model-level benchmark: a LLaMA-style decoder, PEFT LoRA / DoRA against doracheck.

Model: transformers LlamaConfig (hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
4 layers, bf16, random weights); adapters r = 384, alpha = 768 on every linear layer.
Per implementation, in one process: training step (forward + backward, plus ``optimizer.step()``
with ``--optimizer adamw_fused|adamw_foreach``; ``none``, the default, excludes it; gradient
checkpointing on, sequence 4096, batch 1) median ms and peak GiB; inference forward
ms; decode tokens/s (batch 1, greedy, ``--new-tokens`` tokens with the KV cache).

Implementations: peft_lora_fp32/bf16 (use_dora=False), peft_dora_fp32/bf16 (PEFT DoRA with its
default fp32 adapters / bf16 adapters), doracheck_fp32/bf16 (the same PEFT DoRA models after
``doracheck.integrations.peft.enable``). "fp32"/"bf16" is the adapter dtype
(``autocast_adapter_dtype``); activations are bf16 throughout.

Usage (GPU): python benchmarks/bench_model.py --csv benchmarks/results/model_h200.csv
Smaller smoke run: --layers 1 --hidden 512 --intermediate 1024 --seq 256 --new-tokens 8
CPU smoke (no figures): --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2
    --rank 8 --seq 32 --new-tokens 4 --reps 2
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from llama_model import TARGETS, add_llama_args, llama_config
from row_csv import RowWriter

from doracheck.timing import quantile


def build(impl: str, args, checkpointing: bool = True):
    """The model of ``impl`` (see the module docstring), gradient checkpointing on unless asked."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = llama_config(args, args.seq + args.new_tokens + 8)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    kind, adapter_dtype = impl.rsplit("_", 1)
    use_dora = "dora" in kind
    lora = peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, use_dora=use_dora,
        target_modules=TARGETS,
    )
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=(adapter_dtype == "fp32"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    if kind.startswith("doracheck"):
        from doracheck.integrations.peft import enable

        enable(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def compiled_train_step(impl: str, args):
    """One training step of ``impl``'s model (``build``, no checkpointing) under ``torch.compile``:
    forward, backward, AdamW ``step()`` (fused on CUDA), ``zero_grad``. Returns the step callable."""
    model = build(impl, args, checkpointing=False)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=args.device == "cuda")
    run = torch.compile(model)
    model.train()

    def step():
        run(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(fn, reps: int, device: str = "cuda"):
    """Median ms over ``reps`` calls: CUDA events on a GPU, perf_counter on the CPU (smoke runs)."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(impl: str, args) -> dict:
    model = build(impl, args)
    dev = args.device
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]

    opt = None
    if args.optimizer != "none":  # a training step as users run it: the update makes every norm stale
        opt = torch.optim.AdamW(params, lr=1e-5, fused=args.optimizer == "adamw_fused", foreach=args.optimizer == "adamw_foreach")

    def step():
        model.train()
        model(ids, labels=ids).loss.backward()
        if opt is not None:
            opt.step()
        for p in params:
            p.grad = None

    for _ in range(3):
        step()
    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    step_ms, step_times = timed(step, args.reps, dev)
    step_gib = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")

    def infer():
        model.eval()
        with torch.no_grad():
            model(ids)

    infer()
    infer_ms, infer_times = timed(infer, args.reps, dev)
    model.eval()
    model.gradient_checkpointing_disable()  # generation with the KV cache (checkpointing turns it off)
    prompt = ids[:, :32]
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, do_sample=False)
        _sync(dev)
        # Twice, the faster kept: the first full-length generate of a process pays one-off costs
        # (benchmarks/README.md, Model).
        decode_tps = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            _sync(dev)
            decode_tps = max(decode_tps, (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t0))
    del model
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"impl": impl, "step_ms": round(step_ms, 2), "step_ms_p20": round(quantile(sorted(step_times), 0.2), 2),
            "step_ms_p80": round(quantile(sorted(step_times), 0.8), 2), "step_gib": round(step_gib, 3), "infer_ms": round(infer_ms, 2),
            "infer_ms_p20": round(quantile(sorted(infer_times), 0.2), 2), "infer_ms_p80": round(quantile(sorted(infer_times), 0.8), 2),
            "decode_tok_s": round(decode_tps, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="peft_lora_bf16,peft_lora_fp32,peft_dora_bf16,peft_dora_fp32,doracheck_bf16,doracheck_fp32")
    add_llama_args(ap)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--csv")
    ap.add_argument("--optimizer", default="none", choices=["none", "adamw_fused", "adamw_foreach"],
                    help="include optimizer.step() in the training step (none: forward + backward only, as labelled)")
    ap.add_argument("--device", default="cuda", help="cuda for figures; cpu only for a smoke run at tiny sizes")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_model: needs a CUDA device (or --device cpu for a smoke run)")
        return 2
    import peft
    import transformers
    import triton

    out = RowWriter(args.csv)
    for impl in args.impls.split(","):
        row = measure(impl, args)
        row.update(optimizer=args.optimizer, gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__,
                   peft=peft.__version__, transformers=transformers.__version__)
        out.add(row)
        print(row, flush=True)
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
