"""The Triton factored norm replayed from a CUDA graph: one host call instead of its launches.

A factored norm on the Triton path is a cuBLAS Gram product, two row-dot launches, a finish
launch and five allocations. Its GPU work is 39-246 µs at the benchmark shapes, its host time
0.30-0.36 ms (H200 host, torch 2.11, triton 3.6; docs/design.md section 7), and a training
forward pays it every step (the norm changes with every optimizer step). The norm of one
layer reads the same tensors at the same addresses step after step (optimizers write
parameters in place), so its launches after the Gram product are captured once into a CUDA
graph and replayed (G = A·Aᵀ is written eagerly into a buffer the graph reads):
the replay reads whatever W, A and B hold at replay time, so it is exact for the current
values by construction, whatever wrote them (fused AdamW, ``p.data``, ``load_state_dict`` in
place): nothing is cached but the launches.

When a graph is used (``graphed_norm`` returns None otherwise and the caller launches):
- W, A and B are plain CUDA tensors (or Parameters) on the current device, not while
  torch.compile traces and not while the current stream is being captured (a graph cannot be
  replayed inside a capture);
- the key has been seen ``CAPTURE_AFTER`` times (the first call compiles the kernels and a
  tensor seen once, a temporary, is not worth a capture). The key is everything the captured
  launches depend on: each tensor's address, shape, strides and dtype, the device, the current
  stream, s and ``fan_in_fan_out``. A tensor at the key's address with the key's layout is the
  tensor the graph reads.
- the capture succeeded: a key whose capture raised (out of memory, another thread capturing
  in global mode) is launched eagerly from then on;
- ``DORACHECK_NORM_GRAPHS=0`` in the environment turns graphs off.

Memory: all graphs of one (device, stream) share one memory pool, and all graphs of one rank
one G, so temporaries are held about once, not once per layer (for fp16 B they include an fp32
copy of B, d_out × r); each graph keeps its (4, d_out) fp32 output (229 KiB at d_out = 14336).
Sharing is safe because a replay's output is copied out (one ``clone``) on the same stream
before any other graph of that pool can be replayed, and G is written on that stream just
before the replay that reads it: nothing a replay writes is read after the next replay. At most
``MAX_GRAPHS`` graphs are kept: at that many, the graphs whose B tensor has been freed (a weak
reference; a model that was deleted) are dropped, and if none was, new keys are launched
eagerly (evicting live ones would make a model with more layers than that capture again every
step). A graph whose B was freed keeps working for a new tensor at the same address and layout
(it reads whatever is there). ``clear()`` drops them all and frees the pools.

Bitwise: a replay runs the same kernels with the same launch configurations as the eager
launches, so its terms are bitwise the eager norm's (tests/test_norm_graphs.py, GPU).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .tracing import tracing

CAPTURE_AFTER = 2  # sightings of a key before it is captured
MAX_GRAPHS = 2048
MAX_SEEN = 8192

_lock = threading.Lock()
_graphs: dict[tuple, list] = {}  # key -> [graph, static (4, d_out) output, weak reference to the last B]
_seen: OrderedDict[tuple, int] = OrderedDict()  # key -> sightings before capture
_failed: OrderedDict[tuple, None] = OrderedDict()  # keys whose capture raised: launched eagerly
_pools: dict[tuple, Any] = {}  # (device, stream) -> memory pool handle shared by its graphs
_grams: dict[tuple, torch.Tensor] = {}  # (device, stream, r) -> the fp32 (r, r) G every graph of that r reads
_capture_streams: dict[int, torch.cuda.Stream] = {}
_stats = {"captures": 0, "replays": 0, "failed": 0}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def enabled() -> bool:
    return os.environ.get("DORACHECK_NORM_GRAPHS", "1") != "0"


def stats() -> dict:
    """{"captures", "replays", "failed", "graphs"}: counts since the last ``clear``."""
    with _lock:
        return {**_stats, "graphs": len(_graphs)}


def clear() -> None:
    """Drop every graph, sighting and shared buffer (the pools are freed with their graphs)."""
    with _lock:
        _graphs.clear()
        _seen.clear()
        _failed.clear()
        _pools.clear()
        _grams.clear()
        _stats.update(captures=0, replays=0, failed=0)


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def layout_key(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> tuple:
    """What the captured launches read, besides device and stream: every tensor's address,
    shape, strides and dtype, s and ``fan_in_fan_out``."""
    return float(scaling), bool(fan_in_fan_out), _layout(weight), _layout(lora_A), _layout(lora_B)


def _key(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> tuple | None:
    """The replay key, or None where a graph may not be used for this call."""
    if not (type(weight) in _PLAIN and type(lora_A) in _PLAIN and type(lora_B) in _PLAIN):
        return None  # subclasses (DTensor, fake, functional tensors) and anything not a plain tensor
    if not (weight.is_cuda and lora_A.is_cuda and lora_B.is_cuda) or weight.numel() == 0 or lora_A.numel() == 0:
        return None
    if tracing() or not enabled() or weight.device.index != torch.cuda.current_device():
        return None  # (the capture check below looks at the current device's stream)
    if torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream(weight.device)
    return (weight.device.index, stream.cuda_stream, *layout_key(weight, lora_A, lora_B, scaling, fan_in_fan_out))


def _capture(key: tuple, terms: Callable[[torch.Tensor], torch.Tensor], G: torch.Tensor, device: torch.device) -> tuple:
    """Capture ``terms(G)``'s launches on a side stream into a graph of the (device, stream)
    pool; returns (graph, its static (4, d_out) output). Nothing runs during a capture."""
    pool = _pools.get(key[:2])
    if pool is None:
        pool = _pools[key[:2]] = torch.cuda.graph_pool_handle()
    side = _capture_streams.get(key[0])
    if side is None:
        side = _capture_streams[key[0]] = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = terms(G)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph, out


def _room() -> bool:
    """Whether another graph may be kept (dropping those whose B was freed, at the cap)."""
    if len(_graphs) < MAX_GRAPHS:
        return True
    for key in [k for k, entry in _graphs.items() if entry[2]() is None]:
        del _graphs[key]
    return len(_graphs) < MAX_GRAPHS


def graphed_norm(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool,
    gram: Callable[[torch.Tensor], torch.Tensor], terms: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """The (4, d_out) fp32 terms (base, cross, lora, norm) of this norm, or None where graphs
    are not used for this call (the module docstring says when; the caller then launches).
    ``gram(out)`` writes G = A·Aᵀ into ``out`` (eagerly, on the current stream: a cuBLAS call
    captured on another stream would give that stream a 32 MiB workspace of its own on Hopper);
    ``terms(G)`` launches the rest of exactly this norm, which is what a graph holds."""
    key = _key(weight, lora_A, lora_B, scaling, fan_in_fan_out)
    if key is None:
        return None
    # Outside inference mode: what is made here outlives this call, and an inference tensor
    # could not be written by a later call outside it. Then no_grad, in this order: leaving
    # inference mode turns grad mode on (seen on the H200: G written by an out= GEMM under grad
    # mode raised for fp32 A, and gave the norm an autograd history for bf16 A).
    with _lock, torch.inference_mode(False), torch.no_grad():
        entry = _graphs.get(key)
        if entry is None:
            if key in _failed or not _room():
                return None
            sightings = _seen.pop(key, 0) + 1
            if sightings < CAPTURE_AFTER:
                _seen[key] = sightings
                while len(_seen) > MAX_SEEN:
                    _seen.popitem(last=False)
                return None
        gram_key = (key[0], key[1], lora_A.shape[0])
        G = _grams.get(gram_key)
        if G is None:
            G = _grams[gram_key] = torch.empty(gram_key[2], gram_key[2], dtype=torch.float32, device=weight.device)
        gram(G)
        if entry is None:
            try:
                graph, out = _capture(key, terms, G, weight.device)
            except Exception:  # noqa: BLE001 (any failure to capture: the eager launches still work)
                _failed[key] = None
                while len(_failed) > MAX_SEEN:
                    _failed.popitem(last=False)
                _stats["failed"] += 1
                return None
            entry = _graphs[key] = [graph, out, weakref.ref(lora_B)]
            _stats["captures"] += 1
        elif entry[2]() is not lora_B:
            entry[2] = weakref.ref(lora_B)  # another tensor now at that address and layout
        graph, out = entry[0], entry[1]
        graph.replay()
        _stats["replays"] += 1
        # Copied out before any other graph of this pool runs (the module docstring says why).
        return out.clone()
