"""Chunk ownership and tile order (pure Python) and the kernel's visit order (interpreter)."""

import pytest
import torch

from tilefuse.tp import Trace, gemm
from tilefuse.tp._gemm_core import GemmConfig
from tilefuse.tp._schedule import (
    CHUNK_ORDERS,
    TileSchedule,
    cdiv,
    chunk_order,
    chunk_rows,
)

WORLDS = range(2, 9)


def tile_rows(s: TileSchedule, chunk: int, j: int) -> tuple[int, int]:
    """Global rows ``[lo, hi)`` of tile row ``j`` of ``chunk``."""
    lo = chunk * s.mc + j * s.block_m
    return lo, min(lo + s.block_m, (chunk + 1) * s.mc)


def program_tiles(s: TileSchedule, pid: int, num_programs: int, begin: int = 0, end: int | None = None):
    """Tiles visited by persistent program ``pid`` of ``num_programs``, in visit order."""
    end = s.num_tiles if end is None else end
    return [s.decode(t) for t in range(begin + pid, end, num_programs)]


@pytest.mark.parametrize("world", WORLDS)
def test_chunk_orders_are_permutations_with_the_right_ends(world):
    for rank in range(world):
        for kind in CHUNK_ORDERS:
            order = chunk_order(kind, rank, world)
            assert sorted(order) == list(range(world)), (kind, rank, order)
        assert chunk_order("natural", rank, world) == list(range(world))
        arrival = chunk_order("arrival", rank, world)
        assert arrival == [(rank + s) % world for s in range(world)]
        owner_last = chunk_order("owner_last", rank, world)
        assert owner_last[-1] == rank and owner_last[0] == (rank + 1) % world


def test_chunk_order_bad_arguments():
    with pytest.raises(ValueError, match="chunk order"):
        chunk_order("random", 0, 2)
    with pytest.raises(ValueError, match="rank"):
        chunk_order("arrival", 2, 2)
    with pytest.raises(ValueError, match="world"):
        chunk_order("arrival", 0, 0)
    with pytest.raises(ValueError, match="divisible"):
        chunk_rows(1001, 2)
    assert chunk_rows(2000, 8) == 250


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mc,block_m,group_m", [(256, 64, 4), (250, 64, 8), (40, 16, 1), (1000, 128, 8)])
def test_decode_visits_every_tile_once_in_chunk_order(world, mc, block_m, group_m):
    for rank in (0, world - 1):
        order = tuple(chunk_order("owner_last", rank, world))
        s = TileSchedule(mc, 96, world, block_m, 32, group_m, order)
        tiles = [s.decode(t) for t in range(s.num_tiles)]
        assert len(set(tiles)) == s.num_tiles == world * cdiv(mc, block_m) * cdiv(96, 32)
        positions = [order.index(c) for c, _, _ in tiles]
        assert positions == sorted(positions)  # whole chunks, in the given order
        for c, j, col in tiles:
            lo, hi = tile_rows(s, c, j)
            assert c * mc <= lo < hi <= (c + 1) * mc  # no tile straddles chunks
            assert 0 <= col < s.tile_cols
        assert s.aligned == (mc % block_m == 0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mc,block_m,group_m,lag", [(256, 64, 4, 1), (250, 64, 8, 5), (40, 16, 1, 7),
                                                    (1000, 128, 8, 100), (64, 64, 2, 3)])
def test_interleaved_order_leads_every_own_tile(world, mc, block_m, group_m, lag):
    """lag > 0: every tile once, the own chunk spread through the walk, and each peer's copy of
    a rank's tile i computed at least lag positions ((W - 1) * lag + 1 before the tail, W *
    lag in the middle) before that rank reduces tile i."""
    scheds = [TileSchedule(mc, 96, world, block_m, 32, group_m, tuple(chunk_order("owner_last", r, world)), lag)
              for r in range(world)]
    tpc, eff = scheds[0].tiles_per_chunk, scheds[0].lag_tiles
    assert eff == min(lag, tpc)
    where = []  # per rank: (chunk, in-chunk index) -> position
    for s in scheds:
        pos = {}
        for t in range(s.num_tiles):
            ci, i = s.position(t)
            chunk, j, col = s.decode(t)
            assert chunk == s.order[ci] and (j, col) == TileSchedule(
                mc, 96, world, block_m, 32, group_m, s.order).decode(ci * tpc + i)[1:]
            pos[(chunk, i)] = t
        assert len(pos) == s.num_tiles == world * tpc
        where.append(pos)
    for r in range(world):
        for i in range(tpc):
            own = where[r][(r, i)]
            assert own >= (world - 1) * eff  # nothing of the own chunk in the lead
            for p in range(world):
                if p != r:
                    lead = own - where[p][(r, i)]
                    assert lead >= eff, (r, p, i, lead)
                    if i < tpc - eff:
                        assert lead >= (world - 1) * eff + 1, (r, p, i, lead)
                    if eff <= i < tpc - eff:
                        assert lead >= world * eff, (r, p, i, lead)


def test_interleaved_order_bad_arguments():
    with pytest.raises(ValueError, match="lag"):
        TileSchedule(64, 64, 2, 32, 32, 1, (1, 0), -1)
    with pytest.raises(ValueError, match="two chunks"):
        TileSchedule(64, 64, 1, 32, 32, 1, (0,), 2)
    s = TileSchedule(64, 64, 2, 32, 32, 1, (1, 0), 1)  # 4 tiles a chunk: peer, peer, own, ... own
    assert [s.position(t) for t in range(8)] == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (0, 3), (1, 2), (1, 3)]


def test_banded_super_tiles():
    s = TileSchedule(512, 128, 1, 64, 32, 4, (0,))
    first = [s.decode(t) for t in range(16)]
    # the first band of 4 tile rows sweeps all 4 columns before the next band starts
    assert {j for _, j, _ in first} == {0, 1, 2, 3} and {c for _, _, c in first} == {0, 1, 2, 3}
    assert [s.decode(t)[1:] for t in range(5)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]
    last = TileSchedule(320, 64, 1, 64, 32, 4, (0,))  # 5 tile rows: a short last band of 1
    assert [last.decode(t)[1:] for t in range(8, 10)] == [(4, 0), (4, 1)]


def test_schedule_bad_arguments():
    with pytest.raises(ValueError, match="permutation"):
        TileSchedule(64, 64, 2, 32, 32, 1, (0, 0))
    with pytest.raises(ValueError, match="positive"):
        TileSchedule(0, 64, 1, 32, 32, 1, (0,))
    with pytest.raises(ValueError, match="outside"):
        TileSchedule(64, 64, 1, 32, 32, 1, (0,)).decode(4)


def test_program_tiles():
    s = TileSchedule(64, 64, 2, 32, 32, 2, (1, 0))
    assert program_tiles(s, 0, 3) == [s.decode(0), s.decode(3), s.decode(6)]
    assert program_tiles(s, 1, 3, begin=4) == [s.decode(5)]


@pytest.mark.parametrize("world,order,lag", [(2, "arrival", 0), (4, "owner_last", 0), (8, "arrival", 0),
                                             (3, "natural", 0), (2, "owner_last", 2), (4, "owner_last", 1),
                                             (3, "owner_last", 50)])
def test_kernel_visits_tiles_in_the_python_order(world, order, lag, on_device):
    """The persistent kernel's tile decode equals TileSchedule.decode (read back from a trace)."""
    torch.manual_seed(world)
    cfg = GemmConfig(16, 16, 16, 2, 1, 4)
    mc, n, k, programs = 20, 32, 16, 3
    rank = world - 1
    a = torch.randn(mc * world, k).to(torch.bfloat16)
    b = torch.randn(k, n).to(torch.bfloat16)
    tr = Trace(max_events=64)
    buf = tr.buffer("gemm", rank, programs, a.device)
    out = gemm(a, b, config=cfg, chunks=world, order=order, rank=rank, lag=lag, num_programs=programs, trace=buf)
    s = TileSchedule(mc, n, world, 16, 16, 2, tuple(chunk_order(order, rank, world)), lag)
    seen = {}
    for e in tr.events():
        seen.setdefault(e["program"], []).append((e["seq"], (e["chunk"], e["tile_row"], e["tile_col"])))
    for p in range(programs):
        assert [t for _, t in sorted(seen[p])] == program_tiles(s, p, programs)
    torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)
