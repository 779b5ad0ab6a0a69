"""The fused data path of W ranks in one process, through Triton's interpreter.

Peer buffers are real CPU tensors addressed through int64 workspace bases (as on a GPU through
symmetric memory); launches are ordered senders-first and the start barrier's go words are
pre-set (``tilefuse.tp._emulate``). Checks: results against the fp32 oracle, every output
element written (poisoned buffers), ag_gemm bitwise equal to the GEMM of the gathered rows,
bitwise reruns, and every flag / control word back to zero after the call.
"""

import pytest
import torch

from tilefuse.reference.comm_gemm import ag_gemm_emulated, gemm_rs_emulated
from tilefuse.tp import _primitives as P
from tilefuse.tp import gemm
from tilefuse.tp._emulate import emulate_ag_gemm, emulate_gemm_rs
from tilefuse.tp._gemm_core import GemmConfig

pytestmark = pytest.mark.interpreter
CFG = GemmConfig(16, 16, 16, 2, 1, 4)


def rel(x, ref):
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def assert_clean(wss, n_flags):
    for ws in wss:
        ctl = ws.ctl()
        assert int(ws.err[0]) == 0, f"rank {ws.rank} recorded an error: {ws.err.tolist()}"
        assert ctl[: P.CTL_WORDS].abs().sum() == 0, f"rank {ws.rank} control words not reset: {ctl.tolist()}"
        sig = ws.view(P.SIG_OFFSET.value, (ws.world,), torch.int32)
        assert sig.abs().sum() == 0
        assert ws.flag_words >= n_flags
        assert ws.flags().abs().sum() == 0, f"rank {ws.rank} flags not reset"


def make_ag(world, mc, k, n, layout, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(mc, k, generator=g).to(dtype) for _ in range(world)]
    shape = (k, n) if layout == "kn" else (n, k)
    b = (torch.randn(*shape, generator=g) / k**0.5).to(dtype)
    return shards, b


@pytest.mark.parametrize(
    "world,design,mc,layout,extra",
    [
        (2, "ce", 40, "kn", {}),
        (2, "push", 40, "nk", {"piece_cols": 16}),  # two pieces per band: counted flags
        # the local shard staged by copy engines in 3 pieces over 5 bands, peers by the push kernel
        (2, "push", 80, "kn", {"piece_cols": 16, "local_copy": "ce", "splits": 3}),
        (4, "ce", 32, "nk", {"splits": 1}),
        (4, "push", 24, "kn", {}),
        (8, "ce", 20, "kn", {"splits": 2}),
        (8, "push", 16, "nk", {}),
        (4, "push", 24, "nk", {"local_copy": "ce"}),
        (2, "ce", 40, "kn", {"read_local": False}),  # own rows from the staged buffer too
        (2, "push", 40, "kn", {"local_copy": "sm", "read_local": False}),
    ],
)
def test_ag_gemm_data_path(world, design, mc, layout, extra):
    k, n = 32, 48
    shards, b = make_ag(world, mc, k, n, layout)
    outs, wss, plans = emulate_ag_gemm(shards, b, design=design, b_layout=layout, config=CFG, comm_programs=2,
                                       **extra)
    gathered = torch.cat(shards)
    ref = ag_gemm_emulated(shards, b, layout)
    same_kernel = gemm(gathered, b, b_layout=layout, config=CFG)
    for r, out in enumerate(outs):
        assert not out.isnan().any(), f"rank {r}: unwritten output"
        assert rel(out, ref) < 1e-2
        assert torch.equal(out, same_kernel), f"rank {r}: not bitwise equal to gemm(gathered)"
        g = wss[r].view(wss[r].data_off, (mc * world, k), shards[0].dtype)
        staged = [c for c in range(world) if c != r or plans[r].local_copy != "none"]  # none: own rows unread
        for c in staged:
            rows = slice(c * mc, (c + 1) * mc)
            assert torch.equal(g[rows], gathered[rows]), f"rank {r}: gathered rows of chunk {c} differ"
    assert_clean(wss, plans[0].n_flags)
    if world == 2:  # bitwise rerun (the interpreter is slow: once per design)
        outs2, _, _ = emulate_ag_gemm(shards, b, design=design, b_layout=layout, config=CFG, comm_programs=2,
                                      **extra)
        assert all(torch.equal(x, y) for x, y in zip(outs, outs2))


@pytest.mark.parametrize(
    "world,design,mc,layout,dtype",
    [
        (2, "push", 40, "kn", torch.bfloat16),
        (2, "push", 32, "nk", torch.float16),
        (4, "push", 24, "nk", torch.bfloat16),
        (8, "push", 16, "kn", torch.float16),
    ],
)
def test_gemm_rs_data_path(world, design, mc, layout, dtype):
    k, n = 32, 48
    g = torch.Generator().manual_seed(world)
    a_list = [torch.randn(mc * world, k, generator=g).to(dtype) for _ in range(world)]
    shape = (k, n) if layout == "kn" else (n, k)
    b_list = [(torch.randn(*shape, generator=g) / k**0.5).to(dtype) for _ in range(world)]
    outs, wss, plans = emulate_gemm_rs(a_list, b_list, design=design, b_layout=layout, config=CFG)
    refs = gemm_rs_emulated(a_list, b_list, layout)
    for r, (out, ref) in enumerate(zip(outs, refs)):
        assert out.shape == (mc, n)
        assert not out.isnan().any(), f"rank {r}: unwritten output"
        assert rel(out, ref) < 1e-2, f"rank {r}: {rel(out, ref)}"
    assert_clean(wss, plans[0].n_flags)
    if world == 2:
        outs2, _, _ = emulate_gemm_rs(a_list, b_list, design=design, b_layout=layout, config=CFG)
        assert all(torch.equal(x, y) for x, y in zip(outs, outs2))


@pytest.mark.parametrize("world,lag,mc", [(2, 1, 40), (2, 5, 48), (4, 2, 24), (8, 1, 16), (3, 100, 16)])
def test_gemm_rs_push_interleaved_order(world, lag, mc):
    """push with own tiles interleaved behind the peer stream: the same bits as whole peer
    chunks first (the same sums in the same order), flags clean after the call."""
    k, n = 32, 48
    g = torch.Generator().manual_seed(100 + world)
    a_list = [torch.randn(mc * world, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    b_list = [(torch.randn(k, n, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(world)]
    outs, wss, plans = emulate_gemm_rs(a_list, b_list, design="push", config=CFG, lag=lag)
    assert plans[0].lag == lag and plans[0].schedule.lag_tiles == min(lag, plans[0].tiles_per_chunk)
    base, _, _ = emulate_gemm_rs(a_list, b_list, design="push", config=CFG, lag=0)
    refs = gemm_rs_emulated(a_list, b_list, "kn")
    for r in range(world):
        assert rel(outs[r], refs[r]) < 1e-2, f"rank {r}"
        assert torch.equal(outs[r], base[r]), f"rank {r}: interleaving changed the bits"
    assert_clean(wss, plans[0].n_flags)


def test_gemm_rs_reduces_in_rank_order():
    """The owner's epilogue: own fp32 partial + peers' partials rounded to the output dtype."""
    world, mc, k, n = 3, 16, 16, 16
    g = torch.Generator().manual_seed(7)
    a_list = [torch.randn(mc * world, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    b_list = [torch.randn(k, n, generator=g).to(torch.bfloat16) for _ in range(world)]
    outs, _, _ = emulate_gemm_rs(a_list, b_list, design="push", config=CFG)
    for r in range(world):
        rows = slice(r * mc, (r + 1) * mc)
        acc = a_list[r][rows].float() @ b_list[r].float()
        for s in range(1, world):
            src = (r + s) % world
            acc += (a_list[src][rows].float() @ b_list[src].float()).to(torch.bfloat16).float()
        torch.testing.assert_close(outs[r].float(), acc.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def _assert_option_keeps_bits(option: str, world: int, mc: int, seed: int, what: str, **kw):
    """gemm_rs with ``option=True`` gives the bits of ``option=False`` on every rank (and the
    option is on in the plan), with the flags left clean."""
    k, n = 32, 48
    g = torch.Generator().manual_seed(seed)
    a_list = [torch.randn(mc * world, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    b_list = [(torch.randn(k, n, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(world)]
    outs, wss, plans = emulate_gemm_rs(a_list, b_list, config=CFG, **{option: True}, **kw)
    base, _, _ = emulate_gemm_rs(a_list, b_list, config=CFG, **{option: False}, **kw)
    assert getattr(plans[0], option)
    for r in range(world):
        assert not outs[r].isnan().any(), f"rank {r}: unwritten output"
        assert torch.equal(outs[r], base[r]), f"rank {r}: {what} changed the bits"
    assert_clean(wss, plans[0].n_flags)


@pytest.mark.parametrize("world,mc,lag", [(2, 48, 3), (3, 32, 0), (2, 40, 0)])
def test_gemm_rs_partials_by_tma(world, mc, lag):
    """The owner's partials loaded through the receive buffer's tensor descriptor: the same bits
    as per-thread loads (aligned chunks; mc = 40 is not a multiple of the 16-row tile, so the
    option falls back to per-thread loads there)."""
    _assert_option_keeps_bits("recv_tma", world, mc, 300 + world, "TMA loads", lag=lag)
