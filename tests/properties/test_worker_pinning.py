"""pytest-xdist workers are spread over the GPUs: worker gwN runs on GPU N mod count."""

from __future__ import annotations

import os

import pytest
import torch

from doracheck.properties.gpu_workers import gpu_for_worker


@pytest.mark.parametrize(
    "worker, count, expected",
    [("gw0", 2, 0), ("gw1", 2, 1), ("gw2", 2, 0), ("gw7", 4, 3), ("gw13", 8, 5),
     ("gw3", 1, None), ("gw3", 0, None), ("master", 4, None), (None, 4, None), ("gwx", 2, None)],
)
def test_gpu_for_worker(worker, count, expected):
    assert gpu_for_worker(worker, count) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="runs under pytest-xdist")
def test_this_worker_runs_on_its_own_gpu():
    worker = os.environ["PYTEST_XDIST_WORKER"]
    expected = int(worker[2:]) % torch.cuda.device_count()
    assert torch.cuda.current_device() == expected
    x = torch.ones(4, device="cuda")
    assert x.device.index == expected
