"""The implementations ``doracheck verify`` can judge, as ``doracheck.properties.Implementation``s.

- ``doracheck``: the public API (Triton on CUDA, torch elsewhere), with its norm, module and cache;
- ``torch``: the same with the pure-torch path forced;
- ``peft``: PEFT 0.21's own DoRA layer (``doracheck.properties.impl_peft``);
- ``MODULE:CALLABLE``: any callable with ``dora_linear``'s signature, or ``MODULE:NAME`` naming an
  ``Implementation`` (a norm function and a module class with it); ``doracheck:dora_linear`` and
  ``doracheck.properties.impl_peft:peft_dora_linear`` are doracheck and ``peft`` in full.

``doracheck verify``'s glue between library and properties: the library (``doracheck``,
``doracheck.planner``, ...) is imported when an implementation is resolved, never at import time;
``doracheck.properties``' ``__init__`` does not import this module."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import torch

from .props_common import Implementation


class ImplementationError(Exception):
    """The --impl spec cannot be resolved (a usage error)."""


def doracheck_implementation(path: str | None = None) -> Implementation:
    """doracheck itself (``path`` = "torch" forces the pure-torch path)."""
    import doracheck
    from doracheck.dispatch import choose_path, forced_path
    from doracheck.kernels import norm_memory_bound
    from doracheck.kernels.settings import triton_norm_memory_bound
    from doracheck.norm_rule import clear_norm_cache

    def bound(d_out, d_in, r, device="cpu", lora_B_dtype=None):
        on_triton = choose_path(torch.device(device)).name == "triton" and path != "torch"
        return triton_norm_memory_bound(d_out, d_in, r, lora_B_dtype) if on_triton else norm_memory_bound(d_out, d_in, r)

    wrap = (lambda f: forced_path(path, f)) if path else (lambda f: f)
    return Implementation(
        name=path or "doracheck",
        dora_linear=wrap(doracheck.dora_linear),
        factored_norm=wrap(doracheck.factored_norm),
        module_cls=doracheck.DoRALinear,
        clear_cache=clear_norm_cache,
        norm_memory_bound=bound,
        setting=small_chunks,
    )


SUITE_CHUNK_BYTES = 2048  # T·d_out·itemsize above this is backpropagated in token chunks


@contextlib.contextmanager
def small_chunks():
    """The backward's token-chunking threshold at ``SUITE_CHUNK_BYTES`` instead of 32 MiB of dz
    (never reached at the suite's sizes): the larger problems take the chunked backward (a few
    tokens a chunk, a short last one), the smaller ones the whole one."""
    from doracheck.kernels import settings

    saved = settings.BACKWARD_CHUNK_BYTES
    settings.BACKWARD_CHUNK_BYTES = SUITE_CHUNK_BYTES
    try:
        yield
    finally:
        settings.BACKWARD_CHUNK_BYTES = saved


def doracheck_variant_implementation(variant: str) -> Implementation:
    """doracheck with the planner's choice replaced by ``variant`` (e.g. "merged+whole"), so the
    suite can verify every variant the planner may pick."""
    from doracheck.planner import parse_variant, use_variant

    chosen = parse_variant(variant)
    base = doracheck_implementation()

    def with_variant(fn):
        def wrapper(*args, **kwargs):
            with use_variant(chosen):
                return fn(*args, **kwargs)

        return wrapper

    base.name = f"doracheck@{chosen.name}"
    base.dora_linear = with_variant(base.dora_linear)
    return base


def resolve(spec: str) -> Implementation:
    """'doracheck' | 'doracheck@VARIANT' | 'torch' | 'peft' | 'MODULE:CALLABLE' -> Implementation."""
    if spec == "doracheck":
        return doracheck_implementation()
    if spec.startswith("doracheck@"):
        try:
            return doracheck_variant_implementation(spec.partition("@")[2])
        except ValueError as exc:
            raise ImplementationError(f"--impl: {exc}") from None
    if spec == "torch":
        return doracheck_implementation("torch")
    if spec == "peft":
        if importlib.util.find_spec("peft") is None:
            raise ImplementationError("--impl peft: PEFT is not installed here (pip install peft, or pip install -e '.[peft]')")
        from doracheck.properties.impl_peft import peft_dora_linear

        return Implementation(name="peft", dora_linear=peft_dora_linear)
    if ":" not in spec:
        raise ImplementationError(f"--impl: expected doracheck, doracheck@VARIANT, torch, peft or MODULE:CALLABLE, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImplementationError(f"--impl: cannot import module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if isinstance(fn, Implementation):  # a norm function and a module class come with it
        return fn
    if not callable(fn):
        raise ImplementationError(f"--impl: {module_name!r} has no callable {attr!r}")
    return _known(fn) or Implementation(name=spec, dora_linear=fn)


def _known(fn) -> Implementation | None:
    """The full implementation behind a callable that is one of ours: ``doracheck:dora_linear``
    is doracheck (with its norm, module and cache), the PEFT wrapper is ``peft``."""
    import doracheck

    if fn is doracheck.dora_linear:
        return doracheck_implementation()
    if getattr(fn, "__module__", "") == "doracheck.properties.impl_peft" and getattr(fn, "__name__", "") == "peft_dora_linear":
        return Implementation(name="peft", dora_linear=fn)
    return None
