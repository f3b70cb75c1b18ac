"""Eager greedy decode, PEFT LoRA and doracheck interleaved in ONE process (the lent hosts differ
by ±30% in host speed and eager decode is host-bound). Tokens per second, median over rounds;
``dc:env=NAME=VALUE`` sets an environment variable for that configuration (an A/B of a switch
such as ``DORACHECK_NORM_GRAPHS``), and the script says whether doracheck's generated tokens are
the same in every doracheck configuration. ``flags=off`` runs a configuration with torch's cuBLAS
16-bit reduction flags off for the whole process (doracheck then has nothing to switch around
its GEMMs: an A/B of the switching itself).

``--compiled``: every model's forward under ``torch.compile(mode="reduce-overhead")`` with
transformers' static KV cache, as users serve compiled decode (``bench_step.py --mode
decode_compiled`` runs one model per process instead; these processes differed by up to 15% for
LoRA itself, so the compiled ratio is taken here, interleaved).

    python benchmarks/decode_ab.py --new-tokens 64 --rounds 5 --csv out.csv [--compiled]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from ab_step import parse_configs
from bench_model import build
from llama_model import add_llama_args
from row_csv import RowWriter

from doracheck.timing import quantile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(ap)
    ap.add_argument("--configs", default="lora;dc")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--csv")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compiled", action="store_true", help="torch.compile(mode='reduce-overhead') and a static KV cache")
    args, _ = ap.parse_known_args(argv)
    configs = parse_configs(args.configs)
    models = {}
    for kind, impl in (("lora", "peft_lora_bf16"), ("dc", "doracheck_bf16")):
        if any(c["kind"] == kind for _, c in configs):
            models[kind] = build(impl, args, checkpointing=False).eval()
            if args.compiled:
                models[kind].forward = torch.compile(models[kind].forward, mode="reduce-overhead")
    generate_kwargs: dict = {"do_sample": False}
    if args.compiled:
        generate_kwargs["cache_implementation"] = "static"
    mode = "decode_compiled" if args.compiled else "decode_eager"
    prompt = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1)).to(args.device)
    n = args.new_tokens
    cuda = args.device == "cuda"

    original: dict[str, str | None] = {}  # each variable a configuration set, as it was before

    def decode(c):
        for name, value in original.items():  # undo the previous configuration's variable
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if "env" in c:
            name, value = c["env"].split("=", 1)
            original.setdefault(name, os.environ.get(name))
            os.environ[name] = value
        matmul = torch.backends.cuda.matmul
        flags = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
        if c.get("flags") == "off":  # the process's cuBLAS 16-bit reduction off for this configuration's calls
            matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = False
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                out = models[c["kind"]].generate(prompt, max_new_tokens=n, min_new_tokens=n, **generate_kwargs)
                if cuda:
                    torch.cuda.synchronize()
                return out, (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t0)
        finally:
            matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = flags

    tokens, rates = {}, {name: [] for name, _ in configs}
    for name, c in configs:  # warm-up: Triton compiles, the norm graphs' first sightings and captures
        decode(c)
        tokens[name] = decode(c)[0]
    for _ in range(args.rounds):
        for name, c in configs:
            out, rate = decode(c)
            rates[name].append(rate)
            if not torch.equal(out, tokens[name]):
                tokens[name + " (changed between runs)"] = out
    import peft
    import triton

    versions = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "triton": triton.__version__,
                "peft": peft.__version__}
    writer = RowWriter(args.csv) if args.csv else None
    base = None
    print(f"{'config':24s} {'tok/s':>8s} {'p20':>8s} {'p80':>8s} {'x lora':>7s}")
    for name, _ in configs:
        r = sorted(rates[name])
        med = quantile(r, 0.5)
        base = med if name == "lora" else base
        ratio = med / base if base else float("nan")
        print(f"{name:24s} {med:8.1f} {quantile(r, 0.2):8.1f} {quantile(r, 0.8):8.1f} {ratio:7.3f}")
        if writer:
            writer.add({"config": name, "mode": mode, "value": round(med, 2), "p20": round(quantile(r, 0.2), 2),
                        "p80": round(quantile(r, 0.8), 2), "unit": "tok/s", "ratio_to_lora": round(ratio, 3),
                        "samples": len(r), "new_tokens": n, "rank": args.rank, "layers": args.layers, "dtype": "bf16",
                        **versions})
    if writer:
        writer.close()
    dc = [name for name, c in configs if c["kind"] == "dc"]
    if len(dc) > 1:
        same = all(torch.equal(tokens[dc[0]], tokens[other]) for other in dc[1:])
        print(f"doracheck's tokens the same in every configuration: {same}")
    print("changed between runs:", [k for k in tokens if k.endswith("(changed between runs)")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
