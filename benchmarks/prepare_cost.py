"""Host cost of the norm-buffer check that runs before every forward without grad mode (diagnostic).

``doracheck.inference_norms`` checks every layer's norm buffer before each inference forward,
each decode token included, compiled or not (its hooks run eagerly around the compiled body).
With the buffers already up to date it does no GPU work, so its cost is pure host time added to
every token. This times ``_prepare`` + ``_finish`` (median of 7 batches of 200) on the model of
``llama_model.py`` (28 accelerated layers at the default 4 layers), and F.linear on one token for
scale. CPU by default at small shapes (the check does not depend on the shapes).

    python benchmarks/prepare_cost.py [--device cuda --hidden 4096 ...]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_model import build
from llama_model import add_llama_args

from doracheck import inference_norms


def median_us(fn, batches: int = 7, n: int = 200) -> float:
    for _ in range(20):
        fn()
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(per)[batches // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.set_defaults(hidden=64, intermediate=128, heads=4, kv_heads=2, rank=8)
    args = ap.parse_args(argv)
    model = build("doracheck_bf16", args, checkpointing=False).eval()
    holder = model.__dict__[inference_norms._HOLDER]

    def check():
        inference_norms._prepare(model, holder)
        inference_norms._finish(holder)

    x = torch.randn(1, args.hidden, device=args.device, dtype=torch.bfloat16)
    W = torch.randn(args.hidden, args.hidden, device=args.device, dtype=torch.bfloat16)
    with torch.no_grad():
        check_us = median_us(check)
        linear_us = median_us(lambda: F.linear(x, W))
    print(f"{len(holder.slots)} layers: norm-buffer check {check_us:.1f} µs per forward "
          f"({check_us / max(len(holder.slots), 1):.2f} per layer); F.linear on one token {linear_us:.2f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
