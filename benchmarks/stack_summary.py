"""Summarise py-spy's raw (collapsed) stacks of ``host_sample_step.py``: where the host time goes.

Each line of py-spy's ``--format raw`` output is ``frame;frame;...;leaf count``, a frame being
``function (file:line)``. Samples taken while the model was built (imports, ``build``), while Triton compiled a
kernel or a norm graph was captured are left out. Prints the share of samples per function counted inclusively (once per sample, wherever it
is on the stack) for the functions whose file matches ``--files``, and the leaf lines (the line
each sample was executing: C calls such as a kernel launch count towards the Python line that
made them).

    python benchmarks/stack_summary.py stacks.txt [--files doracheck,kernels,peft] [--top 40]
        [--rate 250 --steps 45]

With the sampling rate and the number of steps the profile covered (warm-up included), each
line also gives ms of thread time a step (samples of all threads count, so shares of a whole
step's threads, not of its wall time).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# The model's construction, and one-off work of the first steps (Triton compiling a kernel,
# a norm graph's capture) that a long run amortises.
_SKIP = ("build (bench_model.py", "_find_and_load", "<module> (bench_model.py", "compile (triton/compiler/compiler.py",
         "_capture (kernels/norm_graphs.py")


def parse(lines):
    """[(frames, count)] of the stacks, those of the model's construction left out."""
    stacks = []
    for raw in lines:
        raw = raw.rstrip("\n")
        if not raw:
            continue
        body, _, count = raw.rpartition(" ")
        if not count.isdigit():  # a line py-spy cut short (it writes "Errors: N" when samples fail)
            continue
        frames = body.split(";")
        if any(any(s in f for s in _SKIP) for f in frames):
            continue
        stacks.append((frames, int(count)))
    return stacks


def _function(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['fn']} ({m['file']})"


def summarise(stacks, files: tuple[str, ...]) -> tuple[int, Counter, Counter]:
    """(total samples, inclusive samples per function of ``files``, samples per leaf line)."""
    total = 0
    inclusive: Counter = Counter()
    leaves: Counter = Counter()
    for frames, count in stacks:
        total += count
        seen = {_function(f) for f in frames if any(part in f for part in files)}
        for fn in seen:
            inclusive[fn] += count
        leaves[frames[-1]] += count
    return total, inclusive, leaves


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks")
    ap.add_argument("--files", default="doracheck/,kernels/,peft/,checkpoint.py,autograd/function.py")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--rate", type=float, help="py-spy's --rate (samples a second per thread)")
    ap.add_argument("--steps", type=int, help="steps the profile covered, warm-up included")
    args = ap.parse_args()
    with open(args.stacks) as f:
        stacks = parse(f)
    total, inclusive, leaves = summarise(stacks, tuple(args.files.split(",")))
    per_step = 1e3 / args.rate / args.steps if args.rate and args.steps else None
    print(f"{total} samples outside the model's construction"
          + (f", {total * per_step:.1f} ms of thread time a step" if per_step else ""))
    for title, counts in (("inclusive, by function", inclusive), ("leaf lines", leaves)):
        print(f"== {title}")
        for fn, n in counts.most_common(args.top):
            print(f"{100 * n / total:6.1f}%" + (f" {n * per_step:7.2f} ms" if per_step else "") + f"  {fn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
