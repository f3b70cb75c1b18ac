"""A fingerprint of the layer: y and every gradient over a grid of configurations, recorded to a
file, and two recordings compared bitwise. Run it before and after a change that should not
change a single bit (a refactor): both recordings on the same machine, path and versions.

    python benchmarks/layer_fingerprint.py record before.pt --path torch [--device cuda]
    TRITON_INTERPRET=1 python benchmarks/layer_fingerprint.py record before.pt --path triton
    python benchmarks/layer_fingerprint.py compare before.pt after.pt     # exit 1 on any difference

The grid: dora_linear in fp32/bf16/fp16 (fp64 on the torch path) with and without bias,
dropout (a fixed keep-mask), the exact norm gradient, every planner variant, a token-chunked
backward (chunks forced small) and a zero magnitude entry; dora_from_base (the PEFT path)
with one and two adapters, bias, dropout and a zero magnitude entry, each with its no-grad
forward; and on the torch path mixed precisions (fp64 magnitude, fp64 x, bf16 weights). NaN equals NaN; a dtype or shape change is a difference.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

import doracheck
from doracheck import planner
from doracheck.autograd import dora_from_base
from doracheck.dispatch import use_path
from doracheck.kernels import settings
from doracheck.norm_cache import clear_norm_cache


def _problem(dev: str, dt: torch.dtype, *, bias: bool, zero_m: bool = False, seed: int = 0,
             d_in: int = 24, d_out: int = 20, r: int = 4, T: int = 14):
    """(x, W, A, B, m, b, dy, keep) on ``dev``, random and non-zero (m[3] = 0 with ``zero_m``)."""
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(dt)
    A = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(dt)
    B = (torch.randn(d_out, r, generator=g) * 0.3).to(dt)
    m = (W.float().norm(dim=1) * (1 + 0.1 * torch.randn(d_out, generator=g))).to(dt)
    if zero_m:
        m[3] = 0
    b = (torch.randn(d_out, generator=g) * 0.5).to(dt) if bias else None
    x = torch.randn(2, T // 2, d_in, generator=g).to(dt)
    dy = torch.randn(2, T // 2, d_out, generator=g).to(dt)
    keep = torch.rand(2, T // 2, d_in, generator=g) > 0.2
    leaf = lambda t: None if t is None else t.to(dev).requires_grad_()  # noqa: E731
    return leaf(x), W.to(dev), leaf(A), leaf(B), leaf(m), leaf(b), dy.to(dev), keep.to(dev)


def _grads(tensors) -> list:
    return [None if t is None or t.grad is None else t.grad.clone() for t in tensors]


def _linear_cases(path: str, dev: str, out: dict) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16] + ([torch.float64] if path == "torch" else [])
    variants = ["factored", "factored+whole", "factored+recompute_xa", "merged"]
    flags = [False, True]
    for dt, bias, drop, det, var, chunk, zero_m in itertools.product(dtypes, flags, flags, flags, variants, flags, flags):
        x, W, A, B, m, b, dy, keep = _problem(dev, dt, bias=bias, zero_m=zero_m)
        old = settings.BACKWARD_CHUNK_BYTES
        if chunk:  # chunks of 5 tokens
            settings.BACKWARD_CHUNK_BYTES = 5 * W.shape[0] * x.element_size()
        clear_norm_cache()
        try:
            with planner.use_variant(var):
                y = doracheck.dora_linear(x, W, A, B, m, 1.7, b, dropout_p=0.2 if drop else 0.0, training=drop,
                                          detach_norm=not det, dropout_mask=keep if drop else None)
                y.backward(dy)
                with torch.no_grad():
                    y_infer = doracheck.dora_linear(x, W, A, B, m, 1.7, b, detach_norm=not det)
        finally:
            settings.BACKWARD_CHUNK_BYTES = old
        out[("linear", str(dt), bias, drop, det, var, chunk, zero_m)] = [y, y_infer, *_grads([x, A, B, m, b])]


def _from_base_cases(dev: str, out: dict) -> None:
    flags = [False, True]
    for dt, bias, drop, two, zero_m in itertools.product([torch.float32, torch.bfloat16, torch.float16], flags, flags, flags, flags):
        x, W, A, B, m, b, dy, keep = _problem(dev, dt, bias=bias, zero_m=zero_m)
        _, _, A2, B2, m2, _, _, keep2 = _problem(dev, dt, bias=bias, seed=1)
        clear_norm_cache()
        b0 = None if b is None else b.detach()
        kw = {"dropout_p": 0.2 if drop else 0.0}
        y = dora_from_base(x, torch.nn.functional.linear(x, W, b0), W, A, B, m, b0, 1.7, keep_mask=keep if drop else None, **kw)
        if two:
            y = dora_from_base(x, y, W, A2, B2, m2, b0, 0.9, keep_mask=keep2 if drop else None, result_is_base=False, **kw)
        y.backward(dy)
        with torch.no_grad():
            y_infer = dora_from_base(x, torch.nn.functional.linear(x, W, b0), W, A, B, m, b0, 1.7)
        out[("from_base", str(dt), bias, drop, two, zero_m)] = [y, y_infer, *_grads([x, A, B, m, A2, B2, m2])]


def _mixed_cases(dev: str, out: dict) -> None:
    """Mixed precision: fp64 magnitude with fp32 operands, fp64 x with fp32 weights, fp32 x
    with bf16 weights (the torch path; the accumulation rule decides these)."""
    for mix in ("m64", "x64", "w16"):
        for bias in (False, True):
            x, W, A, B, m, b, dy, _ = _problem(dev, torch.float32, bias=bias)
            if mix == "m64":
                m = m.detach().double().requires_grad_()
            elif mix == "x64":
                x, dy = x.detach().double().requires_grad_(), dy.double()
            else:
                W, A, B = W.bfloat16(), A.detach().bfloat16().requires_grad_(), B.detach().bfloat16().requires_grad_()
            clear_norm_cache()
            y = doracheck.dora_linear(x, W, A, B, m, 1.7, b)
            y.backward(dy.to(y.dtype))
            out[("mixed", mix, bias)] = [y, *_grads([x, A, B, m, b])]


def record(path: str, dev: str) -> dict:
    """{case key: [y, no-grad y, gradients...]} on the CPU, for ``path`` ("torch" or "triton")."""
    out: dict = {}
    with use_path(path):
        _linear_cases(path, dev, out)
        _from_base_cases(dev, out)
        if path == "torch":
            _mixed_cases(dev, out)
    return {k: [None if t is None else t.detach().cpu() for t in v] for k, v in out.items()}


def compare(a: dict, b: dict) -> int:
    """Number of differing tensors (printed, the first 15)."""
    if a.keys() != b.keys():
        print(f"different grids: {len(a)} against {len(b)} cases")
        return max(1, abs(len(a) - len(b)))
    bad = 0
    for k in a:
        for i, (u, v) in enumerate(zip(a[k], b[k])):
            if u is None and v is None:
                continue
            same = u is not None and v is not None and u.dtype == v.dtype and u.shape == v.shape and bool(
                ((u == v) | (u.isnan() & v.isnan())).all())
            if not same:
                bad += 1
                if bad <= 15:
                    print("differs:", k, "tensor", i)
    print(f"{bad} differing tensors over {len(a)} cases")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("file")
    r.add_argument("--path", choices=["torch", "triton"], default="torch")
    r.add_argument("--device", default="cpu")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        out = record(args.path, args.device)
        torch.save(out, args.file)
        print(f"{len(out)} cases recorded to {args.file}")
        return 0
    return 1 if compare(torch.load(args.a, weights_only=True), torch.load(args.b, weights_only=True)) else 0


if __name__ == "__main__":
    sys.exit(main())
