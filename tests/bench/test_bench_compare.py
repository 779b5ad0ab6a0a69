"""tilefuse compare: speedups, spread, regression gate, rows in one file only."""

import json

from tilefuse import cli
from tilefuse.bench.compare import compare, comparison_table, context_warnings

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
