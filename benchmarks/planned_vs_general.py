"""A training plan's call against the general path's, host µs, alternating in one process (diagnostic).

``host_breakdown.py`` on the H200 host of 2026-12-03 (twentieth session) timed the planned forward
(``PlannedFromBaseFunction``, what ``integrations.peft_train`` runs for a PEFT layer's repeat
training call) at 559 µs of host time against 272 µs for the general path's forward
(``dora_from_base``) on the same tensors, while on a CPU with the launches stubbed the planned one
is the faster. This times both, alternating, over ``--rounds`` rounds (forward alone and forward +
backward), with parameters as a PEFT model holds them (``nn.Parameter``, W frozen), then
cProfiles ``--n`` forwards of each by own time.

    python benchmarks/planned_vs_general.py [--d 4096 --r 384 --tokens 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F
from host_breakdown import host_us
from row_csv import print_report

from doracheck import dispatch
from doracheck.autograd import PlannedFromBaseFunction, dora_from_base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt, d, r, T, s = "cuda", torch.bfloat16, args.d, args.r, args.tokens, 2.0
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dt)

    W = torch.nn.Parameter(rand(d, d, scale=d ** -0.5), requires_grad=False)
    A = torch.nn.Parameter(rand(r, d, scale=d ** -0.5))
    B = torch.nn.Parameter(rand(d, r, scale=0.02))
    with torch.no_grad():
        m = torch.nn.Parameter(torch.linalg.vector_norm(W.float() + s * B.float() @ A.float(), dim=1).to(dt))
    x = rand(1, T, d).requires_grad_()
    dy = rand(1, T, d)
    backend = dispatch.backend_for(x, W, A, B, m)

    def general():
        return dora_from_base(x, F.linear(x, W), W, A, B, m, None, s)

    def planned():
        return PlannedFromBaseFunction.apply(F.linear(x, W), x, W, A, B, m, None, s, backend)

    def step(fwd):
        def run():
            fwd().backward(dy)
            x.grad = A.grad = B.grad = m.grad = None
        return run

    lines = [f"# planned_vs_general.py, {torch.cuda.get_device_name()}, torch {torch.__version__}; d {d}, r {r}, T {T}, "
             f"bf16; host µs per call, median of 5 batches of {args.n}, rows alternating"]
    for i in range(args.rounds):
        for name, fn in (("general forward", general), ("planned forward", planned),
                         ("general forward + backward", step(general)), ("planned forward + backward", step(planned))):
            lines.append(f"round {i} {name:28s} {host_us(fn, args.n, torch.cuda.synchronize):8.1f}")
            print(lines[-1], flush=True)
    for name, fn in (("general forward", general), ("planned forward", planned)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(4 * args.n):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        lines.append(f"== cProfile, {4 * args.n} calls of the {name}, by own time")
        lines.append(text.getvalue())
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
