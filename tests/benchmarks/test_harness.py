"""benchmarks/harness.py: the result CSVs, the timing statistics and the A/B interleaving (CPU, fast)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_results_append_rows_with_every_field(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    monkeypatch.setattr(harness, "_ENV", None)
    path = tmp_path / "layer.csv"
    results = harness.Results("layer", ["tokens", "mode"], path)
    stats = harness.Stats.of([1.0, 2.0, 3.0, 4.0, 5.0])
    results.add({"impl": "linear", "shape": "64x48r8", "dtype": "bf16", "unit": "ms", "tokens": 16, "mode": "infer",
                 **stats.row(), "rounds": 2})
    results.add({"impl": "doracheck_bf16", "shape": "64x48r8", "dtype": "bf16", "unit": "ms", "tokens": 16, "mode": "infer",
                 **stats.row(), "rounds": 2})
    header, rows = _rows(path)
    assert header[: len(harness.ENV_FIELDS)] == harness.ENV_FIELDS
    for field in ["commit", "gpu", "torch", "triton", "peft", "transformers", "date", "shape", "dtype", "median", "p10",
                  "p90", "rounds", "n", "tokens", "mode"]:
        assert field in header
    assert [r["impl"] for r in rows] == ["linear", "doracheck_bf16"]
    assert rows[0]["commit"] == "abc1234" and rows[0]["median"] == "3.0" and rows[0]["p10"] == "1.4"
    assert rows[0]["gpu"] and rows[0]["torch"] and rows[0]["date"]

    again = harness.Results("layer", ["tokens", "mode"], path)  # a later run appends, header once
    again.add({"impl": "linear", "median": 9.0})
    header2, rows2 = _rows(path)
    assert header2 == header and len(rows2) == 3 and rows2[2]["median"] == "9.0" and rows2[2]["mode"] == ""
    assert path.read_text().count("date,commit") == 1


def test_a_new_column_rewrites_the_header_once_and_keeps_the_rows(tmp_path):
    path = tmp_path / "x.csv"
    harness.append_row(path, ["a", "b"], {"a": 1, "b": 2})
    harness.append_row(path, ["a", "b", "c"], {"a": 3, "c": 4})
    header, rows = _rows(path)
    assert header == ["a", "b", "c"]
    assert rows == [{"a": "1", "b": "2", "c": ""}, {"a": "3", "b": "", "c": "4"}]


def test_an_undeclared_column_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not declared"):
        harness.append_row(tmp_path / "x.csv", ["a"], {"a": 1, "typo": 2})
    assert not (tmp_path / "x.csv").exists()


def test_smoke_and_test_runs_never_write_to_results(monkeypatch):
    monkeypatch.delenv("BENCH_RESULTS", raising=False)
    assert harness.RESULTS not in harness.results_path("layer").parents  # under pytest (PYTEST_CURRENT_TEST)
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert harness.results_path("layer") == harness.RESULTS / "layer.csv"
    assert harness.RESULTS not in harness.results_path("layer", smoke=True).parents
    monkeypatch.setenv("BENCH_RESULTS", "/somewhere")
    assert harness.results_path("layer") == Path("/somewhere/layer.csv")


def test_quantiles_interpolate_between_order_statistics():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert harness.quantile(xs, 0.5) == 3.0
    assert harness.quantile(xs, 0.0) == 1.0 and harness.quantile(xs, 1.0) == 5.0
    assert harness.quantile(xs, 0.1) == pytest.approx(1.4)
    assert harness.quantile(xs, 0.9) == pytest.approx(4.6)
    assert harness.quantile([7.0], 0.9) == 7.0


def test_time_fn_warms_up_then_returns_median_and_quantiles_of_reps():
    calls = []
    stats = harness.time_fn(lambda: calls.append(1), reps=7, warmup=2, device="cpu")
    assert len(calls) == 9
    assert stats.n == 7
    assert 0 <= stats.p10 <= stats.median <= stats.p90
    row = stats.row()
    assert set(row) == {"median", "p10", "p90", "n"}


def test_time_call_records_the_host_time_to_issue():
    host: list[float] = []
    ms = harness.time_call(lambda: sum(range(1000)), "cpu", host)
    assert len(host) == 1 and ms >= 0 and host[0] == ms


def test_rounds_alternate_the_order():
    assert harness.round_orders(["A", "B"], 4) == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    assert harness.round_orders(["A", "B", "C"], 2, alternate=False) == [["A", "B", "C"]] * 2


def test_interleaved_runs_every_case_in_every_round_settling_after_each_switch():
    log: list[str] = []
    switches: list[str] = []
    counter = {"A": 0, "B": 0}

    def case(name):
        def sample():
            counter[name] += 1
            log.append(name)
            return float(counter[name])

        return sample

    samples = harness.interleaved({"A": case("A"), "B": case("B")}, rounds=3, per_round=2, settle=1,
                                  between=switches.append)
    assert switches == ["A", "B", "B", "A", "A", "B"]
    assert log == ["A"] * 3 + ["B"] * 3 + ["B"] * 3 + ["A"] * 3 + ["A"] * 3 + ["B"] * 3
    # each turn: one settling call (dropped), then two samples
    assert samples["A"] == [[2.0, 3.0], [5.0, 6.0], [8.0, 9.0]]
    assert samples["B"] == [[2.0, 3.0], [5.0, 6.0], [8.0, 9.0]]
    assert harness.drop_settling([1, 2, 3, 4, 5, 6], per_round=2, settle=1) == [2, 3, 5, 6]


def test_summarise_gives_ratio_to_the_reference_and_its_spread_over_rounds():
    samples = {"A": [[10.0, 10.0], [10.0, 10.0], [20.0, 20.0]], "B": [[11.0, 11.0], [9.0, 9.0], [22.0, 22.0]]}
    out = harness.summarise(samples, ref="A")
    assert out["A"].ratio == 1.0 and out["A"].rounds == 3
    assert out["B"].stats.median == 11.0
    assert out["B"].ratio == pytest.approx(11.0 / 10.0)
    assert out["B"].ratio_p10 == pytest.approx(harness.quantile([1.1, 0.9, 1.1], 0.1))
    assert out["B"].ratio_p90 == pytest.approx(1.1)
    row = out["B"].row()
    assert {"median", "p10", "p90", "n", "rounds", "ratio", "ratio_p10", "ratio_p90"} <= set(row)
    alone = harness.summarise(samples)
    assert alone["B"].ratio != alone["B"].ratio  # nan without a reference


def test_table_lines_up_columns():
    text = harness.table([{"a": 1.23456, "b": "x"}, {"a": 2, "b": "long"}], ["a", "b"])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b"] and lines[1].split() == ["1.235", "x"] and len(lines) == 3


def test_ab_stages_a_checkout_under_another_package_name(tmp_path):
    """ab.py imports two commits side by side by renaming the package in a copy."""
    import ab
    checkout = tmp_path / "checkout"
    (checkout / "doracheck" / "integrations").mkdir(parents=True)
    (checkout / "kernels").mkdir()
    (checkout / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "doracheck" = "doracheck", "doracheck.kernels" = "kernels" }\n')
    (checkout / "doracheck" / "__init__.py").write_text("from doracheck.kernels import OPS\nNAME = 'doracheck::op'\n")
    (checkout / "doracheck" / "integrations" / "__init__.py").write_text("")
    (checkout / "kernels" / "__init__.py").write_text("OPS = 'torch.ops.doracheck'\nKEEP = 'doracheck_bf16 DORACHECK_PATH'\n")
    assert ab.package_dirs(checkout) == {"doracheck": "doracheck", "doracheck.kernels": "kernels"}
    site, _ = ab.stage(str(checkout), "dc_t", tmp_path / "stage")
    assert (site / "dc_t" / "kernels" / "__init__.py").read_text() == (
        "OPS = 'torch.ops.dc_t'\nKEEP = 'doracheck_bf16 DORACHECK_PATH'\n")
    sys.path.insert(0, str(site))
    try:
        import dc_t

        assert dc_t.NAME == "dc_t::op" and dc_t.OPS == "torch.ops.dc_t"
    finally:
        sys.path.remove(str(site))
        for name in [m for m in sys.modules if m == "dc_t" or m.startswith("dc_t.")]:
            del sys.modules[name]
