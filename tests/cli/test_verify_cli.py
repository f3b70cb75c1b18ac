"""``doracheck verify`` and ``doracheck calibrate`` as a user meets them: no false comfort.

- an implementation on which nothing can be checked (n/a everywhere) is exit 2 with the reason;
- ``--impl peft`` without PEFT is exit 2 naming the install line;
- PEFT's NaN on a zero row is reported once, by edge.zero_row, and leaves the accuracy rows finite;
- the reason of every n/a is printed;
- calibrate reports tightness (error over bound) and proposes no budget row.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from doracheck.cli.main import main


def test_nothing_checkable_is_exit_2_with_the_reason(na_module, capsys):
    assert main(["verify", "--impl", f"{na_module}:never", "--quick", "--dtype", "fp32"]) == 2
    assert "nothing could be checked" in capsys.readouterr().err


def test_peft_missing_is_exit_2(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "peft" else real(name, *a, **k))
    assert main(["verify", "--impl", "peft", "--quick", "--dtype", "fp32"]) == 2
    assert "pip install peft" in capsys.readouterr().err


def test_peft_zero_row_nan_is_reported_once_not_in_every_accuracy_row(capsys):
    pytest.importorskip("peft")
    code = main(["verify", "--impl", "peft", "--quick", "--dtype", "fp32", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1  # PEFT fails edge.zero_row (NaN) and the compose/row-scaling properties
    rows = {r["prop"]: r for r in doc["results"]}
    assert rows["edge.zero_row"]["status"] == "FAIL"
    for prop in ("forward.y", "backward.dx", "backward.dA", "backward.dB", "backward.dm", "ratio.forward.y"):
        assert math.isfinite(rows[prop]["worst"]), rows[prop]


def test_na_reasons_are_printed(capsys):
    pytest.importorskip("peft")
    main(["verify", "--impl", "peft", "--quick", "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert "n/a  norm.three_term [fp32]:" in out


def test_calibrate_reports_tightness_and_proposes_nothing(capsys):
    assert main(["calibrate", "--cases", "2", "--dtype", "fp32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"] and all(0 <= r["tightness"] <= 1 for r in doc["rows"])
    assert all("proposed" not in r for r in doc["rows"])
