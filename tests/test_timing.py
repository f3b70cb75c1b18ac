"""``doracheck.timing``: the side-by-side timer interleaves its callables and amortises short
calls, checked against a fake clock (no sleeps: deterministic on a loaded CI machine)."""

from __future__ import annotations

import pytest

from doracheck import timing


@pytest.fixture
def fake_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_time_interleaved_rotates_and_batches(fake_clock):
    order = []

    def work(name, seconds):
        def fn():
            order.append(name)
            fake_clock[0] += seconds
        return fn

    fns = {"short": work("short", 0.5e-3), "long": work("long", 3e-3)}
    times = timing.time_interleaved(fns, "cpu", rounds=4, warmup=2, min_sample_ms=2.0)
    # per call, whatever the batch size: 0.5 ms and 3 ms
    assert times["short"] == pytest.approx([0.5] * 4) and times["long"] == pytest.approx([3.0] * 4)
    # warm-up (2) and one probe call each, then rounds whose first callable rotates; a 0.5 ms call
    # is timed 4 to a sample (2 ms), a 3 ms one alone
    timed = order[2 * 3:]
    rounds = []
    while timed:
        first = timed[0]
        k = 4 if first == "short" else 1
        other = "long" if first == "short" else "short"
        rounds.append(timed[:k] + timed[k:k + (1 if other == "long" else 4)])
        timed = timed[5:]
    assert [r[0] for r in rounds] == ["short", "long", "short", "long"]
    assert all(sorted(r) == ["long"] + ["short"] * 4 for r in rounds)


def test_time_ms_is_sorted_and_counts_reps(fake_clock):
    steps = iter([1e-3, 3e-3, 2e-3] * 3)

    def fn():
        fake_clock[0] += next(steps)

    assert timing.time_ms(fn, "cpu", reps=3, warmup=3) == pytest.approx([1.0, 2.0, 3.0])
