"""ag_gemm: ``all_gather(a_shard, dim 0) @ b`` with the gather hidden under the product.

Designs (``design=``; the policy picks one per shape from measurements):

* ``"ce"`` — copy engines. A side stream copies the local shard into this rank's gathered
  buffer (symmetric memory) in ``splits`` bands, meets the peers (barrier kernel), then pulls
  each peer's shard from the peer's buffer, band by band, in arrival order (rank+1, rank+2,
  ...), writing a flag after each band; a final barrier tells peers their shard was read.
  The persistent GEMM uses every SM and waits, per tile, on the flag of the band it reads.
* ``"push"`` — SM-driven. ``comm_programs`` programs of a push kernel copy the local shard,
  band by band (one band = one tile row) and piece by piece, into every peer's gathered buffer
  and count pieces on the destination's band flag; the GEMM runs on the remaining SMs. The
  local shard lands in this rank's own buffer by the same programs (``local_copy="sm"``) or by
  copy engines on a second side stream in ``splits`` pieces (``"ce"``), leaving the push
  programs the remote stores alone; or nowhere (``read_local``, below).

Both: the GEMM may read this rank's own rows straight from ``a_shard`` in a launch of their own
(``read_local``, by default where that launch fills its waves, ``default_read_local``): its
tiles wait for nothing. (push then stages nothing locally; ``ce`` still copies the shard into
the gathered buffer, for the peers to pull.)

Both: the GEMM visits chunks in arrival order (own rows first, ``_schedule.chunk_order``), so
a tile never waits behind data that arrives later. Every wait is bounded (``timeout_s``). The
measurements behind every default are in ``benchmarks/NOTES.md`` (fused TP GEMM rounds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from tilefuse._jit import cdiv
from tilefuse.tp import _options
from tilefuse.tp import _primitives as P
from tilefuse.tp._comm_kernels import _ag_push_kernel, _barrier_kernel
from tilefuse.tp._common import FusedPlan
from tilefuse.tp._gemm_core import (
    EPI_LOCAL,
    CommArgs,
    GemmConfig,
    check_operands,
    default_config,
    launch_gemm,
    num_sms,
)
from tilefuse.tp._options import AgGemmOptions, check_bool, check_local_copy
from tilefuse.tp._schedule import TileSchedule, chunk_order, chunk_rows
from tilefuse.tp.symm import Workspace

DESIGNS = ("ce", "push")
# push stages its local shard by copy engines from this shard size on: below it the copy
# engines' launch latency costs more than the push programs' local stores.
PUSH_CE_STAGING_MIN_BYTES = 32 << 20
# read_local splits the GEMM in two launches (own chunk, then peers); the own launch's last wave
# leaves programs idle that one launch would have moved on to peer tiles. So read the own rows
# directly where that idle share is at most this, or the own chunk is under one wave.
READ_LOCAL_MAX_IDLE = 0.10


def default_read_local(own_tiles: int, programs: int) -> bool:
    """Whether the GEMM reads the own rows from the shard (``READ_LOCAL_MAX_IDLE``)."""
    waves = own_tiles / programs
    if waves <= 1:
        return True
    full = -(-own_tiles // programs)
    return (full - waves) / full <= READ_LOCAL_MAX_IDLE


def default_local_copy(mc: int, k: int, elem_bytes: int = 2) -> str:
    """Who stages push's local shard (``mc x k``): copy engines from ``PUSH_CE_STAGING_MIN_BYTES``."""
    return "ce" if mc * k * elem_bytes >= PUSH_CE_STAGING_MIN_BYTES else "sm"


@dataclass(frozen=True)
class AgPlan(FusedPlan):
    """Everything one rank needs to launch a fused ag_gemm of one shape (cached per shape)."""

    band_tiles: int  # tile rows per flag band
    bands: int  # bands per chunk
    pieces: int  # push: pieces per band (the flag target); ce: 1
    piece_cols: int
    comm_programs: int  # push kernel programs (0 for ce)
    gemm_programs: int
    local_copy: str  # who stages the local shard: "sm" (push programs), "ce" (copy engines), "none"
    local_splits: int  # copy-engine pieces of the local shard (0 for "sm")
    n_flags: int
    data_bytes: int  # the gathered buffer [M, K]
    read_local: bool  # the GEMM reads the own rows from a_shard, not from the gathered buffer

    @property
    def band_rows(self) -> int:
        return self.band_tiles * self.config.block_m


def make_plan(
    design: str, m: int, n: int, k: int, world: int, rank: int, dtype: torch.dtype, device: torch.device, *,
    config: GemmConfig | None = None,
    comm_programs: int | None = None,
    splits: int | None = None,
    piece_cols: int | None = None,
    num_programs: int | None = None,
    local_copy: str | None = None,
    read_local: bool | None = None,
) -> AgPlan:
    """Layout and launch parameters. ``num_programs``: the SMs to plan for (default: the
    device's). The other arguments are :class:`AgGemmOptions`' fields (None: the defaults
    described there)."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    check_local_copy(local_copy)
    if design == "ce" and local_copy == "sm":
        raise ValueError("the ce design stages the local shard by copy engines: local_copy must be 'ce' or None")
    check_bool("read_local", read_local)
    if design == "push" and read_local and local_copy is not None:
        raise ValueError("push with read_local stages no local copy: pass local_copy only with read_local=False")
    mc = chunk_rows(m, world)
    sms = num_programs or num_sms(device)
    cfg = config or default_config(m, n, k, sms)
    sched = TileSchedule(mc, n, world, cfg.block_m, cfg.block_n, cfg.group_m,
                         tuple(chunk_order("arrival", rank, world)))
    tm = sched.tile_rows_per_chunk
    item = dtype.itemsize
    sp = 4 if splits is None else splits  # ce: bands per chunk; push: copy-engine staging pieces
    if sp < 1:
        raise ValueError(f"splits must be >= 1, got {sp}")
    if design == "ce":
        band_tiles = cdiv(tm, min(sp, tm))
        pieces, pcols, comm = 1, k, 0
        # One SM stays free for the barrier kernels of the side stream: a GEMM holding every SM
        # while it waits for rows that only arrive after a barrier would deadlock.
        gemm_programs = sms - 1
    else:
        comm = 32 if comm_programs is None else comm_programs
        if not 1 <= comm < sms:
            raise ValueError(f"comm_programs must be in [1, {sms}), got {comm}")
        band_tiles = 1
        pcols = min(k, 1024 if piece_cols is None else piece_cols)
        if pcols < 1:
            raise ValueError(f"piece_cols must be >= 1, got {pcols}")
        pieces = cdiv(k, pcols)
        gemm_programs = sms - comm
    if read_local is None:
        read_local = (design == "ce" or local_copy is None) and default_read_local(
            sched.tiles_per_chunk, max(1, gemm_programs))
    if design == "ce":
        local, local_splits = "ce", cdiv(tm, band_tiles)
    else:
        local = "none" if read_local else local_copy or default_local_copy(mc, k, item)
        local_splits = min(sp, tm) if local == "ce" else 0
    bands = cdiv(tm, band_tiles)
    n_flags = world * bands
    return AgPlan(design, m, n, k, world, rank, dtype, cfg, sched, band_tiles, bands, pieces, pcols, comm,
                  gemm_programs, local, local_splits, n_flags, m * k * item, read_local)


def gathered_view(plan: AgPlan, ws: Workspace) -> torch.Tensor:
    return ws.view(ws.data_off, (plan.m, plan.k), plan.dtype)


def flags_view(plan: AgPlan, ws: Workspace) -> torch.Tensor:
    return ws.view(P.FLAGS_OFFSET, (plan.n_flags,), torch.int32)


# ---------------------------------------------------------------------------------------------
# Kernel launches of one rank (used by the op and by the single-process emulation)


def launch_push(plan: AgPlan, ws: Workspace, a_shard: torch.Tensor, timeout: int, *, barrier: bool = True,
                trace: torch.Tensor | None = None) -> None:
    programs = plan.comm_programs
    _ag_push_kernel[(programs,)](
        a_shard, ws.local.data_ptr(), ws.bases_dev, ws.data_off, P.FLAGS_OFFSET, plan.mc, plan.k,
        plan.band_rows, plan.bands, plan.pieces, plan.piece_cols, plan.rank,
        ws.err.data_ptr(), timeout, trace if trace is not None else ws.bases_dev,
        W=plan.world, NUM_PROGRAMS=programs, BR=32, BC=512, BARRIER=barrier, TRACE=trace is not None,
        MAX_EVENTS=trace.shape[1] if trace is not None else 1, USE_TIMER=P.use_timer(a_shard.device.type),
        LOCAL=plan.local_copy == "sm", num_warps=8,
    )


def launch_barrier(ws: Workspace, timeout: int, op: str, *, set_go_gemm: bool = False,
                   set_go_comm: bool = False) -> None:
    _barrier_kernel[(1,)](
        ws.bases_dev, ws.local.data_ptr(), ws.err.data_ptr(), timeout, ws.rank,
        W=ws.world, OP=P.OP_CODES[op], SET_GO_GEMM=set_go_gemm, SET_GO_COMM=set_go_comm,
        USE_TIMER=P.use_timer(ws.local.device.type), num_warps=1,
    )


def launch_gemm_part(plan: AgPlan, ws: Workspace, a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     b_layout: str, timeout: int, *, trace: torch.Tensor | None = None,
                     own_trace: torch.Tensor | None = None) -> None:
    """The GEMM of one rank's call. With ``read_local`` two launches on the stream: the own
    chunk's tiles (first in the order) from ``a_shard``, waiting for nothing (``own_trace``),
    then the peers' tiles from the gathered buffer (``trace``)."""
    comm = CommArgs(ws.local, ws.bases_dev, ws.err, timeout, band_tiles=plan.band_tiles,
                    bands_per_chunk=plan.bands, flag_target=plan.pieces, n_reset_flags=plan.n_flags)
    kw = dict(schedule=plan.schedule, rank=plan.rank, config=plan.config, b_layout=b_layout,
              epilogue=EPI_LOCAL.value, wait_a=True, num_programs=plan.gemm_programs, op="ag_gemm")
    gathered = gathered_view(plan, ws)
    begin = 0
    if plan.read_local:
        begin = plan.schedule.tiles_per_chunk
        launch_gemm(gathered, b, out, comm=replace(comm, reset=False), tile_end=begin, trace=own_trace,
                    a_local=a_shard, **kw)
    launch_gemm(gathered, b, out, comm=comm, tile_begin=begin, trace=trace, **kw)


def _band_rows(plan: AgPlan, band: int) -> tuple[int, int]:
    lo = band * plan.band_rows
    return lo, min(lo + plan.band_rows, plan.mc)


def write_flags(flags: torch.Tensor, index: int, count: int = 1, value: int = 1) -> None:
    """Set ``flags[index : index + count] = value`` in stream order after the copies before it
    (copy-engine staging)."""
    if flags.device.type != "cuda":
        flags[index : index + count] = value
        return
    from torch._C._distributed_c10d import _SymmetricMemory

    u32 = flags.view(torch.uint32)
    if torch.cuda.is_current_stream_capturing():
        _SymmetricMemory.memset32(u32, offset=index, val=value, count=count)
    else:  # cuStreamWriteValue32 fences the copies before it
        for i in range(index, index + count):
            _SymmetricMemory.stream_write_value32(u32, i, value)


def ce_local_copies(plan: AgPlan, ws: Workspace, a_shard: torch.Tensor) -> None:
    """Stage the local shard in this rank's gathered buffer by copy engines, in
    ``plan.local_splits`` pieces, each followed by the flags of the bands it completes (set to
    the GEMM's target, ``plan.pieces``)."""
    gathered, flags = gathered_view(plan, ws), flags_view(plan, ws)
    base = plan.rank * plan.mc
    per = cdiv(plan.bands, plan.local_splits)
    for b0 in range(0, plan.bands, per):
        b1 = min(b0 + per, plan.bands)
        lo, hi = _band_rows(plan, b0)[0], _band_rows(plan, b1 - 1)[1]
        gathered[base + lo : base + hi].copy_(a_shard[lo:hi])
        write_flags(flags, plan.rank * plan.bands + b0, b1 - b0, plan.pieces)


def ce_peer_copies(plan: AgPlan, ws: Workspace) -> None:
    gathered, flags = gathered_view(plan, ws), flags_view(plan, ws)
    for s in range(1, plan.world):
        src = (plan.rank + s) % plan.world
        remote = ws.peer_view(src, ws.data_off, (plan.m, plan.k), plan.dtype)
        base = src * plan.mc
        for bnd in range(plan.bands):
            lo, hi = _band_rows(plan, bnd)
            gathered[base + lo : base + hi].copy_(remote[base + lo : base + hi])
            write_flags(flags, src * plan.bands + bnd)


def run_fused(plan: AgPlan, state, ws: Workspace, a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
              b_layout: str, timeout: int, trace=None) -> None:
    """One rank's fused call on CUDA streams: communication on the state's side stream, the
    GEMM on the current stream, joined at the end (also inside CUDA-graph capture)."""
    main = torch.cuda.current_stream(a_shard.device)
    side = state.side
    state.start_event.record(main)
    side.wait_event(state.start_event)
    comm_trace = gemm_trace = own_trace = None
    if trace is not None:
        if plan.read_local:
            own_trace = trace.buffer("gemm", plan.rank, plan.gemm_programs, a_shard.device)
        gemm_trace = trace.buffer("gemm", plan.rank, plan.gemm_programs, a_shard.device)
        if plan.design == "push":
            comm_trace = trace.buffer("push", plan.rank, plan.comm_programs, a_shard.device)
    staged = plan.design == "push" and plan.local_copy == "ce"
    if staged:  # copy engines stage the local shard beside the push kernel
        state.copy.wait_event(state.start_event)
        with torch.cuda.stream(state.copy):
            ce_local_copies(plan, ws, a_shard)
        state.copy_event.record(state.copy)
    with torch.cuda.stream(side):
        if plan.design == "push":
            launch_push(plan, ws, a_shard, timeout, trace=comm_trace)
        else:
            ce_local_copies(plan, ws, a_shard)
            launch_barrier(ws, timeout, "ag_gemm")
            ce_peer_copies(plan, ws)
            launch_barrier(ws, timeout, "ag_gemm")
    state.end_event.record(side)
    launch_gemm_part(plan, ws, a_shard, b, out, b_layout, timeout, trace=gemm_trace, own_trace=own_trace)
    main.wait_event(state.end_event)
    if staged:
        main.wait_event(state.copy_event)


_make_plan_cached = functools.lru_cache(maxsize=64)(make_plan)


def ag_gemm(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    *,
    group=None,
    out: torch.Tensor | None = None,
    return_gathered: bool = False,
    b_layout: str = "kn",
    path: str | None = None,
    design: str | None = None,
    options: AgGemmOptions | None = None,
    trace=None,
):
    """``C = all_gather(a_shard, dim 0) @ b`` on every rank of ``group`` (column-parallel layer).

    Args:
        a_shard: ``[M/W, K]`` bf16 or fp16, contiguous: this rank's rows of the activations
            (rank r holds rows ``[r*M/W, (r+1)*M/W)``). Any ``M/W >= 1``, the same on every
            rank; K a multiple of 8.
        b: ``[K, N]`` (``b_layout="kn"``) or nn.Linear's weight ``[N, K]`` (``b_layout="nk"``,
            i.e. ``x @ weight.T``), same dtype, contiguous; N a multiple of 8.
        group: torch.distributed process group (default: the world), one process per GPU.
        out: optional ``[M, N]`` output (contiguous, a_shard's dtype and device).
        return_gathered: also return the gathered ``[M, K]`` activations (a fresh tensor).
        path / design: force ``"fused"`` or ``"nccl"`` and the fused design (``"ce"`` copy
            engines, ``"push"`` SM push); by default :mod:`tilefuse.tp.policy` decides.
        options: :class:`tilefuse.tp.AgGemmOptions` (GEMM tiles, push programs, splits, local
            staging, timeout); fields left None come from ``tilefuse.tp.set_options``, then
            from the policy's measurements of this exact shape, then from the defaults.
        trace: a :class:`tilefuse.tp.Trace` to record per-program activity.

    Returns:
        ``C`` ``[M, N]``, or ``(C, gathered)`` with ``return_gathered``. The fused path is bitwise
        equal to ``tilefuse.tp.gemm(gathered, b)`` with the same config.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, layouts, alignment, options, shapes that
            differ between the ranks.
        RuntimeError: no initialised process group; workspace growth inside graph capture.
        CommTimeoutError: a wait timed out in this or an earlier call (rank, op, chunk named).
    """
    from tilefuse.tp import _common
    from tilefuse.tp._gemm_core import gemm

    k, n = check_operands(a_shard, b, b_layout, "a_shard")
    if not isinstance(return_gathered, bool):
        raise TypeError(f"return_gathered must be a bool, got {type(return_gathered).__name__}")
    opts = _options.resolve(options, AgGemmOptions)
    g, rank, world = _common.resolve_group(group)
    # Shapes first: a rank raising alone would leave its peers waiting in the next collective.
    _common.check_same_shapes(g, world, "ag_gemm", {"a_shard": tuple(a_shard.shape), "b": tuple(b.shape)},
                              a_shard.device)
    if a_shard.shape[0] == 0:
        raise ValueError("a_shard has 0 rows: every rank needs at least one row (M/W >= 1)")
    m = a_shard.shape[0] * world
    out = _common.check_out(out, (m, n), a_shard)
    dec = _common.decide("ag_gemm", g, world, m, n, k, a_shard, path, design)
    if dec.path == "gemm":
        gemm(a_shard, b, out, b_layout=b_layout, config=opts.config)
        return (out, a_shard.clone()) if return_gathered else out
    if dec.path == "nccl":
        out, gathered = _common.ag_gemm_nccl(a_shard, b, out, g, world, b_layout, opts.config)
        return (out, gathered) if return_gathered else out
    state, plan, ws, timeout = _common.prepare_fused("ag_gemm", _make_plan_cached, dec, opts, g, rank, world,
                                                     m, n, k, a_shard)
    run_fused(plan, state, ws, a_shard, b, out, b_layout, timeout, trace)
    if return_gathered:
        gathered = gathered_view(plan, ws).clone()
        if plan.local_copy == "none":  # nothing staged the own rows
            gathered[rank * plan.mc : (rank + 1) * plan.mc].copy_(a_shard)
        return out, gathered
    return out
