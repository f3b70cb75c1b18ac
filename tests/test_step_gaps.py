"""benchmarks/step_gaps.py reads a Chrome trace and charges each idle gap of the GPU timeline to
the CPU op chain that launched the kernel ending it. Checked here on small synthetic traces
(the tool itself needs a GPU to record one), so its figures in the README rest on tested code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
step_gaps = pytest.importorskip("step_gaps")


def _x(cat, name, ts, dur, tid=1, corr=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def _trace():
    return [
        _x("user_annotation", "forward", 0, 100),
        _x("cpu_op", "DoRAFromBaseFunction", 10, 50),
        _x("cpu_op", "aten::mm", 20, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, corr=1),  # launched before the GPU was idle
        _x("cuda_runtime", "cuLaunchKernelEx", 25, 2, corr=2),  # launched 13 µs after it went idle
        _x("kernel", "k1", 8, 4, tid=7, corr=1),  # busy 8-12
        _x("kernel", "k2", 30, 4, tid=7, corr=2),  # busy 30-34: an 18 µs gap the host caused
        _x("user_annotation", "backward", 200, 100, tid=1),
        _x("cuda_runtime", "cudaLaunchKernel", 3, 2, tid=2, corr=3),  # launched before the gap began
        _x("kernel", "k3", 40, 5, tid=7, corr=3),  # busy 40-45: a 6 µs gap that is not the host's wait
    ]


def test_a_gap_is_charged_to_the_op_chain_that_launched_the_kernel_ending_it():
    result = step_gaps.analyse(_trace(), min_gap_us=2.0, steps=1)
    assert result["gpu_busy_ms_per_step"] == pytest.approx(13e-3)
    assert result["span_ms_per_step"] == pytest.approx(37e-3)
    assert result["idle_ms_per_step"] == pytest.approx(24e-3)
    assert result["host_wait_idle_ms_per_step"] == pytest.approx(18e-3)
    assert result["other_idle_ms_per_step"] == pytest.approx(6e-3)
    assert result["idle_by_phase_ms_per_step"] == {"forward": pytest.approx(18e-3)}
    (top,) = result["top"]
    assert (top["phase"], top["where"], top["launch"]) == ("forward", "DoRAFromBaseFunction > aten::mm", "cuLaunchKernelEx")


def test_gaps_below_the_threshold_are_not_counted():
    result = step_gaps.analyse(_trace(), min_gap_us=10.0, steps=1)
    assert result["host_wait_idle_ms_per_step"] == pytest.approx(18e-3)
    assert result["other_idle_ms_per_step"] == 0  # the 6 µs gap is below 10
    halved = step_gaps.analyse(_trace(), min_gap_us=2.0, steps=2)
    assert halved["host_wait_idle_ms_per_step"] == pytest.approx(9e-3)  # per step over two steps


def test_nested_ops_give_the_outermost_first():
    stacks = step_gaps._Stacks([
        _x("cpu_op", "outer", 0, 100), _x("cpu_op", "middle", 10, 50), _x("cpu_op", "inner", 20, 5),
        _x("cpu_op", "sibling", 70, 10),
    ])
    assert stacks.enclosing(1, 22) == ["outer", "middle", "inner"]
    assert stacks.enclosing(1, 40) == ["outer", "middle"]
    assert stacks.enclosing(1, 75) == ["outer", "sibling"]
    assert stacks.enclosing(1, 150) == []
