"""Model-level equivalence on a GPU: ``enable``d PEFT DoRA against plain PEFT DoRA.

The benchmark model of bench_model.py (LLaMA-style, hidden 4096, intermediate 14336, 32 heads,
8 KV heads, 4 layers, bf16 weights, random init; DoRA r = 384, alpha = 768 on every linear
layer, PEFT's default fp32 adapters, non-zero lora_B):
1. logits of one sequence (``--seq`` tokens), plain PEFT against ``enable``: cosine, rel_l2 and
   the largest difference, next to the largest logit, in bf16 and with the whole model in fp32
   (where rounding of the rest of the model no longer hides the DoRA layers); and each bf16
   result against the fp32 forward (which side is nearer to the unrounded result);
2. ``--steps`` AdamW steps side by side (same seed, same batches, bf16 autocast, sequence
   ``--train-seq``): per-step |Δloss| mean and max, and rel_l2 of every adapter at the end; plus
   a control: each against the same training run in fp32 without autocast, so a difference
   between the two is set against the size of bf16 rounding itself;
3. save with one and load with the other: logits of the reloaded model against the saver's.
Prints one JSON object; exit 1 when the fp32 cosine < 0.99999, a reload differs, or doracheck's
bf16 training is further from the fp32 run than twice PEFT's. "targets_met" says
whether the bf16 targets (cosine >= 0.99999, mean |Δloss| <= 1e-3) hold as well.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile

import torch
from llama_model import TARGETS, add_llama_args, llama_config


def build(args, seed: int = 0):
    import peft
    import transformers

    torch.manual_seed(seed)
    config = llama_config(args, max(args.seq, args.train_seq) + 8)
    with torch.device(args.device):
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, use_dora=True, target_modules=TARGETS))
    gen = torch.Generator(device=args.device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device=args.device) * 0.01)
    return model


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(ap)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    import peft

    from doracheck.integrations.peft import enable

    plain = build(args)
    ours = enable(copy.deepcopy(plain))
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    report: dict = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
                    "peft": peft.__version__, "shape": vars(args)}
    plain32 = copy.deepcopy(plain).float()
    ours32 = enable(copy.deepcopy(plain32))
    with torch.no_grad():
        a = plain(ids).logits.float()
        b = ours(ids).logits.float()
        ref = plain32(ids).logits
        b32 = ours32(ids).logits
    report["logits"] = {
        "cosine": cosine(a, b), "rel_l2": rel_l2(b, a), "max_abs_diff": float((a - b).abs().max()),
        "max_abs_logit": float(a.abs().max()), "rel_l2_peft_vs_fp32": rel_l2(a, ref), "rel_l2_doracheck_vs_fp32": rel_l2(b, ref),
        "fp32_cosine": cosine(b32, ref), "fp32_rel_l2": rel_l2(b32, ref), "fp32_max_abs_diff": float((b32 - ref).abs().max()),
    }
    del a, b, ref, b32, ours32

    models = (plain, ours, plain32)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for m in models]
    losses = []
    for step in range(args.steps):
        batch = torch.randint(0, 32000, (1, args.train_seq), generator=torch.Generator().manual_seed(100 + step)).to(args.device)
        row = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            model.train()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda" and i < 2):
                loss = model(batch, labels=batch).loss
            loss.backward()
            opt.step()
            row.append(float(loss))
        losses.append(row)

    def mean_abs(i, j):
        return sum(abs(r[i] - r[j]) for r in losses) / len(losses)

    worst = max(
        ((name, rel_l2(q, p)) for (name, p), q in zip(plain.named_parameters(), ours.parameters()) if p.requires_grad),
        key=lambda t: t[1],
    )
    report["training"] = {"steps": args.steps, "mean_abs_dloss": mean_abs(0, 1), "max_abs_dloss": max(abs(r[0] - r[1]) for r in losses),
                          "mean_abs_dloss_peft_vs_fp32": mean_abs(0, 2), "mean_abs_dloss_doracheck_vs_fp32": mean_abs(1, 2),
                          "final_loss": losses[-1], "worst_adapter_rel_l2": worst[1], "worst_adapter": worst[0]}
    del plain32, opts

    short = ids[:, :256]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        ours.eval()
        plain.eval()
        ours.save_pretrained(f"{tmp}/ours")
        plain.save_pretrained(f"{tmp}/plain")
        base = build(args, seed=0).get_base_model()  # same base weights (same seed), adapters replaced by loading
        loaded_in_peft = peft.PeftModel.from_pretrained(base, f"{tmp}/ours").eval()
        d1 = rel_l2(loaded_in_peft(short).logits, ours(short).logits)
        del loaded_in_peft, base
        base = build(args, seed=0).get_base_model()
        loaded_in_ours = enable(peft.PeftModel.from_pretrained(base, f"{tmp}/plain").eval())
        d2 = rel_l2(loaded_in_ours(short).logits, plain(short).logits)
    report["save_load"] = {"ours_saved_peft_loaded_rel_l2": d1, "peft_saved_ours_loaded_rel_l2": d2}
    tr = report["training"]
    ok = (report["logits"]["fp32_cosine"] >= 0.99999 and max(d1, d2) <= 1e-2
          and tr["mean_abs_dloss_doracheck_vs_fp32"] <= 2.0 * tr["mean_abs_dloss_peft_vs_fp32"])
    report["pass"] = ok
    report["targets_met"] = report["logits"]["cosine"] >= 0.99999 and tr["mean_abs_dloss"] <= 1e-3
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
