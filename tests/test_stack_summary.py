"""benchmarks/stack_summary.py: py-spy's collapsed stacks summarised (a diagnostic's analysis,
checked on synthetic stacks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import stack_summary  # noqa: E402

STACKS = [
    "<module> (host_sample_step.py:52);main (host_sample_step.py:26);build (bench_model.py:37);x (a.py:1) 50",
    "main (host_sample_step.py:44);step (host_sample_step.py:33);forward (doracheck/autograd.py:141);"
    "norm (kernels/backends.py:108);norm (kernels/backends.py:110) 6",
    "main (host_sample_step.py:44);step (host_sample_step.py:33);forward (doracheck/autograd.py:141) 2",
    "main (host_sample_step.py:44);step (host_sample_step.py:33);forward (doracheck/autograd.py:141);"
    "compile (triton/compiler/compiler.py:298);make_llir (triton/backends/nvidia/compiler.py:378) 40",
    "run (threading.py:1) 2",
]


def test_construction_and_one_off_compiles_are_left_out_and_functions_count_once_per_sample():
    total, inclusive, leaves = stack_summary.summarise(stack_summary.parse(STACKS), ("doracheck/", "kernels/"))
    assert total == 10  # 6 + 2 + 2: the build and the compile left out
    assert inclusive["forward (doracheck/autograd.py)"] == 8
    assert inclusive["norm (kernels/backends.py)"] == 6  # twice on one stack, counted once
    assert leaves["norm (kernels/backends.py:110)"] == 6 and leaves["forward (doracheck/autograd.py:141)"] == 2
    assert "run (threading.py)" not in inclusive and leaves["run (threading.py:1)"] == 2


def test_ms_a_step_from_the_rate_and_steps(tmp_path, capsys, monkeypatch):
    path = tmp_path / "stacks.txt"
    path.write_text("\n".join(STACKS) + "\n")
    monkeypatch.setattr(sys, "argv", ["stack_summary.py", str(path), "--rate", "100", "--steps", "2", "--top", "3"])
    assert stack_summary.main() == 0
    out = capsys.readouterr().out
    assert "10 samples outside the model's construction, 50.0 ms of thread time a step" in out
    assert " 80.0%   40.00 ms  forward (doracheck/autograd.py)" in out  # 8 samples × 10 ms / 2 steps
