"""Where a DoRA layer's backward spends its host time inside autograd's engine (diagnostic).

host_breakdown.py found, on the H200 host, a forward + backward of one layer (4096², r 384,
T 16) costing about 1.06 ms more than its forward, while ``layer_backward`` called directly
took about 0.3 ms. This times, per call, the backward as the engine runs it and its parts
(``.backward()`` as the caller sees it, the Function's ``backward``, ``_restore``,
``layer_backward``), records which thread runs it, and times ``layer_backward`` called
directly on the main thread (grad mode on and off) and on a second Python thread.

    python benchmarks/backward_engine_probe.py [--d 4096 --r 384 --tokens 16 --n 200]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from row_csv import print_report

from doracheck import autograd as dora_autograd
from doracheck import backward as backward_pass
from doracheck import dispatch
from doracheck import forward as forward_pass
from doracheck.kernels import ops
from doracheck.layer_state import LayerArgs, Need

_totals: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_threads: dict[str, set] = defaultdict(set)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals[name] += time.perf_counter() - t0
            _calls[name] += 1
            _threads[name].add(threading.get_ident())

    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    dev, dt, d, r, T, s = torch.device(args.device), torch.bfloat16, args.d, args.r, args.tokens, 2.0
    gen = torch.Generator().manual_seed(0)
    W = (torch.randn(d, d, generator=gen) * d ** -0.5).to(dev, dt)
    A = (torch.randn(r, d, generator=gen) * d ** -0.5).to(dev, dt).requires_grad_()
    B = (torch.randn(d, r, generator=gen) * 0.02).to(dev, dt).requires_grad_()
    m = torch.ones(d, device=dev, dtype=dt).requires_grad_()
    x = torch.randn(1, T, d, generator=gen).to(dev, dt).requires_grad_()
    dy = torch.randn(1, T, d, generator=gen).to(dev, dt)

    fn_cls = dora_autograd.DoRAFromBaseFunction
    fn_cls.backward = staticmethod(timed("Function.backward", fn_cls.backward))
    dora_autograd._restore = timed("_restore", dora_autograd._restore)
    backward_pass.layer_backward = timed("layer_backward", backward_pass.layer_backward)
    forward_call = timed("forward (dora_from_base)", dora_autograd.dora_from_base)
    # the forward's parts, looked up by module attribute at call time
    fn_cls.forward = staticmethod(timed("  Function.forward", fn_cls.forward))
    forward_pass.from_base_forward = timed("  from_base_forward", forward_pass.from_base_forward)
    forward_pass.norm_and_scale = timed("    norm_and_scale", forward_pass.norm_and_scale)
    forward_pass.norm_cache.lookup_or_compute = timed("      lookup_or_compute", forward_pass.norm_cache.lookup_or_compute)
    forward_pass.norm_with_floor = timed("        norm_with_floor", forward_pass.norm_with_floor)
    dora_autograd._save = timed("  _save", dora_autograd._save)
    dispatch.backend_for = timed("  backend_for", dispatch.backend_for)
    for name in ("_setup", "_prescale", "_chunk", "_dm"):
        setattr(backward_pass, name, timed(f"  backward {name}", getattr(backward_pass, name)))
    ops.call = timed("ops.call (eager Triton ops, both passes)", ops.call)

    def step():
        y = forward_call(x, F.linear(x, W), W, A, B, m, None, s)
        t0 = time.perf_counter()
        y.backward(dy)
        _totals[".backward() as the caller sees it"] += time.perf_counter() - t0
        _calls[".backward() as the caller sees it"] += 1
        x.grad = A.grad = B.grad = m.grad = None

    def run(fn, n):
        for _ in range(20):
            fn()
        sync()
        _totals.clear(), _calls.clear(), _threads.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        wall = (time.perf_counter() - t0) / n * 1e6
        sync()
        return wall

    lines = [f"# backward_engine_probe.py, {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}; d {d}, r {r}, T {T}, bf16",
             f"main thread {threading.get_ident()}"]
    wall = run(step, args.n)
    lines.append(f"{'forward + backward, whole step':44s} {wall:9.1f} µs")
    for name in sorted(_totals):
        lines.append(f"{name:44s} {_totals[name] / _calls[name] * 1e6:9.1f} µs  ({_calls[name]} calls, threads {sorted(_threads[name])})")

    # layer_backward called directly, on the Saved of a forward without the Function
    backend = dispatch.backend_for(x, W, A, B, m)
    a = LayerArgs(W, A, B, m, None, s)
    x2 = x.detach().reshape(T, d)
    with torch.no_grad():
        _, saved = forward_pass.from_base_forward(F.linear(x2, W), x2, a, None, backend, need_saved=True)
    need, dy2 = Need(True, False, True, True, True, False), dy.reshape(T, d)

    def direct():
        backward_pass.layer_backward(saved, dy2, a, (1, T), need)

    def direct_no_grad():
        with torch.no_grad():
            direct()

    lines.append(f"{'layer_backward direct, grad mode on':44s} {run(direct, args.n):9.1f} µs")
    lines.append(f"{'layer_backward direct, no_grad':44s} {run(direct_no_grad, args.n):9.1f} µs")
    result = {}

    def on_thread():
        result["us"] = run(direct_no_grad, args.n)

    th = threading.Thread(target=on_thread)
    th.start()
    th.join()
    lines.append(f"{'layer_backward direct, no_grad, other thread':44s} {result['us']:9.1f} µs")
    small = torch.zeros(8, device=dev)

    def ten_adds():
        for _ in range(10):
            torch.add(small, 1.0)

    lines.append(f"{'10 torch.add on 8 floats, main thread':44s} {run(ten_adds, args.n):9.1f} µs")
    th = threading.Thread(target=lambda: result.update(us=run(ten_adds, args.n)))
    th.start()
    th.join()
    lines.append(f"{'10 torch.add on 8 floats, other thread':44s} {result['us']:9.1f} µs")
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
