"""The tilefuse command: env, tiny interpreter runs of the suites, plot, delegation."""

import importlib
import json
import sys
import types

import pytest

from tilefuse import cli
from tilefuse.bench import report
from tilefuse.bench.env import environment, gpu_slug

TINY = ["--samples", "2", "--calls", "1", "--quiet", "--no-clocks"]


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_env_record(capsys):
    env = environment("batch")
    for key in ("gpu", "gpu_count", "driver", "cuda", "torch", "triton", "tilefuse", "commit", "command",
                "timing_mode"):
        assert key in env
    assert env["timing_mode"] == "batch"
    assert cli.main(["env", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tilefuse"] == env["tilefuse"]


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("cpu (Triton interpreter)") == "cpu"


def test_bench_indexer_tiny(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    plot = ["--plot", str(png)] if _importable("matplotlib") else []
    rc = cli.main(["bench", "indexer", "--shapes", "16x256", "--formats", "fp8", "--output", str(out),
                   *plot, *TINY])
    assert rc == 0, capsys.readouterr().err
    res = report.load_result(out)
    assert res["suite"] == "indexer"
    names = {r["case"] for r in res["rows"]}
    assert len(names) == 6  # the shape, plus no-clean, fewer heads, bf16 logits, compressed and D 64 on it
    subject = [r for r in res["rows"] if r["impl"] == "tilefuse"]
    assert all(r["status"] == "ok" and r["check"]["passed"] and r["post_check"]["passed"] for r in subject)
    assert all(len(r["stats"]["samples_us"]) == 2 for r in subject)
    assert all(r["flops"] > 0 for r in subject)
    assert {r["params"]["head_dim"] for r in subject} == {64, 128}
    compressed = [r for r in res["rows"] if r["params"]["compressed"]]
    assert {r["impl"] for r in compressed} == {"tilefuse", "deep_gemm"}  # no eager row: it writes full rows
    clean = [r for r in subject if r["params"]["clean_logits"]]
    assert all(r["check"]["mask_exact"] for r in clean)
    peers = {r["impl"]: r for r in res["rows"] if r["case"] == subject[0]["case"]}
    assert peers["deep_gemm"]["status"] in ("skipped", "ok")
    assert peers["torch eager"]["status"] == "ok"
    assert not peers["tilefuse"]["peer"] and peers["torch eager"]["peer"] and peers["deep_gemm"]["peer"]
    if res["environment"]["interpreter"]:
        assert "not a performance number" in subject[0]["stats"]["timer"]
        assert all(not c["available"] for c in res["ceilings"].values())
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_indexer_reproduce_tiny(tmp_path):
    out = tmp_path / "rep.json"
    rc = cli.main(["bench", "indexer", "--reproduce", "--shapes", "16x256", "--formats", "fp8",
                   "--output", str(out), *TINY])
    assert rc == 0
    res = report.load_result(out)
    assert res["settings"]["reproduce"] is True
    impls = [r["impl"] for r in res["rows"]]
    assert impls == ["fp8 clean no-meta", "fp8 clean meta", "fp8 no-clean no-meta", "fp8 no-clean meta"]
    for r in res["rows"]:
        assert r["check"]["zero_workload"]["zeros_exact"]
        assert r["peer_ratio"] == {} and r["peer"] is False  # variants of tilefuse: all gate in compare
    assert all(r["check"]["bitwise_vs_no_metadata"] for r in res["rows"] if r["impl"].endswith(" meta")
               and not r["impl"].endswith("no-meta"))


def test_bench_paged_tiny(tmp_path, capsys, monkeypatch):
    """Without --output the file goes under the results root (the checkout's benchmarks/results,
    redirected here), and the command prints the absolute path it wrote."""
    monkeypatch.setattr(report, "results_root", lambda: tmp_path / "results")
    monkeypatch.chdir(tmp_path / "..")
    rc = cli.main(["bench", "paged", "--shapes", "2x2x128", "--mode", "batch", *TINY])
    err = capsys.readouterr().err
    assert rc == 0, err
    [out] = (tmp_path / "results" / gpu_slug()).glob("paged-*.json")
    assert f"results: {out}" in err
    res = report.load_result(out)
    mine = res["rows"][0]
    assert mine["impl"] == "tilefuse" and mine["status"] == "ok" and mine["stats"]["mode"] == "batch"
    assert mine["bytes"] > 0 and mine["tbps"] is not None and mine["ceiling"] == "copy"


def _plottable(path):
    from .results_factory import result, row

    report.write_result(result([row("a | tilefuse", [1.0, 2.0], tflops=5.0, x="1/2"),
                                row("b | tilefuse", [1.0, 2.0], tflops=7.0, x="3/4", status="failed"),
                                row("a | peer", [3.0], impl="peer", tflops=2.0, x="1/2")],
                               ceilings={"fp8_matmul": {"available": True, "value": 10.0, "unit": "TFLOP/s"}}),
                        path)
    return path


def test_plot_command(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = _plottable(tmp_path / "r.json")
    png = tmp_path / "deep" / "out.png"
    assert cli.main(["plot", str(src), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.strip() == str(png)


def test_plot_output_defaults_beside_the_input(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    src = _plottable(tmp_path / "run.v2.json")
    monkeypatch.chdir(tmp_path / "..")  # not the input's directory
    assert cli.main(["plot", str(src)]) == 0
    png = tmp_path / "run.v2.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.strip() == str(png)
    # A name without a suffix gets .png, and the command prints the file it wrote.
    assert cli.main(["plot", str(src), "-o", str(tmp_path / "noext")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "noext.png")
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "noext").exists()


def test_bench_plot_without_matplotlib_fails_before_running(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("tilefuse.bench.runner.run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    assert cli.main(["bench", "paged", "--shapes", "2x2x128", "--plot", str(tmp_path / "p.png"), *TINY]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_bad_usage_exits_2(tmp_path, capsys):
    assert cli.main(["bench", "indexer", "--shapes", "16by256", "--no-output", "-q"]) == 2
    assert "--shapes" in capsys.readouterr().err
    assert cli.main(["bench", "paged", "--shapes", "1x1", "--no-output", "-q"]) == 2
    assert cli.main(["bench", "indexer", "--formats", "int4", "--no-output", "-q"]) == 2
    assert cli.main(["bench", "indexer", "--mode", "batch", "--l2-flush", "--no-output", "-q"]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "indexer", "--mode", "wallclock"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,module", [(["bench", "ag-gemm", "--m", "4096"], "tilefuse.bench.suites.tp"),
                                         (["bench", "gemm-rs"], "tilefuse.bench.suites.tp"),
                                         (["kernels", "list"], "tilefuse.kernelcheck.cli")])
def test_delegated_commands(monkeypatch, capsys, argv, module):
    monkeypatch.setitem(sys.modules, module, None)  # not installed
    assert cli.main(argv) == 2
    assert module in capsys.readouterr().err

    seen = []
    fake = types.ModuleType(module)
    fake.main = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main(argv) == 0
    assert seen == [argv[1:]]  # "bench ag-gemm ..." hands over "ag-gemm ..."


def test_bench_help_names_the_default_output(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "paged", "--help"])
    assert e.value.code == 0
    assert f"{report.results_root()}/<gpu>/<suite>-<time>.json" in "".join(capsys.readouterr().out.split())


def test_plot_marks_interpreter_runs_by_their_environment():
    """A GPU run timed on the host clock (the serving loop) is not marked as an interpreter
    run; a run whose environment says interpreter is; older files fall back to the timer."""
    from tilefuse.bench.plot import interpreted_run

    rows = [{"stats": {"timer": "host perf_counter"}}]
    assert not interpreted_run({"environment": {"interpreter": False}, "rows": rows})
    assert interpreted_run({"environment": {"interpreter": True}, "rows": [{"stats": {"timer": "cuda events"}}]})
    assert interpreted_run({"environment": {}, "rows": [{"stats": None}, *rows]})  # (a failed row has none)
