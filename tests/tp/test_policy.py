"""The fused-vs-NCCL policy: rules, measured-table lookup, overrides (W = 2..8)."""

import json

import pytest
import torch

from tilefuse.bench.suites.tp import policy_rows, write_policy
from tilefuse.tp import policy

ROWS = [
    {"op": "ag_gemm", "m": 1024, "n": 7168, "k": 8192, "world": 2, "dtype": "bfloat16", "winner": "nccl",
     "best_fused": "push"},
    {"op": "ag_gemm", "m": 16384, "n": 2048, "k": 16384, "world": 2, "dtype": "bfloat16", "winner": "ce"},
    {"op": "ag_gemm", "m": 4096, "n": 512, "k": 4096, "world": 8, "dtype": "bfloat16", "winner": "push"},
    {"op": "gemm_rs", "m": 8192, "n": 8192, "k": 1024, "world": 2, "dtype": "bfloat16", "winner": "nccl"},
    {"op": "gemm_rs", "m": 8192, "n": 8192, "k": 1024, "world": 2, "dtype": "float16", "winner": "push"},
]


@pytest.fixture
def table():
    saved = policy.table()
    policy.load_table(ROWS)
    yield
    policy.load_table(saved)


def test_rules_before_the_table(table):
    assert policy.decide("ag_gemm", 64, 64, 64, 1).path == "gemm"
    d = policy.decide("ag_gemm", 16384, 2048, 16384, 2, nodes=2)
    assert d.path == "nccl" and "2 nodes" in d.reason
    assert policy.decide("gemm_rs", 8192, 8192, 1024, 16).path == "nccl"
    d = policy.decide("gemm_rs", 8192, 8192, 1024, 2, device_type="cpu")
    assert d.path == "nccl" and "cpu" in d.reason
    with pytest.raises(ValueError, match="forced but is unavailable"):
        policy.decide("gemm_rs", 8192, 8192, 1024, 2, device_type="cpu", path="fused")
    with pytest.raises(ValueError, match="forced but is unavailable"):
        policy.decide("ag_gemm", 8192, 1024, 8192, 4, nodes=2, design="push")


def test_table_lookup_nearest_row(table):
    d = policy.decide("ag_gemm", 2048, 7168, 8192, 2)
    assert d.path == "nccl" and d.row["m"] == 1024 and "NCCL + GEMM was faster" in d.reason
    d = policy.decide("ag_gemm", 8192, 4096, 16384, 2)
    assert (d.path, d.design) == ("fused", "ce") and d.row["m"] == 16384
    # world sizes without rows use the nearest measured world size (ties: the larger)
    for w in (3, 4):
        assert policy.lookup("ag_gemm", 4096, 512, 4096, w)["world"] == 2
    for w in (5, 6, 7, 8):
        assert policy.decide("ag_gemm", 4096, 512, 4096, w).design == "push"
    assert policy.decide("gemm_rs", 8192, 8192, 1024, 2, torch.bfloat16).path == "nccl"
    assert policy.decide("gemm_rs", 8192, 8192, 1024, 2, torch.float16).design == "push"


def test_overrides(table, monkeypatch):
    assert policy.decide("ag_gemm", 1024, 7168, 8192, 2, path="fused").design == "push"  # row's best fused
    assert policy.decide("ag_gemm", 1024, 7168, 8192, 2, design="ce").design == "ce"
    with policy.override("ag_gemm", path="nccl"):
        assert policy.decide("ag_gemm", 16384, 2048, 16384, 2).path == "nccl"
        assert policy.decide("gemm_rs", 8192, 8192, 1024, 2, torch.float16).path == "fused"
    assert policy.decide("ag_gemm", 16384, 2048, 16384, 2).path == "fused"
    policy.set_override(design="push")
    try:
        assert policy.decide("gemm_rs", 8192, 8192, 1024, 2).design == "push"
    finally:
        policy.set_override()
    # the environment is not read: the override setters are the one way to force a path
    monkeypatch.setenv("TILEFUSE_TP_PATH", "nccl")
    assert policy.decide("ag_gemm", 16384, 2048, 16384, 2).path == "fused"
    with pytest.raises(ValueError, match="path must be one of"):
        policy.set_override("gemm_rs", path="sideways")


def test_bad_queries_and_rows(table):
    with pytest.raises(ValueError, match="op must be one of"):
        policy.decide("allreduce", 1, 1, 1, 2)
    with pytest.raises(ValueError, match="design for gemm_rs"):
        policy.decide("gemm_rs", 64, 64, 64, 2, design="ce")
    with pytest.raises(ValueError, match="lacks"):
        policy.load_table([{"op": "ag_gemm", "m": 1}])
    with pytest.raises(ValueError, match="winner"):
        policy.load_table([{**ROWS[0], "winner": "forward"}])


def test_empty_table_defaults_to_fused():
    saved = policy.table()
    try:
        policy.load_table([])
        d = policy.decide("gemm_rs", 4096, 4096, 512, 2)
        assert (d.path, d.design) == ("fused", policy.DEFAULT_DESIGN["gemm_rs"]) and "no measured rows" in d.reason
    finally:
        policy.load_table(saved)


def test_shipped_table_is_valid():
    rows = policy.load_table()
    for r in rows:
        assert r["op"] in policy.OPS and r["world"] >= 2


def test_policy_rows_from_results(tmp_path):
    result = {"summary": [
        {"op": "ag_gemm", "m": 4096, "n": 512, "k": 4096, "world": 2, "dtype": "bf16", "nccl+cublas_us": 120.0,
         "fused_us": {"fused:ce": 90.0, "fused:push/p16": 70.0, "fused:push/p32": 60.0}},
        {"op": "gemm_rs", "m": 1024, "n": 4096, "k": 1792, "world": 2, "dtype": "bf16", "nccl+cublas_us": 30.0,
         "fused_us": {"fused:push": 45.0}},
    ]}
    rows = policy_rows(result)
    assert rows[0]["winner"] == "push" and rows[0]["fused_us"] == {"ce": 90.0, "push": 60.0}
    assert rows[1]["winner"] == "nccl" and rows[1]["best_fused"] == "push"
    # within the tie margin the op's default design stays
    close = {"summary": [{"op": "ag_gemm", "m": 4096, "n": 8192, "k": 3584, "world": 2, "dtype": "bf16",
                          "nccl+cublas_us": 513.0, "fused_us": {"fused:ce": 431.0, "fused:push/p16": 427.0}}]}
    assert policy_rows(close)[0]["winner"] == "ce"
    assert policy_rows(close, tie=0.0)[0]["winner"] == "push"
    with pytest.raises(ValueError, match="tie"):
        policy_rows(close, tie=1.5)
    src = tmp_path / "r.json"
    src.write_text(json.dumps(result))
    saved = policy.table()
    try:
        out = write_policy([str(src)], str(tmp_path / "table.json"))
        assert len(out) == 2 and all(r["timing"] == "batch" and r["source"] == "r.json" for r in out)
        assert "table.json row 0 from r.json" in policy.decide("ag_gemm", 4096, 512, 4096, 2).reason
        assert policy.decide("gemm_rs", 1024, 4096, 1792, 2).path == "nccl"
    finally:
        policy.load_table(saved)


def test_graph_capture_picks_the_graph_timed_rows():
    """Eager calls answer from rows timed eagerly (host launch cost included), calls captured
    into a CUDA graph from graph-timed rows; a mode without rows falls back to the other."""
    saved = policy.table()
    shape = {"op": "ag_gemm", "m": 4096, "n": 512, "k": 4096, "world": 2, "dtype": "bfloat16"}
    try:
        policy.load_table([{**shape, "timing": "batch", "winner": "nccl", "best_fused": "push"},
                           {**shape, "timing": "graph", "winner": "push"}])
        eager = policy.decide("ag_gemm", 4096, 512, 4096, 2, capturing=False)
        graph = policy.decide("ag_gemm", 4096, 512, 4096, 2, capturing=True)
        assert eager.path == "nccl" and "batch timing" in eager.reason
        assert (graph.path, graph.design) == ("fused", "push") and "graph timing" in graph.reason
        assert policy.decide("ag_gemm", 4096, 512, 4096, 2).path == "nccl"  # not capturing here
        policy.load_table([{**shape, "timing": "graph", "winner": "push"}])
        assert policy.decide("ag_gemm", 4096, 512, 4096, 2, capturing=False).design == "push"
    finally:
        policy.load_table(saved)
    # The shipped table has both modes for 2 x H200.
    assert {r.get("timing") for r in policy.table()} == {"batch", "graph"}


def test_measured_variant_options_apply_at_their_exact_shape():
    """A row's fastest variant (bare design unless beaten by more than the tie margin) gives
    its options to calls of exactly that shape, never to neighbours; a caller's own value wins."""
    from tilefuse.tp import AgGemmOptions
    from tilefuse.tp._gemm_core import GemmConfig

    result = {"settings": {"mode": "graph"}, "summary": [
        {"op": "ag_gemm", "m": 8192, "n": 1024, "k": 8192, "world": 2, "dtype": "bf16", "nccl+cublas_us": 480.0,
         "fused_us": {"fused:ce": 390.0, "fused:push": 330.0, "fused:push/p24/b128": 301.0}},
        {"op": "ag_gemm", "m": 4096, "n": 512, "k": 4096, "world": 2, "dtype": "bf16", "nccl+cublas_us": 120.0,
         "fused_us": {"fused:push": 90.0, "fused:push/p24": 89.0}},  # within the tie: the defaults
    ]}
    rows = policy_rows(result)
    assert [r["variant"] for r in rows] == ["push/p24/b128", "push"]
    saved = policy.table()
    try:
        policy.load_table(rows)
        dec = policy.decide("ag_gemm", 8192, 1024, 8192, 2, torch.bfloat16, capturing=True)
        assert dec.design == "push" and "push/p24/b128" in dec.reason
        assert dec.options == {"comm_programs": 24, "config": GemmConfig(128, 128, 64, 8, 5, 8)}
        assert policy.decide("ag_gemm", 8192, 1024, 4096, 2, torch.bfloat16, capturing=True).options == {}
        assert policy.decide("ag_gemm", 4096, 512, 4096, 2, torch.bfloat16, capturing=True).options == {}
        assert policy.decide("ag_gemm", 8192, 1024, 8192, 2, design="push").options == {}  # forced
        given = AgGemmOptions(comm_programs=16)
        assert given.with_measured(dec.options) == AgGemmOptions(comm_programs=16,
                                                                 config=GemmConfig(128, 128, 64, 8, 5, 8))
    finally:
        policy.load_table(saved)


def test_outside_the_measured_range_answers_nccl(table):
    """Decode-sized M (below the smallest measured M = 1024 of ag_gemm W = 2) and M, N or K
    beyond the measured range go to NCCL + GEMM, saying so; inside the range the nearest row
    answers and the reason cites it by table row."""
    for m in (2, 64, 256, 1023):
        d = policy.decide("ag_gemm", m, 7168, 8192, 2)
        assert d.path == "nccl" and d.row is None
        assert f"M = {m} is outside the measured M = 1024..16384 of ag_gemm W=2" in d.reason
    assert "M = 32768 is outside" in policy.decide("ag_gemm", 32768, 4096, 16384, 2).reason
    assert "K = 65536 is outside" in policy.decide("ag_gemm", 8192, 4096, 65536, 2).reason
    assert "N = 16 is outside" in policy.decide("ag_gemm", 8192, 16, 8192, 2).reason
    d = policy.decide("ag_gemm", 8192, 4096, 16384, 2)
    assert "ag_gemm M=16384 N=2048 K=16384 W=2 (batch timing; the rows given to load_table row 1)" in d.reason
    # a forced path still forces (the range decides only what the table answers)
    assert policy.decide("ag_gemm", 64, 7168, 8192, 2, path="fused").design == "push"


def test_shipped_table_sends_decode_sizes_to_nccl():
    rows = policy.load_table()
    smallest = min(r["m"] for r in rows if r["op"] == "gemm_rs" and r["world"] == 2)
    for m in (2, 16, 256):
        assert m < smallest
        d = policy.decide("gemm_rs", m, 8192, 3584, 2, torch.bfloat16, capturing=True)
        assert d.path == "nccl" and "outside the measured M" in d.reason, d.reason
    d = policy.decide("gemm_rs", 8192, 8192, 3584, 2, torch.bfloat16, capturing=True)
    assert "policy_table.json row " in d.reason and d.row is not None


def test_decisions_are_cached_until_the_table_or_overrides_change(table, monkeypatch):
    calls = []
    real = policy._decide
    monkeypatch.setattr(policy, "_decide", lambda *a: calls.append(a) or real(*a))
    first = policy.decide("ag_gemm", 2048, 7168, 8192, 2, capturing=False)
    assert policy.decide("ag_gemm", 2048, 7168, 8192, 2, capturing=False) is first and len(calls) == 1
    with policy.override("ag_gemm", path="fused"):
        assert policy.decide("ag_gemm", 2048, 7168, 8192, 2, capturing=False).path == "fused"
    assert policy.decide("ag_gemm", 2048, 7168, 8192, 2, capturing=False) == first and len(calls) == 3
    policy.load_table(ROWS[:2])
    policy.decide("ag_gemm", 2048, 7168, 8192, 2, capturing=False)
    assert len(calls) == 4
