"""The GEMM core alone, traces, plans and the argument checks that need no process group."""

import importlib
import json

import pytest
import torch

from tilefuse import _jit
from tilefuse.bench.suites.tp import fused_variants, shapes
from tilefuse.tp import GemmConfig, Trace, default_config, gemm
from tilefuse.tp.trace import chrome_trace

from ..conftest import ON_GPU

ag = importlib.import_module("tilefuse.tp._ag_gemm")
rs = importlib.import_module("tilefuse.tp._gemm_rs")
CPU = torch.device("cpu")


@pytest.mark.parametrize("m,n,k,layout,dtype", [(48, 40, 24, "kn", torch.bfloat16), (33, 24, 40, "nk", torch.float16)])
def test_gemm_core_matches_torch_and_writes_everything(m, n, k, layout, dtype, on_device):
    torch.manual_seed(m)
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype) if layout == "kn" else torch.randn(n, k).to(dtype)
    out = torch.full((m, n), float("nan")).to(dtype)
    cfg = GemmConfig(16, 16, 16, 2, 1, 4)
    y = gemm(a, b, out, b_layout=layout, config=cfg)
    assert y is out and not out.isnan().any()
    ref = a.float() @ (b.float() if layout == "kn" else b.float().T)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(gemm(a, b, b_layout=layout, config=cfg), out)  # bitwise rerun
    # chunked tile orders compute the same tiles: bitwise equal
    assert torch.equal(gemm(a[:32], b, b_layout=layout, config=cfg, chunks=2, order="owner_last", rank=1),
                       gemm(a[:32], b, b_layout=layout, config=cfg))


def test_gemm_planned_layout_takes_each_calls_tensors(on_device):
    """A second call of one layout skips the checks and the plan: new tensors (and a
    weight that is an nn.Parameter) still give their own product, bitwise the first path's."""
    cfg = GemmConfig(16, 16, 16, 2, 1, 4)
    results = []
    for seed in range(3):
        torch.manual_seed(seed)
        a = torch.randn(32, 24).to(torch.bfloat16)
        b = torch.nn.Parameter(torch.randn(24, 40).to(torch.bfloat16), requires_grad=False)
        out = torch.full((32, 40), float("nan")).to(torch.bfloat16)
        results.append((gemm(a, b, out, config=cfg), gemm(a, b, config=cfg), a, b))
    for y, fresh, a, b in results:
        assert torch.equal(y, fresh)
        torch.testing.assert_close(y.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(results[0][0], results[1][0])


def test_gemm_planned_layout_takes_its_partial_launch_with_the_calls_tensors(on_device, monkeypatch):
    """On a planned layout, once its launch is proven direct, calls pass their own tensors to
    the layout's partial launch (nothing rebuilt); one that declines takes the launcher, with
    the call's own tensors."""
    from tilefuse.tp import _gemm_core as core

    calls = []

    class FakeLauncher:  # launches nothing: records what the op asks for
        def __init__(self):
            self.declines = False
            self.proven = False

        def __call__(self, key, grid, args, options):
            calls.append(("launch", args[0].base.data_ptr(), args[2].base.data_ptr(), args[5].data_ptr()))

        def partial(self, key, grid, args, options, live):
            assert live == ((0, 1), 2, (3, 4, 5))
            assert args[1] is args[0] and args[4] is args[3]
            if not self.proven:  # (the launcher proves a key's direct call on its third launch)
                self.proven = True
                return None

            def launch(a, b, out):
                if self.declines:
                    return False
                calls.append(("partial", a.data_ptr(), b.data_ptr(), out.data_ptr()))
                return True

            return launch

    fake = FakeLauncher()
    monkeypatch.setattr(core, "_gemm_launcher", fake)
    monkeypatch.setattr(core, "_plain_plans", {})
    cfg = GemmConfig(16, 16, 16, 2, 1, 4)
    a, b = torch.randn(32, 24).to(torch.bfloat16), torch.randn(24, 40).to(torch.bfloat16)
    a2 = torch.randn(32, 24).to(torch.bfloat16)
    out, out2 = torch.empty(32, 40, dtype=torch.bfloat16), torch.empty(32, 40, dtype=torch.bfloat16)
    for x, o in ((a, out), (a, out), (a, out), (a2, out2), (a, out2), (a2, out)):
        core.gemm(x, b, o, config=cfg)
    kinds = [c[0] for c in calls]
    # the first call plans, the next two launch (the partial launch made after the second), then partial
    assert kinds == ["launch", "launch", "launch", "partial", "partial", "partial"]
    assert calls[3][1:] == (a2.data_ptr(), b.data_ptr(), out2.data_ptr())
    assert calls[4][1] == a.data_ptr() and calls[5][1:] == (a2.data_ptr(), b.data_ptr(), out.data_ptr())
    fake.declines = True
    core.gemm(a, b, out, config=cfg)
    assert calls[-1] == ("launch", a.data_ptr(), b.data_ptr(), out.data_ptr())


def test_gemm_bad_inputs(on_device, monkeypatch):
    a = torch.randn(32, 16).to(torch.bfloat16)
    b = torch.randn(16, 24).to(torch.bfloat16)
    gemm(a, b)  # a planned layout: bad inputs of any other layout are still checked
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        gemm(a.float(), b.float())
    with pytest.raises(TypeError, match="dtype"):
        gemm(a, b.half())
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(a, b.T.contiguous(), b_layout="kn")
    with pytest.raises(ValueError, match="b_layout"):
        gemm(a, b, b_layout="tn")
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm(a[:, :12], b[:12])
    with pytest.raises(ValueError, match="must be positive"):
        gemm(a[:, :0], b[:0])
    with pytest.raises(ValueError, match="must be positive"):
        gemm(a, b[:, :0])
    with pytest.raises(ValueError, match="contiguous"):
        gemm(torch.randn(16, 32).to(torch.bfloat16).T, b)
    with pytest.raises(ValueError, match="2-D"):
        gemm(a[None], b)
    with pytest.raises(ValueError, match="out must be"):
        gemm(a, b, torch.empty(32, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        gemm(a.float().cpu().numpy(), b)
    # CPU tensors without the interpreter (a layout not planned yet: whether the interpreter
    # runs is fixed at import): a clear error, not a failure inside Triton
    monkeypatch.setattr("tilefuse._validate.interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="need a CUDA tensor"):
        gemm(a.cpu()[:8], b.cpu())
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(block_m=96)
    with pytest.raises(ValueError, match="invalid GemmConfig"):
        GemmConfig(num_warps=3)


def test_flatten_only_for_plain_launches(on_device):
    """The flattened tile loop may run a tile's loads before the previous tile's epilogue:
    only plain GEMM launches get it (ag_gemm's loads wait on band flags; the fused epilogues
    keep the nested loop), whatever the config asks."""
    core = importlib.import_module("tilefuse.tp._gemm_core")
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs["FLATTEN"])

    with _jit.redirected(core._persistent_gemm, Recorder()):  # it launches through a tilefuse._jit.Launcher
        a, b = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
        flat = GemmConfig(16, 16, 16, 2, 1, 4, flatten=True)
        gemm(a, b, config=flat)
        gemm(a, b, config=GemmConfig(16, 16, 16, 2, 1, 4))
        sched = core.TileSchedule(32, 64, 2, 16, 16, 2, (0, 1))
        out = torch.zeros(64, 64, dtype=torch.bfloat16)
        core.launch_gemm(a, b, out, schedule=sched, rank=0, config=flat, wait_a=True)
        core.launch_gemm(a, b, out[:32], schedule=sched, rank=0, config=flat, epilogue=core.EPI_RS_PUSH.value)
    assert seen == [True, False, False, False]
    assert default_config(8192, 8192, 1024).flatten and not default_config(4096, 512, 4096).flatten


def test_default_config():
    assert default_config(8192, 8192, 1024) == GemmConfig(128, 256, 64, 8, 3, 8, flatten=True)
    assert default_config(4096, 512, 4096).block_n == 128


def test_plans_bad_options_and_layouts():
    with pytest.raises(ValueError, match="design"):
        ag.make_plan("nvls", 64, 64, 64, 2, 0, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="comm_programs"):
        ag.make_plan("push", 64, 64, 64, 2, 0, torch.bfloat16, CPU, comm_programs=4)  # 4 programs on CPU
    with pytest.raises(ValueError, match="splits"):
        ag.make_plan("ce", 64, 64, 64, 2, 0, torch.bfloat16, CPU, splits=0)
    with pytest.raises(ValueError, match="divisible"):
        rs.make_plan("push", 63, 64, 64, 2, 0, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="design"):
        rs.make_plan("forward", 64, 64, 64, 2, 0, torch.bfloat16, CPU)
    p = ag.make_plan("push", 4096, 512, 4096, 2, 1, torch.bfloat16, CPU, num_programs=132, comm_programs=32)
    assert (p.gemm_programs, p.pieces, p.bands, p.schedule.order) == (100, 4, 16, (1, 0))
    assert p.n_flags == 2 * 16 and p.data_bytes == 4096 * 4096 * 2
    assert (p.local_copy, p.local_splits, p.read_local) == ("none", 0, True)  # under a wave: reads a_shard
    assert [ag.default_read_local(t, 100) for t in (64, 100, 128, 448, 896, 2048)] == [
        True, True, False, False, True, True]  # 1.28 / 4.48 waves leave 36% / 10.4% idle
    p = ag.make_plan("push", 4096, 512, 4096, 2, 1, torch.bfloat16, CPU, num_programs=132, read_local=False)
    assert (p.local_copy, p.local_splits) == ("sm", 0)  # a 16 MiB shard: the push programs stage it
    p = ag.make_plan("push", 8192, 1024, 8192, 2, 0, torch.bfloat16, CPU, num_programs=132, read_local=False)
    assert (p.local_copy, p.local_splits) == ("ce", 4)  # 64 MiB: copy engines
    with pytest.raises(ValueError, match="read_local"):
        ag.make_plan("push", 64, 64, 64, 2, 0, torch.bfloat16, CPU, local_copy="sm", read_local=True)
    with pytest.raises(ValueError, match="read_local"):
        ag.make_plan("push", 64, 64, 64, 2, 0, torch.bfloat16, CPU, read_local=1)
    p = ag.make_plan("push", 4096, 512, 4096, 2, 1, torch.bfloat16, CPU, num_programs=132, local_copy="ce",
                     splits=3)
    assert (p.local_copy, p.local_splits, p.bands, p.pieces) == ("ce", 3, 16, 4)
    with pytest.raises(ValueError, match="local_copy"):
        ag.make_plan("push", 64, 64, 64, 2, 0, torch.bfloat16, CPU, local_copy="dma")
    with pytest.raises(ValueError, match="local_copy"):
        ag.make_plan("ce", 64, 64, 64, 2, 0, torch.bfloat16, CPU, local_copy="sm")
    p = ag.make_plan("ce", 4096, 512, 4096, 2, 0, torch.bfloat16, CPU, num_programs=132, splits=4)
    assert (p.gemm_programs, p.band_tiles, p.bands, p.pieces) == (131, 4, 4, 1)
    assert (p.local_copy, p.local_splits, p.read_local) == ("ce", 4, True)  # 32 tiles on 131: under a wave
    p = rs.make_plan("push", 8192, 8192, 1024, 2, 0, torch.bfloat16, CPU, num_programs=132, lag=0)
    assert p.schedule.order == (1, 0) and p.gemm_programs == 132 and p.n_flags == 2 * p.tiles_per_chunk
    assert p.data_bytes == 8192 * 8192 * 2 and p.recv_tma
    big = rs.make_plan("push", 32768, 32768, 4096, 2, 0, torch.bfloat16, CPU, num_programs=132)
    inter = rs.make_plan("push", 16384, 16384, 2048, 2, 0, torch.bfloat16, CPU, num_programs=132)
    assert (big.lag, big.recv_tma) == (0, True) and (inter.lag, inter.recv_tma) == (66, False)
    with pytest.raises(ValueError, match="recv_tma"):
        rs.make_plan("push", 64, 64, 64, 2, 0, torch.bfloat16, CPU, recv_tma=1)


def test_gemm_rs_push_lag_defaults_and_checks():
    """Interleave where whole peer chunks first was link-bound on 2 x H200 (K <= 2048) and the
    grid has >= 3 waves; one wave of lag (66 tiles at W = 2, 132 programs)."""
    def lag(m, n, k, design="push", **kw):
        return rs.make_plan(design, m, n, k, 2, 0, torch.bfloat16, CPU, num_programs=132, **kw).lag

    assert lag(8192, 8192, 1024) == lag(4096, 4096, 512) == lag(16384, 4096, 1792) == 66
    assert lag(16384, 16384, 2048) == 66
    assert lag(32768, 32768, 4096) == lag(8192, 8192, 3584) == 0  # the link keeps up
    assert lag(1024, 4096, 1792) == lag(1024, 8192, 3584) == 0  # one or two waves
    assert lag(8192, 8192, 1024, lag=0) == 0
    assert lag(8192, 8192, 1024, lag=500) == 500
    assert rs.default_lag(1024, 8, 132, 10**6) == 17 and rs.default_lag(1024, 1, 132, 10**6) == 0
    with pytest.raises(ValueError, match="lag"):
        lag(8192, 8192, 1024, lag=-1)


def test_gemm_rs_push_programs():
    def plan(m, n, k, design="push", **kw):
        return rs.make_plan(design, m, n, k, 2, 0, torch.bfloat16, CPU, num_programs=132, **kw)

    assert plan(8192, 8192, 1024).gemm_programs == 132
    assert plan(8192, 8192, 1024, gemm_programs=131).gemm_programs == 131
    with pytest.raises(ValueError, match="gemm_programs"):
        plan(8192, 8192, 1024, gemm_programs=133)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's trace (no clock); GPU traces run in tests/tp/gpu_checks.py")
def test_trace_export(tmp_path):
    torch.manual_seed(0)
    a = torch.randn(64, 16).to(torch.bfloat16)
    b = torch.randn(16, 32).to(torch.bfloat16)
    tr = Trace(max_events=8)
    gemm(a, b, config=GemmConfig(16, 16, 16, 2, 1, 4), chunks=2, order="arrival", rank=1, num_programs=3,
         trace=tr.buffer("gemm", 1, 3, a.device))
    evs = tr.events()
    assert len(evs) == 8 and {e["chunk"] for e in evs} == {0, 1}
    doc = tr.to_chrome(str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text()) == doc
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 8 and all(e["pid"] == 1 and e["cat"] == "gemm" for e in slices)
    assert all({"head_us", "tail_us", "wait_us"} <= set(e["args"]) for e in slices)  # split of each tile
    assert all(e["start_ns"] == e["split_ns"] == e["end_ns"] == 0 for e in evs)  # no clock here
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"} == {
        "gemm program 0", "gemm program 1", "gemm program 2"}
    assert tr.summary()["gemm"]["items"] == 8
    with pytest.raises(ValueError, match="role"):
        tr.buffer("reduce", 0, 1, a.device)


def test_trace_puts_ranks_on_one_time_axis():
    """Each rank's timer offset is subtracted: two tiles that started together on two GPUs
    whose timers differ by 0.5 ms start at the same ts in the merged file."""
    def tile(rank, start):
        return {"role": "gemm", "rank": rank, "launch": 0, "program": 0, "seq": 0, "start_ns": start,
                "split_ns": start + 2000, "end_ns": start + 3000, "wait_ns": 0, "chunk": 0, "tile_row": 0,
                "tile_col": 0}

    events = [tile(0, 10_000), tile(1, 510_000)]
    raw = [e for e in chrome_trace(events)["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in raw] == [0.0, 500.0]
    doc = chrome_trace(events, offsets=[0, 500_000])
    aligned = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in aligned] == [0.0, 0.0] and all(e["dur"] == 3.0 for e in aligned)
    assert all(e["args"]["head_us"] == 2.0 for e in aligned) and doc["metadata"]["clock_offsets_ns"] == [0, 500_000]
    with pytest.raises(ValueError, match="max_events"):
        Trace(max_events=0)


def test_bench_arguments():
    assert shapes("ag_gemm", "seed")[0] == (4096, 512, 4096, "seed")
    assert shapes("gemm_rs", "seed")[-1] == (32768, 32768, 4096, "seed")
    assert shapes("ag_gemm", "seed,4096x512x4096") == shapes("ag_gemm", "seed")
    assert len(shapes("gemm_rs", "llm")) == 8 and shapes("ag_gemm", "2000x768x512")[0][:3] == (2000, 768, 512)
    with pytest.raises(ValueError, match="MxNxK"):
        shapes("ag_gemm", "big")
    assert fused_variants("ag_gemm", "ce,push/p16+32") == [
        ("fused:ce", "ce", {}), ("fused:push/p16", "push", {"comm_programs": 16}),
        ("fused:push/p32", "push", {"comm_programs": 32})]
    assert [v[0] for v in fused_variants("gemm_rs", "push/l0+198,push/l66/g131+132")] == [
        "fused:push/l0", "fused:push/l198", "fused:push/l66/g131", "fused:push/l66/g132"]
    assert fused_variants("gemm_rs", "push/g131")[0][2] == {"gemm_programs": 131}
    with pytest.raises(ValueError, match="design"):
        fused_variants("gemm_rs", "forward/p16")
    assert fused_variants("gemm_rs", "push/l0")[0][2] == {"lag": 0}
    assert fused_variants("ag_gemm", "push/csm+ce/s8") == [
        ("fused:push/csm/s8", "push", {"local_copy": "sm", "splits": 8}),
        ("fused:push/cce/s8", "push", {"local_copy": "ce", "splits": 8})]
    assert fused_variants("gemm_rs", "push/t1")[0][2] == {"recv_tma": True}
    assert fused_variants("ag_gemm", "auto,push") == [("fused:auto", None, {}), ("fused:push", "push", {})]
    with pytest.raises(ValueError, match="auto takes no options"):
        fused_variants("ag_gemm", "auto/p24")
    assert fused_variants("gemm_rs", "push/x0+1")[1][:2] == ("fused:push/x1", "push")
    assert fused_variants("gemm_rs", "push/x0+1")[1][2] == {"send_tma": True}
    assert not rs.make_plan("push", 64, 64, 64, 2, 0, torch.bfloat16, CPU).send_tma
    # send_tma is the Gluon kernel (sm_90 GPUs): elsewhere the plan keeps the Triton kernel.
    cpu_plan = rs.make_plan("push", 256, 64, 64, 2, 0, torch.bfloat16, CPU, send_tma=True)
    assert cpu_plan.schedule.aligned and not cpu_plan.send_tma
    with pytest.raises(ValueError, match="send_tma"):
        rs.make_plan("push", 64, 64, 64, 4, 0, torch.bfloat16, CPU, send_tma=True)
    [(name, _, opts)] = fused_variants("ag_gemm", "push/b128")
    assert name == "fused:push/b128" and opts["config"] == GemmConfig(128, 128, 64, 8, 5, 8)
    with pytest.raises(ValueError, match="x takes 0 or 1"):
        fused_variants("gemm_rs", "push/x3")
    with pytest.raises(ValueError, match="b takes"):
        fused_variants("ag_gemm", "push/b64")
    with pytest.raises(ValueError, match="design"):
        fused_variants("gemm_rs", "ce")
    with pytest.raises(ValueError, match="variant option"):
        fused_variants("gemm_rs", "push/q3")
    with pytest.raises(ValueError, match="gemm_rs takes l, g, t, x, b"):
        fused_variants("gemm_rs", "push/p16")  # ag_gemm's push programs
    with pytest.raises(ValueError, match="ag_gemm takes"):
        fused_variants("ag_gemm", "push/l3")


def test_bench_entry_without_gpus(tmp_path, capsys):
    from tilefuse.bench.suites.tp import main

    if torch.cuda.device_count() >= 2:
        pytest.skip("has GPUs: the launcher would start a real run")
    assert main(["ag-gemm", "--shapes", "seed"]) == 2
    assert "needs at least 2 GPUs" in capsys.readouterr().err
    res = tmp_path / "r.json"
    res.write_text(json.dumps({"summary": [{"op": "gemm_rs", "m": 4096, "n": 4096, "k": 512, "world": 2,
                                            "dtype": "bf16", "nccl+cublas_us": 130.0,
                                            "fused_us": {"fused:push": 70.0}}]}))
    from tilefuse.tp import policy

    saved = policy.table()
    try:
        assert main(["gemm-rs", "--write-policy", str(res), "--policy-table", str(tmp_path / "t.json")]) == 0
        assert json.loads((tmp_path / "t.json").read_text())["rows"][0]["winner"] == "push"
    finally:
        policy.load_table(saved)
    with pytest.raises(SystemExit):
        main(["all-reduce"])


def test_gemm_rs_takes_the_gluon_kernel_where_it_applies(monkeypatch):
    """On an sm_90 GPU, push at W = 2 runs the Gluon kernel by default where chunks are whole
    tiles (and then loads the partials by TMA); the Triton kernel otherwise, or when asked for
    with send_tma=False."""
    def plan(m=256, world=2, design="push", **kw):
        return rs.make_plan(design, m, 64, 64, world, 0, torch.bfloat16, CPU, config=GemmConfig(128, 64, 64, 8, 3, 8),
                            num_programs=132, **kw)

    monkeypatch.setattr(rs, "capability_major", lambda device: 9)
    assert plan().send_tma and plan().recv_tma
    assert not plan(m=2 * 200).send_tma  # 200-row chunks: not whole 128-row tiles
    assert not plan(world=4).send_tma
    assert not plan(send_tma=False).send_tma
    monkeypatch.setattr(rs, "capability_major", lambda device: 10)
    assert not plan(send_tma=True).send_tma


def test_options_are_checked_and_layered():
    """Options: checked when built; a call's fields over the process-level ones (set_options /
    use_options, restored after the block), then the policy's measured ones; no environment."""
    from tilefuse.tp import AgGemmOptions, GemmRsOptions, get_options, set_options, use_options
    from tilefuse.tp._options import resolve

    for bad, word in ((dict(comm_programs=0), "comm_programs"), (dict(splits=1.5), "splits"),
                      (dict(local_copy="dma"), "local_copy"), (dict(read_local=1), "read_local"),
                      (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=True), "timeout_s")):
        with pytest.raises(ValueError, match=word):
            AgGemmOptions(**bad)
    with pytest.raises(TypeError, match="config"):
        GemmRsOptions(config=(128, 256))
    for bad, word in ((dict(lag=-1), "lag"), (dict(gemm_programs=0), "gemm_programs"),
                      (dict(send_tma="yes"), "send_tma"), (dict(recv_tma=0), "recv_tma")):
        with pytest.raises(ValueError, match=word):
            GemmRsOptions(**bad)
    with pytest.raises(TypeError):
        AgGemmOptions(lag=3)  # gemm_rs's knob
    with pytest.raises(TypeError, match="AgGemmOptions or GemmRsOptions"):
        set_options({"comm_programs": 16})
    with pytest.raises(TypeError, match="AgGemmOptions"):
        resolve(GemmRsOptions(), AgGemmOptions)
    assert GemmRsOptions().timeout() == 60.0 and GemmRsOptions(timeout_s=2).timeout() == 2.0
    cfg = GemmConfig(16, 16, 16, 2, 1, 4)
    with use_options(AgGemmOptions(comm_programs=8, splits=2), GemmRsOptions(lag=0)):
        assert get_options(GemmRsOptions) == GemmRsOptions(lag=0)
        got = resolve(AgGemmOptions(splits=3), AgGemmOptions)
        assert got == AgGemmOptions(comm_programs=8, splits=3)
        assert got.with_measured({"comm_programs": 24, "config": cfg, "lag": 5}) == AgGemmOptions(
            comm_programs=8, splits=3, config=cfg)  # measured fills only what is unset; lag is not ag's
        assert got.plan_kwargs()["splits"] == 3 and "timeout_s" not in got.plan_kwargs()
    assert get_options(AgGemmOptions) == AgGemmOptions() and resolve(None, GemmRsOptions) == GemmRsOptions()


def test_host_cost_bench_runs_tiny(capsys, tmp_path):
    """The eager host-cost benchmark (GPU numbers later) runs on CPU at a tiny shape."""
    from tilefuse.bench.suites.tp import main

    out = tmp_path / "host.jsonl"
    assert main(["host", "--m", "32", "--n", "32", "--k", "32", "--calls", "2", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["variant"] == "tilefuse_gemm" and rows[0]["host_us"] > 0
    assert "tilefuse_gemm" in capsys.readouterr().out
