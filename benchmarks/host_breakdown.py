"""Host µs per call of each part of one DoRA layer's training forward and backward (diagnostic).

The model step is host-bound (issue 17): this times, without synchronising inside the timed
loop, the host cost of the whole PEFT-style call (``dora_from_base``: forward, forward +
backward, inference) and of each piece it is made of (the norm and its graph replay, each
Triton launch, each torch op, the Python checks), at a token count small enough that the GPU
never holds the host back. Then a cProfile of the forward + backward, by own time. Shares
matter, not the third digit: figures move ±30% between the lent hosts.

    python benchmarks/host_breakdown.py [--d-in 4096 --d-out 4096 --r 384 --tokens 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from row_csv import print_report

from doracheck import autograd as dora_autograd
from doracheck import backward as backward_pass
from doracheck import dispatch, norm_cache, numerics
from doracheck import forward as forward_pass
from doracheck.autograd import PlannedFromBaseFunction
from doracheck.kernels import norm_graphs, ops
from doracheck.kernels.compose_torch import magnitude_scale
from doracheck.kernels.compose_triton import grad_scale_dm_triton, lora_up_compose_triton
from doracheck.kernels.norm_triton import gram_triton
from doracheck.kernels.tracing import tracing
from doracheck.layer_state import LayerArgs, Need


def host_us(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> float:
    """Median over 5 batches of ``n`` calls of the host time per call (µs); the device is
    drained between batches, never inside one."""
    for _ in range(10):
        fn()
    sync()
    per_batch = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_batch.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return sorted(per_batch)[2]


def cprofile_text(fn: Callable[[], object], calls: int, sync: Callable[[], None], sort: str, limit: int) -> str:
    """cProfile's table of ``calls`` calls of ``fn`` (the device drained at the end), sorted by ``sort``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(limit)
    return text.getvalue()


def profiler_table(fn: Callable[[], object], calls: int, sync: Callable[[], None], sort_by: str, rows: int) -> str:
    """torch.profiler's table (CPU and CUDA) of ``calls`` calls of ``fn``, sorted by ``sort_by``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as torch_prof:
        for _ in range(calls):
            fn()
        sync()
    return torch_prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)


class _DirtyIdentity(torch.autograd.Function):
    """An autograd Function that rewrites its first input in place (``mark_dirty``), as the
    from-base Functions do with ``result``, saving two tensors: the machinery's cost alone."""

    @staticmethod
    def forward(ctx, result, x):
        ctx.save_for_backward(x, None)
        ctx.mark_dirty(result)
        return result

    @staticmethod
    def backward(ctx, dy):
        return None, dy[..., : ctx.saved_tensors[0].shape[-1]]


class _Identity(torch.autograd.Function):
    """The cheapest autograd Function: what ``apply`` alone costs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-in", type=int, default=4096)
    ap.add_argument("--d-out", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=50, help="calls per timed batch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt = torch.device(args.device), torch.bfloat16
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    d_in, d_out, r, T = args.d_in, args.d_out, args.r, args.tokens
    W = rand(d_out, d_in, scale=d_in ** -0.5)
    A = rand(r, d_in, scale=d_in ** -0.5).requires_grad_()
    B = rand(d_out, r, scale=0.02).requires_grad_()
    s = 2.0
    with torch.no_grad():
        m = torch.linalg.vector_norm((W.float() + s * B.float() @ A.float()), dim=1).to(dt).requires_grad_()
    x = rand(1, T, d_in).requires_grad_()
    dy = rand(1, T, d_out)
    backend = dispatch.backend_for(x, W, A, B, m)
    a = LayerArgs(W, A, B, m, None, s)
    x2 = x.detach().reshape(T, d_in)
    r2 = F.linear(x2, W)
    g = torch.ones(d_out, device=dev)
    n = torch.ones(d_out, device=dev)
    xa = x2 @ A.detach().t()
    G = torch.empty(r, r, device=dev)
    dy2 = dy.reshape(T, d_out)

    x_frozen = x.detach()

    def lora_step():  # the PEFT LoRA layer's work: base + s·(x·Aᵀ)·Bᵀ, forward and backward
        (F.linear(x, W) + F.linear(F.linear(x, A), B) * s).backward(dy)
        x.grad = A.grad = B.grad = None

    def train_forward():
        return dora_autograd.dora_from_base(x, F.linear(x, W), W, A, B, m, None, s)

    def train_step():
        train_forward().backward(dy)
        x.grad = A.grad = B.grad = m.grad = None

    def planned_forward():  # what a training plan runs (doracheck.integrations.peft_train)
        return PlannedFromBaseFunction.apply(F.linear(x, W), x, W, A, B, m, None, s, backend)

    def planned_step():
        planned_forward().backward(dy)
        x.grad = A.grad = B.grad = m.grad = None

    def train_step_frozen_x():  # no dx wanted (the first layer of a model)
        dora_autograd.dora_from_base(x_frozen, F.linear(x_frozen, W), W, A, B, m, None, s).backward(dy)
        A.grad = B.grad = m.grad = None

    def grad_only():  # torch.autograd.grad instead of .backward (no AccumulateGrad)
        return torch.autograd.grad(train_forward(), (x, A, B, m), dy)

    def infer():
        with torch.no_grad():
            return dora_autograd.dora_from_base(x, F.linear(x, W), W, A, B, m, None, s)

    def saved_forward():
        with torch.no_grad():
            return forward_pass.from_base_forward(F.linear(x2, W), x2, a, None, backend, need_saved=True)

    _, saved = saved_forward()
    need = Need(True, False, True, True, True, False)

    def _graph_entry(rows_out: int):
        """The norm graph whose static output has ``rows_out`` rows (made by the rows above it)."""
        return next(e for e in norm_graphs._graphs.values() if e[1].shape[0] == rows_out)

    def _graph_of(rows_out: int):
        return _graph_entry(rows_out)[0]

    def _graph_output(rows_out: int):
        return _graph_entry(rows_out)[1]

    def the_numerics():
        with numerics.our_numerics(dev.type):
            pass

    rows: list[tuple[str, Callable[[], object]]] = [
        ("F.linear(x, W) alone", lambda: F.linear(x2, W)),
        ("training forward (dora_from_base, recorded)", train_forward),
        ("training forward + backward", train_step),
        ("  the same, x frozen (no dx)", train_step_frozen_x),
        ("planned forward (PlannedFromBaseFunction, a plan's call)", planned_forward),
        ("planned forward + backward", planned_step),
        ("F.linear(x, W), x requiring grad (recorded)", lambda: F.linear(x, W)),
        ("Function apply, mark_dirty + save (no work)", lambda: _DirtyIdentity.apply(F.linear(x, W), x)),
        ("  the same, torch.autograd.grad", grad_only),
        ("LoRA-style layer forward + backward", lora_step),
        ("inference forward (no_grad)", infer),
        ("from_base_forward, need_saved (no Function)", saved_forward),
        ("layer_backward (no engine)", lambda: backward_pass.layer_backward(saved, dy2, a, (1, T), need)),
        ("autograd.Function apply, identity", lambda: _Identity.apply(x)),
        ("norm_and_scale (recording)", lambda: forward_pass.norm_and_scale(backend, a, need_g=True, recording=True)),
        ("backend.factored_norm", lambda: backend.factored_norm(W, A, B, s, False)),
        ("backend.scaled_norm (training: replay, clone, unbind)", lambda: backend.scaled_norm(W, A, B, m.detach(), s, False)),
        ("  its graph.replay() alone", lambda: _graph_of(6).replay()),
        ("  clone of its (6, d_out) output", lambda: _graph_output(6).clone()),
        ("  unbind(0) of a (6, d_out) tensor", lambda: _graph_output(6).unbind(0)),
        ("factored norm, eager launches (no graph)", lambda: ops._factored_norm(W, A, B, s, False)),
        ("gram_triton(out=G)", lambda: gram_triton(A.detach(), out=G)),
        ("norm_graphs key", lambda: norm_graphs._key(W, A, B, s, False)),
        ("norm_cache.lookup_or_compute, trivial compute", lambda: norm_cache.lookup_or_compute(
            W, A, B, s, False, lambda: (None, None), recording=True, tag="probe")),
        ("magnitude_scale(m, n_safe)", lambda: magnitude_scale(m.detach(), n)),
        ("torch.clamp_min(n, eps)", lambda: torch.clamp_min(n, 1e-12)),
        ("x2 @ A.t()", lambda: x2 @ A.detach().t()),
        ("compose launch, in place", lambda: lora_up_compose_triton(r2, xa, B.detach(), g, s, out=r2)),
        ("grad_scale_dm launch", lambda: grad_scale_dm_triton(dy2, r2, g, n, None, from_output=True, final_dm=True)),
        ("torch.empty_like(dy2)", lambda: torch.empty_like(dy2)),
        ("our_numerics enter + exit", the_numerics),
        ("dispatch.backend_for (6 tensors)", lambda: dispatch.backend_for(x, W, A, B, m, None)),
        ("tracing()", tracing),
        ("norm_cache.fsdp_active()", norm_cache.fsdp_active),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing if cuda else (lambda: None)),
    ]
    if not cuda:  # the interpreter: a few of each, it is slow
        args.n = 2
    lines = []
    env = f"torch {torch.__version__}"
    try:
        import triton
        env += f", triton {triton.__version__}"
    except ImportError:
        pass
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    lines.append(f"# host_breakdown.py, {gpu}, {env}; d_in {d_in}, d_out {d_out}, r {r}, T {T}, bf16; "
                 f"host µs per call, median of 5 batches of {args.n}")
    for name, fn in rows:
        lines.append(f"{name:48s} {host_us(fn, args.n, sync):9.1f}")
        print(lines[-1], flush=True)
    lines.append(f"norm graphs: {norm_graphs.stats()}")
    if cuda:  # where the forward + backward's host time goes, op by op (autograd nodes included)
        lines.append(f"== torch.profiler over {args.n} planned forward + backward calls, by self CPU")
        lines.append(profiler_table(planned_step, args.n, sync, "self_cpu_time_total", 40))
    lines.append(f"== cProfile of {4 * args.n} planned forward + backward calls, by own time")
    lines.append(cprofile_text(planned_step, 4 * args.n, sync, "tottime", 35))
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
