"""``doracheck bench``: time doracheck's DoRA layer against plain nn.Linear on this machine, and
with ``--plan`` the planner's variants, predicted against measured, side by side.

    doracheck bench [--shapes 4096x4096r16,...] [--tokens 1,4096] [--dtype bf16] [--mode infer,train]
                    [--plan [--timed]] [--reps N] [--json] [--csv FILE]

Shapes are d_in x d_out r rank. Times: median over ``--reps`` samples after warm-up, each
sample back-to-back calls timed together, the variants of a row and nn.Linear of the same
shape interleaved round-robin on the same inputs (``doracheck.timing.time_interleaved``; CUDA
events on a GPU; on a CPU the host clock, at small default shapes, and the figures describe
the CPU).
``infer`` is a no_grad forward (norm cached), ``train`` forward + backward with every input
requiring grad except the frozen weight. With ``--plan`` each row is one (shape, T, dtype,
mode): every candidate variant's predicted and measured ms, the variant the cost model picks
and the fastest measured one; the summary says in how many rows the pick is within 5% of the
fastest. ``--timed`` adds the choice of the planner's timing mode, made from its own
measurement and judged on the row's. Exit 0, or 2 on bad arguments.
"""

from __future__ import annotations

import json
import sys

import torch

GPU_SHAPES = "4096x4096r16,4096x4096r128,8192x8192r384,4096x14336r384,14336x4096r384"
CPU_SHAPES = "256x256r8,512x256r16"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time the DoRA layer (and the planner's variants) on this machine")
    p.add_argument("--shapes", help=f"comma list of DINxDOUTrR (default on a GPU: {GPU_SHAPES}; on a CPU: {CPU_SHAPES})")
    p.add_argument("--tokens", help="comma list of token counts (default 1,4096 on a GPU, 1,64 on a CPU)")
    p.add_argument("--dtype", default="bf16", help="comma list of bf16, fp16, fp32 (activations, weights and adapters)")
    p.add_argument("--mode", default="infer,train", help="comma list of infer, train")
    p.add_argument("--plan", action="store_true", help="the planner's variants: predicted against measured")
    p.add_argument("--timed", action="store_true",
                   help="with --plan: also let the planner's timing mode choose (from its own measurement)")
    p.add_argument("--reps", type=int, default=15, help="samples per variant (each of back-to-back calls)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    p.set_defaults(run=run)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        dims, sep, r = item.strip().partition("r")
        d_in, x, d_out = dims.partition("x")
        if not (sep and x and d_in.isdigit() and d_out.isdigit() and r.isdigit()) or min(int(d_in), int(d_out), int(r)) < 1:
            raise ValueError(f"--shapes: expected DINxDOUTrR like 4096x4096r16, got {item!r}")
        out.append((int(d_in), int(d_out), int(r)))
    return out


def _format_row(row: dict, plan: bool) -> str:
    head = f"{row['d_in']}x{row['d_out']} r{row['r']} T{row['tokens']} {row['dtype']} {row['mode']:5s} linear {row['linear_ms']:.4f}"
    if plan:
        cells = "  ".join(f"{k}: pred {row['predicted_ms'][k]:.4f} meas {row['measured_ms'][k]:.4f}" for k in row["measured_ms"])
        mark = "ok" if row["chosen_over_fastest"] <= 1.05 else f"{row['chosen_over_fastest']:.2f}x"
        timed = ""
        if "timed_chosen" in row:
            t_mark = "ok" if row["timed_chosen_over_fastest"] <= 1.05 else f"{row['timed_chosen_over_fastest']:.2f}x"
            timed = f" timed chose {row['timed_chosen']} ({t_mark})"
        return f"{head} | chose {row['chosen']} fastest {row['fastest']} ({mark}){timed} | {cells}"
    return f"{head}  doracheck {row['doracheck_ms']:.4f} ({row['variant']})  x{row['ratio_to_linear']:.2f} linear"


def run(args) -> int:
    from doracheck.measure import CsvRows, bench_row, plan_summary

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        shapes = parse_shapes(args.shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES))
        tokens = [int(t) for t in (args.tokens or ("1,4096" if device.type == "cuda" else "1,64")).split(",")]
        dtypes = [DTYPES[d.strip()] for d in args.dtype.split(",")]
        modes = [m.strip() for m in args.mode.split(",")]
        if any(m not in ("infer", "train") for m in modes) or any(t < 1 for t in tokens) or args.reps < 1:
            raise ValueError("--mode takes infer and/or train; --tokens and --reps must be at least 1")
        if args.timed and not args.plan:
            raise ValueError("--timed goes with --plan")
    except KeyError as exc:
        print(f"doracheck bench: --dtype: expected bf16, fp16 or fp32, got {exc.args[0]!r}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"doracheck bench: {exc}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    total = len(shapes) * len(tokens) * len(dtypes) * len(modes)
    if not args.json:
        print(f"doracheck bench on {name} (median ms per call over {args.reps} samples of back-to-back calls, side by side)",
              flush=True)
    try:
        csv_rows = CsvRows(args.csv) if args.csv else None
    except OSError as exc:
        print(f"doracheck bench: --csv: cannot write {args.csv}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        for (d_in, d_out, r) in shapes:
            for T in tokens:
                for dt in dtypes:
                    for mode in modes:
                        row = bench_row(device, name, d_in, d_out, r, T, dt, mode, args.reps, with_plan=args.plan,
                                        timed=args.timed)
                        rows.append(row)
                        if csv_rows is not None:
                            csv_rows.write(row)
                        if not args.json:
                            print(_format_row(row, args.plan), flush=True)
                        elif sys.stderr.isatty():
                            print(f"\rdoracheck bench: {len(rows)}/{total}", end="", file=sys.stderr, flush=True)
    finally:
        if csv_rows is not None:
            csv_rows.close()
    summary = plan_summary(rows, args.timed) if args.plan else {}
    if args.json:
        print(json.dumps({"device": name, "rows": rows, "summary": summary}, indent=1))
        return 0
    if summary:
        print(f"planner: chosen within 5% of the fastest measured in {summary['chosen_within_5pct_of_fastest']} of {summary['rows']} rows"
              f" ({summary['chosen_within_5pct_where_a_choice']} of the {summary['rows_with_a_choice']} with more than one candidate)")
        if "timed_within_5pct_of_fastest" in summary:
            print(f"planner, timing mode: within 5% in {summary['timed_within_5pct_of_fastest']} of {summary['rows']} rows")
    return 0
