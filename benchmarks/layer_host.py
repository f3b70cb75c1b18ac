"""Host µs of one PEFT layer's training call, LoRA against doracheck with and without its
training plans (issue 17; GPU). A PEFT model of one Linear (4096², r 384, bf16 adapters),
x of T = 16 tokens requiring grad, so the GPU never holds the host back; each row is the median
over 5 batches of ``--calls`` calls of the host time per call (the device drained between
batches, never inside one). ``--loop ROW`` instead runs that row for ``--seconds`` (for py-spy).

    python benchmarks/layer_host.py [--d 4096 --r 384 --tokens 16 --calls 200]
    py-spy record --format raw -o stacks.txt -- python benchmarks/layer_host.py --loop dc_fwd --seconds 20
"""

from __future__ import annotations

import argparse
import time

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from doracheck.integrations import peft_train
from doracheck.integrations.peft import enable


def layer(kind: str, d: int, r: int, device: str):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(d, d, bias=False)).to(device, torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], use_dora=kind != "lora"),
                           autocast_adapter_dtype=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    if kind == "dc":
        enable(model)
    model.train()
    return model.base_model.model[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--loop")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    lora, dc = layer("lora", args.d, args.r, dev), layer("dc", args.d, args.r, dev)
    x = torch.randn(1, args.tokens, args.d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, args.tokens, args.d, device=dev, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def fwd(m):
        return lambda: m(x)

    def step(m):
        def run():
            m(x).backward(dy)
            x.grad = None
            for p in m.parameters():
                p.grad = None
        return run

    rows = {"lora_fwd": (fwd(lora), True), "dc_fwd": (fwd(dc), True), "dc_fwd_noplan": (fwd(dc), False),
            "lora_step": (step(lora), True), "dc_step": (step(dc), True), "dc_step_noplan": (step(dc), False)}
    if args.loop:
        fn, plans = rows[args.loop]
        peft_train.ENABLED = plans
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for _ in range(50):
                fn()
            sync()
        return 0
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# layer_host.py, {gpu}, torch {torch.__version__}; d {args.d}, r {args.r}, "
          f"T {args.tokens}, bf16; host µs per call, median of 5 batches of {args.calls}")
    for rnd in range(2):  # twice, interleaved, so host drift hits every row alike
        for name, (fn, plans) in rows.items():
            peft_train.ENABLED = plans
            for _ in range(10):
                fn()
            sync()
            per = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                per.append((time.perf_counter() - t0) / args.calls * 1e6)
                sync()
            print(f"round {rnd} {name:16s} {sorted(per)[2]:9.1f}", flush=True)
    peft_train.ENABLED = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
