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


def _work(order, clock, name, seconds):
    def fn():
        order.append(name)
        clock[0] += seconds
    return fn


def test_time_interleaved_batches_short_calls_and_rotates(fake_clock):
    order: list[str] = []
    fns = {"s": _work(order, fake_clock, "s", 0.5e-3), "l": _work(order, fake_clock, "l", 3e-3)}
    times = timing.time_interleaved(fns, "cpu", rounds=4, warmup=2, min_sample_ms=2.0)
    # per call, whatever the batch size: 0.5 ms and 3 ms
    assert times["s"] == pytest.approx([0.5] * 4) and times["l"] == pytest.approx([3.0] * 4)
    # warm-up (2) and one probe call each; then a 0.5 ms call is timed 4 to a sample (2 ms), a
    # 3 ms one alone, and the first callable of a round alternates
    assert "".join(order) == "sss" + "lll" + "ssssl" + "lssss" + "ssssl" + "lssss"


def test_time_interleaved_rotates_rather_than_reverses(fake_clock):
    order: list[str] = []
    fns = {c: _work(order, fake_clock, c, 3e-3) for c in "abc"}
    timing.time_interleaved(fns, "cpu", rounds=3, warmup=0)
    assert "".join(order) == "abc" + "abc" + "bca" + "cab"


@pytest.mark.parametrize("fns, rounds", [({}, 3), ({"a": lambda: None}, 0)])
def test_time_interleaved_rejects_nothing_to_time(fns, rounds):
    with pytest.raises(ValueError, match="at least one callable and one round"):
        timing.time_interleaved(fns, "cpu", rounds=rounds)


def test_time_ms_is_sorted_and_counts_reps(fake_clock):
    steps = iter([1e-3, 3e-3, 2e-3] * 3)

    def fn():
        fake_clock[0] += next(steps)

    assert timing.time_ms(fn, "cpu", reps=3, warmup=3) == pytest.approx([1.0, 2.0, 3.0])
