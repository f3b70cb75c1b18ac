"""The Triton factored norm replayed from a CUDA graph: one host call instead of its launches.

A factored norm on the Triton path is a Gram product (with the sum of its split-K partials), two
row-dot launches, a finish launch and seven allocations. Its GPU work is 39-246 µs at the benchmark shapes, its host time
0.30-0.36 ms (H200 host, torch 2.11, triton 3.6; docs/design.md section 7), and a training
forward pays it every step (the norm changes with every optimizer step). The norm of one
layer reads the same tensors at the same addresses step after step (optimizers write
parameters in place), so its launches, the Gram product G = A·Aᵀ included, are captured once
into a CUDA graph and replayed: the replay reads whatever W, A and B hold at replay time, so it is exact for the current
values by construction, whatever wrote them (fused AdamW, ``p.data``, ``load_state_dict`` in
place): nothing is cached but the launches.

When a graph is used (``graphed_norm`` returns None otherwise and the caller launches):
- W, A and B are plain CUDA tensors (or Parameters) on the current device, not while
  torch.compile traces and not while the current stream is being captured (a graph cannot be
  replayed inside a capture);
- the key has been seen ``CAPTURE_AFTER`` times (the first call compiles the kernels and a
  tensor seen once, a temporary, is not worth a capture). The key is everything the captured
  launches depend on: each tensor's address, shape, strides and dtype (the magnitude's too when
  the graph also forms n_safe and g), the device, the current stream, s and ``fan_in_fan_out``. A tensor at the key's address with the key's layout is the
  tensor the graph reads.
- no capture has failed in this process: after one raises (out of memory at the peak of a
  forward, another thread capturing in global mode), every norm is launched eagerly, with a
  warning, until ``clear()`` (and the allocator is told the capture ended and the default CUDA
  generator is taken out of capture mode: torch 2.11 does neither after a failed capture);
- ``DORACHECK_NORM_GRAPHS=0`` in the environment turns graphs off, and so does
  ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (no caching allocator, no private pools).

Memory: all graphs of one (device, stream) share one memory pool, so temporaries are held
about once, not once per layer (G and its split-K partials, ``settings.gram_config``'s splits
× r × r fp32: 8 MiB at r = 384, 8.6 MiB at r = 256; for fp16 B an fp32 copy of B, d_out × r);
each graph keeps its (4, d_out) fp32 output, (6, d_out) for a training forward's graph, which
also forms n_safe and g (344 KiB at d_out = 14336). A layer used both ways has two graphs (its
evaluation's and its training's), so ``MAX_GRAPHS`` covers half as many such layers. Sharing is safe because a replay's output is copied out (one
``clone``) on the same stream before any other graph of that pool can be replayed: nothing a
replay writes is read after the next replay. At most
``MAX_GRAPHS`` graphs are kept: at that many, the graphs one of whose W, A, B has been freed
(weak references; a deleted model, a temporary cast of W) are dropped, looked for only after
some such tensor was freed, and if none was, new keys are launched eagerly (evicting live ones
would make a model with more layers than that capture again every step). A graph whose tensors
were freed keeps working for new tensors at the same addresses and layouts (it reads whatever
is there). ``clear()`` drops them all and frees the pools.

Bitwise: a replay runs the same kernels with the same launch configurations as the eager
launches, so its terms are bitwise the eager norm's (tests/test_norm_graphs.py, GPU).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from .settings import cublas_cross_pieces
from .tracing import tracing

CAPTURE_AFTER = 2  # sightings of a key before it is captured
MAX_GRAPHS = 2048
MAX_SEEN = 8192

_lock = threading.Lock()
_graphs: dict[tuple, list] = {}  # key -> [graph, static (4 or 6, d_out) output, weak references to W, A, B]
_seen: OrderedDict[tuple, int] = OrderedDict()  # key -> sightings before capture
_pools: dict[tuple, Any] = {}  # (device, stream) -> memory pool handle shared by its graphs
_capture_streams: dict[int, torch.cuda.Stream] = {}
_blas_ready: set[int] = set()  # devices whose capture stream has its cuBLAS workspace
_stats = {"captures": 0, "replays": 0, "failed": 0}
_NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") == "1"  # read by torch once, at CUDA start
_state = {"off": False, "dead": False}  # off: a capture failed; dead: a tensor a graph reads was freed
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def enabled() -> bool:
    """Off with ``DORACHECK_NORM_GRAPHS=0``, without torch's caching allocator
    (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, as under compute-sanitizer runs that set it: a capture
    then allocates with cudaMalloc), and for the rest of the process after a failed capture."""
    return not _state["off"] and not _NO_CACHING and os.environ.get("DORACHECK_NORM_GRAPHS", "1") != "0"


def stats() -> dict:
    """{"captures", "replays", "failed", "graphs"}: counts since the last ``clear``."""
    with _lock:
        return {**_stats, "graphs": len(_graphs)}


_clear_listeners: list[Callable[[], None]] = []


def on_clear(listener: Callable[[], None]) -> None:
    """Call ``listener()`` at every ``clear()`` (``doracheck.norm_groups`` drops its group graphs)."""
    _clear_listeners.append(listener)


def clear() -> None:
    """Drop every graph, sighting and shared buffer (the pools are freed with their graphs) and
    allow graphs again after a failed capture."""
    with _lock:
        _graphs.clear()
        _seen.clear()
        _pools.clear()
        _stats.update(captures=0, replays=0, failed=0)
        _state.update(off=False, dead=False)
    for listener in _clear_listeners:
        listener()


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def layout_key(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool,
               magnitude: torch.Tensor | None = None) -> tuple:
    """What the captured launches read, besides device and stream: every tensor's address,
    shape, strides and dtype (the magnitude's too, for a graph that forms n_safe and g), s and
    ``fan_in_fan_out``."""
    key = (float(scaling), bool(fan_in_fan_out), _layout(weight), _layout(lora_A), _layout(lora_B))
    return key if magnitude is None else (*key, _layout(magnitude))


def _key(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool,
         magnitude: torch.Tensor | None = None) -> tuple | None:
    """The replay key, or None where a graph may not be used for this call."""
    if not (type(weight) in _PLAIN and type(lora_A) in _PLAIN and type(lora_B) in _PLAIN):
        return None  # subclasses (DTensor, fake, functional tensors) and anything not a plain tensor
    if not (weight.is_cuda and lora_A.is_cuda and lora_B.is_cuda) or weight.numel() == 0 or lora_A.numel() == 0:
        return None
    if magnitude is not None and not (type(magnitude) in _PLAIN and magnitude.is_cuda):
        return None
    if tracing() or not enabled() or weight.device.index != torch.cuda.current_device():
        return None  # (the capture check below looks at the current device's stream)
    if torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream(weight.device)
    return (weight.device.index, stream.cuda_stream, *layout_key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude))


def _capture(key: tuple, terms: Callable[[], torch.Tensor], device: torch.device) -> tuple:
    """Capture ``terms()``'s launches on a side stream into a graph of the (device, stream)
    pool; returns (graph, its static (4 or 6, d_out) output). Nothing runs during a capture."""
    pool = _pools.get(key[:2])
    if pool is None:
        pool = _pools[key[:2]] = torch.cuda.graph_pool_handle()
    side = _capture_stream(device, blas=False)  # made, and its workspace set up, at the first sighting
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except BaseException:
            _end_generator_capture(device)
            raise
        try:
            out = terms()
        except BaseException:
            _end_capture(graph, device, pool, raising=False)  # the launches' own error is the one to report
            raise
        _end_capture(graph, device, pool, raising=True)
    current.wait_stream(side)
    return graph, out


def _capture_stream(device: torch.device, blas: bool) -> torch.cuda.Stream:
    """The device's capture stream, made at the first sighting of a norm that may be captured;
    with ``blas`` (the norm runs cuBLAS: ``settings.cublas_cross_pieces``) its cuBLAS workspace is
    set up too, once per device (``_set_up_blas_workspace``). At the first sighting, not at the
    capture: the workspace is process state, like the kernels' compilation in a process's first
    norm call, not memory of the call that happens to capture (``doracheck verify``'s norm.memory
    property measures the call after a first one; set up at the capture, the 32 MiB showed
    there)."""
    side = _capture_streams.get(device.index)
    if side is None:
        side = _capture_streams[device.index] = torch.cuda.Stream(device)
    if blas and device.index not in _blas_ready:
        _set_up_blas_workspace(side, device)
        _blas_ready.add(device.index)
    return side


def _set_up_blas_workspace(side: torch.cuda.Stream, device: torch.device) -> None:
    """One tiny cuBLAS GEMM on the capture stream before its first capture. torch gives each
    (cuBLAS handle, stream) pair a workspace of its own (32 MiB on Hopper), allocated at that
    pair's first GEMM; the norm's U = W·Aᵀ (``norm_triton.cross_product_u``) would otherwise
    allocate it inside the first capture, from the graphs' private pool. Allocated here, outside
    any capture, it is ordinary process state, once per device (fp32 norms, which run no cuBLAS,
    never set it up)."""
    with torch.cuda.stream(side):
        probe = torch.zeros(1, 16, dtype=torch.bfloat16, device=device)
        torch.mm(probe, probe.t(), out_dtype=torch.float32)  # the very call the norm makes (aten::mm.dtype)
    torch.cuda.current_stream(device).wait_stream(side)


def _end_capture(graph, device: torch.device, pool, raising: bool) -> None:
    try:
        graph.capture_end()
    except Exception:
        _end_pool_allocation(device, pool)
        _end_generator_capture(device)
        if raising:
            raise


def _end_generator_capture(device: torch.device) -> None:
    """After a capture that failed to begin or to end: ``capture_begin`` puts the device's
    default CUDA generator in capture mode and only a ``capture_end`` that succeeds takes it out
    (torch 2.11), so the user's next CUDA random call outside a capture raised "Offset
    increment outside graph capture encountered unexpectedly" (seen on the H200:
    ``kaiming_uniform_`` in a later test of the same process). A capture of one fill that ends
    cleanly runs the generator's capture epilogue. It draws no random numbers, so the
    generator's seed and offset stay what they were (tests/test_norm_graphs.py checks both).
    Run on the stream and device of the failed capture; if this capture fails too, the device
    is in a state no fill can mend and the failed capture's error is the one to report."""
    try:
        scratch = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            scratch.fill_(1.0)
        finally:
            graph.capture_end()
        del graph
    except Exception:  # noqa: BLE001 (best effort: see the docstring)
        pass


def _end_pool_allocation(device: torch.device, pool) -> None:
    """After a capture that failed to end: torch 2.11's ``capture_end`` raises before it tells
    the caching allocator that the capture is over (fixed upstream later), which leaves the
    allocator believing a capture runs (``empty_cache`` then asserts, freed memory is kept).
    On a torch that already ended it, this raises, and that is fine. The pool itself is not
    released here (a torch that releases it on its own would then release it twice, under
    graphs that share it): what the failed capture and the other graphs hold in it, a few MiB
    of norm temporaries, stays reserved until the process ends."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index, pool)
        except Exception:  # noqa: BLE001 (already ended by torch itself)
            pass


def _on_tensor_freed(_ref) -> None:
    _state["dead"] = True  # no lock: a weakref callback may run anywhere, a flag write is atomic


def _refs(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple:
    return tuple(weakref.ref(t, _on_tensor_freed) for t in (weight, lora_A, lora_B))


def _alive(refs: tuple, *tensors: torch.Tensor) -> bool:
    return all(ref() is t for ref, t in zip(refs, tensors))


def _room() -> bool:
    """Whether another graph may be kept: at the cap, the graphs one of whose tensors was freed
    are dropped, looked for only after a tensor was freed (not at every call)."""
    if len(_graphs) < MAX_GRAPHS:
        return True
    if _state["dead"]:
        _state["dead"] = False
        for key in [k for k, entry in _graphs.items() if any(ref() is None for ref in entry[2])]:
            del _graphs[key]
    return len(_graphs) < MAX_GRAPHS


def _give_up(error: Exception) -> None:
    """After a failed capture (lock held): graphs off for the rest of the process (until
    ``clear()``). A failed capture is usually memory running out at the peak of a forward, and
    its pool is not reused. The graphs are dropped too: none will be replayed again, and what
    they hold in pools that no failed capture touched goes back to the allocator."""
    _graphs.clear()
    _seen.clear()
    _pools.clear()
    _state["off"] = True
    _stats["failed"] += 1
    warnings.warn(f"doracheck: capturing a norm graph failed ({type(error).__name__}: {error}); "
                  "norms are launched without graphs from now on", RuntimeWarning, stacklevel=3)


def capture_launches(device: torch.device, terms: Callable[[], torch.Tensor], blas: bool) -> tuple | None:
    """(graph, static output) of ``terms()`` captured into the pool of ``device``'s current
    stream, for launches that, like one norm's, read tensors that stay where they are (the
    caller checks their addresses and layouts before each ``replay_launches``); None where
    graphs may not be used (off, traced, another device current, the stream capturing) or the
    capture failed (then graphs are off, as for ``graphed_norm``). ``blas``: ``terms()`` runs a
    cuBLAS GEMM (its workspace on the capture stream is set up first). Eager only."""
    if (tracing() or not enabled() or device.type != "cuda" or device.index != torch.cuda.current_device()
            or torch.cuda.is_current_stream_capturing()):
        return None
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    with _lock, torch.inference_mode(False), torch.no_grad(), _set_fwd_grad_enabled(False):
        _capture_stream(device, blas)
        try:
            graph, out = _capture(key, terms, device)
        except Exception as error:  # noqa: BLE001 (any failure to capture: the eager launches still work)
            _give_up(error)
            return None
    return graph, out


def replay_launches(graph: Any, out: torch.Tensor) -> torch.Tensor:
    """Replay a ``capture_launches`` graph on the current stream and return a copy of its
    output (copied before any other graph of the pool runs, as ``graphed_norm`` does)."""
    with _lock, torch.inference_mode(False), torch.no_grad(), _set_fwd_grad_enabled(False):
        graph.replay()
        return out.clone()


def graphed_norm(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool,
    terms: Callable[[], torch.Tensor], magnitude: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The (4, d_out) fp32 terms (base, cross, lora, norm) of this norm, or None where graphs
    are not used for this call (the module docstring says when; the caller then launches).
    ``magnitude``: the m that ``terms()`` reads too (rows n_safe and g: (6, d_out)), part of the key.
    ``terms()`` launches exactly this norm, all of it (its cuBLAS GEMM U = W·Aᵀ included: the
    capture stream's cuBLAS workspace is set up before its first capture), which is what a
    graph holds."""
    key = _key(weight, lora_A, lora_B, scaling, fan_in_fan_out, magnitude)
    if key is None or _state["off"]:
        return None
    # Outside inference mode: what is made here outlives this call, and an inference tensor
    # could not be written by a later call outside it. Then no_grad and no forward AD, in this
    # order: leaving inference mode turns both grad modes on (seen on the H200: G written by an
    # out= GEMM under grad mode raised for fp32 A, and gave the norm an autograd history for
    # bf16 A; with forward AD a dual A made the out= GEMM raise). Keep this order: on exit the
    # inference-mode guard puts back the caller's whole autograd state, the other two included.
    with _lock, torch.inference_mode(False), torch.no_grad(), _set_fwd_grad_enabled(False):
        entry = _graphs.get(key)
        if entry is None:
            if not _room():
                return None
            _capture_stream(weight.device, cublas_cross_pieces(weight.dtype, lora_A.dtype) > 0)
            sightings = _seen.pop(key, 0) + 1
            if sightings < CAPTURE_AFTER:
                _seen[key] = sightings
                while len(_seen) > MAX_SEEN:
                    _seen.popitem(last=False)
                return None
        if entry is None:
            try:
                graph, out = _capture(key, terms, weight.device)
            except Exception as error:  # noqa: BLE001 (any failure to capture: the eager launches still work)
                _give_up(error)
                return None
            entry = _graphs[key] = [graph, out, _refs(weight, lora_A, lora_B)]
            _stats["captures"] += 1
        elif not _alive(entry[2], weight, lora_A, lora_B):
            entry[2] = _refs(weight, lora_A, lora_B)  # other tensors now at those addresses and layouts
        graph, out = entry[0], entry[1]
        graph.replay()
        _stats["replays"] += 1
        # Copied out before any other graph of this pool runs (the module docstring says why).
        return out.clone()
