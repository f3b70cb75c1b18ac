"""The model's training step and inference forward, LoRA / doracheck / PEFT DoRA interleaved in ONE process.

Model: ``llama_model.py`` (DESIGN section 7: hidden 4096, intermediate 14336, 32/8 heads, 4
layers, bf16, r = 384 on every linear layer, sequence 4096, batch 1). Configurations
(``--configs``, llama_model names; default ``lora,doracheck,peft_dora``, bf16 adapters). Parts:
  step   forward + backward + fused AdamW ``step()`` + ``zero_grad``, gradient checkpointing on
         (non-reentrant); ``--optimizer none`` leaves the update out (then labelled so: the norm
         is not recomputed after an update); ``--no-gc`` without checkpointing
  infer  one no_grad forward of the sequence
Every configuration runs in every round (order reversed every other round), one untimed call
after each switch, then ``--steps`` calls timed with CUDA events. Rows: median and p10/p90 over
all rounds, the ratio to the first configuration (LoRA) and its spread over the rounds (p10-p90
of the per-round ratios), the peak GiB above resident of one step, and the host's median time to
issue a call (``host_ms``: near the elapsed time, the step is host-bound).

    python benchmarks/model_step.py [--configs lora,doracheck,peft_dora] [--rounds 6] [--steps 4]
    python benchmarks/model_step.py --smoke
"""

from __future__ import annotations

import argparse

import harness
import llama_model as lm

FIELDS = ["part", "optimizer", "checkpointing", "ratio", "ratio_p10", "ratio_p90", "peak_gib", "host_ms"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="lora,doracheck,peft_dora")
    ap.add_argument("--parts", default="step,infer")
    ap.add_argument("--optimizer", default="adamw_fused", choices=["adamw_fused", "adamw_foreach", "none"])
    ap.add_argument("--no-gc", action="store_true", help="without gradient checkpointing")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="timed calls per configuration and round")
    lm.add_llama_args(ap)
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        lm.apply_smoke(args)
        args.rounds, args.steps = 2, 2
    device = harness.resolve_device(args, "model_step")
    configs = args.configs.split(",")
    results = harness.Results("model_step", FIELDS, args.csv, args.smoke)
    models = {c: lm.build(c, args, checkpointing=not args.no_gc) for c in configs}
    ids = lm.token_ids(args, args.seq)
    printed = []
    for part in args.parts.split(","):
        if part == "step":
            fns = {c: lm.train_step(m, ids, args.optimizer) for c, m in models.items()}
        elif part == "infer":
            fns = {c: lm.inference(m, ids) for c, m in models.items()}
        else:
            raise SystemExit(f"unknown part {part!r} (step, infer)")
        for fn in fns.values():
            for _ in range(3):
                fn()
        host: dict[str, list[float]] = {c: [] for c in configs}
        samples = harness.interleaved({c: (lambda c=c: harness.time_call(fns[c], device, host[c])) for c in configs},
                                      rounds=args.rounds, per_round=args.steps)
        peaks = {c: lm.peak_gib(fns[c], device) for c in configs}
        for c, s in harness.summarise(samples, ref=configs[0]).items():
            row = results.add({"case": part, "part": part, "impl": lm.impl_name(c), "shape": lm.shape_label(args),
                               "dtype": "bf16", "unit": "ms", **s.row(3),
                               "optimizer": args.optimizer if part == "step" else "-",
                               "checkpointing": "off" if args.no_gc or part == "infer" else "on",
                               "peak_gib": round(peaks[c], 3), "host_ms": round(harness.quantile(harness.drop_settling(host[c], args.steps), 0.5), 3)})
            printed.append(row)
            print(f"{part:5s} {c:10s} {s.stats} ms  x{s.ratio:.3f} {configs[0]} ({s.ratio_p10:.3f}-{s.ratio_p90:.3f})  "
                  f"peak {peaks[c]:.3f} GiB  host {row['host_ms']} ms", flush=True)
    print(harness.table(printed, ["part", "impl", "median", "p10", "p90", "ratio", "ratio_p10", "ratio_p90", "peak_gib",
                                  "host_ms"]))
    print(f"rows appended to {results.path}")
    print(harness.summary_line(printed, lambda r: f"{r['part']} {r['impl']}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
