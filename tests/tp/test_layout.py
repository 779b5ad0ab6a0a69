"""Workspace layouts across calls: flag words never overlap an earlier call's data.

Each call resets the flags it used, but a later call of another shape (or design) may have
more flag words, reaching into bytes the earlier call used as data; ``FusedState.clear_flags``
zeroes exactly those before the call. gemm_rs's two designs share one layout.
"""

import importlib

import pytest
import torch

from tilefuse.tp import _primitives as P
from tilefuse.tp.symm import FusedState, emulated_workspaces

ag = importlib.import_module("tilefuse.tp._ag_gemm")
rs = importlib.import_module("tilefuse.tp._gemm_rs")
CPU = torch.device("cpu")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 512), (8192, 8192, 1024), (32768, 32768, 4096), (2000, 768, 512)])
def test_gemm_rs_flags_precede_the_receive_buffer(world, m, n, k):
    if m % world:
        pytest.skip("M not divisible by W")
    push = rs.make_plan("push", m, n, k, world, 0, torch.bfloat16, CPU, num_programs=132)
    assert P.FLAGS_OFFSET < push.flags_end <= push.recv_off and push.recv_off % 1024 == 0
    assert push.nbytes == push.recv_off + m * n * 2


@pytest.mark.parametrize("design", ["ce", "push"])
@pytest.mark.parametrize("world", [2, 8])
def test_ag_gemm_flags_precede_gathered_rows(design, world):
    for s in (4096, 32768):
        plan = ag.make_plan(design, s, s // 8, s, world, 0, torch.bfloat16, CPU, num_programs=132)
        assert plan.flags_end == P.FLAGS_OFFSET + 4 * plan.n_flags <= plan.gath_off


def _state(nbytes=1 << 14):
    st = FusedState(None, "gemm_rs", CPU)
    st.ws = emulated_workspaces(2, nbytes)[0]
    st.clean_end = st.ws.nbytes  # as after an allocation: all zero
    return st


def test_clear_flags_zeroes_only_bytes_used_as_data_before():
    st = _state()
    buf = st.ws.local
    st.clear_flags(1024)  # call A: flags up to 1024, data after
    assert st.clean_end == 1024
    buf[1024:].fill_(7)  # A's data
    buf[: P.FLAGS_OFFSET].fill_(3)  # control words and barrier slots: never touched
    st.clear_flags(4096)  # call B has more flags: [1024, 4096) held A's data
    assert buf[P.FLAGS_OFFSET:4096].eq(0).all()
    assert buf[4096:].eq(7).all() and buf[: P.FLAGS_OFFSET].eq(3).all()
    assert st.clean_end == 4096
    buf[4096:].fill_(9)  # B's data
    st.clear_flags(2048)  # call C: fewer flags, all within B's (reset) flags: nothing to clear
    assert buf[2048:4096].eq(0).all() and buf[4096:].eq(9).all()
    assert st.clean_end == 2048  # C's data may now follow 2048
    buf[2048:].fill_(5)
    st.clear_flags(3072)
    assert buf[P.FLAGS_OFFSET:3072].eq(0).all() and buf[3072:].eq(5).all()


def test_clear_flags_needs_a_workspace():
    st = FusedState(None, "ag_gemm", CPU)
    with pytest.raises(RuntimeError, match="workspace"):
        st.clear_flags(1024)
