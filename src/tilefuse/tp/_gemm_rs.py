"""gemm_rs: ``reduce_scatter(a @ b, dim 0, sum)`` with the transfers hidden under the product.

Each rank computes the peer-owned row chunks (rank+1, rank+2, ...) before its own
(``_schedule.chunk_order("owner_last")``); the owner adds the peers' partials of a tile in the
epilogue of its own tile (fp32 accumulator + each peer's partial in the output dtype, in rank
order from rank+1), then writes the result once. One design, ``"push"`` (epilogue push):
a finished peer-owned tile is stored straight into the owner's receive buffer (symmetric
memory) and the owner's per-tile flag is raised one tile later, when the stores have drained
under the next tile's main loop. Program 0 first meets the peers (so every owner has finished
reading its buffer from the last call) and opens the go word the others wait on before their
first remote store. One kernel, all SMs, no side stream. The tile order interleaves peer and
own tiles where the link would not keep up with whole peer chunks first (``lag``,
``default_lag``). At W = 2 on Hopper, with chunks of whole tiles, the same walk runs as a
Gluon kernel (``_gemm_rs_gluon``, ``send_tma``) whose pushed tiles' stores stay in flight
under the next tile's main loop. The measurements behind every default are in
``benchmarks/NOTES.md`` (fused TP GEMM rounds).

Every wait is bounded (``timeout_s``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from tilefuse._device import capability_major
from tilefuse.tp import _options
from tilefuse.tp import _primitives as P
from tilefuse.tp._common import FusedPlan
from tilefuse.tp._gemm_core import (
    EPI_RS_PUSH,
    CommArgs,
    GemmConfig,
    default_config,
    launch_gemm,
    num_sms,
)
from tilefuse.tp._options import GemmRsOptions, check_bool
from tilefuse.tp._schedule import TileSchedule, chunk_order, chunk_rows
from tilefuse.tp.symm import Workspace

DESIGNS = ("push",)
# push's tile order (``default_lag``). Interleave only where whole peer chunks first would ask
# more of the link than it carries:
# the partials of (W-1)/W of the product leave in (W-1)/W of the GEMM, i.e. at elem_bytes *
# GEMM_FLOPS / (2 K) bytes/s whatever M, N and W; and only on grids of INTERLEAVE_MIN_WAVES waves
# or more (on one or two waves the own tiles just wait). Then the own tiles trail the peer
# stream by LAG_WAVES waves of the grid in the middle of the walk.
GEMM_FLOPS = 650e12  # bf16 dense GEMM rate of the core on an H200
LINK_BYTES_PER_S = 250e9  # push rate above which the peer phase was link-bound
INTERLEAVE_MIN_WAVES = 3
LAG_WAVES = 1.0


@dataclass(frozen=True)
class RsPlan(FusedPlan):
    """Everything one rank needs to launch a fused gemm_rs of one shape (cached per shape)."""

    gemm_programs: int
    data_bytes: int  # the receive buffer [W, M/W, N]
    recv_tma: bool  # the owner loads peer partials by TMA (tensor descriptor) in its epilogue
    send_tma: bool  # push at W = 2 by the Gluon kernel: pushed tiles' TMA stores left in flight

    @property
    def lag(self) -> int:
        return self.schedule.lag

    @property
    def tiles_per_chunk(self) -> int:
        return self.schedule.tiles_per_chunk

    @property
    def n_flags(self) -> int:
        """Receive flags: one per (source rank, tile of the own chunk)."""
        return self.world * self.tiles_per_chunk



def default_lag(k: int, world: int, programs: int, num_tiles: int, elem_bytes: int = 2) -> int:
    """push's lag: 0 (whole peer chunks first) where the link keeps up with the GEMM or the grid
    is short, else ``LAG_WAVES`` waves of ``programs`` between a peer computing a tile and its
    owner reducing it in the middle of the walk (the own tile follows ``world * lag`` positions
    after the peer's copy of it there, at least ``lag`` at the ends)."""
    demand = elem_bytes * GEMM_FLOPS / (2 * k)
    if world < 2 or demand <= LINK_BYTES_PER_S or num_tiles < INTERLEAVE_MIN_WAVES * programs:
        return 0
    return max(1, -(-int(LAG_WAVES * programs) // world))


def make_plan(
    design: str, m: int, n: int, k: int, world: int, rank: int, dtype: torch.dtype, device: torch.device, *,
    config: GemmConfig | None = None,
    num_programs: int | None = None,
    lag: int | None = None,
    gemm_programs: int | None = None,
    recv_tma: bool | None = None,
    send_tma: bool | None = None,
) -> RsPlan:
    """Workspace use: receive flags ``[W, tiles per chunk]``, the receive buffer ``[W, M/W, N]``.
    ``num_programs``: the SMs to plan for (default: the device's). The other arguments are
    :class:`GemmRsOptions`' fields (None: the defaults described there)."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if lag is not None and (not isinstance(lag, int) or lag < 0):
        raise ValueError(f"lag must be a non-negative int or None, got {lag!r}")
    check_bool("send_tma", send_tma)
    if send_tma and world != 2:
        raise ValueError(f"send_tma is for world size 2 (one peer), got W = {world}")
    check_bool("recv_tma", recv_tma)
    mc = chunk_rows(m, world)
    sms = num_programs or num_sms(device)
    if gemm_programs is not None and not (isinstance(gemm_programs, int) and 1 <= gemm_programs <= sms):
        raise ValueError(f"gemm_programs must be an int in [1, {sms}] (resident programs), got {gemm_programs!r}")
    cfg = config or default_config(m, n, k, sms)
    item = dtype.itemsize
    sched = TileSchedule(mc, n, world, cfg.block_m, cfg.block_n, cfg.group_m,
                         tuple(chunk_order("owner_last", rank, world)))
    if lag is None:
        lag = default_lag(k, world, sms, sched.num_tiles, item)
    if lag and world > 1:
        sched = replace(sched, lag=lag)
    # TMA partial loads by default where the walk is not interleaved (measured: NOTES).
    tma = sched.lag_tiles == 0 if recv_tma is None else recv_tma
    # The Gluon kernel by default where it runs (measured: NOTES).
    if send_tma is None:
        send_tma = world == 2
    send = send_tma and sched.aligned and capability_major(device) == 9  # Gluon's wgmma/TMA: sm_90
    return RsPlan(design, m, n, k, world, rank, dtype, cfg, sched, gemm_programs or sms, m * n * item,
                  tma or send, send)


def launch_gemm_part(plan: RsPlan, ws: Workspace, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     b_layout: str, timeout: int, *, tile_begin: int = 0, tile_end: int | None = None,
                     reset: bool = True, barrier: bool = True, trace: torch.Tensor | None = None) -> None:
    comm = CommArgs(ws.local, ws.bases_dev, ws.err, timeout, flags_off=P.FLAGS_OFFSET, recv_off=ws.data_off,
                    n_reset_flags=plan.n_flags, reset=reset, barrier=barrier,
                    recv=ws.view(ws.data_off, (plan.m, plan.n), plan.dtype) if plan.recv_tma else None)
    if plan.send_tma:  # the whole walk in one launch
        from tilefuse.tp import _gemm_rs_gluon

        if tile_begin != 0 or tile_end not in (None, plan.schedule.num_tiles):
            raise ValueError("the Gluon push kernel runs the whole tile walk in one launch")
        peer_recv = ws.peer_view(1 - plan.rank, ws.data_off, (plan.m, plan.n), plan.dtype)
        _gemm_rs_gluon.launch(a, b, out, comm.recv, peer_recv, schedule=plan.schedule, rank=plan.rank,
                              config=plan.config, b_layout=b_layout, comm=comm, num_programs=plan.gemm_programs,
                              trace=trace, op_code=P.OP_CODES["gemm_rs"], use_timer=P.use_timer(a.device.type))
        return
    launch_gemm(a, b, out, schedule=plan.schedule, rank=plan.rank, config=plan.config, b_layout=b_layout,
                epilogue=EPI_RS_PUSH.value, comm=comm, num_programs=plan.gemm_programs, tile_begin=tile_begin,
                tile_end=tile_end, trace=trace, op="gemm_rs")


def run_fused(plan: RsPlan, ws: Workspace, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_layout: str,
              timeout: int, trace=None) -> None:
    """One rank's fused call: the GEMM alone on the current stream (its program 0 runs the
    barrier)."""
    gemm_trace = trace.buffer("gemm", plan.rank, plan.gemm_programs, a.device) if trace is not None else None
    launch_gemm_part(plan, ws, a, b, out, b_layout, timeout, trace=gemm_trace)


_make_plan_cached = functools.lru_cache(maxsize=64)(make_plan)


def gemm_rs(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    group=None,
    out: torch.Tensor | None = None,
    b_layout: str = "kn",
    path: str | None = None,
    design: str | None = None,
    options: GemmRsOptions | None = None,
    trace=None,
):
    """``reduce_scatter(a @ b, dim 0, sum)`` over ``group`` (row-parallel layer).

    Args:
        a: ``[M, K]`` bf16 or fp16, contiguous: this rank's K slice of the activations; M must
            be divisible by the world size W (any such M, the same on every rank); K a multiple
            of 8.
        b: ``[K, N]`` (``b_layout="kn"``) or nn.Linear's weight ``[N, K]`` (``"nk"``), same
            dtype, contiguous; N a multiple of 8.
        group: torch.distributed process group (default: the world).
        out: optional ``[M/W, N]`` output; rank r receives rows ``[r*M/W, (r+1)*M/W)``.
        path / design: force ``"fused"`` / ``"nccl"`` and the design (``"push"``); by default
            the policy decides.
        options: :class:`tilefuse.tp.GemmRsOptions` (GEMM tiles, tile order, programs, TMA
            choices, timeout); fields left None come from ``tilefuse.tp.set_options``, then
            from the policy's measurements of this exact shape, then from the defaults.
        trace: a :class:`tilefuse.tp.Trace`.

    Returns:
        ``[M/W, N]``: the sum over ranks of their partial products' rows of this rank, computed
        as the own fp32 partial plus each peer's partial rounded to the output dtype.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, layouts, alignment, options, M % W != 0,
            shapes that differ between the ranks.
        RuntimeError: no initialised process group; workspace growth inside graph capture.
        CommTimeoutError: a wait timed out in this or an earlier call.
    """
    from tilefuse.tp import _common
    from tilefuse.tp._gemm_core import check_operands, gemm

    k, n = check_operands(a, b, b_layout, "a")
    opts = _options.resolve(options, GemmRsOptions)
    g, rank, world = _common.resolve_group(group)
    # Shapes first: a rank raising alone would leave its peers waiting in the next collective.
    _common.check_same_shapes(g, world, "gemm_rs", {"a": tuple(a.shape), "b": tuple(b.shape)}, a.device)
    m = a.shape[0]
    if m == 0:
        raise ValueError("a has 0 rows: gemm_rs needs M >= W rows (M divisible by the world size)")
    if m % world:
        raise ValueError(f"a has M = {m} rows, which must be divisible by the world size {world}")
    out = _common.check_out(out, (m // world, n), a)
    dec = _common.decide("gemm_rs", g, world, m, n, k, a, path, design)
    if dec.path == "gemm":
        return gemm(a, b, out, b_layout=b_layout, config=opts.config)
    if dec.path == "nccl":
        return _common.gemm_rs_nccl(a, b, out, g, b_layout, opts.config)
    _, plan, ws, timeout = _common.prepare_fused("gemm_rs", _make_plan_cached, dec, opts, g, rank, world,
                                                 m, n, k, a)
    run_fused(plan, ws, a, b, out, b_layout, timeout, trace)
    return out
