"""What every driver in benchmarks/ shares: timing, interleaved rounds, environment, result files.

Timing. ``time_call`` times one call: CUDA events recorded around it and synchronised after it
on a GPU (the host's time to issue the call is inside the interval, as a user waits for it), the
host clock on a CPU. ``time_fn`` does ``warmup`` untimed calls, then ``reps`` timed ones, and
returns ``Stats``: median, p10 and p90 (linear interpolation between order statistics), n.
``graph_time`` is the GPU time alone: the calls captured in a CUDA graph and replayed, so the
host's launch cost stays out of a kernel's rate.

Interleaving. Hosts differ by tens of percent in speed and a host-bound step follows its host, so
two things are compared only in one process, round by round: ``interleaved`` runs every case in
each round (the order reversed every other round, A B / B A), each after ``settle`` untimed calls
(the first call after a switch), and ``summarise`` gives each case its pooled ``Stats``, its
ratio to a reference case and the spread of that ratio over the rounds (p10-p90 of the
per-round ratios of medians). A difference inside that spread is not a difference.

Results. ``Results(driver, fields)`` appends rows to ``benchmarks/results/<driver>.csv`` (one
file per driver; ``$BENCH_RESULTS`` or ``--csv`` elsewhere); every row carries ``environment()``:
date, commit (``$BENCH_COMMIT``, else ``git rev-parse``), GPU, torch / triton / peft /
transformers versions. A row is written as soon as it is measured, so a run cut short keeps it.
``--smoke`` runs write to a temporary folder, never to results/.

    python benchmarks/harness.py env        # the environment a row would carry
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ENV_FIELDS = ["date", "commit", "gpu", "torch", "triton", "peft", "transformers"]
MEASURE_FIELDS = ["case", "impl", "shape", "dtype", "unit", "median", "p10", "p90", "n", "rounds"]


# ---------------------------------------------------------------- statistics


def quantile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1), linear between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        return cls(quantile(samples, 0.5), quantile(samples, 0.1), quantile(samples, 0.9), len(samples))

    def row(self, digits: int = 4) -> dict:
        return {"median": round(self.median, digits), "p10": round(self.p10, digits), "p90": round(self.p90, digits),
                "n": self.n}

    def __str__(self) -> str:
        return f"{self.median:.4g} ({self.p10:.4g}-{self.p90:.4g})"


# ---------------------------------------------------------------- timing


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def peak_bytes(fn: Callable[[], object], device: str) -> float:
    """Peak memory allocated during one call of ``fn`` above what was allocated before it (bytes;
    NaN off CUDA, where the caching allocator's statistics do not exist)."""
    import torch

    if not device.startswith("cuda"):
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - before)


def time_call(fn: Callable[[], object], device: str = "cuda", host: list[float] | None = None) -> float:
    """Milliseconds of one call of ``fn``: CUDA events around it, synchronised after (GPU), or
    the host clock (CPU). ``host``: append the host's time to issue the call (until ``fn``
    returns, before the synchronisation), ms; close to the elapsed time means host-bound."""
    cuda = str(device).startswith("cuda")
    if cuda:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    fn()
    issued = (time.perf_counter() - t0) * 1e3
    if host is not None:
        host.append(issued)
    if not cuda:
        return issued
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_fn(fn: Callable[[], object], *, reps: int = 20, warmup: int = 3, device: str = "cuda") -> Stats:
    """``warmup`` untimed calls, then ``reps`` calls timed one by one (``time_call``)."""
    for _ in range(warmup):
        fn()
    sync(device)
    return Stats.of([time_call(fn, device) for _ in range(reps)])


def graph_time(fn: Callable[[], object], *, reps: int = 20, inner: int = 10) -> Stats:
    """GPU milliseconds per call of ``fn`` without the host: ``inner`` calls captured in one CUDA
    graph (after a warm-up on a side stream), the graph replayed ``reps`` times."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return Stats.of([time_call(graph.replay, "cuda") / inner for _ in range(reps)])


# ---------------------------------------------------------------- interleaved rounds


def round_orders(names: Sequence[str], rounds: int, alternate: bool = True) -> list[list[str]]:
    """The order of the cases in each round: as given, reversed every other round (A B, B A, ...)."""
    return [list(names) if not alternate or i % 2 == 0 else list(reversed(names)) for i in range(rounds)]


def interleaved(cases: dict[str, Callable[[], float]], *, rounds: int, per_round: int = 1, settle: int = 1,
                alternate: bool = True, between: Callable[[str], None] | None = None) -> dict[str, list[list[float]]]:
    """``samples[name][round]``: each case's ``per_round`` samples in each round, cases in the
    order of ``round_orders``; each sample is what ``cases[name]()`` returns (ms from ``time_call``,
    tokens/s, ...), after ``settle`` calls whose results are dropped. ``between(name)`` runs
    before a case's turn (a switch of settings)."""
    samples: dict[str, list[list[float]]] = {name: [] for name in cases}
    for order in round_orders(list(cases), rounds, alternate):
        for name in order:
            if between is not None:
                between(name)
            for _ in range(settle):
                cases[name]()
            samples[name].append([float(cases[name]()) for _ in range(per_round)])
    return samples


def drop_settling(values: Sequence[float], per_round: int, settle: int = 1) -> list[float]:
    """Of values recorded on every call a case made in ``interleaved`` (the ``settle`` calls of
    each turn first), those of the timed calls."""
    turn = settle + per_round
    return [v for i, v in enumerate(values) if i % turn >= settle]


@dataclass(frozen=True)
class Summary:
    stats: Stats  # over every sample of every round
    ratio: float  # this median / the reference's median (nan without a reference)
    ratio_p10: float  # spread: p10 and p90 of the per-round ratios of medians
    ratio_p90: float
    rounds: int

    def row(self, digits: int = 4) -> dict:
        return {**self.stats.row(digits), "rounds": self.rounds, "ratio": round(self.ratio, 4),
                "ratio_p10": round(self.ratio_p10, 4), "ratio_p90": round(self.ratio_p90, 4)}


def summarise(samples: dict[str, list[list[float]]], ref: str | None = None) -> dict[str, Summary]:
    """Per case: pooled Stats, the ratio of its median to ``ref``'s, and that ratio's spread."""
    medians = {name: [quantile(r, 0.5) for r in rounds] for name, rounds in samples.items()}
    out = {}
    for name, rounds in samples.items():
        stats = Stats.of([x for r in rounds for x in r])
        if ref is not None and ref in samples:
            ref_stats = Stats.of([x for r in samples[ref] for x in r])
            per_round = [a / b for a, b in zip(medians[name], medians[ref]) if b]
            ratio = stats.median / ref_stats.median if ref_stats.median else float("nan")
            out[name] = Summary(stats, ratio, quantile(per_round, 0.1), quantile(per_round, 0.9), len(rounds))
        else:
            nan = float("nan")
            out[name] = Summary(stats, nan, nan, nan, len(rounds))
    return out


# ---------------------------------------------------------------- environment


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def git_commit(path: Path = HERE, use_env: bool = True) -> str:
    """``$BENCH_COMMIT`` (with ``use_env``), else the short commit of the checkout at ``path``
    (``-dirty`` with uncommitted changes to tracked files), else ``unknown`` (a copy without .git)."""
    if use_env and os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        rev = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_ENV: dict | None = None


def environment() -> dict:
    """date (UTC), commit, gpu, and the versions of torch, triton, peft, transformers."""
    global _ENV
    if _ENV is None:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        _ENV = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), "commit": git_commit(),
                "gpu": gpu, "torch": torch.__version__, "triton": _version("triton"), "peft": _version("peft"),
                "transformers": _version("transformers")}
    return dict(_ENV)


# ---------------------------------------------------------------- result files


def append_row(path: str | Path, fields: Sequence[str], row: dict) -> None:
    """Append ``row`` to the CSV at ``path`` under the columns ``fields`` (missing values empty).
    A new or empty file gets the header first. A file whose header lacks some of ``fields`` (an
    older column set) is rewritten once with its columns followed by the new ones, its rows kept."""
    unknown = set(row) - set(fields)
    if unknown:
        raise ValueError(f"{path}: columns not declared: {sorted(unknown)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header: list[str] = []
    if path.exists() and path.stat().st_size > 0:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
    if header and set(fields) - set(header):
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
        header = header + [c for c in fields if c not in header]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(old)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header or list(fields), restval="")
        if not header:
            w.writeheader()
        w.writerow(row)


def write_header(path: str | Path, fields: Sequence[str]) -> None:
    """Start ``path`` with the header alone (nothing if it exists)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(list(fields))


def results_path(driver: str, smoke: bool = False) -> Path:
    """Where ``driver``'s rows go: ``$BENCH_RESULTS/<driver>.csv``, else benchmarks/results/; a
    temporary folder for smoke runs and for runs under pytest (a test that starts a driver, as
    tests/integrations/test_fsdp.py starts fsdp.py, inherits ``PYTEST_CURRENT_TEST``)."""
    folder = os.environ.get("BENCH_RESULTS")
    if folder:
        return Path(folder) / f"{driver}.csv"
    if smoke or os.environ.get("PYTEST_CURRENT_TEST"):
        return Path(tempfile.gettempdir()) / "doracheck-bench-smoke" / f"{driver}.csv"
    return RESULTS / f"{driver}.csv"


class Results:
    """Rows of one driver: ``add(row)`` appends ``environment()`` + row to the driver's CSV."""

    def __init__(self, driver: str, fields: Sequence[str], path: str | Path | None = None, smoke: bool = False):
        self.fields = list(dict.fromkeys([*ENV_FIELDS, *MEASURE_FIELDS, *fields]))
        self.path = Path(path) if path else results_path(driver, smoke)
        self.rows: list[dict] = []

    def add(self, row: dict) -> dict:
        full = {**environment(), **row}
        append_row(self.path, self.fields, full)
        self.rows.append(full)
        return full


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


# ---------------------------------------------------------------- command line


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, on the CPU when no GPU (a check of the script, no figures)")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (smoke runs only)")
    ap.add_argument("--csv", help="append the rows here instead of benchmarks/results/<driver>.csv")


def resolve_device(args, name: str) -> str:
    """The device a driver runs on; exits with 2 when a measurement asks for a missing GPU."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() or not args.smoke else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{name}: needs a CUDA device (or --smoke for a check of the script on the CPU)", file=sys.stderr)
        raise SystemExit(2)
    args.device = device
    return device


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain text table of ``columns`` of ``rows`` (floats to 4 significant digits)."""

    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells]
    return "\n".join(lines)


def summary_line(rows: Sequence[dict], label: Callable[[dict], str]) -> str:
    """``summary: LABEL xRATIO (P10-P90), ...`` over the rows that have a ratio to a reference
    other than themselves (run_all.sh shows the last such line per step)."""
    parts = [f"{label(r)} x{r['ratio']:.3f} ({r['ratio_p10']:.3f}-{r['ratio_p90']:.3f})" for r in rows
             if isinstance(r.get("ratio"), float) and r["ratio"] == r["ratio"] and (r["ratio_p10"], r["ratio_p90"]) != (1.0, 1.0)]
    return "summary: " + ", ".join(parts)


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_profile(fn: Callable[[], object], path: str | Path, calls: int = 10, top: int = 40) -> None:
    """Where the host time of ``calls`` calls of ``fn`` goes, by Python function (cProfile: the
    ``top`` functions by own time, then by cumulative time), written to ``path``. For host-bound
    loops (eager decode, small-T steps) where a GPU trace shows only gaps between kernels."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    Path(path).write_text(f"{calls} calls\n{out.getvalue()}")


if __name__ == "__main__":
    if sys.argv[1:] == ["env"]:
        print(json.dumps(environment(), indent=1))
    else:
        print(__doc__)
