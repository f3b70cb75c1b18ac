"""A PEFT-path layer's forward without autograd at a few tokens (decode), replayed from a CUDA
graph over copies of its activations. Opt-in: ``DORACHECK_DECODE_GRAPHS=1`` (read at every call).

Experimental: built and tested on the CPU (a stand-in capture under the Triton interpreter)
when the session's GPU time had run out, so not yet run on a GPU; the first call that uses it
warns. ``benchmarks/decode_check.sh`` runs its GPU test, the inference-norm GPU tests with it on
and the decode A/B in one device call; until that has passed it stays off by default.

Why (issue 17): eager decode is host-bound. A layer's inference forward is x·Aᵀ and the
compose, two launches, but with the Python between them it costs about 0.23-0.29 ms of host
time per token on the lent H200 hosts against a few µs of GPU work, and a model pays it for
every layer and token (eager decode at 0.52x PEFT LoRA's tokens/s).

What is captured: xa = x·Aᵀ and y = g⊙(result - b + s·xa·Bᵀ) + b with g = m / max(n, eps)
formed in the compose (``forward.from_base_forward``'s inference branch), on the Triton path,
eagerly on CUDA (not while torch.compile traces, not inside another capture), for at most
``MAX_TOKENS`` tokens. The activations are copied in and out of the graph's own two buffers
(x and the output, T×d_in and T×d_out: 48 KiB a layer at T = 1, d = 4096 + 14336 in bf16), so
the graph does not depend on where the caller's activations live (the whole-pass training
graphs that keyed on those addresses replayed too rarely: benchmarks/results/pass_graphs_h200.txt).
A call costs the three copies, one replay and a key.

The key is everything the replay reads besides its buffers: A, B, m, max(n, eps) (an armed
norm buffer or the norm cache's stored value) and the bias, each by address, shape, strides and
dtype; s; the token count, widths and dtypes; the device and current stream. Parameters and
norm buffers keep their addresses while they are updated in place, and a replay reads what they
hold then, so it is exact for their current values whatever wrote them. A key is captured on its
``CAPTURE_AFTER``-th sighting; at most ``MAX_GRAPHS`` graphs. All graphs of one (device, stream)
share one memory pool (their temporaries: x·Aᵀ, a T×r product): safe, since each replay's
results are copied out on the same stream before another replay runs. A failed capture turns
decode graphs off, with a warning, until ``clear()``.
Bitwise: the replay runs the eager call's kernels on copies of the same values.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch

from .kernels import norm_graphs
from .kernels.tracing import tracing
from .layer_state import LayerArgs

MAX_TOKENS = 16  # each token count is a graph per layer with buffers of its own: keep the set small
CAPTURE_AFTER = 2
MAX_GRAPHS = 4096
MAX_SEEN = 8192

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_lock = threading.Lock()
_graphs: dict[tuple, tuple] = {}  # key -> (graph, static x, static output)
_seen: OrderedDict[tuple, int] = OrderedDict()
_pools: dict[tuple, Any] = {}
_warm_devices: set[int] = set()
_stats = {"captures": 0, "replays": 0, "failed": 0}
_state = {"off": False, "warned": False}


def enabled() -> bool:
    """On with ``DORACHECK_DECODE_GRAPHS=1``; never without torch's caching allocator
    (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``) or after a failed capture (until ``clear()``)."""
    on = os.environ.get("DORACHECK_DECODE_GRAPHS", "0") == "1" and not _state["off"] and not norm_graphs._NO_CACHING
    if on and not _state["warned"]:
        _state["warned"] = True
        warnings.warn("doracheck: DORACHECK_DECODE_GRAPHS=1 turns on an experimental path that has not yet been "
                      "run on a GPU (doracheck/decode_graphs.py)", RuntimeWarning, stacklevel=3)
    return on


def stats() -> dict:
    """{"captures", "replays", "failed", "graphs"} since the last ``clear``."""
    with _lock:
        return {**_stats, "graphs": len(_graphs)}


def clear() -> None:
    """Drop every decode graph and its buffers, and allow graphs again after a failed capture."""
    with _lock:
        _graphs.clear()
        _seen.clear()
        _pools.clear()
        _stats.update(captures=0, replays=0, failed=0)
        _state["off"] = False


def _stream(device: torch.device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _usable(*tensors: torch.Tensor | None) -> bool:
    index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or not t.is_cuda or t.device.index != index):
            return False
    return not torch.cuda.is_current_stream_capturing()


def _warm(device: torch.device) -> None:
    """Give the capture stream its cuBLAS workspaces before its first capture, outside any pool
    (a GEMM captured first on a new stream would allocate them inside the capture)."""
    if device.index in _warm_devices:
        return
    side = norm_graphs.side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            ones = torch.ones(16, 16, dtype=dtype, device=device)
            torch.mm(ones, ones)
    side.synchronize()
    _warm_devices.add(device.index)


def _layouts(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else norm_graphs.layout(t) for t in tensors)


def replayed(r2: torch.Tensor, x2: torch.Tensor, a: LayerArgs, backend, n_safe: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether y = g⊙(r2 - b + s·(x2·Aᵀ)·Bᵀ) + b was written into ``r2`` by a replay; False: the
    caller runs the same forward eagerly (the module docstring says when a graph serves)."""
    if not enabled() or tracing() or backend.name != "triton":
        return False
    T, d_out = r2.shape
    if not 0 < T <= MAX_TOKENS or d_out == 0 or x2.dtype != r2.dtype or not (r2.is_contiguous() and x2.is_contiguous()):
        return False
    A, B, m = a.lora_A, a.lora_B, a.magnitude
    if not _usable(r2, x2, A, B, m, n_safe, bias):
        return False
    device, s = r2.device, float(a.scaling)
    key = (device.index, _stream(device), s, T, x2.shape[1], d_out, r2.dtype, _layouts(A, B, m, n_safe, bias))
    with _lock:
        # The buffers outlive this call, so they are made and written outside inference mode
        # (a later call outside it could not write an inference tensor); the copy back into r2
        # runs in the caller's mode (r2 may be an inference tensor, written only inside it).
        with torch.inference_mode(False), torch.no_grad():
            out_static = _replay(key, r2, x2, A, B, m, n_safe, bias, s, backend)
        if out_static is None:
            return False
        r2.copy_(out_static)
        return True


def _replay(key, r2, x2, A, B, m, n_safe, bias, s, backend):
    """The graph's output buffer after a replay on copies of x2 and r2, or None (not captured yet,
    or the capture failed). Under ``_lock``."""
    device, cd, T, d_out = r2.device, r2.dtype, r2.shape[0], r2.shape[1]
    entry = _graphs.get(key)
    if entry is None:
        if len(_graphs) >= MAX_GRAPHS:
            return None
        sightings = _seen.pop(key, 0) + 1
        if sightings < CAPTURE_AFTER:
            _seen[key] = sightings
            while len(_seen) > MAX_SEEN:
                _seen.popitem(last=False)
            return None
        _warm(device)
        x_static = torch.empty(T, x2.shape[1], dtype=cd, device=device)
        out_static = torch.empty(T, d_out, dtype=cd, device=device)

        def forward():  # forward.from_base_forward's inference branch, on the buffers
            xa = x_static @ (A if A.dtype == cd else A.to(cd)).t()
            y = backend.compose_infer(out_static, xa, B, m, n_safe, bias, s, True)
            if y is not out_static:
                out_static.copy_(y)

        pool = _pools.get(key[:2])
        if pool is None:
            pool = _pools[key[:2]] = torch.cuda.graph_pool_handle()
        try:
            graph, _ = norm_graphs.capture_into_pool(forward, device, pool)
        except Exception as error:  # noqa: BLE001 (any failure to capture: the eager call still works)
            _graphs.clear()
            _seen.clear()
            _pools.clear()
            _state["off"] = True
            _stats["failed"] += 1
            warnings.warn(f"doracheck: capturing a decode graph failed ({type(error).__name__}: {error}); "
                          "inference forwards run without decode graphs from now on", RuntimeWarning, stacklevel=4)
            return None
        entry = _graphs[key] = (graph, x_static, out_static)
        _stats["captures"] += 1
    graph, x_static, out_static = entry
    x_static.copy_(x2)
    out_static.copy_(r2)
    graph.replay()
    _stats["replays"] += 1
    return out_static
