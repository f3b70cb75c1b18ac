"""One norm refresh for all the planned layers of a training forward (issue 17).

Every training forward recomputes each DoRA layer's norm n = ||W + s·B·A|| (rows) and
g = m / max(n, eps) (``norm_cache`` rule 1: the optimizer may have written the parameters).
On the H200 the eager step is host-bound, and each layer's norm, replayed from its own CUDA
graph (``kernels.norm_graphs``), cost about 340 µs of host time inside the model step (py-spy,
``benchmarks/results/host_sample_twentysecond_h200.txt``): 9.5 ms a step for the 28 layers of
``bench_model.py``, whose norms are a few ms of GPU work. Here the layers that a training
forward runs through their training plans (``integrations.peft_train``) form a *group*: all
their norms are captured into one CUDA graph, replayed once per forward, when the first member
asks; each member then takes its own rows. Same kernels, same operands: bitwise the norms the
layers compute one by one (tests/test_norm_groups.py).

A *pass* is one forward of a model given to ``integrations.peft.enable``, per thread: hooks on
it and on its base model (``begin_pass`` / ``end_pass``) open and close it, and it is anchored
to the frame that runs that forward, so it is open exactly while that forward runs (a forward
interrupted by Ctrl-C, which skips even ``always_call`` hooks, leaves none open). The base
model's forward is a pass of its own, also inside its model's forward or another model's.
Groups belong to a (device, stream, implementation path, root model of the pass). When a
member's rows are used (``scaled_norm`` returns None otherwise and the layer computes its norm alone, as
before):
- the group was refreshed in this pass, in the current training era (``norm_cache.era``: it
  ends at every optimizer step, at a training forward after a backward, and at
  ``clear_norm_cache``), and this member has not taken its rows since that refresh (a layer
  called twice in one forward refreshes the whole group again). So the user's code between two
  forwards (a hand-written SGD step through ``p.data``, another model's forward, a retry after
  an exception) never sits between a refresh and a take: found in review, where one group of
  two models refreshed at the first model's forward served the second model's rows from before
  its ``p.data`` update;
- at the refresh every member's W, A, B and m were the objects the group was made from, alive,
  at the addresses, shapes, strides and dtypes the graph reads and the layer's own call saw
  (else the group is dropped: a model moved, resharded or replaced);
- the member's tensors are still those, at that layout, and their version counters have not
  moved since the refresh (an in-place write under ``no_grad`` between the first member's
  forward and this one's);
- a training forward (autograd recording), outside a backward (a checkpoint recompute reads the
  norm its forward stored, ``norm_cache`` rule 2), not traced, not inside a CUDA graph capture,
  the Triton path on CUDA with norm graphs on (``DORACHECK_NORM_GRAPHS``), m fp32 or 16-bit of
  stride 1, a single process (no torch.distributed group of more than one: FSDP's forward
  prefetch or DeepSpeed could be gathering a later layer's parameters into place on another
  stream while the first member reads them, which no layout or version check sees; DeepSpeed
  ZeRO-3 parameters are refused by their ``ds_id`` too). On a CPU the group refreshes eagerly
  (each member's norm launched in turn, no graph): no saving, the same rule, which is what the
  CPU tests exercise.

One write nothing can see: ``param.data`` (or ``set_``) changed in place at the same address
and layout *during* one forward, after the first member's call and before another member's (a
forward hook editing a layer's adapters or its frozen weight mid-forward, e.g. weight noise
written through ``.data``; no framework we know of does this). Turn groups off for such a model
(``DORACHECK_NORM_GROUPS=0`` or ``enable(model, norm_buffers=False)``). The layer-by-layer path
read the parameters at each layer's own call; a group reads them all at the first member's.

A group is learnt, not declared: the sequence of planned layers that asked for a norm in a
training era is recorded, and when two consecutive eras saw the same sequence (no layer twice;
at most ``MAX_MEMBERS`` are recorded) of at least ``MIN_MEMBERS`` layers, it becomes the group
of its place at the next era's first call. A group whose members were not all used in two
refreshes running, or one of whose members no longer matches its layer, is dropped and learnt
again (two eras). A group goes when one of its B tensors is freed (a deleted model: its graph
and rows with it) and at ``norm_graphs.clear()``.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import norm_cache
from .kernels import norm_graphs
from .kernels.backends import Backend, FactoredNorm
from .kernels.settings import cublas_cross_pieces
from .layer_state import LayerArgs

ENABLED = os.environ.get("DORACHECK_NORM_GROUPS", "1") != "0"  # read at import; the attribute at run time
MIN_MEMBERS = 2  # one layer gains nothing from a group
MAX_MEMBERS = 4096  # a longer sequence in one era is not recorded further
IDLE_REFRESHES = 2  # refreshes running with a member unused before the group is dropped
_G_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # m dtypes the one-kernel scaled norm takes

_lock = threading.RLock()
_tls = threading.local()  # this thread's open forwards of enabled models (``_open_entries``)
_pass_ids = itertools.count(1)
_groups: dict[tuple, _Group] = {}  # place (device, stream, path, pass root) -> its group
_learning: dict[tuple, dict] = {}  # place -> {"era", "current": [sightings], "previous": [keys] or None}
_stats = {"groups": 0, "refreshes": 0, "taken": 0, "dropped": 0}


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class _Member:
    """One layer of a group: weak references to its W, A, B, m, their layouts, its s, its rows'
    place in the group's output, and the version counters at the last refresh."""

    __slots__ = ("refs", "layouts", "scaling", "offset", "d_out", "versions", "taken")

    def __init__(self, tensors: tuple, scaling: float, offset: int, place: tuple):
        # B's reference drops the group when B is freed (a deleted model): its graph and rows go then
        self.refs = tuple(weakref.ref(t, _forgetter(place) if i == 2 else None) for i, t in enumerate(tensors))
        self.layouts = tuple(_layout(t) for t in tensors)
        self.scaling = scaling
        self.offset = offset
        self.d_out = tensors[0].shape[0]
        self.versions: tuple | None = None
        self.taken = False

    def tensors(self) -> tuple | None:
        """(W, A, B, m) if all alive at the layouts the group reads, else None."""
        tensors: tuple[Any, ...] = tuple(ref() for ref in self.refs)
        if any(t is None for t in tensors) or tuple(_layout(t) for t in tensors) != self.layouts:
            return None
        return tensors

    def is_layer(self, a: LayerArgs) -> bool:
        refs = self.refs
        return (refs[0]() is a.weight and refs[1]() is a.lora_A and refs[2]() is a.lora_B and refs[3]() is a.magnitude
                and float(a.scaling) == self.scaling
                and (_layout(a.weight), _layout(a.lora_A), _layout(a.lora_B), _layout(a.magnitude)) == self.layouts)


class _Group:
    """The members of one place (device, stream, path, pass root), their captured norms (CUDA) or
    none (CPU), and the rows of the last refresh."""

    def __init__(self, keys: list, members: list[_Member], backend: Backend, graph: Any, out: torch.Tensor | None):
        self.keys = keys  # the sequence of sightings it was made from
        self.members = members
        self.slots = {id(m.refs[2]()): i for i, m in enumerate(members)}  # id(B) -> index
        self.backend = backend
        self.graph, self.out = graph, out
        self.when: tuple | None = None  # (era, pass id) of the last refresh
        self.rows: Any = None  # the refreshed rows: a flat tensor (graph) or a list of (fn, n_safe, g)
        self.idle = 0

    def refresh(self, when: tuple) -> bool:
        """Recompute every member's norm (one replay, or each launched on a CPU); False where
        the group no longer holds (then it is dropped)."""
        # graphs off since: a capture failed (``norm_graphs.clear()`` drops the groups itself)
        if self.graph is not None and not norm_graphs.enabled():
            return False
        if self.when is not None:
            self.idle = self.idle + 1 if not all(m.taken for m in self.members) else 0
            if self.idle >= IDLE_REFRESHES:
                return False
        current: list[Any] = [m.tensors() for m in self.members]
        if any(t is None for t in current):
            return False
        if self.graph is not None:
            self.rows = norm_graphs.replay_launches(self.graph, self.out)
        else:
            self.rows = [_scaled(self.backend, W, A, B, mag, m.scaling) for (W, A, B, mag), m in zip(current, self.members)]
        for t, m in zip(current, self.members):
            m.versions = tuple(x._version for x in t)
            m.taken = False
        self.when = when
        _stats["refreshes"] += 1
        return True

    def take(self, i: int) -> tuple:
        m = self.members[i]
        m.taken = True
        _stats["taken"] += 1
        if self.graph is None:
            return self.rows[i]
        base, cross, lora, n, n_safe, g = self.rows[m.offset:m.offset + 6 * m.d_out].view(6, m.d_out).unbind(0)
        return FactoredNorm(base, cross, lora, n, None, None), n_safe, g


def _forgetter(place: tuple):
    def forget(_ref) -> None:
        with _lock:
            group = _groups.get(place)
            if group is not None and any(m.refs[2] is _ref for m in group.members):
                del _groups[place]
                _stats["dropped"] += 1
    return forget


def _scaled(backend: Backend, weight: Any, lora_A: Any, lora_B: Any, magnitude: Any, scaling: float) -> tuple:
    """(FactoredNorm without U and G, n_safe, g): what a layer computes alone (``forward.norm_and_scale``)."""
    fn, n_safe, g = backend.scaled_norm(weight, lora_A, lora_B, magnitude, scaling, False)
    return fn._replace(U=None, G=None), n_safe, g


def _running(frame: Any) -> bool:
    """Whether ``frame`` is on this thread's stack (its call has not returned or unwound)."""
    f: Any = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def _open_entries() -> list:
    """This thread's open forwards (passes), innermost last: (id of the module, the frame that
    called its pre-hook, the pass's number). An entry whose frame has left the stack is dropped here: its forward
    ended without its forward hook (Ctrl-C skips even ``always_call`` hooks). Entries are pushed
    in call order, so once the innermost is running every one below it is too."""
    entries = getattr(_tls, "entries", None)
    if entries is None:
        entries = _tls.entries = []
    while entries and not _running(entries[-1][1]):
        entries.pop()
    return entries


def current_pass() -> tuple | None:
    """(id of its module, its number) of the innermost pass still running on this thread, or None."""
    entries = _open_entries()
    return (entries[-1][0], entries[-1][2]) if entries else None


def begin_pass(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of an enabled model and of its base model: each of their forwards is a
    pass of its own (the base model's, inside its model's forward, holds every layer of it). The
    pass is anchored to the frame that runs the forward (the caller of this hook): it is open
    exactly while that frame is on the stack, so a forward interrupted by Ctrl-C (torch calls
    ``always_call`` hooks on ``Exception`` only) leaves no pass open for the user's code after it
    (found by the test suite, and again in review with a ``.data`` write and a direct call of an
    inner module after the interrupt). A base model never joins an enclosing pass (found in
    review: a second model's base model called from a hook of the first joined the first's pass
    and took its group's rows from before the hook's ``.data`` update)."""
    if torch.compiler.is_compiling():
        return
    _open_entries().append((id(module), sys._getframe(1), next(_pass_ids)))


begin_outer_pass = begin_pass  # the hook's name in whole models pickled before it was merged into begin_pass


def end_pass(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook (``always_call``: on an exception too): the module's entry goes (and with it
    the reference to its frame, which holds the forward's locals)."""
    if torch.compiler.is_compiling():
        return
    entries = _open_entries()
    if entries and entries[-1][0] == id(module):
        entries.pop()


def _end_pass(*_args: Any) -> None:
    """No forward of this thread is under way once a backward or an optimizer step runs in it
    (a second guard: the frame anchor already closes a pass whose forward is gone). On CUDA the
    autograd engine runs backwards in its own threads; there this clears that thread's entries."""
    _tls.entries = []


norm_cache.on_backward(_end_pass)
register_optimizer_step_post_hook(_end_pass)


def _distributed() -> bool:
    """More than one process in torch.distributed: FSDP (with forward prefetch) or DeepSpeed
    may be gathering a later layer's parameters into their places on another stream while the
    first member reads them (no layout or version check sees that)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _place(backend: Backend, a: LayerArgs) -> tuple | None:
    """((device, stream, backend, root of the pass), the pass's number) of this call where a
    group may serve it, else None."""
    W, m = a.weight, a.magnitude
    if (not ENABLED or a.fan_in_fan_out or not a.detach_norm or m.dtype not in _G_DTYPES or m.dim() != 1
            or m.stride(0) != 1 or m.device != W.device or norm_cache._in_backward() or not norm_cache._cacheable()
            or _distributed()):
        return None
    open_pass = current_pass()
    if open_pass is None:
        return None
    root, pass_id = open_pass
    if W.is_cuda:
        if (backend.name != "triton" or not norm_graphs.enabled() or W.device.index != torch.cuda.current_device()
                or torch.cuda.is_current_stream_capturing()):
            return None
        return (W.device.index, norm_cache._stream_of(W), backend.name, root), pass_id
    return (str(W.device), None, backend.name, root), pass_id


def scaled_norm(backend: Backend, a: LayerArgs) -> tuple | None:
    """(FactoredNorm, n_safe, g) of a planned layer's training forward from its group, or None
    (the layer computes its norm alone). The module docstring says when."""
    found = _place(backend, a)
    if found is None:
        return None
    place, pass_id = found
    era = norm_cache.era()
    with _lock:
        _learn(place, a, era, backend)
        group = _groups.get(place)
        i = group.slots.get(id(a.lora_B)) if group is not None else None
        return _from_group(place, group, i, a, (era, pass_id)) if group is not None and i is not None else None


def _from_group(place: tuple, group: _Group, i: int, a: LayerArgs, when: tuple) -> tuple | None:
    """``when``: (era, pass id) of this call."""
    member = group.members[i]
    if not member.is_layer(a):
        _drop(place)
        return None
    if group.when != when or member.taken:
        if not group.refresh(when):
            _drop(place)
            return None
    if tuple(t._version for t in (a.weight, a.lora_A, a.lora_B, a.magnitude)) != member.versions:
        return None  # written in place since the refresh: this layer computes its own
    return group.take(i)


def _drop(place: tuple) -> None:
    if _groups.pop(place, None) is not None:
        _stats["dropped"] += 1


def _sighting(a: LayerArgs) -> tuple:
    tensors = (a.weight, a.lora_A, a.lora_B, a.magnitude)
    return tuple(id(t) for t in tensors) + tuple(_layout(t) for t in tensors) + (float(a.scaling),), tensors


def _learn(place: tuple, a: LayerArgs, era: int, backend: Backend) -> None:
    """Record this call in its era's sequence. At the first call of a new era, where the two
    eras before it saw the same sequence and it is not the group's already, make the group
    from it (replacing the one there)."""
    state = _learning.get(place)
    if state is None:
        state = _learning[place] = {"era": era, "current": [], "previous": None}
    if state["era"] != era:
        finished = [key for key, _ in state["current"]]
        if (state["previous"] is not None and finished == state["previous"] and len(finished) >= MIN_MEMBERS
                and len(set(finished)) == len(finished)):
            group = _groups.get(place)
            if group is None or group.keys != finished:
                _groups.pop(place, None)
                _make(place, finished, [weak for _, weak in state["current"]], backend)
        state.update(era=era, current=[], previous=finished)
    if len(state["current"]) < MAX_MEMBERS:
        key, tensors = _sighting(a)
        state["current"].append((key, _Sighting(tensors, float(a.scaling))))


class _Sighting:
    """A sighting's tensors, held weakly until the group is made."""

    __slots__ = ("refs", "scaling")

    def __init__(self, tensors: tuple, scaling: float):
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.scaling = scaling


def _make(place: tuple, keys: list, sightings: list, backend: Backend) -> bool:
    """Make the group of ``place`` from the tensors of a sequence (alive, unchanged); on CUDA
    capture every member's norm into one graph."""
    tensors = [tuple(ref() for ref in s.refs) for s in sightings]
    if any(t is None for ts in tensors for t in ts):
        return False
    # Each layer's tensors at the layouts its own call saw: a framework that gathers a layer's
    # parameters only for its own forward (sharded in between) never forms a group.
    if any(tuple(_layout(t) for t in ts) != key[4:8] for ts, key in zip(tensors, keys)):
        return False
    if any(hasattr(t, "ds_id") for ts in tensors for t in ts):  # DeepSpeed ZeRO-3 parameters (gathered per module)
        return False
    members, offset = [], 0
    for ts, s in zip(tensors, sightings):
        members.append(_Member(ts, s.scaling, offset, place))
        offset += 6 * ts[0].shape[0]
    graph = out = None
    if tensors[0][0].is_cuda:  # one graph of every member's norm, its rows in one flat output
        from .kernels.norm_triton import norm_terms

        def terms() -> torch.Tensor:
            return torch.cat([norm_terms(W, A, B, s.scaling, False, m).reshape(-1) for (W, A, B, m), s in zip(tensors, sightings)])

        blas = any(cublas_cross_pieces(W.dtype, A.dtype) > 0 for W, A, _, _ in tensors)
        captured = norm_graphs.capture_launches(tensors[0][0].device, terms, blas)
        if captured is None:
            return False
        graph, out = captured
    _groups[place] = _Group(keys, members, backend, graph, out)
    _stats["groups"] += 1
    return True


def clear() -> None:
    """Drop every group and what was learnt (``norm_graphs.clear()`` calls it; a group that
    outlives ``clear_norm_cache`` is safe: the era it ends makes the group refresh)."""
    with _lock:
        _groups.clear()
        _learning.clear()


norm_graphs.on_clear(clear)


def stats() -> dict:
    """{"groups" made, "refreshes", "taken" (rows a layer used), "dropped", "members" now}."""
    with _lock:
        # a copy: a B freed by the garbage collector during the sum drops its group (``_forgetter``,
        # same thread, so the lock does not hold it off)
        return {**_stats, "members": sum(len(g.members) for g in list(_groups.values()))}
