"""Interleaved A/B of TWO commits of doracheck in ONE process: is B as fast as A?

    git worktree add /tmp/base 152454a            # or: mkdir /tmp/base && git archive 152454a | tar -x -C /tmp/base
    python benchmarks/ab.py /tmp/base . [--parts step,infer,layer,decode,decode_compiled] [--rounds 6]
    python benchmarks/ab.py 152454a HEAD          # git revisions of this checkout: exported with git archive

A and B are directories holding a checkout (pyproject.toml, doracheck/, kernels/, ...) or git
revisions. Two versions of one package cannot be imported under one name, so each side's packages
are copied into a temporary folder under a name of its own (``dc_a``, ``dc_b``: ``doracheck`` ->
``dc_a``, ``doracheck.kernels`` -> ``dc_a.kernels``, ... as that checkout's pyproject
``package-dir`` maps them) and the word ``doracheck`` is renamed in their Python source (imports,
the ``doracheck::`` torch.library namespace, ``torch.ops.doracheck``), so both import side by side
and register their ops apart. This driver never imports ``doracheck`` itself. Each side then
builds the same PEFT model (same seed) and applies its own ``enable``. Global hooks a side
installs (an optimizer-step hook, say) stay installed for the whole process, so each side pays
the other's too; an A/A run (the same directory twice) shows the floor of the comparison.

Parts, each measured round by round (order A B / B A alternating, one untimed call after each
switch; ``--rounds`` >= 5):
  step             the model's step + fused AdamW, gradient checkpointing (ms; llama_model.py)
  infer            the model's no_grad forward of the sequence (ms)
  layer            one PEFT DoRA layer, 4096², r 16, T = 1: forward + backward + fused AdamW (ms; host time)
  decode           eager greedy decode, 64 tokens (tok/s)
  decode_compiled  static KV cache, forward compiled by generate (reduce-overhead), 64 tokens (tok/s)
``--lora`` adds PEFT LoRA (bf16 adapters) as a third side, for scale. Printed per part: A and B
medians (p10-p90), B/A and its spread over the rounds (p10-p90 of the per-round ratios). For
times B/A < 1 is faster; for tok/s B/A > 1 is faster.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import harness
import llama_model as lm
import torch

FIELDS = ["part", "side", "source", "ratio", "ratio_p10", "ratio_p90"]
PARTS = ["step", "infer", "layer", "decode", "decode_compiled"]
REPO = harness.HERE.parent


@dataclass
class Side:
    name: str  # A, B
    alias: str  # the package's name in this process
    source: str  # what was given, with its commit where known
    enable: object


def package_dirs(checkout: Path) -> dict[str, str]:
    """{package: folder} for doracheck's packages, from the checkout's pyproject ``package-dir``."""
    text = (checkout / "pyproject.toml").read_text() if (checkout / "pyproject.toml").exists() else ""
    block = re.search(r"package-dir\s*=\s*\{([^}]*)\}", text)
    pairs = dict(re.findall(r'"([\w.]+)"\s*=\s*"([^"]*)"', block.group(1))) if block else {}
    dirs = {k: v for k, v in pairs.items() if k == "doracheck" or k.startswith("doracheck.")}
    return dirs or {"doracheck": "doracheck"}


def export_revision(rev: str, dest: Path) -> str:
    """``git archive`` of ``rev`` (of the checkout holding this script) into ``dest``; its short hash."""
    short = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True,
                           check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", short], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return short


def stage(source: str, alias: str, root: Path) -> tuple[Path, str]:
    """Copy the doracheck packages of ``source`` (a checkout folder or a git revision) to
    ``root/alias`` with ``doracheck`` renamed ``alias``; returns (site folder, label)."""
    path = Path(source)
    if path.is_dir():
        # a checkout or worktree has .git; an export (git archive) has no commit to ask for
        label = f"{source}@{harness.git_commit(path, use_env=False)}" if (path / ".git").exists() else source
    else:
        path = root / f"export_{alias}"
        label = export_revision(source, path)
    site = root / "site"
    for name, folder in sorted(package_dirs(path).items(), key=lambda kv: kv[0].count(".")):
        dest = site.joinpath(alias, *name.split(".")[1:])
        shutil.copytree(path / folder, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    word = re.compile(r"\bdoracheck\b")
    for file in (site / alias).rglob("*.py"):
        file.write_text(word.sub(alias, file.read_text()))
    return site, label


def load_sides(sources: list[str], root: Path) -> list[Side]:
    sides = []
    for name, source in zip("AB", sources):
        alias = f"dc_{name.lower()}"
        site, label = stage(source, alias, root)
        if str(site) not in sys.path:
            sys.path.insert(0, str(site))
        importlib.import_module(alias)
        enable = importlib.import_module(f"{alias}.integrations.peft").enable
        sides.append(Side(name, alias, label, enable))
        print(f"side {name}: {label} as {alias}", flush=True)
    return sides


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="side A: a checkout folder or a git revision (the reference, e.g. 152454a)")
    ap.add_argument("b", help="side B: a checkout folder or a git revision")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="timed model steps / forwards per side and round")
    ap.add_argument("--layer-calls", type=int, default=20, help="timed layer calls per side and round")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--lora", action="store_true", help="PEFT LoRA as a third side, for scale")
    ap.add_argument("--host-profile", metavar="DIR", help="after each part's rounds, cProfile each side's calls "
                    "into DIR/PART_SIDE.txt (where the host time goes: harness.host_profile)")
    lm.add_llama_args(ap)
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        lm.apply_smoke(args)
        args.rounds, args.steps, args.layer_calls, args.new_tokens = 2, 2, 3, 4
    elif args.rounds < 5:
        ap.error("--rounds: at least 5 (a spread needs rounds)")
    device = harness.resolve_device(args, "ab")
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    root = Path(tempfile.mkdtemp(prefix="doracheck-ab-"))
    sides = load_sides([args.a, args.b], root)
    names = [s.name for s in sides] + (["lora"] if args.lora else [])
    source = {s.name: s.source for s in sides} | {"lora": "peft_lora_bf16"}
    results = harness.Results("ab", FIELDS, args.csv, args.smoke)
    models: dict[str, torch.nn.Module] = {}
    if set(parts) & {"step", "infer", "decode", "decode_compiled"}:
        for s in sides:
            models[s.name] = lm.build("doracheck_bf16", args, checkpointing=True, enable=s.enable)
        if args.lora:
            models["lora"] = lm.build("peft_lora_bf16", args, checkpointing=True)
    ids = lm.token_ids(args, args.seq)
    printed = []
    for part in parts:
        per_round, settle, unit = args.steps, 1, "ms"
        if part == "step":
            fns = {n: lm.train_step(m, ids) for n, m in models.items()}
        elif part == "infer":
            fns = {n: lm.inference(m, ids) for n, m in models.items()}
        elif part == "layer":
            import layer

            d, r = (64, 8) if args.smoke else (4096, 16)
            layers = {s.name: layer.build("dcpeft_bf16", d, d, r, device, enable=s.enable) for s in sides}
            if args.lora:
                layers["lora"] = layer.build("peft_lora_bf16", d, d, r, device)
            x = torch.randn(1, d, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
            dy = torch.randn(1, d, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
            fns = {n: layer.call(m, "step", x, dy) for n, m in layers.items()}
            per_round = args.layer_calls
        else:
            decoders = {n: lm.Decoder(m, args, args.new_tokens, compiled=part == "decode_compiled") for n, m in models.items()}
            fns = {n: d.rate for n, d in decoders.items()}
            per_round, settle, unit = 1, 0, "tok/s"
        for fn in fns.values():  # warm-up
            for _ in range(2 if unit == "tok/s" else 3):
                fn()
        harness.sync(device)
        if unit == "ms":
            cases = {n: (lambda f=fns[n]: harness.time_call(f, device)) for n in names}
        else:
            cases = {n: fns[n] for n in names}
        samples = harness.interleaved(cases, rounds=args.rounds, per_round=per_round, settle=settle)
        if args.host_profile:  # after the timed rounds, so the profiler's overhead never enters them
            Path(args.host_profile).mkdir(parents=True, exist_ok=True)
            for n in names:
                harness.host_profile(fns[n], Path(args.host_profile) / f"{part}_{n}.txt", calls=max(per_round, 2))
        for n, s in harness.summarise(samples, ref="A").items():
            row = results.add({"case": part, "part": part, "side": n, "source": source[n], "impl": n,
                               "shape": "layer 4096x4096r16 T1" if part == "layer" else lm.shape_label(args),
                               "dtype": "bf16", "unit": unit, **s.row(3)})
            printed.append(row)
            print(f"{part:15s} {n:4s} {s.stats} {unit}  x{s.ratio:.3f} A ({s.ratio_p10:.3f}-{s.ratio_p90:.3f})", flush=True)
        if part == "layer":
            del layers, fns
            harness.free_memory()
    leaked = sorted(m for m in sys.modules if m == "doracheck" or m.startswith("doracheck."))
    if leaked:
        print(f"warning: the unrenamed doracheck was imported too ({leaked[:3]}...): its global hooks ran for both sides")
    print(f"A = {sides[0].source}\nB = {sides[1].source}")
    print(harness.table([r for r in printed if r["side"] != "A"],
                        ["part", "side", "unit", "median", "p10", "p90", "ratio", "ratio_p10", "ratio_p90"]))
    print("ratio: median over A's median (spread: p10-p90 of the per-round ratios); times: < 1 is faster, tok/s: > 1")
    print(f"rows appended to {results.path}")
    print(harness.summary_line([r for r in printed if r["side"] == "B"], lambda r: f"{r['part']} B/A"))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
