"""What one CUDA graph per layer pass would save: a diagnostic for the next host-time step.

The eager training step is host-bound (issue 17; README "Misses, and why"): a layer's forward
costs 0.5-0.8 ms of host time and its backward about 1 ms on the lent H200 hosts, for GPU work
that is mostly shorter. This measures the bound a whole-pass graph could reach before anyone
builds one: the PEFT-path training forward (``from_base_forward``: norm, g, x·Aᵀ, compose) and
``layer_backward`` are each captured once with fixed tensors and replayed, against the same
calls made eagerly, for host µs per call (no synchronisation inside a batch), GPU µs per call
(CUDA events over a batch) and a bitwise comparison of every output. A library version would
key the graphs by every tensor's address as the norm graphs do and allocate its outputs
outside them; the probe ignores that bookkeeping (a few µs).

    python benchmarks/layer_graph_probe.py [--d-in 4096 --d-out 4096 --r 384 --tokens 16,4096]
    TRITON_INTERPRET=1 DORACHECK_PATH=triton python benchmarks/layer_graph_probe.py --device cpu \
        --d-in 32 --d-out 48 --r 8 --tokens 16        # the eager half only, to check the script
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from row_csv import print_report

from doracheck import backward as backward_pass
from doracheck import dispatch
from doracheck import forward as forward_pass
from doracheck.layer_state import LayerArgs, Need
from doracheck.numerics import our_numerics


def host_and_gpu_us(fn: Callable[[], object], n: int, cuda: bool) -> tuple[float, float]:
    """(host µs per call, median of 5 batches; GPU µs per call over the batches, from events)."""
    for _ in range(5):
        fn()
    if cuda:
        torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host.append((time.perf_counter() - t0) / n * 1e6)
        if end is not None:
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3 / n)
    return sorted(host)[2], (sorted(gpu)[2] if gpu else float("nan"))


def captured(fn: Callable[[], object]):
    """(graph, fn's outputs as captured): warmed up on a side stream, then captured there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def flat(obj) -> list:
    """Every tensor in a (nested) result, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in flat(item)]
    return []


def same(a, b) -> bool:
    ta, tb = flat(a), flat(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-in", type=int, default=4096)
    ap.add_argument("--d-out", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", default="16,4096")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt, s = torch.device(args.device), torch.bfloat16, 2.0
    cuda = dev.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    d_in, d_out, r = args.d_in, args.d_out, args.r
    W = (torch.randn(d_out, d_in, generator=gen) * d_in ** -0.5).to(dev, dt)
    A = (torch.randn(r, d_in, generator=gen) * d_in ** -0.5).to(dev, dt)
    B = (torch.randn(d_out, r, generator=gen) * 0.02).to(dev, dt)
    m = (1.0 + 0.01 * torch.randn(d_out, generator=gen)).to(dev, dt)
    a = LayerArgs(W, A, B, m, None, s)
    backend = dispatch.backend_for(W, A, B, m)
    lines = [f"# layer_graph_probe.py, {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}; "
             f"d_in {d_in}, d_out {d_out}, r {r}, bf16, backend {backend.name}; host µs / GPU µs per call",
             f"{'T':>6s} {'pass':9s} {'eager host':>11s} {'eager GPU':>10s} {'graph host':>11s} {'graph GPU':>10s}  bitwise"]
    for T in (int(t) for t in args.tokens.split(",")):
        x2 = torch.randn(T, d_in, generator=gen).to(dev, dt)
        dy2 = torch.randn(T, d_out, generator=gen).to(dev, dt)
        base = F.linear(x2, W)
        r2 = torch.empty_like(base)
        need = Need(True, False, True, True, True, False)

        def forward():
            r2.copy_(base)  # the base output the forward rewrites in place, fresh each call
            with torch.no_grad(), our_numerics(dev.type):
                return forward_pass.from_base_forward(r2, x2, a, None, backend, need_saved=True)

        y_ref, saved = forward()
        y_ref = y_ref.clone()
        saved_ref = [t.clone() for t in flat(saved)]

        def backward():
            with torch.no_grad(), our_numerics(dev.type):
                return backward_pass.layer_backward(saved, dy2, a, (T,), need)

        grads_ref = [t.clone() for t in flat(backward())]
        for name, fn, ref in (("forward", forward, [y_ref, *saved_ref]), ("backward", backward, grads_ref)):
            eager_host, eager_gpu = host_and_gpu_us(fn, args.n, cuda)
            row = f"{T:6d} {name:9s} {eager_host:11.1f} {eager_gpu:10.1f}"
            if cuda:
                graph, out = captured(fn)
                graph.replay()
                torch.cuda.synchronize()
                got = [r2, *flat(out[1])] if name == "forward" else flat(out)
                graph_host, graph_gpu = host_and_gpu_us(graph.replay, args.n, cuda)
                row += f" {graph_host:11.1f} {graph_gpu:10.1f}  {same(got, ref)}"
            lines.append(row)
            print(row, flush=True)
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
