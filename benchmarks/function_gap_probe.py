"""Why a layer costs more host time inside its autograd Function than called directly (diagnostic).

host_breakdown.py (H200 hosts) put the recorded training forward (``dora_from_base``) at
656 µs and the same ``from_base_forward`` called directly under no_grad at 271 µs; the backward
through the engine at about 1060 µs against 279 µs for ``layer_backward`` alone. This times
the steps between the two, one difference at a time, then cProfiles the two ends by
cumulative time, so the gap is located before anything is changed.

    python benchmarks/function_gap_probe.py [--d-in 4096 --d-out 4096 --r 384 --tokens 16] [--out FILE]
    TRITON_INTERPRET=1 DORACHECK_PATH=triton python benchmarks/function_gap_probe.py --device cpu --d-in 32 --d-out 48 --r 8
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from host_breakdown import cprofile_text, host_us, profiler_table
from row_csv import print_report

from doracheck import autograd as dora_autograd
from doracheck import backward as backward_pass
from doracheck import dispatch, numerics
from doracheck import forward as forward_pass
from doracheck.layer_state import LayerArgs, Need


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-in", type=int, default=4096)
    ap.add_argument("--d-out", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt = torch.device(args.device), torch.bfloat16
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dt)

    d_in, d_out, r, T, s = args.d_in, args.d_out, args.r, args.tokens, 2.0
    W = rand(d_out, d_in, scale=d_in ** -0.5)
    A = rand(r, d_in, scale=d_in ** -0.5).requires_grad_()
    B = rand(d_out, r, scale=0.02).requires_grad_()
    m = (1.0 + 0.01 * rand(d_out)).requires_grad_()
    x = rand(1, T, d_in).requires_grad_()
    x_frozen = x.detach()
    dy = rand(1, T, d_out)
    a = LayerArgs(W, A, B, m, None, s)
    a_plain = LayerArgs(W, A.detach(), B.detach(), m.detach(), None, s)
    backend = dispatch.backend_for(x, W, A, B, m)
    need = Need(True, False, True, True, True, False)

    def direct(args_, xx):
        with torch.no_grad():
            x2 = xx.detach().reshape(T, d_in)
            return forward_pass.from_base_forward(F.linear(x2, W), x2, args_, None, backend, need_saved=True)

    def in_function_context(xx):  # what DoRAFromBaseFunction.forward adds around it
        with torch.no_grad(), numerics.our_numerics(dev.type):
            b = dispatch.backend_for(xx, W, A, B, m)
            x2 = xx.detach().reshape(T, d_in)
            return forward_pass.from_base_forward(F.linear(x2, W), x2, a, None, b, need_saved=True)

    def recorded(xx):
        return dora_autograd.dora_from_base(xx, F.linear(xx, W), W, A, B, m, None, s)

    def not_recorded_apply(xx):
        with torch.no_grad():
            return dora_autograd.DoRAFromBaseFunction.apply(F.linear(xx, W), xx, W, A, B, m, None, s, False)

    _, saved = direct(a, x)
    dy2 = dy.reshape(T, d_out)

    def step(xx):
        recorded(xx).backward(dy)
        A.grad = B.grad = m.grad = None
        if xx.requires_grad:
            xx.grad = None

    rows: list[tuple[str, Callable[[], object]]] = [
        ("F.linear(x, W)", lambda: F.linear(x_frozen, W)),
        ("forward direct, params detached", lambda: direct(a_plain, x)),
        ("forward direct, params requiring grad", lambda: direct(a, x)),
        ("forward with the Function's context (numerics)", lambda: in_function_context(x)),
        ("Function.apply under no_grad", lambda: not_recorded_apply(x)),
        ("recorded forward, x frozen", lambda: recorded(x_frozen)),
        ("recorded forward, x requiring grad", lambda: recorded(x)),
        ("layer_backward alone", lambda: backward_pass.layer_backward(saved, dy2, a, (1, T), need)),
        ("layer_backward under our_numerics", lambda: _numerics_backward(dev.type, saved, dy2, a, T, need)),
        ("forward + backward, x frozen", lambda: step(x_frozen)),
        ("forward + backward, x requiring grad", lambda: step(x)),
    ]
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    if not cuda:
        args.n = 2
    lines = [f"# function_gap_probe.py, {gpu}, torch {torch.__version__}; d_in {d_in}, d_out {d_out}, r {r}, T {T}, bf16, "
             f"backend {backend.name}; host µs per call, median of 5 batches of {args.n}"]
    for name, fn in rows:
        lines.append(f"{name:52s} {host_us(fn, args.n, sync):9.1f}")
        print(lines[-1], flush=True)
    if cuda:  # host and GPU time side by side: a row whose GPU time is its host time is GPU-bound
        from layer_graph_probe import host_and_gpu_us

        def single_thread_step():  # the backward on this thread: no hand-over to autograd's device thread
            with torch.autograd.set_multithreading_enabled(False):
                step(x)

        for name, fn in (("forward + backward, backward on the calling thread", single_thread_step),
                         ("recorded forward, x requiring grad", lambda: recorded(x)),
                         ("layer_backward alone", lambda: backward_pass.layer_backward(saved, dy2, a, (1, T), need)),
                         ("forward + backward, x requiring grad", lambda: step(x))):
            host, gpu_time = host_and_gpu_us(fn, args.n, True)
            lines.append(f"{name:52s} host {host:9.1f}  GPU {gpu_time:9.1f}")
            print(lines[-1], flush=True)
        lines.append(f"== torch.profiler over {args.n} forward + backward calls, by self CUDA time")
        lines.append(profiler_table(lambda: step(x), args.n, sync, "self_cuda_time_total", 25))
    # The same with the cuBLAS flags left as they are (numerics' switch made a no-op): what switching costs.
    enter, leave = numerics._flags_enter, numerics._flags_exit
    numerics._flags_enter = numerics._flags_exit = lambda: None
    for name, fn in (("forward + backward, x requiring grad, flags not switched", lambda: step(x)),
                     ("layer_backward under our_numerics, flags not switched",
                      lambda: _numerics_backward(dev.type, saved, dy2, a, T, need))):
        lines.append(f"{name:52s} {host_us(fn, args.n, sync):9.1f}")
        print(lines[-1], flush=True)
    numerics._flags_enter, numerics._flags_exit = enter, leave
    for name, fn in (("recorded forward + backward, x requiring grad", lambda: step(x)),
                     ("forward direct + layer_backward alone", lambda: _direct_both(direct, a, x, dy2, T, need))):
        lines.append(f"== cProfile of {4 * args.n} calls of: {name}, by cumulative time")
        lines.append(cprofile_text(fn, 4 * args.n, sync, "cumulative", 45))
    print_report(lines, args.out)
    return 0


def _numerics_backward(device_type, saved, dy2, a, T, need):
    with numerics.our_numerics(device_type):
        return backward_pass.layer_backward(saved, dy2, a, (1, T), need)


def _direct_both(direct, a, x, dy2, T, need):
    _, saved = direct(a, x)
    return backward_pass.layer_backward(saved, dy2, a, (1, T), need)


if __name__ == "__main__":
    raise SystemExit(main())
