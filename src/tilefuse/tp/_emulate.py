"""Run the fused kernels of W ranks in one process (CPU tests through Triton's interpreter).

The interpreter runs programs one after another, so a wait for something a later launch would
provide never ends. The emulation therefore orders the launches the way the data flows — every
rank's senders before any rank's receivers — and pre-sets the go words that the start barrier
would raise (the barrier is tested on its own). The kernels, the peer addressing through
int64 workspace bases, the flags, the epilogues and the end-of-call resets are the real ones.
"""

from __future__ import annotations

import torch

from tilefuse.tp import _ag_gemm as ag
from tilefuse.tp import _gemm_rs as rs
from tilefuse.tp import _primitives as P
from tilefuse.tp.symm import Workspace, emulated_workspaces


def _poisoned(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _check_fits(wss: list[Workspace], plans) -> None:
    """The workspaces hold the call, and every flag word the call waits on is zero before it
    starts (a non-zero one would let a wait pass before its data arrived)."""
    for ws, plan in zip(wss, plans):
        if not ws.fits(plan.n_flags, plan.data_bytes):
            raise ValueError(f"rank {ws.rank}: the workspace does not hold {plan.n_flags} flags and "
                             f"{plan.data_bytes} data bytes")
        stale = ws.flags()[: plan.n_flags].nonzero().flatten().tolist()
        if stale:
            raise RuntimeError(f"rank {ws.rank}: stale flags before the call at words {stale[:8]}")


def _set_go(wss: list[Workspace], word) -> None:
    for ws in wss:
        ws.ctl()[word.value] = 1


def emulate_ag_gemm(shards: list[torch.Tensor], b: torch.Tensor, *, design: str, b_layout: str = "kn",
                    config=None, comm_programs: int | None = None, splits: int | None = None,
                    piece_cols: int | None = None, num_programs: int = 4, spins: int = 200, trace=None,
                    local_copy: str | None = None, read_local: bool | None = None,
                    wss: list[Workspace] | None = None):
    """Every rank's ``ag_gemm`` output (poisoned before the launch), workspaces and plans; on
    ``wss`` (e.g. those of earlier calls) or on fresh workspaces."""
    world = len(shards)
    mc, k = shards[0].shape
    n = b.shape[1] if b_layout == "kn" else b.shape[0]
    dev = shards[0].device
    plans = [ag.make_plan(design, mc * world, n, k, world, r, shards[0].dtype, dev, config=config,
                          comm_programs=comm_programs, splits=splits, piece_cols=piece_cols,
                          num_programs=num_programs, local_copy=local_copy, read_local=read_local)
             for r in range(world)]
    wss = wss or emulated_workspaces(world, plans[0].n_flags, plans[0].data_bytes, dev)
    _check_fits(wss, plans)
    timeout = P.timeout_units(1.0, dev.type, spins)
    if design == "push":
        _set_go(wss, P.CTL_GO_COMM)
        for r in range(world):
            if plans[r].local_copy == "ce":
                ag.ce_local_copies(plans[r], wss[r], shards[r])
        for r in range(world):
            buf = trace.buffer("push", r, plans[r].comm_programs, dev) if trace is not None else None
            ag.launch_push(plans[r], wss[r], shards[r], timeout, barrier=False, trace=buf)
    else:
        for r in range(world):
            ag.ce_local_copies(plans[r], wss[r], shards[r])
        for r in range(world):
            ag.ce_peer_copies(plans[r], wss[r])
    outs = [_poisoned((mc * world, n), shards[0]) for _ in range(world)]
    for r in range(world):
        traced_own = trace is not None and plans[r].read_local
        own = trace.buffer("gemm", r, plans[r].gemm_programs, dev) if traced_own else None
        buf = trace.buffer("gemm", r, plans[r].gemm_programs, dev) if trace is not None else None
        ag.launch_gemm_part(plans[r], wss[r], shards[r], b, outs[r], b_layout, timeout, trace=buf, own_trace=own)
    return outs, wss, plans


def emulate_gemm_rs(a_list: list[torch.Tensor], b_list: list[torch.Tensor], *, design: str = "push",
                    b_layout: str = "kn", config=None, num_programs: int = 4, spins: int = 200,
                    lag: int | None = None, trace=None, recv_tma: bool | None = None,
                    wss: list[Workspace] | None = None):
    """Every rank's ``gemm_rs`` output, workspaces and plans (on ``wss`` or fresh workspaces):
    peer-owned tiles of all ranks first, then the owners' own tiles with the fused reduction.
    An interleaved order (lag > 0) runs in lock-step segments of ``lag`` tile positions, every
    rank's segment before the next: an own tile needs peer tiles at least ``lag`` positions
    earlier, so they are always in an earlier segment."""
    world = len(a_list)
    m, k = a_list[0].shape
    b0 = b_list[0]
    n = b0.shape[1] if b_layout == "kn" else b0.shape[0]
    dev = a_list[0].device
    plans = [rs.make_plan(design, m, n, k, world, r, a_list[0].dtype, dev, config=config,
                          num_programs=num_programs, lag=lag, recv_tma=recv_tma)
             for r in range(world)]
    wss = wss or emulated_workspaces(world, plans[0].n_flags, plans[0].data_bytes, dev)
    _check_fits(wss, plans)
    timeout = P.timeout_units(1.0, dev.type, spins)
    outs = [_poisoned((m // world, n), a_list[0]) for _ in range(world)]
    _set_go(wss, P.CTL_GO_GEMM)

    def gemm(r, begin, end, reset):
        buf = trace.buffer("gemm", r, plans[r].gemm_programs, dev) if trace is not None else None
        rs.launch_gemm_part(plans[r], wss[r], a_list[r], b_list[r], outs[r], b_layout, timeout, tile_begin=begin,
                            tile_end=end, reset=reset, barrier=False, trace=buf)

    step = plans[0].schedule.lag_tiles
    if step:
        total = plans[0].schedule.num_tiles
        for begin in range(0, total, step):
            for r in range(world):
                gemm(r, begin, min(begin + step, total), begin + step >= total)
        return outs, wss, plans
    peer_tiles = (world - 1) * plans[0].tiles_per_chunk  # the first tiles of every rank's walk (lag 0)
    for r in range(world):
        gemm(r, 0, peer_tiles, False)
    for r in range(world):
        gemm(r, peer_tiles, plans[r].schedule.num_tiles, True)
    return outs, wss, plans
