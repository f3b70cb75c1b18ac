"""Whole-pass CUDA graphs: a DoRA layer's training forward and backward, each replayed from
one CUDA graph (one host call instead of its 15-20 torch ops and Triton launches).

Why (issue 17): the eager training step is host-bound. On the lent H200 hosts a layer's
training forward costs 0.49-0.58 ms of host time and its backward 0.28-0.62 ms, while a replay
of the same work costs 3-8 µs (benchmarks/layer_graph_probe.py, results/head_check_h200.txt).
Opt-in for now: ``DORACHECK_PASS_GRAPHS=1`` in the environment (read at every call).

What is captured: the case PEFT's DoRA layers run in training, where the output stands for z
(the first active adapter, ``result`` = x·Wᵀ exactly, no bias, no dropout, detached norm, the
Triton backend, a frozen W), on CUDA, eagerly (not while torch.compile traces, not inside
another capture, not under create_graph):
- forward: n_safe = max(n, eps), g = m / n_safe, xa = x·Aᵀ, and y = g⊙(result + s·xa·Bᵀ)
  written into ``result``. The norm n itself is not in the graph: it comes from the usual path
  (the norm cache's rule: computed by every training forward, read by its checkpoint
  recompute; ``norm_cache``), and is copied into the graph's input buffer (one host op).
- backward: ``backward.layer_backward`` whole (dz, dm, dx, dA, dB, lost rows).

Keys: everything a replay reads is fixed when it is captured, so the key is every tensor it
reads (address, shape, strides, dtype: x, result, dy, the saved tensors, W, A, B, m, and dx,
which is allocated before each backward), the device, the current stream, s,
``fan_in_fan_out``, the gradients wanted, the backward's token chunk and the planner variant.
A graph is replayed only for a call whose tensors are exactly those; a training loop in a
steady state allocates the same addresses step after step, and any other call runs eagerly.
A key is captured on its ``CAPTURE_AFTER``-th sighting; at most ``MAX_PER_SITE`` graphs per
layer and pass (a layer whose activations move every step stops capturing) and ``MAX_GRAPHS``
in all.

Outputs: dx is a new tensor each call (its address is in the key), so nothing the size of the
activations is held between calls. The small outputs are the graph's own buffers, allocated
outside its memory pool: n and max(n, eps) (2 × d_out fp32), g (d_out), xa (T × r) for the
forward; dA, dB, dm for the backward (about 3 MiB per layer at d_in = 4096, r = 384,
T = 4096 in bf16, each way). Before a replay overwrites them, each must be held by nobody but
the graph (counted three ways: Python references, holders of the tensor, holders of its
storage, as torch.compile's CUDA-graph trees count storages): a
forward whose previous outputs are still saved for a pending backward (two forwards of one
layer on the same tensors before a backward), or a gradient someone kept, runs eagerly. The
backward's gradients are handed out as the buffers themselves, so autograd's AccumulateGrad
copies them into ``.grad`` rather than adopting them. Temporaries live in one memory pool per
(device, stream), shared by all pass graphs: replays on one stream never overlap and nothing
in the pool outlives a replay. That pool holds the largest pass's temporaries (dz chunks, a
T × r product), plus a cuBLAS workspace for the capture stream (32 MiB on Hopper).

A failed capture (out of memory at a peak, a launch that cannot be captured) turns pass graphs
off for the process, with a warning, until ``clear()``; the call that failed runs eagerly.
Bitwise: a replay runs the eager call's kernels with the same launch configurations, so its
outputs are bitwise the eager ones (tests/test_pass_graphs.py, GPU).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .kernels import norm_graphs
from .kernels.constants import EPS
from .kernels.settings import backward_token_chunk
from .kernels.tracing import tracing
from .layer_state import Grads, LayerArgs, Need, Saved

CAPTURE_AFTER = 2
MAX_PER_SITE = 8
MAX_GRAPHS = 2048
MAX_SEEN = 8192

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_COUNTS_USES = hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_lock = threading.Lock()
_stats = {"captures": 0, "replays": 0, "busy": 0, "failed": 0}
_state = {"off": False}


@dataclass
class _Entry:
    graph: Any
    buffers: tuple  # the graph's own output buffers
    holders: tuple  # each buffer's ``_holders`` while only the entry holds it


_graphs: dict[tuple, _Entry] = {}
_seen: OrderedDict[tuple, int] = OrderedDict()
_site_captures: dict[tuple, int] = {}
_pools: dict[tuple, Any] = {}
_warm_streams: set[int] = set()


def enabled() -> bool:
    """On with ``DORACHECK_PASS_GRAPHS=1``; never without torch's caching allocator
    (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), on a torch that cannot count a tensor's holders,
    or after a failed capture (until ``clear()``)."""
    return (os.environ.get("DORACHECK_PASS_GRAPHS", "0") == "1" and not _state["off"] and not norm_graphs._NO_CACHING
            and _COUNTS_USES)


def stats() -> dict:
    """{"captures", "replays", "busy" (calls run eagerly because a graph's buffers were still
    held), "failed", "graphs"} since the last ``clear``."""
    with _lock:
        return {**_stats, "graphs": len(_graphs)}


def clear() -> None:
    """Drop every pass graph, its buffers and the pools, and allow graphs again after a failed capture."""
    with _lock:
        _graphs.clear()
        _seen.clear()
        _site_captures.clear()
        _pools.clear()
        _stats.update(captures=0, replays=0, busy=0, failed=0)
        _state["off"] = False


def _holders(t: torch.Tensor) -> tuple[int, int, int]:
    """(Python references to the tensor object, holders of the tensor itself, holders of its
    storage): a hook that kept a gradient holds the object; autograd's saved tensors and
    ``.grad`` fields hold the tensor; views hold the storage."""
    storage = torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # type: ignore[attr-defined]
    return sys.getrefcount(t), t._use_count(), storage  # type: ignore[attr-defined]


def _holders_of(buffers: tuple) -> tuple:
    return tuple(_holders(b) for b in buffers)


def _idle(entry: _Entry) -> bool:
    """Whether nobody but the entry holds any of its buffers (counted by the same code, over the
    same tuple, as when the entry was made: Python's reference counts are that sensitive)."""
    return _holders_of(entry.buffers) == entry.holders


def _stream(device: torch.device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _usable(*tensors: torch.Tensor) -> bool:
    """Whether a graph may serve a call on these tensors (the module docstring says when)."""
    if not enabled() or tracing():
        return False
    index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    for t in tensors:
        if type(t) not in _PLAIN or not t.is_cuda or t.device.index != index:
            return False
    return not torch.cuda.is_current_stream_capturing()


def _warm(device: torch.device) -> None:
    """Give the capture stream its cuBLAS workspaces before the first capture, outside any
    pool (a GEMM captured first on a new stream would allocate them inside the capture)."""
    if device.index in _warm_streams:
        return
    side = norm_graphs.side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            a = torch.ones(16, 16, dtype=dtype, device=device)
            torch.mm(a, a)
            torch.addmm(a, a, a, alpha=2.0)
    side.synchronize()
    _warm_streams.add(device.index)


def _fail(error: Exception) -> None:
    _graphs.clear()
    _seen.clear()
    _site_captures.clear()
    _pools.clear()
    _state["off"] = True
    _stats["failed"] += 1
    warnings.warn(f"doracheck: capturing a pass graph failed ({type(error).__name__}: {error}); "
                  "DoRA layers run without pass graphs from now on", RuntimeWarning, stacklevel=3)


def _replayed(key: tuple, site: tuple, device: torch.device,
              make: Callable[[], tuple[tuple, Callable[[], None]]], before: Callable[[tuple], None]) -> _Entry | None:
    """The entry of ``key`` after it was replayed (captured first when due), or None: the
    caller runs eagerly. ``make()`` allocates the buffers and returns (buffers, the function
    to capture); ``before(buffers)`` fills the input buffers eagerly before each replay."""
    with _lock, torch.inference_mode(False), torch.no_grad():
        entry = _graphs.get(key)
        if entry is None:
            if len(_graphs) >= MAX_GRAPHS or _site_captures.get(site, 0) >= MAX_PER_SITE:
                return None
            sightings = _seen.pop(key, 0) + 1
            if sightings < CAPTURE_AFTER:
                _seen[key] = sightings
                while len(_seen) > MAX_SEEN:
                    _seen.popitem(last=False)
                return None
            _warm(device)
            buffers, fn = make()
            pool_key = key[1:3]
            pool = _pools.get(pool_key)
            if pool is None:
                pool = _pools[pool_key] = torch.cuda.graph_pool_handle()
            try:
                graph, _ = norm_graphs.capture_into_pool(fn, device, pool)
            except Exception as error:  # noqa: BLE001 (any failure to capture: the eager call still works)
                _fail(error)
                return None
            del fn  # the closure holds the first call's tensors; the graph needs only their addresses
            entry = _graphs[key] = _Entry(graph, buffers, ())
            entry.holders = _holders_of(entry.buffers)
            _site_captures[site] = _site_captures.get(site, 0) + 1
            _stats["captures"] += 1
        elif not _idle(entry):
            _stats["busy"] += 1
            return None
        before(entry.buffers)
        entry.graph.replay()
        _stats["replays"] += 1
        return entry


def _layouts(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else norm_graphs.layout(t) for t in tensors)


def from_output_forward(r2: torch.Tensor, x2: torch.Tensor, a: LayerArgs, backend, norm: torch.Tensor):
    """(xa, g, n, max(n, eps)) from a replay that wrote y = g⊙(r2 + s·(x2·Aᵀ)·Bᵀ) into ``r2``,
    with ``norm`` the layer's n for this call; or None where no graph serves the call (the
    caller then runs the same forward eagerly). Only for the case the module docstring names."""
    A, B, m = a.lora_A, a.lora_B, a.magnitude
    if backend.name != "triton" or a.bias is not None or not a.detach_norm or not _usable(r2, x2, A, B, m, norm):
        return None
    device, s = r2.device, float(a.scaling)
    T, d_out, cd = r2.shape[0], r2.shape[1], r2.dtype
    if T == 0 or d_out == 0 or x2.dtype != cd:
        return None
    site = ("forward", device.index, _stream(device), s, A.data_ptr(), B.data_ptr(), m.data_ptr(), T)
    key = (*site, _layouts(r2, x2, A, B, m), norm.dtype, tuple(norm.shape))

    def make():
        nn = torch.empty(2, d_out, dtype=norm.dtype, device=device)
        g = torch.empty(d_out, dtype=torch.promote_types(m.dtype, norm.dtype), device=device)
        xa = torch.empty(T, A.shape[0], dtype=cd, device=device)

        def forward():  # the eager forward's ops, in its order (forward.from_base_forward)
            torch.clamp_min(nn[0], EPS, out=nn[1])
            torch.div(m, nn[1], out=g)
            torch.mm(x2, A.t() if A.dtype == cd else A.to(cd).t(), out=xa)
            y, _, from_output = backend.compose_saving(r2, xa, B, g, None, s, True, True)
            if not from_output:
                raise RuntimeError("pass graph: the compose kept z, not the output (not the case graphs serve)")
            if y is not r2:  # the Triton compose writes in place; a twin that returns a new tensor
                r2.copy_(y)

        return (nn, g, xa), forward

    entry = _replayed(key, site, device, make, lambda buffers: buffers[0][0].copy_(norm))
    if entry is None:
        return None
    nn, g, xa = entry.buffers
    return xa, g, nn[0], nn[1]


def _new_dx(T: int, d_in: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """dx's tensor for one backward: from the caching allocator, which in a steady-state loop
    hands the same block back step after step (its address is part of the key)."""
    return torch.empty(T, d_in, dtype=dtype, device=device)


def from_output_backward(saved: Saved, dy: torch.Tensor, a: LayerArgs, lead: tuple, need: Need) -> Grads | None:
    """``layer_backward``'s Grads from a replay, or None where no graph serves the call (the
    caller then runs it eagerly). dx is a new tensor; dA, dB, dm are the graph's buffers."""
    from .backward import layer_backward  # backward imports forward, which imports this module

    x2, xa, h, g, n, n_safe = saved.x2, saved.xa, saved.h, saved.g, saved.n, saved.n_safe
    W, A, B, m = a.weight, a.lora_A, a.lora_B, a.magnitude
    if (saved.backend.name != "triton" or not saved.from_output or saved.keep is not None or a.bias is not None
            or not a.detach_norm or need.dW or need.db or xa is None or h is None or torch.is_grad_enabled()):
        return None
    if not _usable(x2, xa, h, g, n, n_safe, dy, W, A, B, m):
        return None
    T, d_in, d_out = x2.shape[0], x2.shape[1], g.shape[0]
    if T == 0 or d_out == 0 or h.shape != (T, d_out):
        return None
    device, s = x2.device, float(a.scaling)
    dy2 = dy.reshape(T, d_out)
    dx = _new_dx(T, d_in, x2.dtype, device) if need.dx else None
    chunk = backward_token_chunk(T, d_out, x2.element_size())
    site = ("backward", device.index, _stream(device), s, bool(a.fan_in_fan_out), tuple(need), chunk, saved.variant,
            W.data_ptr(), A.data_ptr(), B.data_ptr(), m.data_ptr(), T)
    key = (*site, _layouts(x2, xa, h, g, n, n_safe, dy2, W, A, B, m, dx))
    wanted = (need.dA, need.dB, need.dm)

    def make():
        outs = (torch.empty_like(A), torch.empty_like(B), torch.empty_like(m))
        buffers = tuple(t for t, want in zip(outs, wanted) if want)

        def backward():
            grads = layer_backward(saved, dy2, a, (T,), need, dx_out=dx)
            for buffer, got in zip(buffers, [t for t in (grads.dA, grads.dB, grads.dm) if t is not None]):
                buffer.copy_(got)

        return buffers, backward

    entry = _replayed(key, site, device, make, lambda buffers: None)
    if entry is None:
        return None
    given = iter(entry.buffers)
    dA, dB, dm = (next(given) if want else None for want in wanted)
    return Grads(None if dx is None else dx.view(*lead, d_in), None, dA, dB, dm, None)
