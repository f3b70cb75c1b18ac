"""``doracheck bench``: doracheck's DoRA layer timed against plain nn.Linear on this machine, and with
``--plan`` the planner's variants, predicted against measured (options, times, exit codes: docs/cli.md).
A row's columns are interleaved round-robin on the same inputs (``timing.time_interleaved``);
``--csv FILE`` gets the rows as they are measured (``measure.CsvRows``), so a run cut short keeps them."""

from __future__ import annotations

import json
import sys

GPU_SHAPES = "4096x4096r16,4096x4096r128,8192x8192r384,4096x14336r384,14336x4096r384"
CPU_SHAPES = "256x256r8,512x256r16"
DTYPE_CHOICES = ("bf16", "fp16", "fp32")
PREDICTED = "predicted for H200 (cost model)"
TIMES = ("Times: ms per call after warm-up; each of the {reps} samples times back-to-back calls (CUDA events on a GPU,\n"
         "  the host clock on a CPU), all columns of a row interleaved round-robin on the same inputs; median and\n"
         "  p10-p90 (10th to 90th percentile) of the samples. infer = no_grad forward, train = forward + backward.")
LEGEND = ("ratio = doracheck's median / nn.Linear's median on the same inputs (1.00x: as fast as the plain layer).\n" + TIMES)
PLAN_LEGEND = ("vs fastest = measured median / the row's fastest variant's; pick: model = the cost model's choice, "
               "timed = the\n  timing mode's (--timed), fastest = the fastest measured. The predicted column is the "
               "cost model's estimate\n  for an H200 (doracheck.planner.H200), on every device.\n" + TIMES)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time the DoRA layer (and the planner's variants) on this machine",
                       description="Time doracheck's DoRA layer against plain nn.Linear on this machine, side by side; "
                                   "with --plan, every computation order the planner considers, predicted against "
                                   "measured.",
                       epilog="exit codes: 0 done, 2 bad arguments, an unwritable --csv or out of memory, 130 interrupted")
    p.add_argument("--shapes", help=f"comma list of DINxDOUTrR (default on a GPU: {GPU_SHAPES}; on a CPU: {CPU_SHAPES})")
    p.add_argument("--tokens", help="comma list of token counts T (default 1,4096 on a GPU, 1,64 on a CPU)")
    p.add_argument("--dtype", default="bf16", help="comma list of bf16, fp16, fp32 (activations, weights and adapters; default: bf16)")
    p.add_argument("--mode", default="infer,train",
                   help="comma list of infer (no_grad forward) and train (forward + backward) (default: both)")
    p.add_argument("--plan", action="store_true", help="time every variant the planner considers, beside its cost-model prediction")
    p.add_argument("--timed", action="store_true",
                   help="with --plan: also let the planner's timing mode choose (from its own measurement)")
    p.add_argument("--reps", type=int, default=15, help="samples per variant, each of back-to-back calls (default: 15)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table (a progress bar on a terminal)")
    p.add_argument("--csv", metavar="FILE",
                   help="also write the rows to FILE as they are measured: device, versions, shape, dtype, mode, "
                        "median, p10 and p90 ms (an existing FILE is replaced once the first row is measured)")
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


def _parse_tokens(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and int(t) >= 1 for t in items):
        raise ValueError(f"--tokens: expected a comma list of token counts of at least 1, got {text!r}")
    return [int(t) for t in items]


def _parse(args, cuda: bool) -> tuple[list, list[int], list[str], list[str]]:
    shapes = parse_shapes(args.shapes or (GPU_SHAPES if cuda else CPU_SHAPES))
    tokens = _parse_tokens(args.tokens or ("1,4096" if cuda else "1,64"))
    dtypes = [d.strip() for d in args.dtype.split(",")]
    if any(d not in DTYPE_CHOICES for d in dtypes):
        raise ValueError(f"--dtype: expected a comma list of bf16, fp16, fp32, got {args.dtype!r}")
    modes = [m.strip() for m in args.mode.split(",")]
    if any(m not in ("infer", "train") for m in modes):
        raise ValueError(f"--mode: expected a comma list of infer, train, got {args.mode!r}")
    if args.reps < 1:
        raise ValueError("--reps must be at least 1")
    if args.timed and not args.plan:
        raise ValueError("--timed goes with --plan")
    return shapes, tokens, dtypes, modes


class Columns:
    """A text table printed a line at a time: (header, width, "<" or ">") per column."""

    def __init__(self, spec: list[tuple[str, int, str]]):
        self.spec = [(h, max(w, len(h)), a) for h, w, a in spec]

    def line(self, cells) -> str:
        return "  ".join(c.rjust(w) if a == ">" else c.ljust(w) for c, (_, w, a) in zip(cells, self.spec)).rstrip()

    def head(self) -> str:
        return self.line([h for h, _, _ in self.spec]) + "\n" + "  ".join("-" * w for _, w, _ in self.spec)


def _ms(x: float) -> str:
    """Milliseconds in at most 6 characters below 10^6 ms (4 decimals below 1 ms, then 4 significant digits)."""
    for limit, decimals in ((1, 4), (10, 3), (100, 2), (1000, 1)):
        if x < limit:
            return f"{x:.{decimals}f}"
    return f"{x:.0f}"


def _range(lo: float, hi: float) -> str:
    return f"{_ms(lo)}-{_ms(hi)}"


def _shape(row: dict) -> str:
    return f"{row['d_in']}x{row['d_out']} r{row['r']}"


def make_columns(plan: bool, shapes, tokens, names: list[str]) -> Columns:
    key = [("shape", max(len(f"{a}x{b} r{r}") for a, b, r in shapes), "<"), ("T", max(len(str(t)) for t in tokens), ">"),
           ("dtype", 5, "<"), ("mode", 5, "<"), ("variant", max(len(n) for n in names), "<")]
    if plan:
        return Columns([*key, (PREDICTED, 8, ">"), ("measured ms", 8, ">"), ("p10-p90", 13, ">"), ("vs fastest", 7, ">"),
                        ("pick", 4, "<")])
    return Columns([*key, ("nn.Linear ms", 8, ">"), ("p10-p90", 13, ">"), ("doracheck ms", 8, ">"), ("p10-p90", 13, ">"),
                    ("ratio", 7, ">")])


def row_lines(row: dict, columns: Columns, plan: bool) -> list[str]:
    key = [_shape(row), str(row["tokens"]), row["dtype"], row["mode"]]
    if not plan:
        return [columns.line([*key, row["variant"], _ms(row["linear_ms"]), _range(row["linear_p10_ms"], row["linear_p90_ms"]),
                              _ms(row["doracheck_ms"]), _range(row["doracheck_p10_ms"], row["doracheck_p90_ms"]),
                              f"{row['ratio_to_linear']:.2f}x"])]
    lines = [columns.line([*key, "nn.Linear", "-", _ms(row["linear_ms"]), _range(row["linear_p10_ms"], row["linear_p90_ms"]),
                           "", ""])]
    fastest = row["measured_ms"][row["fastest"]]
    for name, ms in row["measured_ms"].items():
        picks = [label for label, chosen in (("model", row["chosen"]), ("timed", row.get("timed_chosen")),
                                             ("fastest", row["fastest"])) if chosen == name]
        lines.append(columns.line(["", "", "", "", name, _ms(row["predicted_ms"][name]), _ms(ms),
                                   _range(row["measured_p10_ms"][name], row["measured_p90_ms"][name]),
                                   f"{ms / fastest:.2f}x", ", ".join(picks)]))
    return lines


def run(args) -> int:
    from doracheck.cli.verify_cmd import guarded
    return guarded("bench", _run, args)


def _run(args) -> int:
    import torch

    from doracheck.measure import CsvRows
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = _parse(args, device.type == "cuda")
    except ValueError as exc:
        print(f"doracheck bench: {exc}", file=sys.stderr)
        return 2
    try:
        csv_rows = CsvRows(args.csv) if args.csv else None
    except OSError as exc:
        print(f"doracheck bench: --csv: cannot write {args.csv}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        return _bench(args, device, parsed, csv_rows)
    finally:  # every way out, Ctrl-C and a closed stdout included: rows kept, or an existing file untouched
        if csv_rows is not None:
            csv_rows.close()


def _bench(args, device, parsed, csv_rows) -> int:
    import torch

    from doracheck import planner
    from doracheck.measure import versions
    shapes, tokens, dtypes, modes = parsed
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    configs = [(s, T, torch_dtypes[dt], mode) for s in shapes for T in tokens for dt in dtypes for mode in modes]
    plans = [planner.plan(d_in, d_out, r, T, dt, mode == "train") for (d_in, d_out, r), T, dt, mode in configs]
    if args.plan:  # the names the variant column will hold
        names = ["nn.Linear", *(v.name for p in plans for v in p.candidates)]
    else:
        names = [p.variant.name if device.type == "cuda" else planner.DEFAULT.name for p in plans]
    columns = make_columns(args.plan, shapes, tokens, names)
    if not args.json:
        v = versions()
        print(f"doracheck bench on {name} (doracheck {v['doracheck']}, torch {v['torch']}, triton {v['triton'] or 'not installed'}): "
              f"ms per call, median and p10-p90 of {args.reps} samples", flush=True)
        if args.plan and "H200" not in name:
            print(f"note: the predictions are the cost model's for an H200, not for {name}: "
                  "compare the measured times with each other, not with them", flush=True)
        print(columns.head(), flush=True)
    rows: list[dict] = []
    status = _measure_rows(args, device, name, configs, columns, csv_rows, rows)
    if status is not None:
        return status
    return _finish(args, name, rows)


def _out_of_memory(exc: BaseException) -> bool:
    """A CUDA or host allocation failure (torch raises RuntimeError for the CPU's)."""
    import torch
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate" in text or "out of memory" in text)


def _measure_rows(args, device, name: str, configs, columns: Columns, csv_rows, rows: list[dict]) -> int | None:
    """Measure, print and write each row as it comes; an exit code if the run stops early."""
    from doracheck.cli.progress import Progress
    from doracheck.cli.verify_cmd import interrupted
    # a bar under --json only: otherwise the table's lines show the progress
    progress = Progress("bench", len(configs), unit="row", draw=args.json)
    try:
        return _rows(args, device, name, configs, columns, csv_rows, rows, progress)
    except KeyboardInterrupt:
        progress.done()
        return interrupted("bench", _csv_note(args, csv_rows))
    finally:
        progress.done()


def _rows(args, device, name: str, configs, columns: Columns, csv_rows, rows: list[dict], progress) -> int | None:
    from doracheck.measure import bench_row
    what = ""
    for (d_in, d_out, r), T, dt, mode in configs:
        what = f"{d_in}x{d_out} r{r} T{T} {str(dt).removeprefix('torch.')} {mode}"
        try:
            row = bench_row(device, name, d_in, d_out, r, T, dt, mode, args.reps, with_plan=args.plan, timed=args.timed)
        except (MemoryError, RuntimeError) as exc:
            if not _out_of_memory(exc):
                raise
            print(f"doracheck bench: out of memory at {what} on {name}; try smaller --shapes or --tokens"
                  f"{_csv_note(args, csv_rows)}", file=sys.stderr)
            return 2
        rows.append(row)
        if csv_rows is not None:
            try:
                csv_rows.write(row)
            except OSError as exc:
                print(f"doracheck bench: --csv: cannot write {args.csv}: {exc.strerror or exc}", file=sys.stderr)
                return 2
        if not args.json:
            print("\n".join(row_lines(row, columns, args.plan)), flush=True)
        progress(what)
    return None


def _csv_note(args, csv_rows) -> str:
    """For a run cut short: where the rows measured so far are (none: the file is as it was)."""
    if csv_rows is None or not csv_rows.rows:
        return ""
    return f"; the {csv_rows.rows} rows measured are in {args.csv}"


def _finish(args, name: str, rows: list[dict]) -> int:
    from doracheck.measure import plan_summary, versions
    summary = plan_summary(rows, args.timed) if args.plan else {}
    if args.json:
        doc = {"device": name, **versions(), "reps": args.reps, "rows": rows, "summary": summary}
        doc.update({"predicted_for": PREDICTED} if args.plan else {})
        print(json.dumps(doc, indent=1))
        return 0
    if summary:
        print(f"planner: chosen within 5% of the fastest measured in {summary['chosen_within_5pct_of_fastest']} of {summary['rows']} rows"
              f" ({summary['chosen_within_5pct_where_a_choice']} of the {summary['rows_with_a_choice']} with more than one candidate)")
        if "timed_within_5pct_of_fastest" in summary:
            print(f"planner, timing mode: within 5% in {summary['timed_within_5pct_of_fastest']} of {summary['rows']} rows")
    print()
    print((PLAN_LEGEND if args.plan else LEGEND).format(reps=args.reps))
    if args.csv:
        print(f"csv: {args.csv}")
    return 0
