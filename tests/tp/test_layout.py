"""Workspace layout and the flag protocol across calls of any shape, eager or replayed.

Flags live in a region of their own that no call uses as data, and each call's kernels zero
the flags they used at the end: so every call starts on zero flags whatever ran before it on
the workspace, with no host step (a CUDA-graph replay never reaches the host). The
interleavings below run on emulated workspaces: a "capture" binds a call to its tensors, a
"replay" runs the same launches again after new values were written into those tensors, as a
graph replay does. ``_emulate`` raises if any flag a call waits on is non-zero at its start.
"""

import pytest
import torch

from tilefuse.reference.comm_gemm import ag_gemm_emulated, gemm_rs_emulated
from tilefuse.tp import _ag_gemm as ag
from tilefuse.tp import _gemm_rs as rs
from tilefuse.tp import _primitives as P
from tilefuse.tp import symm
from tilefuse.tp._emulate import emulate_ag_gemm, emulate_gemm_rs
from tilefuse.tp._gemm_core import GemmConfig

CPU = torch.device("cpu")
CFG = GemmConfig(16, 16, 16, 2, 1, 4)


def test_data_never_overlaps_the_flag_region():
    for flag_words in (1, 100, 1 << 14):
        [ws] = symm.emulated_workspaces(1, flag_words, 4096)
        assert ws.data_off >= P.FLAGS_OFFSET + 4 * flag_words and ws.data_off % 1024 == 0
        assert ws.data_bytes == 4096 and ws.fits(flag_words, 4096) and not ws.fits(flag_words + 1, 4096)
    plan = rs.make_plan("push", 8192, 8192, 1024, 2, 0, torch.bfloat16, CPU, num_programs=132)
    assert plan.n_flags == 2 * 32 * 32 and plan.data_bytes == 8192 * 8192 * 2
    plan = ag.make_plan("push", 8192, 1024, 8192, 2, 0, torch.bfloat16, CPU, num_programs=132)
    assert plan.n_flags == 2 * 32 and plan.data_bytes == 8192 * 8192 * 2


def test_workspace_grows_flags_and_data_and_keeps_the_old_one(monkeypatch):
    made = []

    def fake_allocate(group, flag_words, data_bytes, device):
        made.append((flag_words, data_bytes))
        return symm.emulated_workspaces(1, flag_words, data_bytes)[0]

    monkeypatch.setattr(symm, "allocate_workspace", fake_allocate)
    monkeypatch.setattr(symm, "_device_barrier", lambda group, device: None)
    st = symm.FusedState(None, "gemm_rs", CPU)
    first = st.ensure(10, 5000)
    assert made == [(symm.MIN_FLAG_WORDS, 1 << 20)]
    assert st.ensure(symm.MIN_FLAG_WORDS, 1 << 20) is first  # fits: no allocation
    second = st.ensure(symm.MIN_FLAG_WORDS + 1, 100)  # more flags: the data region stays as large
    assert made[-1] == (2 * symm.MIN_FLAG_WORDS, 1 << 20) and st.retired == [first]
    st.ensure(1, 3 << 20)  # more data: the flag region stays as large
    assert made[-1] == (2 * symm.MIN_FLAG_WORDS, 3 << 20) and st.retired == [first, second]


def _rs_inputs(world, mc, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(mc * world, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    b = [(torch.randn(k, n, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(world)]
    return a, b


def _ag_inputs(world, mc, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(mc, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    return shards, (torch.randn(k, n, generator=g) / k**0.5).to(torch.bfloat16)


def _rel(x, ref):
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def _assert_flags_zero(wss, when):
    for ws in wss:
        assert ws.flags().abs().sum() == 0, f"rank {ws.rank}: flags left set {when}"
        assert ws.ctl()[: P.CTL_WORDS].abs().sum() == 0, f"rank {ws.rank}: control words left set {when}"


class Captured:
    """A mocked CUDA graph: the call bound to its input tensors; ``replay`` runs the same
    launches after new values were copied into them (no host step of the op in between)."""

    def __init__(self, run, inputs):
        self.run, self.inputs = run, inputs

    def replay(self, new_values):
        for t, v in zip(self.inputs, new_values):
            t.copy_(v)
        return self.run()


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 3])
def test_gemm_rs_capture_eager_replay_interleavings(world):
    """capture A / eager B / replay A / eager B / replay A / eager C on one set of workspaces:
    B has more flags than A (its flag words are where A's data would start in a per-call
    layout), C fewer; interleaved (lag) and whole-chunk walks. Every result is right and every
    call starts and ends on zero flags."""
    k, n = 16, 32
    shapes = {"A": 16, "B": 48, "C": 32}  # rows per chunk
    big = [rs.make_plan("push", shapes["B"] * world, n, k, world, r, torch.bfloat16, CPU, config=CFG,
                        num_programs=4) for r in range(world)]
    wss = symm.emulated_workspaces(world, big[0].n_flags, big[0].data_bytes)
    small = rs.make_plan("push", shapes["A"] * world, n, k, world, 0, torch.bfloat16, CPU, config=CFG,
                         num_programs=4)
    assert small.n_flags < big[0].n_flags

    def eager(name, seed, lag=None):
        a, b = _rs_inputs(world, shapes[name], k, n, seed)
        outs, _, _ = emulate_gemm_rs(a, b, config=CFG, lag=lag, wss=wss)
        for r, (out, ref) in enumerate(zip(outs, gemm_rs_emulated(a, b, "kn"))):
            assert _rel(out, ref) < 1e-2, f"{name} rank {r}"
        _assert_flags_zero(wss, f"after {name}")

    a_in, b_in = _rs_inputs(world, shapes["A"], k, n, 1)
    graph = Captured(lambda: emulate_gemm_rs(a_in, b_in, config=CFG, lag=1, wss=wss)[0], [*a_in, *b_in])
    graph.run()  # the capture's own run
    _assert_flags_zero(wss, "after capturing A")
    for step in range(2):
        eager("B", 10 + step, lag=2 if step else None)
        new_a, new_b = _rs_inputs(world, shapes["A"], k, n, 20 + step)
        outs = graph.replay([*new_a, *new_b])
        for r, (out, ref) in enumerate(zip(outs, gemm_rs_emulated(new_a, new_b, "kn"))):
            assert _rel(out, ref) < 1e-2, f"replay {step} rank {r}"
        _assert_flags_zero(wss, f"after replay {step} of A")
    eager("C", 30)
    eager("B", 31)


@pytest.mark.interpreter
@pytest.mark.parametrize("design", ["push", "ce"])
def test_ag_gemm_capture_eager_replay_interleavings(design):
    """The same for ag_gemm (W = 2): capture A, then eager B (more bands: more flags) and replays
    of A in turn, then a call staging the local shard in the gathered buffer (read_local off)."""
    world, k, n = 2, 16, 32
    rows = {"A": 16, "B": 64}
    big = ag.make_plan(design, rows["B"] * world, n, k, world, 0, torch.bfloat16, CPU, config=CFG,
                       comm_programs=2 if design == "push" else None, num_programs=4)
    wss = symm.emulated_workspaces(world, big.n_flags, big.data_bytes)
    opts = dict(design=design, config=CFG, comm_programs=2 if design == "push" else None, wss=wss)

    def check(outs, shards, b, what):
        ref = ag_gemm_emulated(shards, b, "kn")
        for r, out in enumerate(outs):
            assert _rel(out, ref) < 1e-2, f"{what} rank {r}"
        _assert_flags_zero(wss, f"after {what}")

    shards_a, b_a = _ag_inputs(world, rows["A"], k, n, 1)
    graph = Captured(lambda: emulate_ag_gemm(shards_a, b_a, **opts)[0], [*shards_a, b_a])
    check(graph.run(), shards_a, b_a, "capturing A")
    for step in range(2):
        shards_b, b_b = _ag_inputs(world, rows["B"], k, n, 10 + step)
        check(emulate_ag_gemm(shards_b, b_b, **opts)[0], shards_b, b_b, f"eager B {step}")
        new_s, new_b = _ag_inputs(world, rows["A"], k, n, 20 + step)
        check(graph.replay([*new_s, new_b]), new_s, new_b, f"replay {step} of A")
    shards_b, b_b = _ag_inputs(world, rows["B"], k, n, 30)
    check(emulate_ag_gemm(shards_b, b_b, read_local=False, **opts)[0], shards_b, b_b, "B staged")


def test_a_stale_flag_is_caught_before_the_call():
    """What the interleavings guard against: a flag word left non-zero where a call will wait."""
    world, mc, k, n = 2, 16, 16, 32
    a, b = _rs_inputs(world, mc, k, n, 3)
    plan = rs.make_plan("push", mc * world, n, k, world, 0, torch.bfloat16, CPU, config=CFG, num_programs=4)
    wss = symm.emulated_workspaces(world, plan.n_flags, plan.data_bytes)
    wss[1].flags()[plan.n_flags - 1] = 7
    with pytest.raises(RuntimeError, match="stale flags"):
        emulate_gemm_rs(a, b, config=CFG, wss=wss)
