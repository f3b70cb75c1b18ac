"""Model-level equivalence: PEFT DoRA after ``doracheck.integrations.peft.enable`` against plain PEFT DoRA.

The model of ``llama_model.py`` (bf16 weights, random init; DoRA r = 384, alpha = 768 on every
linear layer with PEFT's default fp32 adapters, lora_B non-zero):
1. logits of one sequence (``--seq`` tokens), plain PEFT against ``enable``: cosine, rel_l2 and the
   largest difference, in bf16 and with the whole model in fp32 (where the rounding of the rest
   of the model no longer hides the DoRA layers); and each bf16 result against the fp32 forward;
2. ``--steps`` AdamW steps side by side (same seed and batches, bf16 autocast on a GPU, sequence
   ``--train-seq``): per-step |Δloss| mean and max, the largest adapter rel_l2 at the end; and each
   against the same training in fp32, so the difference between the two is set against the size
   of bf16 rounding itself;
3. save with one and load with the other: logits of the reloaded model against the saver's.
One row per figure in results/equivalence.csv (``median`` holds the figure); the JSON report is
printed. Exit 1 when the fp32 cosine < 0.99999, a reload differs (rel_l2 > 1e-2), or doracheck's
bf16 training is further from the fp32 run than twice PEFT's. ``targets_met``: the bf16 targets
(cosine >= 0.99999, mean |Δloss| <= 1e-3) as well.

    python benchmarks/equivalence.py [--steps 200]
    python benchmarks/equivalence.py --smoke
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import harness
import llama_model as lm
import torch

FIELDS = ["metric", "passed"]


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lm.add_llama_args(ap)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json-out")
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        lm.apply_smoke(args)
        args.steps, args.train_seq = 3, 16
    device = harness.resolve_device(args, "equivalence")
    import peft

    from doracheck.integrations.peft import enable

    positions = max(args.seq, args.train_seq) + 8
    plain = lm.build("peft_dora_fp32", args, checkpointing=False, max_positions=positions)
    ours = enable(copy.deepcopy(plain))
    ids = lm.token_ids(args, args.seq)
    plain32 = copy.deepcopy(plain).float()
    ours32 = enable(copy.deepcopy(plain32))
    with torch.no_grad():
        a, b = plain(ids).logits.float(), ours(ids).logits.float()
        ref, b32 = plain32(ids).logits, ours32(ids).logits
    logits = {
        "cosine": cosine(a, b), "rel_l2": rel_l2(b, a), "max_abs_diff": float((a - b).abs().max()),
        "max_abs_logit": float(a.abs().max()), "rel_l2_peft_vs_fp32": rel_l2(a, ref), "rel_l2_doracheck_vs_fp32": rel_l2(b, ref),
        "fp32_cosine": cosine(b32, ref), "fp32_rel_l2": rel_l2(b32, ref), "fp32_max_abs_diff": float((b32 - ref).abs().max()),
    }
    del a, b, ref, b32, ours32

    models = (plain, ours, plain32)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for m in models]
    losses = []
    for step in range(args.steps):
        batch = lm.token_ids(args, args.train_seq, seed=100 + step)
        row = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            model.train()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda") and i < 2):
                loss = model(batch, labels=batch).loss
            loss.backward()
            opt.step()
            row.append(float(loss))
        losses.append(row)

    def mean_abs(i, j):
        return sum(abs(r[i] - r[j]) for r in losses) / len(losses)

    worst = max(((name, rel_l2(q, p)) for (name, p), q in zip(plain.named_parameters(), ours.parameters())
                 if p.requires_grad), key=lambda t: t[1])
    training = {"steps": args.steps, "mean_abs_dloss": mean_abs(0, 1), "max_abs_dloss": max(abs(r[0] - r[1]) for r in losses),
                "mean_abs_dloss_peft_vs_fp32": mean_abs(0, 2), "mean_abs_dloss_doracheck_vs_fp32": mean_abs(1, 2),
                "worst_adapter_rel_l2": worst[1]}
    del plain32, opts

    short = ids[:, :256]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        ours.eval()
        plain.eval()
        ours.save_pretrained(f"{tmp}/ours")
        plain.save_pretrained(f"{tmp}/plain")
        base = lm.build("peft_dora_fp32", args, checkpointing=False, max_positions=positions).get_base_model()
        loaded_in_peft = peft.PeftModel.from_pretrained(base, f"{tmp}/ours").eval()
        d1 = rel_l2(loaded_in_peft(short).logits, ours(short).logits)
        del loaded_in_peft, base
        base = lm.build("peft_dora_fp32", args, checkpointing=False, max_positions=positions).get_base_model()
        loaded_in_ours = enable(peft.PeftModel.from_pretrained(base, f"{tmp}/plain").eval())
        d2 = rel_l2(loaded_in_ours(short).logits, plain(short).logits)
    save_load = {"ours_saved_peft_loaded_rel_l2": d1, "peft_saved_ours_loaded_rel_l2": d2}
    ok = (logits["fp32_cosine"] >= 0.99999 and max(d1, d2) <= 1e-2
          and training["mean_abs_dloss_doracheck_vs_fp32"] <= 2.0 * training["mean_abs_dloss_peft_vs_fp32"])
    targets = logits["cosine"] >= 0.99999 and training["mean_abs_dloss"] <= 1e-3
    report = {"logits": logits, "training": training, "save_load": save_load, "pass": ok, "targets_met": targets}
    results = harness.Results("equivalence", FIELDS, args.csv, args.smoke)
    for section, figures in (("logits", logits), ("training", training), ("save_load", save_load)):
        for metric, value in figures.items():
            results.add({"case": section, "metric": metric, "impl": "doracheck vs peft_dora_fp32",
                         "shape": lm.shape_label(args), "dtype": "bf16 model, fp32 adapters", "unit": "",
                         "median": value, "n": 1, "rounds": 1, "passed": ok})
    if args.json_out:
        harness.write_json(args.json_out, report)
    print(report)
    print(f"pass {ok}, bf16 targets met {targets}; rows appended to {results.path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
