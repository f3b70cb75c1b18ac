"""Computation-order planner for the DoRA layer (the RunLoRA idea, arXiv 2312.03415): a DoRA layer can be
computed in several orders giving the same function, the fastest depending on d_in, d_out, r, the token count
T and the dtype. The planner enumerates them, predicts each one's time from a cost model (FLOPs and bytes
against the device's measured ceilings, plus the host's cost per op) or times them once per shape, and picks
one; ``dora_linear`` asks it on every call (cached per shape).

Variants (``Variant``):
- ``order`` "factored": base = x·Wᵀ, xa = x·Aᵀ, then the up-projection xa·Bᵀ fused with the compose; backward
  dx = dz·W + s·(dz·B)·A. Extra FLOPs over nn.Linear: 2·T·r·(d_in + d_out) forward.
- ``order`` "merged": W' = W + s·B·A in the compute dtype (an fp32-accumulated GEMM, rounded once),
  y = g⊙(x·W'ᵀ) (+ b); backward: W' again, dx = dz·W'. Extra: 2·d_out·r·d_in FLOPs a pass (any T) and a
  d_out×d_in temporary. A 16-bit W' moves each weight up to half an ulp, breaking the compose's 0.5-ulp
  property (docs/design.md section 2); in fp32 by 2^-24 relative, far inside every fp32 budget. So "merged" is
  a candidate only in fp32, without dropout, with the detached norm, where its temporary fits the allowance.
- ``chunked`` (training): the backward's dz = g⊙dy a token chunk at a time (settings.BACKWARD_CHUNK_BYTES) or
  whole; a chunked dB is summed over chunks in fp32.
- ``save_xa`` (training): keep x·Aᵀ (T×r) from the forward or recompute it (bitwise the same GEMM): T×r
  activations against 2·T·r·d_in FLOPs.

Memory allowance: at most ``max(32 MiB, 0.25·T·d_out·itemsize)`` of peak memory over the plain linear layer's
(target: <= 1.25x nn.Linear + 32 MiB); a variant's own extra must fit in what the adapter gradients and their
fp32 accumulators leave in training (the default always fits)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from doracheck.kernels.settings import backward_token_chunk


@dataclass(frozen=True)
class Variant:
    order: str = "factored"  # "factored" | "merged"
    chunked: bool = True  # training: backward over token chunks (when dz is large)
    save_xa: bool = True  # training: keep x·Aᵀ from the forward

    @property
    def name(self) -> str:
        return f"{self.order}{'' if self.chunked else '+whole'}{'' if self.save_xa else '+recompute_xa'}"


DEFAULT = Variant()


@dataclass(frozen=True)
class Ceilings:
    """What the cost model divides by. H200: bf16 GEMM 687 TFLOP/s (8192³, cuBLAS), copy 4246 GB/s (read +
    write); fp32 GEMM bf16/14 (no tensor cores; cuBLAS fp32 ~50 TFLOP/s, datasheet 67); kernel ≥ ``kernel_s``.
    Host cost per op, from the host-bound rows (T = 1 and 256) of ``doracheck bench --plan`` on two H200s,
    pooled: forward 38 µs (median no_grad forward 0.230 ms over 6 modelled ops; 0.262 and 0.210 ms per
    table), backward 65 µs (autograd and Python backward in; median training call 1.235 ms measured, 1.241
    predicted). Host time varies ±40% by machine and run: only side-by-side timings compare."""

    gemm_flops_16: float = 687e12
    gemm_flops_32: float = 49e12
    copy_bytes: float = 4.25e12
    kernel_s: float = 4e-6
    host_fwd_op_s: float = 38e-6
    host_bwd_op_s: float = 65e-6


H200 = Ceilings()


@dataclass
class Plan:
    variant: Variant
    predicted_ms: dict[str, float]  # variant name -> predicted ms, every candidate
    measured_ms: dict[str, float] | None = None  # in timing mode
    reason: str = ""
    candidates: list[Variant] = field(default_factory=list)

    def __repr__(self) -> str:  # ms rounded to 4 significant digits; variants by name
        def ms(d: dict[str, float] | None) -> str:
            return "None" if d is None else "{" + ", ".join(f"{k!r}: {v:.4g}" for k, v in d.items()) + "}"

        return (f"Plan(variant={self.variant.name!r}, reason={self.reason!r}, predicted_ms={ms(self.predicted_ms)}, "
                f"measured_ms={ms(self.measured_ms)}, candidates={[v.name for v in self.candidates]!r})")

    def __str__(self) -> str:
        """``factored (cost model); predicted ms: factored 1.566, merged 2.104``."""
        text = f"{self.variant.name} ({self.reason})" if self.reason else self.variant.name
        text += "; predicted ms: " + ", ".join(f"{k} {v:.4g}" for k, v in self.predicted_ms.items())
        if self.measured_ms is not None:
            text += "; measured ms: " + ", ".join(f"{k} {v:.4g}" for k, v in self.measured_ms.items())
        return text


# Process-wide, not a ContextVar: the backward (autograd's device threads) and non-reentrant checkpoint
# recompute run outside the caller's context and must choose as the forward did (saved tensors depend on it).
_FORCED: list[Variant | None] = [None]
_MAX_PLANS = 4096
_PLANS: dict[tuple, Variant] = {}
_TIMED: dict[tuple, dict[str, float]] = {}
_MODE: list[str] = ["cost"]
_MEASURE: list[Callable[..., dict[str, float]] | None] = [None]  # None: ``doracheck.measure.measure_variants``


@contextlib.contextmanager
def use_variant(variant: Variant | str) -> Iterator[None]:
    """Force a variant (a ``Variant`` or its ``name``, e.g. "merged+whole") for every call in the
    process while the block is open (for testing: keep the backward and any checkpoint recompute
    inside). Not checked for precision: "merged" then runs in 16-bit too, where it fails."""
    previous = _FORCED[0]
    _FORCED[0] = parse_variant(variant) if isinstance(variant, str) else variant
    try:
        yield
    finally:
        _FORCED[0] = previous


def parse_variant(name: str) -> Variant:
    parts = name.split("+")
    if parts[0] not in ("factored", "merged") or any(p not in ("whole", "recompute_xa") for p in parts[1:]):
        raise ValueError(f"variant: expected factored|merged[+whole][+recompute_xa], got {name!r}")
    return Variant(parts[0], "whole" not in parts[1:], "recompute_xa" not in parts[1:])


def memory_allowance(d_out: int, tokens: int, itemsize: int) -> int:
    return max(32 * 2**20, tokens * d_out * itemsize // 4)


def extra_bytes(v: Variant, d_in: int, d_out: int, r: int, tokens: int, itemsize: int, training: bool) -> int:
    """Peak bytes a variant adds beyond what every variant needs."""
    extra = d_out * d_in * itemsize if v.order == "merged" else 0
    if training:
        dz_whole = tokens * d_out * itemsize
        extra += (dz_whole if not v.chunked else backward_token_chunk(tokens, d_out, itemsize) * d_out * itemsize)
        extra += tokens * r * itemsize if v.save_xa else 0
    return extra


def candidates(d_in: int, d_out: int, r: int, tokens: int, dtype: torch.dtype, training: bool,
               dropout: bool = False, detach_norm: bool = True) -> list[Variant]:
    """The variants allowed for this call: precision (merged only in fp32) and memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    orders = ["factored"] + (["merged"] if dtype in (torch.float32, torch.float64) and not dropout and detach_norm else [])
    flags = [(True, True), (False, True), (True, False), (False, False)] if training else [(True, True)]
    if training and backward_token_chunk(tokens, d_out, itemsize) >= tokens:
        # dz fits in one chunk: "+whole" is the same program (timing both would time noise)
        flags = [f for f in flags if f[0]]
    # The adapter gradients, their fp32 accumulators and 4 MiB of small buffers come out of the
    # allowance first. The default is always allowed (the memory targets were measured on it).
    fixed = (2 * 4 + 2 * itemsize) * (d_in + d_out) * r + 4 * 2**20 if training else 0
    allowance = memory_allowance(d_out, tokens, itemsize) - fixed
    out = []
    for order, (chunked, save_xa) in itertools.product(orders, flags):
        v = Variant(order, chunked, save_xa)
        if v == DEFAULT or extra_bytes(v, d_in, d_out, r, tokens, itemsize, training) <= allowance:
            out.append(v)
    return out


def _gemm(m: int, n: int, k: int, itemsize: int, ceil: Ceilings, fp32: bool) -> float:
    flops = 2.0 * m * n * k
    bytes_ = (m * k + k * n + m * n) * itemsize
    rate = ceil.gemm_flops_32 if fp32 else ceil.gemm_flops_16
    return max(flops / rate, bytes_ / ceil.copy_bytes) + ceil.kernel_s


def _pass(bytes_: float, ceil: Ceilings) -> float:
    return bytes_ / ceil.copy_bytes + ceil.kernel_s


def predict_ms(v: Variant, d_in: int, d_out: int, r: int, tokens: int, dtype: torch.dtype, training: bool,
               ceil: Ceilings = H200) -> float:
    """Predicted ms of one call (forward, or forward + backward when ``training``): the larger
    of the GPU time (a roofline per kernel plus a fixed cost) and the host time to issue it."""
    T, isz, fp32 = tokens, torch.empty((), dtype=dtype).element_size(), dtype in (torch.float32, torch.float64)
    # forward: g = m/n (inside the compose kernel when nothing is saved), reshape, the autograd node
    gpu, ops, bwd_ops = 0.0, (4 if training else 3), 0
    gpu += _gemm(T, d_out, d_in, isz, ceil, fp32)  # base = x·Wᵀ (or x·W'ᵀ)
    ops += 1
    if v.order == "merged":
        gpu += _gemm(d_out, d_in, r, isz, ceil, fp32) + _pass(2 * d_out * d_in * isz, ceil)  # W' = W + s·B·A
        gpu += _pass(2 * T * d_out * isz, ceil)  # y = g⊙base + b
        ops += 2
        if training:
            gpu += _gemm(T, r, d_in, isz, ceil, fp32)  # xa, for dB
            ops += 1
    else:
        gpu += _gemm(T, r, d_in, isz, ceil, fp32)  # xa
        gpu += _gemm(T, d_out, r, isz, ceil, fp32) + _pass(2 * T * d_out * isz, ceil)  # fused up-projection + compose
        ops += 2
    if training:
        step = T if not v.chunked else backward_token_chunk(T, d_out, isz)
        chunks = -(-T // step) if T else 0
        gpu += _pass(3 * T * d_out * isz, ceil) + chunks * ceil.kernel_s  # dz = g⊙dy, dm partials
        gpu += _gemm(T, r, d_out, isz, ceil, fp32)  # dz·B
        gpu += _gemm(T, d_in, d_out, isz, ceil, fp32)  # dz·W (or dz·W')
        gpu += _gemm(d_out, r, T, isz, ceil, fp32)  # dB = s·dzᵀ·xa
        gpu += _gemm(r, d_in, T, isz, ceil, fp32)  # dA = s·(dz·B)ᵀ·x
        if chunks > 1 and v.order == "factored" and dtype != torch.float16:
            # dz·B, dB and s·(dz·B)·A over all tokens; per chunk dz/dm, dx += dz·W (autograd.py)
            bwd_ops += 15 + 2 * chunks
        else:  # per chunk: dz/dm launch, dz·B, dz·W, addmm, dB GEMM + accumulate
            bwd_ops += 9 + 6 * chunks
        if v.order == "merged":
            gpu += _gemm(d_out, d_in, r, isz, ceil, fp32) + _pass(2 * d_out * d_in * isz, ceil)
            bwd_ops += 1
        else:
            gpu += _gemm(T, d_in, r, isz, ceil, fp32)  # s·(dz·B)·A
        if not v.save_xa:
            gpu += _gemm(T, r, d_in, isz, ceil, fp32)
            bwd_ops += 1
    return 1e3 * max(gpu, ops * ceil.host_fwd_op_s + bwd_ops * ceil.host_bwd_op_s)


def plan(d_in: int, d_out: int, r: int, tokens: int, dtype: torch.dtype = torch.bfloat16, training: bool = False, *,
         timed: bool = False, device: torch.device | str = "cuda", dropout: bool = False, detach_norm: bool = True,
         ceilings: Ceilings = H200, measure: Callable[..., dict[str, float]] | None = None,
         refresh: bool = False) -> Plan:
    """The variant for a DoRA layer of this shape, with every candidate's predicted time. With ``timed`` the
    fastest measured: ``measure(candidates, d_in, d_out, r, tokens, dtype, training, device, dropout=...,
    detach_norm=...)`` -> {name: ms} times them side by side once per shape (cached; ``refresh`` measures
    again); default ``measure.measure_variants``, imported when first needed (it imports the planner)."""
    cands = candidates(d_in, d_out, r, tokens, dtype, training, dropout, detach_norm)
    predicted = {v.name: predict_ms(v, d_in, d_out, r, tokens, dtype, training, ceilings) for v in cands}
    if not timed:
        best = min(cands, key=lambda v: (predicted[v.name], v != DEFAULT))
        return Plan(best, predicted, None, "cost model", cands)
    key = (d_in, d_out, r, tokens, dtype, training, dropout, detach_norm, str(device))
    if refresh or key not in _TIMED:
        if len(_TIMED) >= _MAX_PLANS:  # many distinct token counts: start over rather than grow
            _TIMED.clear()
        if measure is None:
            measure = _MEASURE[0]
        if measure is None:
            from .measure import measure_variants as measure
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"plan(timed=True): device {device!r} is not available here (pass device='cpu' to time on the CPU)")
        _TIMED[key] = measure(cands, d_in, d_out, r, tokens, dtype, training, device, dropout=dropout, detach_norm=detach_norm)
    measured = _TIMED[key]
    best = min(cands, key=lambda v: measured[v.name])
    return Plan(best, predicted, dict(measured), "timed", cands)


def choose(d_in: int, d_out: int, r: int, tokens: int, dtype: torch.dtype, training: bool, dropout: bool,
           detach_norm: bool, device: torch.device) -> Variant:
    """What ``dora_linear`` runs: a forced variant, else the planner's choice cached per shape: the cost
    model's on a GPU, or with ``set_mode("timed")`` the fastest measured (any device, on fresh inputs at
    its first call). A forced "merged" with dropout or the exact norm gradient runs "factored", same flags."""
    if torch.compiler.is_compiling():
        return DEFAULT  # compiled graphs keep one order (and Dynamo does not trace ContextVar)
    forced = _FORCED[0]
    if forced is not None:
        if forced.order == "merged" and (dropout or not detach_norm):
            return Variant("factored", forced.chunked, forced.save_xa)
        return forced
    timed = _MODE[0] == "timed" and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if device.type != "cuda" and not timed:
        return DEFAULT  # the cost model's ceilings describe the GPU
    key = (d_in, d_out, r, tokens, dtype, training, dropout, detach_norm, timed, device)
    v = _PLANS.get(key)
    if v is None:
        if len(_PLANS) >= _MAX_PLANS:  # many distinct token counts: start over rather than grow
            _PLANS.clear()
        v = _PLANS[key] = plan(d_in, d_out, r, tokens, dtype, training, timed=timed, device=device, dropout=dropout,
                               detach_norm=detach_norm).variant
    return v


def set_mode(mode: str) -> None:
    """How ``dora_linear`` plans, process-wide: "cost" (default) or "timed" (each new shape's candidates
    measured once, the fastest kept; ``DORACHECK_PLAN`` sets the start). Timing costs about 15 calls per
    candidate and a second set of inputs per new shape; never under graph capture or torch.compile."""
    if mode not in ("cost", "timed"):
        raise ValueError(f"planner mode: expected 'cost' or 'timed', got {mode!r}")
    _MODE[0] = mode
    _PLANS.clear()


__all__ = ["DEFAULT", "H200", "Ceilings", "Plan", "Variant", "candidates", "choose",
           "parse_variant", "plan", "predict_ms", "set_mode", "use_variant"]


try:
    set_mode(os.environ.get("DORACHECK_PLAN", "cost"))
except ValueError as exc:
    raise ValueError(f"environment variable DORACHECK_PLAN: {exc}") from None
