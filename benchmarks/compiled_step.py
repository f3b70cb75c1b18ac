"""The compiled training step + fused AdamW: LoRA / doracheck / PEFT DoRA interleaved in ONE process.

Model: ``llama_model.py`` under ``torch.compile(model)``, no gradient checkpointing; a step is
forward, backward, fused AdamW ``step()`` and ``zero_grad`` (the optimizer itself eager). The first
call's seconds (compilation) are recorded; then two untimed steps each, and ``--rounds`` rounds of
``--steps`` timed steps per configuration (CUDA events; order reversed every other round).
Processes of the same compiled step have differed by up to 20% on these hosts, so the ratio to
LoRA is taken here, in one process. Beside the elapsed time, the host's time to issue the step
(``host_ms``) and the share of steps whose issue took at least 90% of their elapsed time
(``host_bound``): a host-bound compiled step follows the host's speed.

    python benchmarks/compiled_step.py [--configs lora,doracheck,peft_dora] [--rounds 5] [--steps 4]
    python benchmarks/compiled_step.py --smoke
"""

from __future__ import annotations

import argparse
import time

import harness
import llama_model as lm

FIELDS = ["backend", "ratio", "ratio_p10", "ratio_p90", "first_s", "host_ms", "host_bound"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="lora,doracheck,peft_dora")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (smoke: aot_eager)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    lm.add_llama_args(ap)
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        lm.apply_smoke(args)
        args.rounds, args.steps, args.backend = 2, 2, "aot_eager"
    device = harness.resolve_device(args, "compiled_step")
    configs = args.configs.split(",")
    results = harness.Results("compiled_step", FIELDS, args.csv, args.smoke)
    ids = lm.token_ids(args, args.seq)
    steps, first = {}, {}
    for c in configs:
        steps[c] = lm.train_step(lm.build(c, args, checkpointing=False), ids, "adamw_fused", compiled=True,
                                 backend=args.backend)
        t0 = time.perf_counter()
        steps[c]()
        harness.sync(device)
        first[c] = time.perf_counter() - t0
        for _ in range(2):
            steps[c]()
    harness.sync(device)
    host: dict[str, list[float]] = {c: [] for c in configs}
    elapsed: dict[str, list[float]] = {c: [] for c in configs}

    def sample(c: str) -> float:
        ms = harness.time_call(steps[c], device, host[c])
        elapsed[c].append(ms)
        return ms

    samples = harness.interleaved({c: (lambda c=c: sample(c)) for c in configs}, rounds=args.rounds, per_round=args.steps)
    printed = []
    for c, s in harness.summarise(samples, ref=configs[0]).items():
        timed = list(zip(harness.drop_settling(host[c], args.steps), harness.drop_settling(elapsed[c], args.steps)))
        bound = sum(h >= 0.9 * e for h, e in timed) / max(len(timed), 1)
        row = results.add({"case": "compiled_step", "impl": lm.impl_name(c), "shape": lm.shape_label(args), "dtype": "bf16",
                           "unit": "ms", **s.row(3), "backend": args.backend, "first_s": round(first[c], 1),
                           "host_ms": round(harness.quantile([h for h, _ in timed], 0.5), 3),
                           "host_bound": round(bound, 2)})
        printed.append(row)
        print(f"{c:10s} {s.stats} ms  x{s.ratio:.3f} {configs[0]} ({s.ratio_p10:.3f}-{s.ratio_p90:.3f})  "
              f"first call {first[c]:.1f} s  host {row['host_ms']} ms  host-bound {bound:.0%}", flush=True)
    print(harness.table(printed, ["impl", "median", "p10", "p90", "ratio", "ratio_p10", "ratio_p90", "first_s", "host_ms",
                                  "host_bound"]))
    print(f"rows appended to {results.path}")
    print(harness.summary_line(printed, lambda r: r['impl']))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
