"""Test configuration shared by every test module.

- Without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  triton.jit decorates the kernels, so it is set here, at collection time.
- With several GPUs, pytest-xdist worker gwN is pinned to GPU N mod count.
- hypothesis profiles: "ci" (derandomized, bounded, no deadline; the default) and "long".
- Ctrl-C reaches the commands the CLI tests start, however pytest itself was started (below).
- The repository root is taken off ``sys.path`` (below).
- Under pytest-xdist each worker gets its share of the CPU threads (below).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

# The repository root holds the folder kernels/, installed as ``doracheck.kernels``. With the root
# on sys.path (``python -m pytest`` puts the working directory there) that folder would stand in
# for an installed top-level ``kernels`` package (HuggingFace's, which transformers imports), and
# test modules would fail to collect. The tests import doracheck as installed, never from the root.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != _ROOT]
if getattr(sys.modules.get("kernels"), "__file__", None) == str(_ROOT / "kernels" / "__init__.py"):
    del sys.modules["kernels"]

# Each xdist worker would otherwise run torch (and every command a test starts) on all cores: with
# `-n auto` on 16 cores, 16 workers of 16 threads each. On the H200 machine the suite then took
# 8 min 45 s, its CPU-bound tests several times their serial time. Set before any work runs.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(_threads))
    os.environ["OMP_NUM_THREADS"] = _threads  # the commands the CLI tests start inherit it

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # cuBLAS is bitwise reproducible only with a fixed workspace configuration (PyTorch's
    # reproducibility notes); set before the first cuBLAS handle so determinism tests hold.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from doracheck.properties.gpu_workers import gpu_for_worker

    _gpu = gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())
    if _gpu is not None:
        torch.cuda.set_device(_gpu)

# A background job of a non-interactive shell (`bash .ci/run &`, or a runner that starts its steps
# so) inherits SIGINT ignored, and an ignored signal stays ignored across exec: every command the
# CLI tests start would then ignore their Ctrl-C, and the tests that check exit 130 fail (seen on
# this project's CI machine kind, 5 such failures, none with pytest in the foreground). A handled
# signal is reset to its default at exec, so handling it here gives the children a terminal's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", derandomize=True, max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.register_profile("long", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test extra
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
