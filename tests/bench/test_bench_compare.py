"""tilefuse compare: speedups, spread, regression gate on tilefuse rows, rows in one file only."""

import json

import pytest

from tilefuse import cli
from tilefuse.bench.compare import NothingToCompare, compare, comparison_table, context_warnings

from .results_factory import result, row


def diffs_by_key(diffs):
    return {d.key: d for d in diffs}


def test_verdicts_and_gate():
    before = result([
        row("same", [10.0, 10.1, 9.9]),
        row("slower", [10.0, 10.1, 9.9]),
        row("faster", [10.0, 10.1, 9.9]),
        row("noisy", [10.0, 8.0, 13.0]),
        row("gone", [5.0]),
        row("breaks", [5.0]),
    ])
    after = result([
        row("same", [10.2, 10.1, 10.3]),
        row("slower", [12.0, 12.1, 11.9]),
        row("faster", [8.0, 8.1, 7.9]),
        row("noisy", [11.0, 9.0, 14.0]),
        row("breaks", [5.0], status="failed"),
        row("new", [1.0]),
    ])
    d = diffs_by_key(compare(before, after, tolerance=0.05))
    assert not d["same"].regression and d["same"].verdict == "within tolerance"
    assert d["slower"].regression and d["slower"].beyond_spread and d["slower"].verdict.startswith("REGRESSION")
    assert abs(d["slower"].speedup - 10.0 / 12.0) < 1e-9
    assert not d["faster"].regression and d["faster"].verdict == "faster"
    assert d["noisy"].regression and not d["noisy"].beyond_spread  # 10% slower, within the spread
    assert d["gone"].verdict == "only in before" and not d["gone"].regression
    assert d["new"].verdict == "only in after" and not d["new"].regression
    assert d["breaks"].regression and d["breaks"].verdict == "now failed"
    # Options: significance required, missing rows fail.
    d = diffs_by_key(compare(before, after, tolerance=0.05, significant_only=True, fail_on_missing=True))
    assert not d["noisy"].regression and d["slower"].regression and d["gone"].regression
    d = diffs_by_key(compare(before, after, tolerance=0.25))
    assert not d["slower"].regression
    table = comparison_table(compare(before, after))
    assert "only in after" in table and "0.833x" in table


def test_context_warnings():
    a = result([row("x", [1.0])])
    b = result([row("x", [1.0])], gpu="NVIDIA H100", mode="batch")
    w = context_warnings(a, b)
    assert any("devices" in s for s in w) and any("modes" in s for s in w)


def test_cli_exit_codes(tmp_path, capsys):
    before = tmp_path / "b.json"
    after_ok = tmp_path / "ok.json"
    after_bad = tmp_path / "bad.json"
    before.write_text(json.dumps(result([row("k", [10.0, 10.0])])))
    after_ok.write_text(json.dumps(result([row("k", [10.2, 10.2])])))
    after_bad.write_text(json.dumps(result([row("k", [11.0, 11.0])])))
    assert cli.main(["compare", str(before), str(after_ok)]) == 0
    assert cli.main(["compare", str(before), str(after_bad)]) == 1
    assert cli.main(["compare", str(before), str(after_bad), "--tolerance", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "1 regression(s)" in out
    assert cli.main(["compare", str(before), str(tmp_path / "missing.json")]) == 2


def test_peer_rows_are_shown_not_gated():
    before = result([row("k | tilefuse", [10.0, 10.0]), row("k | torch eager", [50.0, 50.0], impl="torch eager"),
                     row("k | cublas", [20.0, 20.0], impl="cublas"), row("k | deep_gemm", [9.0], impl="deep_gemm")])
    after = result([row("k | tilefuse", [10.1, 10.1]), row("k | torch eager", [90.0, 90.0], impl="torch eager"),
                    row("k | cublas", [20.0, 20.0], impl="cublas")])
    d = diffs_by_key(compare(before, after, fail_on_missing=True))
    assert not d["k | tilefuse"].peer and not d["k | tilefuse"].regression
    eager = d["k | torch eager"]
    assert eager.peer and not eager.regression and eager.verdict == "REGRESSION (+80.0%) (peer: not gated)"
    assert d["k | deep_gemm"].peer and not d["k | deep_gemm"].regression  # missing, but a peer
    # A row's own label wins over its name: a tilefuse variant called like a peer still gates.
    before["rows"][2]["peer"] = False
    after["rows"][2]["peer"] = False
    after["rows"][2]["stats"]["median_us"] = 30.0
    d = diffs_by_key(compare(before, after))
    assert not d["k | cublas"].peer and d["k | cublas"].regression


def test_no_common_tilefuse_row_is_an_error():
    before = result([row("a | tilefuse", [1.0]), row("a | torch eager", [5.0], impl="torch eager")])
    with pytest.raises(NothingToCompare, match="no tilefuse row is in both files"):
        compare(before, result([row("b | tilefuse", [1.0])]))
    with pytest.raises(NothingToCompare, match="1 keys in common"):  # only the peer row is shared
        compare(before, result([row("a | torch eager", [5.0], impl="torch eager")]))


def test_cli_gates_on_tilefuse_rows_and_refuses_disjoint_files(tmp_path, capsys):
    before, after, other = tmp_path / "b.json", tmp_path / "a.json", tmp_path / "o.json"
    before.write_text(json.dumps(result([row("k | tilefuse", [10.0]), row("k | nccl", [10.0], impl="nccl")])))
    after.write_text(json.dumps(result([row("k | tilefuse", [10.0]), row("k | nccl", [20.0], impl="nccl")])))
    other.write_text(json.dumps(result([row("z | tilefuse", [10.0])])))
    assert cli.main(["compare", str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "peer: not gated" in out and "0 regression(s) beyond 5.0% in 1 tilefuse rows" in out
    assert "(1 peer rows shown, not gated)" in out
    assert cli.main(["compare", str(before), str(other)]) == 2
    captured = capsys.readouterr()
    assert "tilefuse compare: no tilefuse row is in both files" in captured.err and "regression" not in captured.out
