"""``tilefuse bench paged --sweep``: the grid, and a tiny run through the interpreter."""

from __future__ import annotations

import pytest

from tilefuse import cli
from tilefuse.bench import report
from tilefuse.bench.suites import paged as suite

from ..conftest import ON_GPU

TINY = ["--samples", "2", "--calls", "1", "--quiet", "--no-clocks"]


def test_sweep_grid():
    specs = suite.sweep_specs()
    rows = {(s.batch, s.next_n, s.mean_ctx) for s in specs}
    assert {s.batch for s in specs} == set(suite.SWEEP_BATCH) and {s.mean_ctx for s in specs} == set(suite.SWEEP_CTX)
    assert all(b * c <= suite.SWEEP_MAX_TOKENS for b, _, c in rows)
    assert (1024, 4, 32768) in rows and (1024, 1, 65536) not in rows
    # Every row in every combination of heads, page size and logits dtype.
    assert len(specs) == len(rows) * 2 * 2 * 2
    big = [s for s in specs if not s.references]
    assert big and all(s.batch * s.mean_ctx >= 2**20 for s in big)
    assert len({s.name for s in specs}) == len(specs)
    assert not any(s.eager for s in specs)  # the sweep is tilefuse beside DeepGEMM: no torch eager row
    only = suite.sweep_specs(shapes=[(64, 2, 8192)])
    assert len(only) == 8 and {s.logits_dtype for s in only} == {"float32", "bfloat16"}


@pytest.mark.skipif(ON_GPU, reason="the tiny run is for the CPU interpreter")
def test_sweep_runs_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = cli.main(["bench", "paged", "--sweep", "--shapes", "2x2x96", "--output", str(out), "--mode", "batch", *TINY])
    assert rc == 0, capsys.readouterr().err
    res = report.load_result(out)
    assert res["settings"]["sweep"] is True
    mine = [r for r in res["rows"] if r["impl"] == "tilefuse"]
    assert len(mine) == 4 and all(r["status"] == "ok" for r in mine)
    assert {r["params"]["logits_dtype"] for r in mine} == {"float32", "bfloat16"}
    assert {r["params"]["block_kv"] for r in mine} == {32, 64}
    assert {r["impl"] for r in res["rows"]} <= {"tilefuse", "deep_gemm"}


def test_sweep_skips_what_deepgemm_sm90_does_not_run(monkeypatch):
    # DeepGEMM's SM90 decode kernel asserts on pages other than 64 tokens and on next_n past 2:
    # its row is a skip with the reason, never an error (which also failed the tilefuse rows
    # checked against it).
    monkeypatch.setattr(suite, "capability_major", lambda device: 9)
    spec = lambda **kw: suite.Spec("fp8", 8, kw.pop("next_n", 1), 4096, 64, **kw)
    assert suite.sm90_peer_skip(spec(), "cuda") is None
    assert suite.sm90_peer_skip(spec(next_n=2), "cuda") is None
    assert "next_n 1 or 2" in suite.sm90_peer_skip(spec(next_n=4), "cuda").skipped
    assert "block_kv 64" in suite.sm90_peer_skip(spec(block_kv=32), "cuda").skipped
    monkeypatch.setattr(suite, "capability_major", lambda device: 10)
    assert suite.sm90_peer_skip(spec(next_n=4, block_kv=32), "cuda") is None


def test_unquantised_limit_loosens_only_for_few_query_rows():
    # One request's few query rows decide the FP8 estimate by their own quantisation draws; from
    # FEW_QUERY_ROWS rows on the check is DeepGEMM's 1e-3, and the MX limits never move.
    spec = lambda fmt, b, n: suite.Spec(fmt, b, n, 4096, 64)
    assert suite.original_limit(spec("fp8", 1, 1)) == suite.FEW_ROWS_ORIGINAL_LIMIT["fp8"]
    assert suite.original_limit(spec("fp8", 1, 4)) == suite.FEW_ROWS_ORIGINAL_LIMIT["fp8"]
    assert suite.original_limit(spec("fp8", 8, 1)) == 1e-3
    assert suite.original_limit(spec("fp8", 2, 4)) == 1e-3
    for fmt in ("mxfp8", "mxfp4"):
        assert suite.original_limit(spec(fmt, 1, 1)) == suite.ORIGINAL_LIMIT[fmt]
