"""FSDP2 (``fully_shard``) training with doracheck on the CPU: 2 processes over gloo.

benchmarks/fsdp.py (the same script runs on 2 GPUs over NCCL) trains a tiny LLaMA-style
model with PEFT DoRA + ``enable`` under FSDP2 and, on rank 0, the same training unsharded on
one device; the per-step losses must agree, every DoRA layer must run through doracheck, and
the norm cache must stand aside (FSDP2 keeps the unsharded parameters' version counters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp.py"


def _run_two_ranks(device: str, steps: int, env: dict) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--device", device, "--mode", "check", "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # a rank's own traceback comes before torchrun's summary, so show the start of stderr too
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[:4000]}\n...\n{done.stderr[-3000:]}"
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_fsdp2_training_on_two_gpus_matches_one_gpu():
    """NCCL over GPUs 0 and 1 (NVLink multicast left off), 50 steps, against rank 0 alone."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    report = _run_two_ranks("cuda", 50, env)
    assert report["enabled_layers"] == 14 and report["norm_cache_stands_aside"]
    assert report["mean_abs_dloss"] <= 1e-3, report


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp2_training_on_two_cpu_ranks_matches_one_device():
    report = _run_two_ranks("cpu", 10, {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert report["world"] == 2
    assert report["enabled_layers"] == 14  # 2 decoder layers x 7 DoRA linears, all through doracheck
    assert report["norm_cache_stands_aside"] and not report["norm_cache_on"]
    assert len(report["losses"]) == 10
    assert all(torch.isfinite(torch.tensor(report["losses"])))
    assert report["mean_abs_dloss"] <= 1e-5, report  # fp32 both ways: only summation order differs
