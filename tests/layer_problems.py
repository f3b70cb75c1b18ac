"""Small DoRA problems and helpers shared by the layer tests."""

from __future__ import annotations

import os

import torch

import doracheck
from doracheck.dispatch import use_path

PATHS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available() else [])


def problem(dtype=torch.float32, seed=0, d_out=8, d_in=12, r=3):
    gen = torch.Generator().manual_seed(seed)
    W = (torch.randn(d_out, d_in, generator=gen) / 3).to(dtype)
    A = torch.randn(r, d_in, generator=gen) / 3
    B = torch.randn(d_out, r, generator=gen)
    m = torch.rand(d_out, generator=gen) + 0.5
    x = torch.randn(2, 5, d_in, generator=gen).to(dtype)
    return x, W, A, B, m


def run_python(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def chunked_grads(monkeypatch, chunk_bytes, tensors, path, dy_value=1e-3):
    from doracheck.kernels import settings

    monkeypatch.setattr(settings, "BACKWARD_CHUNK_BYTES", chunk_bytes)
    leaves = [t.clone().requires_grad_() for t in tensors]
    x, W, A, B, m = leaves
    with use_path(path):
        doracheck.dora_linear(x, W, A, B, m, 1.0).backward(torch.full((x.shape[0], W.shape[0]), dy_value, dtype=x.dtype))
    return {name: t.grad for name, t in zip(("x", "W", "A", "B", "m"), leaves)}
