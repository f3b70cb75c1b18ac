"""Measuring the layer, above it: the planner's candidates timed side by side, and ``doracheck bench``'s
rows (docs/design.md section 5). Timed planning calls ``measure_variants`` (``planner.plan`` imports it
when first needed). Times follow ``doracheck.timing``: warm-up, then CUDA events (the host clock on a CPU),
medians over samples of back-to-back calls; ``measure_variant_spread`` adds the 10th and 90th percentiles."""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import planner
from .functional import dora_linear
from .planner import Variant, use_variant
from .safe_files import install, temp_beside
from .timing import quantile, time_interleaved

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class Spread(NamedTuple):
    """ms per call over the samples: 10th percentile, median, 90th percentile."""

    p10: float
    median: float
    p90: float


def measure_variants(variants: list[Variant], d_in: int, d_out: int, r: int, tokens: int, dtype: torch.dtype,
                     training: bool, device: torch.device | str = "cuda", rounds: int = 15, *, dropout: bool = False,
                     detach_norm: bool = True, with_linear: bool = False) -> dict[str, float]:
    """Median ms of one ``dora_linear`` call per variant, side by side (``timing.time_interleaved``) on one
    set of random non-zero inputs, norm cache warm as in a step. ``training``: forward and backward, all
    inputs but W requiring grad; ``dropout``: p = 0.1, training mode; ``with_linear``: "nn.Linear" too."""
    spread = measure_variant_spread(variants, d_in, d_out, r, tokens, dtype, training, device, rounds, dropout=dropout,
                                    detach_norm=detach_norm, with_linear=with_linear)
    return {name: s.median for name, s in spread.items()}


def measure_variant_spread(variants: list[Variant], d_in: int, d_out: int, r: int, tokens: int, dtype: torch.dtype,
                           training: bool, device: torch.device | str = "cuda", rounds: int = 15, *,
                           dropout: bool = False, detach_norm: bool = True,
                           with_linear: bool = False) -> dict[str, Spread]:
    """``measure_variants``' measurement with the spread of its ``rounds`` samples: {name:
    Spread(p10, median, p90)} in ms per call (quantiles interpolated between sorted samples)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    W = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(dev, dtype)
    A = (torch.randn(r, d_in, generator=gen) / d_in**0.5).to(dev, dtype).requires_grad_(training)
    B = (torch.randn(d_out, r, generator=gen) * 0.02).to(dev, dtype).requires_grad_(training)
    m = (1 + 0.01 * torch.randn(d_out, generator=gen)).to(dev, dtype).requires_grad_(training)
    x = torch.randn(tokens, d_in, generator=gen).to(dev, dtype).requires_grad_(training)
    dy = torch.randn(tokens, d_out, generator=gen).to(dev, dtype)
    p = 0.1 if dropout else 0.0

    def under(v: Variant) -> Callable[[], None]:
        def call() -> None:
            with use_variant(v):
                if training:
                    dora_linear(x, W, A, B, m, 2.0, dropout_p=p, training=dropout,
                                         detach_norm=detach_norm).backward(dy)
                    for t in (x, A, B, m):
                        t.grad = None
                else:
                    with torch.no_grad():
                        dora_linear(x, W, A, B, m, 2.0, dropout_p=p, training=dropout, detach_norm=detach_norm)
        return call

    def linear() -> None:
        if training:
            torch.nn.functional.linear(x, W).backward(dy)
            x.grad = None
        else:
            with torch.no_grad():
                torch.nn.functional.linear(x, W)

    fns = {v.name: under(v) for v in variants}
    if with_linear:
        fns["nn.Linear"] = linear
    with torch.enable_grad():  # also when planning from inside a forward (autograd Functions run without grad)
        times = time_interleaved(fns, dev, rounds)
    return {name: Spread(quantile(t, 0.1), quantile(t, 0.5), quantile(t, 0.9)) for name, t in times.items()}


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str | None]:
    """doracheck's, torch's and triton's versions (None: not installed), for the rows of a bench."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    from doracheck import __version__
    return {"doracheck": __version__, "torch": torch.__version__, "triton": of("triton")}


def bench_row(device: torch.device, device_name: str, d_in: int, d_out: int, r: int, T: int, dt: torch.dtype, mode: str,
              reps: int, *, with_plan: bool = False, timed: bool = False) -> dict:
    """One row of ``doracheck bench``: nn.Linear and doracheck (the planner's variant on a GPU,
    else the default), or with ``with_plan`` every candidate predicted against measured, the cost
    model's pick and the fastest; ``timed`` adds the timing mode's own pick (times: ``*_ms``)."""
    training = mode == "train"
    row: dict[str, Any] = {"device": device_name, **versions(), "d_in": d_in, "d_out": d_out, "r": r, "tokens": T,
                           "dtype": DTYPE_NAMES[dt], "mode": mode, "reps": reps}
    if not with_plan:
        v = planner.plan(d_in, d_out, r, T, dt, training).variant if device.type == "cuda" else planner.DEFAULT
        spread = measure_variant_spread([v], d_in, d_out, r, T, dt, training, device, reps, with_linear=True)
        lin, dora = spread["nn.Linear"], spread[v.name]
        row.update(variant=v.name, linear_ms=lin.median, linear_p10_ms=lin.p10, linear_p90_ms=lin.p90,
                   doracheck_ms=dora.median, doracheck_p10_ms=dora.p10, doracheck_p90_ms=dora.p90,
                   ratio_to_linear=dora.median / lin.median)
        return row
    p = planner.plan(d_in, d_out, r, T, dt, training)
    spread = measure_variant_spread(p.candidates, d_in, d_out, r, T, dt, training, device, reps, with_linear=True)
    lin = spread.pop("nn.Linear")
    measured = {k: s.median for k, s in spread.items()}
    fastest = min(measured, key=lambda k: measured[k])
    row.update(linear_ms=lin.median, linear_p10_ms=lin.p10, linear_p90_ms=lin.p90, chosen=p.variant.name,
               fastest=fastest, predicted_ms=p.predicted_ms, measured_ms=measured,
               measured_p10_ms={k: s.p10 for k, s in spread.items()}, measured_p90_ms={k: s.p90 for k, s in spread.items()},
               chosen_over_fastest=measured[p.variant.name] / measured[fastest])
    if timed:
        t = planner.plan(d_in, d_out, r, T, dt, training, timed=True, device=device, refresh=True,
                         measure=functools.partial(measure_variants, rounds=reps))
        row.update(timed_chosen=t.variant.name, timed_chosen_over_fastest=measured[t.variant.name] / measured[fastest])
    return row


def plan_summary(rows: list[dict], timed: bool) -> dict:
    """How often the planner's pick is within 5% of the fastest measured (``bench --plan``)."""
    within = sum(1 for row in rows if row["chosen_over_fastest"] <= 1.05)
    choice_rows = [row for row in rows if len(row["measured_ms"]) > 1]
    summary = {"rows": len(rows), "chosen_within_5pct_of_fastest": within, "fraction": within / max(1, len(rows)),
               "rows_with_a_choice": len(choice_rows),
               "chosen_within_5pct_where_a_choice": sum(1 for row in choice_rows if row["chosen_over_fastest"] <= 1.05)}
    if timed:
        summary["timed_within_5pct_of_fastest"] = sum(1 for row in rows if row["timed_chosen_over_fastest"] <= 1.05)
    return summary


class CsvRows:
    """Rows written to a CSV file as they come (a run cut short keeps them); dict cells as JSON, a missing
    value empty, the header the first row's keys. An existing file is untouched until a row exists: header
    and first row go to a temporary file beside it, which then replaces ``path``; later rows are appended;
    a run measuring nothing removes only its temporary file. An existing non-regular ``path`` (a folder,
    /dev/null) is refused. Opening and writing raise OSError (the caller reports); ``close()`` cleans up."""

    def __init__(self, path: str) -> None:
        import errno
        import os
        self.path = os.path.realpath(path)  # a symlink keeps pointing at the file it names
        self.rows = 0
        if os.path.lexists(self.path) and not os.path.isfile(self.path):
            what = "is a folder" if os.path.isdir(self.path) else "exists and is not a regular file"
            raise OSError(errno.EEXIST, f"{what}; give the name of a new or regular file")
        fd, tmp = temp_beside(self.path)
        self._tmp: str | None = tmp
        self._file = os.fdopen(fd, "w", newline="")
        self._writer: csv.DictWriter | None = None

    def write(self, row: dict) -> None:
        flat = {k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in row.items()}
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(flat))
            self._writer.writeheader()
        self._writer.writerow(flat)
        self._file.flush()
        self.rows += 1
        if self._tmp is not None:  # the first row: the file now holds something worth keeping
            self._file.close()
            self._replace()
            self._file = open(self.path, "a", newline="")  # noqa: SIM115 (closed by close())
            self._writer = csv.DictWriter(self._file, fieldnames=list(flat))

    def _replace(self) -> None:
        tmp, self._tmp = str(self._tmp), None
        install(tmp, self.path)

    def close(self) -> None:
        import os
        self._file.close()
        if self._tmp is not None:  # no row was written: FILE stays as it was
            tmp, self._tmp = self._tmp, None
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass


__all__ = ["CsvRows", "Spread", "bench_row", "measure_variant_spread", "measure_variants", "plan_summary", "versions"]
