"""What the norm rule keys a stored norm on beyond the tensors: the path, the CUDA stream, FSDP2."""

from __future__ import annotations

import pytest
import torch
from layer_problems import PATHS, problem, run_python

import doracheck
from doracheck.dispatch import use_path
from doracheck.norm_rule import clear_norm_cache


def test_norm_cache_entries_are_per_path():
    """A norm cached by one path used to be served to the other."""
    if len(PATHS) < 2:
        pytest.skip("needs the interpreter for the Triton path")
    x, W, A, B, m = problem()
    clear_norm_cache()
    from doracheck import norm_rule as norm_cache

    with use_path("torch"):
        doracheck.dora_linear(x, W, A, B, m, 2.0)
    misses = norm_cache.norm_cache_stats()["misses"]
    with use_path("triton"):
        doracheck.dora_linear(x, W, A, B, m, 2.0)
    assert norm_cache.norm_cache_stats()["misses"] == misses + 1


def test_a_stored_norm_is_read_only_on_the_stream_it_was_computed_on(monkeypatch):
    """Threads serving one model with a CUDA stream each: a norm computed on stream A must not
    be read on stream B, which could read it before A's kernels finish (the current stream is
    part of the cache key; stand-in streams here)."""
    from doracheck import norm_rule as norm_cache

    stream = {"now": 1}
    monkeypatch.setattr(norm_cache, "_stream_of", lambda t: stream["now"])
    clear_norm_cache()
    W, A, B = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    computed = []

    def compute():
        computed.append(stream["now"])
        return torch.ones(6)

    with torch.no_grad():
        for now in (1, 1, 2, 2, 1):
            stream["now"] = now
            norm_cache.lookup_or_compute(W, A, B, 1.0, False, compute, recording=False)
    assert computed == [1, 2, 1]  # each stream computes its own; the same stream reads its own
    clear_norm_cache()


def test_fsdp_detection_survives_the_pre_2_6_layout_and_same_size_registry():
    """In a fresh process (FSDP detection is sticky): with torch < 2.6's module layout the
    forward still runs; an FSDP state registered while another state died (same registry size)
    is still seen."""
    out = run_python(
        "import sys, gc, torch, torch.nn as nn\n"
        "sys.modules['torch.distributed.fsdp._fully_shard._fsdp_state'] = None\n"
        "import doracheck\n"
        "W = torch.randn(8, 16); A = torch.randn(4, 16); B = torch.randn(8, 4); m = torch.rand(8) + 0.5\n"
        "doracheck.dora_linear(torch.randn(3, 16), W, A, B, m, 2.0)\n"
        "del sys.modules['torch.distributed.fsdp._fully_shard._fsdp_state']\n"
        "from torch.distributed._composable_state import _insert_module_state, _State, _module_state_mapping\n"
        "from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState\n"
        "from doracheck.norm_rule import fsdp_active\n"
        "m1 = nn.Linear(2, 2); s1 = _State(); _insert_module_state(m1, s1)\n"
        "a = fsdp_active(); n1 = len(_module_state_mapping)\n"
        "del m1; gc.collect()\n"
        "m2 = nn.Linear(2, 2); s2 = FSDPState(); _insert_module_state(m2, s2)\n"
        "print(a, fsdp_active(), n1 == len(_module_state_mapping))\n"
    )
    assert out.split() == ["False", "True", "True"]
