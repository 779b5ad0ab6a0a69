"""Barrier, bounded waits and error records, through the interpreter with emulated peers.

The interpreter runs one program at a time, so a wait on something nobody provides must end by
its bound (a spin count here, %globaltimer ns on a GPU) and leave an error record naming the
rank, op, role and chunk; the abort word then makes every later wait return at once.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from tilefuse.tp import _primitives as P
from tilefuse.tp._emulate import emulate_ag_gemm
from tilefuse.tp._gemm_core import GemmConfig
from tilefuse.tp.symm import CommTimeoutError, FusedState, describe, emulated_workspaces, raise_recorded

ag = importlib.import_module("tilefuse.tp._ag_gemm")
rs = importlib.import_module("tilefuse.tp._gemm_rs")
CFG = GemmConfig(16, 16, 16, 2, 1, 4)


def signals(ws):
    return ws.view(P.SIG_OFFSET.value, (ws.world,), torch.int32)


@pytest.mark.interpreter
def test_barrier_with_arrived_peers_signals_and_consumes():
    wss = emulated_workspaces(3, 64, 1 << 16)
    me = wss[1]
    signals(me)[0] = 1  # ranks 0 and 2 have arrived at rank 1
    signals(me)[2] = 1
    ag.launch_barrier(me, P.timeout_units(1.0, "cpu", 50), "gemm_rs", set_go_gemm=True)
    assert signals(me).tolist() == [0, 0, 0]  # consumed
    assert int(signals(wss[0])[1]) == 1 and int(signals(wss[2])[1]) == 1  # announced to both peers
    assert int(me.ctl()[P.CTL_GO_GEMM.value]) == 1 and int(me.ctl()[P.CTL_GO_COMM.value]) == 0
    assert int(me.err[0]) == 0


@pytest.mark.interpreter
def test_barrier_with_a_missing_peer_records_and_raises():
    wss = emulated_workspaces(4, 64, 1 << 16)
    me = wss[2]
    for peer in (0, 1):
        signals(me)[peer] = 1  # rank 3 never arrives
    ag.launch_barrier(me, P.timeout_units(1.0, "cpu", 30), "ag_gemm")
    rec = me.err.tolist()
    assert rec[:5] == [1, 2, P.OP_CODES["ag_gemm"], P.ROLE_BARRIER.value, 3]
    assert int(me.ctl()[P.CTL_ABORT.value]) == 1
    with pytest.raises(CommTimeoutError, match="rank 2 timed out waiting in the start/end barrier for rank 3") as ei:
        raise_recorded(me, "ag_gemm")
    assert "tilefuse.tp.ag_gemm" in str(ei.value) and ei.value.record["chunk"] == 3


@pytest.mark.interpreter
def test_missing_chunk_times_out_in_the_gemm_naming_the_chunk():
    """ag_gemm where rank 1's rows never arrive at rank 0: rank 0's tiles of chunk 1 time out."""
    world, mc, k, n = 2, 32, 16, 16
    shards = [torch.randn(mc, k).to(torch.bfloat16) for _ in range(world)]
    b = torch.randn(k, n).to(torch.bfloat16)
    plans = [ag.make_plan("ce", mc * world, n, k, world, r, torch.bfloat16, torch.device("cpu"), config=CFG,
                          num_programs=4) for r in range(world)]
    wss = emulated_workspaces(world, plans[0].n_flags, plans[0].data_bytes)
    ag.ce_local_copies(plans[0], wss[0], shards[0])  # rank 0's own rows only
    out = torch.full((mc * world, n), float("nan")).to(torch.bfloat16)
    ag.launch_gemm_part(plans[0], wss[0], shards[0], b, out, "kn", P.timeout_units(1.0, "cpu", 20))
    rec = wss[0].err.tolist()
    assert rec[0] == 1 and rec[1] == 0 and rec[3] == P.ROLE_GEMM.value and rec[4] == 1
    msg = describe(rec)
    assert "rank 0" in msg and "ag_gemm" in msg and "chunk 1" in msg
    assert not out[:mc].isnan().any()  # own rows were computed
    # the abort word is sticky: a later call returns at once and reports the same record
    ag.launch_gemm_part(plans[0], wss[0], shards[0], b, out, "kn", P.timeout_units(1.0, "cpu", 10**9))
    assert wss[0].err.tolist() == rec


@pytest.mark.interpreter
def test_gemm_rs_missing_partial_times_out():
    world, mc, k, n = 2, 16, 16, 16
    a = torch.randn(mc * world, k).to(torch.bfloat16)
    b = torch.randn(k, n).to(torch.bfloat16)
    plan = rs.make_plan("push", mc * world, n, k, world, 1, torch.bfloat16, torch.device("cpu"), config=CFG,
                        num_programs=2)
    wss = emulated_workspaces(world, plan.n_flags, plan.data_bytes)
    wss[1].ctl()[P.CTL_GO_GEMM.value] = 1
    out = torch.empty(mc, n, dtype=torch.bfloat16)
    rs.launch_gemm_part(plan, wss[1], a, b, out, "kn", P.timeout_units(1.0, "cpu", 20), barrier=False)
    rec = wss[1].err.tolist()
    assert rec[:5] == [1, 1, P.OP_CODES["gemm_rs"], P.ROLE_GEMM.value, 1]
    assert rec[7] == 1  # expected flag value


def test_state_check_raises_once_recorded_and_stays_broken():
    st = FusedState(None, "gemm_rs", torch.device("cpu"))
    st.ws = emulated_workspaces(2, 64, 1 << 16)[0]
    st.check()  # nothing recorded
    st.ws.err.copy_(torch.tensor([1, 0, 2, 1, 1, -1, 0, 1], dtype=torch.int32))
    with pytest.raises(CommTimeoutError, match="rank 0 timed out"):
        st.check()
    st.ws.err.zero_()
    with pytest.raises(CommTimeoutError, match="reset_group"):
        st.check()  # broken until reset_group


def test_timeout_units():
    assert P.timeout_units(2.5, "cuda") == 2_500_000_000
    assert P.timeout_units(2.5, "cpu", 77) == 77
    with pytest.raises(ValueError, match="timeout_s"):
        P.timeout_units(0, "cuda")


@pytest.mark.interpreter
def test_emulation_without_go_words_times_out_in_push():
    """The push kernel's programs wait for the start barrier's go word before a remote store."""
    world, mc, k, n = 2, 16, 16, 16
    shards = [torch.randn(mc, k).to(torch.bfloat16) for _ in range(world)]
    b = torch.randn(k, n).to(torch.bfloat16)
    plan = ag.make_plan("push", mc * world, n, k, world, 0, torch.bfloat16, torch.device("cpu"), config=CFG,
                        comm_programs=1, num_programs=2)
    wss = emulated_workspaces(world, plan.n_flags, plan.data_bytes)
    ag.launch_push(plan, wss[0], shards[0], P.timeout_units(1.0, "cpu", 20), barrier=False)
    rec = wss[0].err.tolist()
    assert rec[:5] == [1, 0, P.OP_CODES["ag_gemm"], P.ROLE_PUSH.value, 1]
    # the emulated data path with go words set completes cleanly
    outs, wss2, _ = emulate_ag_gemm(shards, b, design="push", config=CFG, comm_programs=1, num_programs=2)
    assert all(int(w.err[0]) == 0 for w in wss2) and not any(o.isnan().any() for o in outs)


@pytest.mark.interpreter
def test_no_store_into_a_peer_after_a_failed_start_barrier():
    """Without the start barrier's go word the senders time out and then leave every peer's
    workspace as it was: no data, no flags (the peer may have gone, or reused the memory)."""
    world, mc, k, n = 2, 32, 16, 16
    g = torch.Generator().manual_seed(5)
    shards = [torch.randn(mc, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    b = torch.randn(k, n, generator=g).to(torch.bfloat16)
    dev = torch.device("cpu")
    timeout = P.timeout_units(1.0, "cpu", 20)
    for local in (None, "sm", "ce"):  # None: nothing stages the own rows (read_local)
        plan = ag.make_plan("push", mc * world, n, k, world, 0, torch.bfloat16, dev, config=CFG, comm_programs=2,
                            num_programs=4, local_copy=local)
        wss = emulated_workspaces(world, plan.n_flags, plan.data_bytes)
        peer_before = wss[1].local.clone()
        ag.launch_push(plan, wss[0], shards[0], timeout, barrier=False)
        assert int(wss[0].err[0]) == 1 and torch.equal(wss[1].local, peer_before), local
    plan = rs.make_plan("push", mc * world, n, k, world, 0, torch.bfloat16, dev, config=CFG, num_programs=4)
    wss = emulated_workspaces(world, plan.n_flags, plan.data_bytes)
    peer_before = wss[1].local.clone()
    a = torch.randn(mc * world, k, generator=g).to(torch.bfloat16)
    out = torch.empty(mc, n, dtype=torch.bfloat16)
    rs.launch_gemm_part(plan, wss[0], a, b, out, "kn", timeout, tile_end=(world - 1) * plan.tiles_per_chunk,
                        reset=False, barrier=False)
    assert int(wss[0].err[0]) == 1 and torch.equal(wss[1].local, peer_before)


def test_waits_branch_uniformly_on_a_gpu():
    """A scalar atomic's result reaches the program's threads through shared memory behind a CTA
    barrier, so a branch that some threads take and others not (a timer read per thread, a
    volatile load of a word another program is writing) makes them meet different barriers:
    the program hangs. Compiled for sm_90a, the waits must read changing words once (no
    volatile load) and agree on the clock through a CTA-wide OR (one per wait loop)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = os.path.join(os.path.dirname(__file__), "_uniform_probe.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    ptx = subprocess.run([sys.executable, probe], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout
    assert ".entry wait_probe" in ptx
    assert "ld.volatile" not in ptx
    assert ptx.count("%globaltimer") >= 2  # the clock is read: a GPU build, not the spin count
    assert ptx.count("bar.red.or.pred") == 2  # the wait_geq loop and the cas_bounded loop
