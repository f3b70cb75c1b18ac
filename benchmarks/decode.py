"""Greedy decode, tokens/s, eager and compiled: LoRA / doracheck / PEFT DoRA interleaved in ONE process.

Model: ``llama_model.py`` (no gradient checkpointing, eval). ``--new-tokens`` (64) tokens after a
32-token prompt, batch 1. Modes: ``eager`` (transformers' dynamic KV cache) and ``compiled`` (a
static KV cache, with which ``generate`` compiles the forward with ``torch.compile``, mode
"reduce-overhead", CUDA graphs; no weights merged). Eager decode is host-bound, so the
configurations are compared within one process, round by round (order reversed every other
round), after two untimed decodes each (the compiled mode's compilation and graph recording).
Rows: tokens/s median and p10/p90 over the rounds, the ratio to the first configuration (LoRA)
with its spread, the first decode's seconds (compile time for ``compiled``), and how many timed
decodes gave other tokens than the first (``changed``: should be 0).

    python benchmarks/decode.py [--modes eager,compiled] [--configs lora,doracheck,peft_dora] [--rounds 5]
    python benchmarks/decode.py --smoke
"""

from __future__ import annotations

import argparse
import time

import harness
import llama_model as lm

FIELDS = ["mode", "new_tokens", "ratio", "ratio_p10", "ratio_p90", "first_s", "changed"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="lora,doracheck,peft_dora")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=1, help="timed decodes per configuration and round")
    lm.add_llama_args(ap)
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        lm.apply_smoke(args)
        args.rounds, args.new_tokens = 2, 4
    harness.resolve_device(args, "decode")
    configs = args.configs.split(",")
    results = harness.Results("decode", FIELDS, args.csv, args.smoke)
    models = {c: lm.build(c, args, checkpointing=False).eval() for c in configs}
    printed = []
    for mode in args.modes.split(","):
        decoders = {c: lm.Decoder(m, args, args.new_tokens, compiled=mode == "compiled") for c, m in models.items()}
        first = {}
        for c, dec in decoders.items():
            t0 = time.perf_counter()
            dec.rate()
            first[c] = time.perf_counter() - t0
            dec.rate()
        samples = harness.interleaved({c: d.rate for c, d in decoders.items()}, rounds=args.rounds, per_round=args.reps,
                                      settle=0)
        for c, s in harness.summarise(samples, ref=configs[0]).items():
            row = results.add({"case": f"decode_{mode}", "mode": mode, "impl": lm.impl_name(c), "shape": lm.shape_label(args),
                               "dtype": "bf16", "unit": "tok/s", **s.row(2), "new_tokens": args.new_tokens,
                               "first_s": round(first[c], 2), "changed": decoders[c].changed})
            printed.append(row)
            print(f"{mode:8s} {c:10s} {s.stats} tok/s  x{s.ratio:.3f} {configs[0]} ({s.ratio_p10:.3f}-{s.ratio_p90:.3f})  "
                  f"first {first[c]:.1f} s  changed {decoders[c].changed}", flush=True)
    print(harness.table(printed, ["mode", "impl", "median", "p10", "p90", "ratio", "ratio_p10", "ratio_p90", "first_s",
                                  "changed"]))
    print(f"rows appended to {results.path}")
    print(harness.summary_line(printed, lambda r: f"{r['mode']} {r['impl']}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
