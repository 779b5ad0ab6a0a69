"""tilefuse bench serving, tiny through the interpreter on CPU: the step loop runs, writes a
valid result file and a plot, and sees no compile after warm-up."""

from __future__ import annotations

import json

import pytest

from tilefuse.bench import report
from tilefuse.bench.suites import serving


def test_step_sequence_changes_shapes_every_step():
    steps = serving.step_sequence(serving.ServingShape(steps=6))
    assert len({(s.s_q, s.s_k) for s in steps}) == 6 and len({s.batch for s in steps}) > 1
    assert all(s.s_k >= s.s_q and len(s.context_lens) == s.batch for s in steps)
    assert serving.bucket_of(3, (1, 2, 4)) == 4 and serving.bucket_of(5, (1, 2, 4)) is None


def test_cli_runs_tiny_and_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    rc = serving.main(["--layers", "2", "--steps", "2", "--modes", "eager", "--no-peer", "-q", "-o", str(out),
                       "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    result = report.load_result(out)
    rows = result["rows"]
    assert {r["x"] for r in rows} >= {"wall per step", "host per call"}
    assert all(r["status"] == "ok" and r["compiles_after_warmup"] == 0 for r in rows)
    assert all(len(r["stats"]["samples_us"]) == 2 for r in rows)
    assert json.loads(out.read_text())["suite"] == "serving"


def test_cli_rejects_bad_options(capsys):
    assert serving.main(["--modes", "fast", "--no-output"]) == 2
    assert serving.main(["--layers", "0", "--no-output"]) == 2
    assert "--layers" in capsys.readouterr().out
