"""Timed plans are keyed by everything that changes the fastest order."""

from __future__ import annotations

import torch


def test_timed_plans_are_keyed_by_dropout_and_norm_mode():
    from doracheck.planner import plan

    def fake(variants, *args, **kwargs):
        return {v.name: 1.0 if v.order == "merged" else 2.0 for v in variants}

    shape = (96, 80, 8, 70000, torch.float32, True)
    with_dropout = plan(*shape, timed=True, device="cpu", dropout=True, measure=fake)
    without = plan(*shape, timed=True, device="cpu", dropout=False, measure=fake)
    assert with_dropout.variant.order == "factored" and without.variant.order == "merged"
