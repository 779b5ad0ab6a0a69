"""Result files (schema, every sample kept), tables and progress."""

import io
import json
from pathlib import Path

import pytest

from tilefuse.bench import report

from .results_factory import result, row


def test_write_and_load_keep_every_sample(tmp_path):
    samples = [float(i) for i in range(40)]
    res = result([row("a | tilefuse", samples, tflops=float("inf"))])
    path = report.write_result(res, tmp_path / "sub" / "r.json")
    raw = json.loads(path.read_text())  # standard JSON: no NaN/Infinity literals
    assert raw["schema"] == report.SCHEMA
    assert raw["rows"][0]["stats"]["samples_us"] == samples
    assert raw["rows"][0]["tflops"] == "inf"
    loaded = report.load_result(path)
    assert loaded["rows"][0]["key"] == "a | tilefuse"


def test_schema_errors(tmp_path):
    with pytest.raises(ValueError, match="schema"):
        report.validate_result({"schema": "other"})
    res = result([row("a", [1.0]), row("a", [2.0])])
    with pytest.raises(ValueError, match="duplicate key"):
        report.validate_result(res)
    res = result([row("a", [1.0], status="bogus")])
    with pytest.raises(ValueError, match="status"):
        report.validate_result(res)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        report.load_result(bad)


def test_default_output_path_is_under_the_checkout_wherever_it_runs(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[2]
    if report.checkout_root() is None:
        pytest.skip("tilefuse is imported from an installed package, not this checkout")
    monkeypatch.chdir(tmp_path)
    assert report.checkout_root() == root
    path = report.default_output_path("paged", "h200")
    assert path.is_absolute() and path.parent == root / "benchmarks" / "results" / "h200"
    assert path.name.startswith("paged-") and path.suffix == ".json"
    monkeypatch.setattr(report, "checkout_root", lambda: None)  # an installed package
    assert report.results_root() == tmp_path / "benchmarks" / "results"


def test_results_table_lists_every_row_and_ceilings():
    ceilings = {"fp8_matmul": {"available": True, "value": 1340.0, "unit": "TFLOP/s"},
                "copy": {"available": False, "reason": "x"}}
    rows = [row("a | tilefuse", [10.0, 11.0], tflops=900.0, ceiling="fp8_matmul"),
            row("a | deep_gemm", None, status="skipped", impl="deep_gemm")]
    rows[0]["ratio_to_ceiling"] = 900.0 / 1340.0
    rows[0]["peer_ratio"] = {"torch eager": 30.0}
    rows[1]["note"] = "skipped: deep_gemm not installed"
    table = report.results_table(result(rows, ceilings=ceilings))
    assert "900.0" in table and "0.67 fp8_matmul" in table and "30.00x torch eager" in table
    assert "SKIPPED: skipped: deep_gemm not installed" in table
    assert "fp8_matmul 1340.00 TFLOP/s" in table and "copy unavailable" in table


def test_format_table_alignment():
    t = report.format_table(["a", "bb"], [["x", "1"], ["yyy", "22"]], "lr")
    assert t.splitlines() == ["a    bb", "---  --", "x     1", "yyy  22"]


def test_progress_plain_stream():
    buf = io.StringIO()
    p = report.Progress(2, stream=buf)
    p.step("first")
    p.note("hello")
    p.step("second")
    p.close()
    assert buf.getvalue() == "[1/2] first\nhello\n[2/2] second\n"
    quiet = io.StringIO()
    report.Progress(2, stream=quiet, enabled=False).step("x")
    assert quiet.getvalue() == ""
