"""``tilefuse kernels``: the table, the progress, the JSON and the exit codes (on the smallest
kernel; known issues on reports made up for the test)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tilefuse import cli as top
from tilefuse.kernelcheck import cli
from tilefuse.kernelcheck.compile import KernelReport


def test_list(capsys):
    assert cli.main(["list", "--kernel", "indexer.prefill_fill", "--target", "sm_90a"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(ln.startswith("indexer.prefill_fill  sm_90a") for ln in lines)


def test_report_table_and_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = top.main(["kernels", "--kernel", "indexer.prefill_fill", "--json", str(out), "--jobs", "2"])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0
    progress = captured.err.splitlines()
    assert progress[0] == "compiling 8 configuration(s) in 2 process(es)"
    assert [ln.split("]")[0].split()[0] for ln in progress[1:]] == [f"[{i}/8" for i in range(1, 9)]
    assert all(ln.endswith(": ok") and " indexer.prefill_fill sm_" in ln for ln in progress[1:])
    assert "indexer.prefill_fill on sm_90a: 4 configuration(s)" in text
    assert "indexer.prefill_fill on sm_100a: 4 configuration(s)" in text
    header = next(ln for ln in text.splitlines() if ln.startswith("configuration"))
    for col in ("regs", "spill", "smem KiB", "wgmma", "mma.sync", "ld.global", "st.global", "tma", "check"):
        assert col in header
    doc = json.loads(out.read_text())
    assert doc["targets"] == ["sm_90a", "sm_100a"] and doc["triton"]
    assert len(doc["reports"]) == 8
    r = doc["reports"][0]
    assert r["ok"] and r["failures"] == [] and r["known_issue"] is None
    assert r["spill_stores"] == 0 and r["registers"] > 0
    assert r["ptx"]["st.global"] > 0 and r["sass"]["STG"] > 0  # SASS counts by default


def test_bad_usage(capsys):
    assert cli.main(["--kernel", "no.such.kernel"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert cli.main(["--jobs", "0", "--kernel", "indexer.prefill_fill"]) == 2


# A configuration with a known spill (budget 128 B) and the kernel / target it is compiled for.
KERNEL, TARGET, LISTED = "indexer.prefill", "sm_90a", "mxfp8 D128 H64 full+clean 64x128 w4s2 bf16-recompute"
COUNT = 137  # configurations of KERNEL on TARGET (the registry's: a new variant changes it on purpose)


@pytest.fixture
def fake_compiles(monkeypatch):
    """``tilefuse kernels --kernel KERNEL --target TARGET`` on made-up reports: every
    configuration passes except LISTED, which spills ``spill[0]`` bytes."""
    spill = [0]

    def compile_many(items, jobs=1, sass=True, on_report=None, compile_timeout=600.0):
        reports = []
        for i, (v, t) in enumerate(items):
            s = spill[0] if v.name == LISTED else 0
            reports.append(KernelReport(kernel=v.kernel, variant=v.name, target=t, ok=True, registers=255,
                                        spill_stores=s, spill_loads=s, stack_frame=s, shared=1024,
                                        sass={"LDL": s // 4, "STL": s // 4}))
            if on_report:
                on_report(i, reports[-1])
        return reports

    monkeypatch.setattr(cli, "compile_many", compile_many)
    return spill


def test_known_issues_exit_0_and_are_listed(fake_compiles, tmp_path, capsys):
    fake_compiles[0] = 12
    out = tmp_path / "k.json"
    assert cli.main(["--kernel", KERNEL, "--target", TARGET, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"{TARGET} {LISTED}: known: spills 12 B stored" in captured.err
    assert "1 known issue(s), accepted by tilefuse/kernelcheck/known_issues.py:" in captured.out
    assert f"  {KERNEL} {TARGET} {LISTED}: spills 12 B stored / 12 B loaded" in captured.out
    assert f"{COUNT} compiles, 0 failing a check, 1 known issue(s)" in captured.out
    reports = {r["variant"]: r for r in json.loads(out.read_text())["reports"]}
    assert reports[LISTED]["known_issue"] == "MXFP8 bf16-upcast tile at the register limit"
    assert reports[LISTED]["failures"]


def test_new_failures_exit_1(fake_compiles, capsys):
    fake_compiles[0] = 160  # over the 128 B budget
    assert cli.main(["--kernel", KERNEL, "--target", TARGET, "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: no progress
    assert "FAIL: spills 160 B stored" in captured.out
    assert f"{COUNT} compiles, 1 failing a check, 0 known issue(s) (failing: {KERNEL})" in captured.out


def test_compile_only_fails_on_compiles_not_spills(fake_compiles, monkeypatch, capsys):
    fake_compiles[0] = 160
    assert cli.main(["--kernel", KERNEL, "--target", TARGET, "-q", "--compile-only"]) == 0
    spilling = cli.compile_many

    def one_broken(items, **kw):
        reports = spilling(items, **kw)
        reports[0] = dataclasses.replace(reports[0], ok=False, error="did not compile within 120 s")
        return reports

    monkeypatch.setattr(cli, "compile_many", one_broken)
    assert cli.main(["--kernel", KERNEL, "--target", TARGET, "-q", "--compile-only"]) == 1
    assert "did not compile within 120 s" in capsys.readouterr().out


def test_fixed_known_issue_is_reported(fake_compiles, capsys):
    assert cli.main(["--kernel", KERNEL, "--target", TARGET, "-q"]) == 0
    out = capsys.readouterr().out
    assert "known issue(s) no longer occur" in out and "mxfp8 * full*" in out
