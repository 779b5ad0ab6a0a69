"""The tilefuse command: env, tiny interpreter runs of the suites, plot, delegation."""

import json
import sys
import types

import pytest

from tilefuse import cli
from tilefuse.bench import report
from tilefuse.bench.env import environment, gpu_slug

TINY = ["--samples", "2", "--calls", "1", "--quiet", "--no-clocks"]


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
    rc = cli.main(["bench", "indexer", "--shapes", "16x256", "--formats", "fp8", "--output", str(out),
                   "--plot", str(png), *TINY])
    assert rc == 0, capsys.readouterr().err
    res = report.load_result(out)
    assert res["suite"] == "indexer"
    names = {r["case"] for r in res["rows"]}
    assert len(names) == 4  # the shape, plus no-clean, fewer heads and bf16 logits on it
    subject = [r for r in res["rows"] if r["impl"] == "tilefuse"]
    assert all(r["status"] == "ok" and r["check"]["passed"] and r["post_check"]["passed"] for r in subject)
    assert all(len(r["stats"]["samples_us"]) == 2 for r in subject)
    assert all(r["flops"] > 0 for r in subject)
    clean = [r for r in subject if r["params"]["clean_logits"]]
    assert all(r["check"]["mask_exact"] for r in clean)
    peers = {r["impl"]: r for r in res["rows"] if r["case"] == subject[0]["case"]}
    assert peers["deep_gemm"]["status"] in ("skipped", "ok")
    assert peers["torch eager"]["status"] == "ok"
    if res["environment"]["interpreter"]:
        assert "not a performance number" in subject[0]["stats"]["timer"]
        assert all(not c["available"] for c in res["ceilings"].values())
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
        assert r["peer_ratio"] == {}
    assert all(r["check"]["bitwise_vs_no_metadata"] for r in res["rows"] if r["impl"].endswith(" meta")
               and not r["impl"].endswith("no-meta"))


def test_bench_paged_tiny(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = cli.main(["bench", "paged", "--shapes", "2x2x128", "--output", str(out), "--mode", "batch", *TINY])
    assert rc == 0, capsys.readouterr().err
    res = report.load_result(out)
    mine = res["rows"][0]
    assert mine["impl"] == "tilefuse" and mine["status"] == "ok" and mine["stats"]["mode"] == "batch"
    assert mine["bytes"] > 0 and mine["tbps"] is not None and mine["ceiling"] == "copy"


def test_plot_command(tmp_path, capsys):
    from .results_factory import result, row

    src = tmp_path / "r.json"
    report.write_result(result([row("a | tilefuse", [1.0, 2.0], tflops=5.0, x="1/2"),
                                row("b | tilefuse", [1.0, 2.0], tflops=7.0, x="3/4", status="failed"),
                                row("a | peer", [3.0], impl="peer", tflops=2.0, x="1/2")],
                               ceilings={"fp8_matmul": {"available": True, "value": 10.0, "unit": "TFLOP/s"}}),
                        src)
    png = tmp_path / "deep" / "out.png"
    assert cli.main(["plot", str(src), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


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
