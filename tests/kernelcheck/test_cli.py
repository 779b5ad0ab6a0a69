"""``tilefuse kernels``: the table, the JSON and the exit codes (on the smallest kernel)."""

from __future__ import annotations

import json

from tilefuse import cli as top
from tilefuse.kernelcheck import cli


def test_list(capsys):
    assert cli.main(["list", "--kernel", "indexer.prefill_fill", "--target", "sm_90a"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(ln.startswith("indexer.prefill_fill  sm_90a") for ln in lines)


def test_report_table_and_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = top.main(["kernels", "--kernel", "indexer.prefill_fill", "--json", str(out), "--jobs", "2"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "indexer.prefill_fill on sm_90a: 4 configuration(s)" in text
    assert "indexer.prefill_fill on sm_100a: 4 configuration(s)" in text
    header = next(ln for ln in text.splitlines() if ln.startswith("configuration"))
    for col in ("regs", "spill", "smem KiB", "wgmma", "mma.sync", "ld.global", "st.global", "tma", "check"):
        assert col in header
    doc = json.loads(out.read_text())
    assert doc["targets"] == ["sm_90a", "sm_100a"] and doc["triton"]
    assert len(doc["reports"]) == 8
    r = doc["reports"][0]
    assert r["ok"] and r["failures"] == [] and r["spill_stores"] == 0 and r["registers"] > 0
    assert r["ptx"]["st.global"] > 0 and r["sass"]["STG"] > 0  # SASS counts by default


def test_bad_usage(capsys):
    assert cli.main(["--kernel", "no.such.kernel"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert cli.main(["--jobs", "0", "--kernel", "indexer.prefill_fill"]) == 2
