"""gemm_rs: ``reduce_scatter(a @ b, dim 0, sum)`` with the transfers hidden under the product.

Each rank computes the peer-owned row chunks (rank+1, rank+2, ...) before its own
(``_schedule.chunk_order("owner_last")``); the owner adds the peers' partials of a tile in the
epilogue of its own tile (fp32 accumulator + each peer's partial in the output dtype, in rank
order from rank+1), then writes the result once. Designs (``design=``):

* ``"push"`` — epilogue push: a finished peer-owned tile is stored straight into the owner's
  receive buffer (symmetric memory) and the owner's per-tile flag is raised one tile later, when
  the stores have drained under the next tile's main loop. Program 0 first meets the peers (so
  every owner has finished reading its buffer from the last call) and opens the go word the
  others wait on before their first remote store. One kernel, all SMs, no side stream. The
  tile order interleaves peer and own tiles (``lag``, ``_schedule``): with whole peer chunks
  first, the link has to carry every partial during the first half of the GEMM (at W = 2).
  At W = 2 on Hopper, with chunks of whole tiles, the same walk runs as a Gluon kernel
  (``_gemm_rs_gluon``, ``send_tma``) whose pushed tiles' stores stay in flight under the
  next tile's main loop.
* ``"forward"`` — communication programs: the GEMM writes peer-owned tiles to a local buffer
  with a local flag; ``comm_programs`` programs of a forwarding kernel copy each finished tile
  to its owner and raise the owner's flag; the GEMM runs on the remaining SMs. The two kernels
  wait on each other, so the first call of a shape runs them one after another (``run_fused``).

Every wait is bounded (``timeout_s``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from tilefuse._device import capability_major
from tilefuse.tp import _primitives as P
from tilefuse.tp._comm_kernels import _rs_forward_kernel
from tilefuse.tp._gemm_core import (
    EPI_RS_LOCAL,
    EPI_RS_PUSH,
    CommArgs,
    GemmConfig,
    default_config,
    launch_gemm,
    num_sms,
)
from tilefuse.tp._schedule import TileSchedule, chunk_order, chunk_rows
from tilefuse.tp.symm import Workspace

DESIGNS = ("push", "forward")
_ALIGN = 1024
# push's tile order (``default_lag``; measured on 2 x H200, benchmarks/NOTES.md, fused GEMM round
# 6). Interleave only where whole peer chunks first would ask more of the link than it carries:
# the partials of (W-1)/W of the product leave in (W-1)/W of the GEMM, i.e. at elem_bytes *
# GEMM_FLOPS / (2 K) bytes/s whatever M, N and W; and only on grids of INTERLEAVE_MIN_WAVES waves
# or more (on one or two waves the own tiles just wait). Then the own tiles trail the peer
# stream by LAG_WAVES waves of the grid in the middle of the walk.
GEMM_FLOPS = 650e12  # bf16 dense GEMM rate of the core on an H200
LINK_BYTES_PER_S = 250e9  # push rate above which the peer phase was link-bound
INTERLEAVE_MIN_WAVES = 3
LAG_WAVES = 1.0


@dataclass(frozen=True)
class RsPlan:
    design: str
    m: int
    n: int
    k: int
    world: int
    rank: int
    dtype: torch.dtype
    config: GemmConfig
    schedule: TileSchedule
    comm_programs: int
    gemm_programs: int
    recv_flags_off: int
    part_flags_off: int
    recv_off: int
    part_off: int
    nbytes: int
    recv_tma: bool  # the owner loads peer partials by TMA (tensor descriptor) in its epilogue
    send_tma: bool  # push at W = 2 by the Gluon kernel: pushed tiles' TMA stores left in flight

    @property
    def lag(self) -> int:
        return self.schedule.lag

    @property
    def mc(self) -> int:
        return self.m // self.world

    @property
    def tiles_per_chunk(self) -> int:
        return self.schedule.tiles_per_chunk

    @property
    def flags_end(self) -> int:
        """End (bytes) of the flag words; data regions start after it."""
        return self.part_flags_off + 4 * self.world * self.tiles_per_chunk

    @property
    def peer_tiles(self) -> int:
        """Tiles of peer-owned chunks: the first ones in this rank's order (forward: lag 0)."""
        return (self.world - 1) * self.tiles_per_chunk


def _align(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


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
    design: str,
    m: int,
    n: int,
    k: int,
    world: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    config: GemmConfig | None = None,
    comm_programs: int | None = None,
    num_programs: int | None = None,
    lag: int | None = None,
    gemm_programs: int | None = None,
    recv_tma: bool | None = None,
    send_tma: bool | None = None,
) -> RsPlan:
    """Layout, the same for both designs (so that calls of either design leave the other's flag
    words zero): recv flags ``[W, tiles per chunk]``, local tile flags of the same shape
    (forward only), the receive buffer ``[W, M/W, N]`` and the local partial ``[M, N]``
    (forward only; push's workspace ends before it). ``num_programs``: the SMs to plan for
    (default: the device's). ``lag``: push's tile order (None: the default, ``default_lag``; 0:
    whole peer chunks first); forward splits its GEMM at the end of the peer chunks and takes
    lag 0 only. ``gemm_programs``: push's persistent programs (default: one per SM; measured
    against 131 at W = 2, where each program alternates pushed and own tiles: slower, NOTES).
    ``recv_tma``: the owner's epilogue loads peer partials through a tensor descriptor (TMA)
    where chunks are tile-aligned (None: push where the walk is not interleaved, lag 0).
    ``send_tma``: push at W = 2 runs the Gluon kernel (``_gemm_rs_gluon``): a peer-owned tile
    leaves by one TMA store that stays in flight under the next tile's main loop, where chunks
    are whole tiles on an sm_90 GPU; the Triton kernel's per-thread stores elsewhere (None: True
    for push at W = 2)."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if lag is not None and (not isinstance(lag, int) or lag < 0):
        raise ValueError(f"lag must be a non-negative int or None, got {lag!r}")
    if send_tma is not None and not isinstance(send_tma, bool):
        raise ValueError(f"send_tma must be a bool or None, got {send_tma!r}")
    if send_tma and (design != "push" or world != 2):
        raise ValueError(f"send_tma is for the push design at world size 2 (one peer), got {design!r} at W = {world}")
    if design == "forward" and lag:
        raise ValueError(f"the forward design walks whole peer chunks first: lag must be 0 or None, got {lag}")
    mc = chunk_rows(m, world)
    sms = num_programs or num_sms(device)
    cfg = config or default_config(m, n, k, sms)
    item = torch.empty((), dtype=dtype).element_size()
    sched = TileSchedule(mc, n, world, cfg.block_m, cfg.block_n, cfg.group_m,
                         tuple(chunk_order("owner_last", rank, world)))
    if lag is None:
        lag = default_lag(k, world, sms, sched.num_tiles, item) if design == "push" else 0
    if lag and world > 1:
        sched = replace(sched, lag=lag)
    n_flags = world * sched.tiles_per_chunk
    recv_flags_off = P.FLAGS_OFFSET
    part_flags_off = recv_flags_off + 4 * n_flags
    recv_off = _align(part_flags_off + 4 * n_flags)
    part_off = recv_off + m * n * item
    if design == "push":
        comm = 0
        nbytes = part_off
        if gemm_programs is not None and not (isinstance(gemm_programs, int) and 1 <= gemm_programs <= sms):
            raise ValueError(f"gemm_programs must be an int in [1, {sms}] (resident programs), got {gemm_programs!r}")
        programs = gemm_programs or sms
    else:
        comm = 16 if comm_programs is None else comm_programs
        if not 1 <= comm < sms:
            raise ValueError(f"comm_programs must be in [1, {sms}), got {comm}")
        if gemm_programs is not None:
            raise ValueError("gemm_programs is push's; forward runs its GEMM on the SMs the forwarding kernel leaves")
        programs = sms - comm
        nbytes = part_off + m * n * item
    if recv_tma is not None and not isinstance(recv_tma, bool):
        raise ValueError(f"recv_tma must be a bool or None, got {recv_tma!r}")
    # TMA partial loads by default for push where the walk is not interleaved. Two runs on
    # 2 x H200 (results/h200x2/gemm_rs-8-recv-tma.json, -9-recv-tma.json): 32768x32768x4096
    # (lag 0) 14.15 / 14.14 against 14.58 / 14.52 ms with per-thread loads; 16384x16384x2048
    # (lag 66) 1.93 / 1.90 against 1.89 / 1.86; elsewhere within 2%. Why the interleaved walk
    # loses is not known.
    tma = (design == "push" and sched.lag_tiles == 0) if recv_tma is None else recv_tma
    # The Gluon kernel by default where it runs: against the Triton kernel in six runs on 2 x H200
    # it was faster at 64 of 72 (shape, run) pairs, by up to 8%, and at most 3% slower
    # (benchmarks/NOTES.md, fused TP round 14).
    if send_tma is None:
        send_tma = design == "push" and world == 2
    send = send_tma and sched.aligned and capability_major(device) == 9  # Gluon's wgmma/TMA: sm_90
    return RsPlan(design, m, n, k, world, rank, dtype, cfg, sched, comm, programs, recv_flags_off,
                  part_flags_off, recv_off, part_off, nbytes, tma or send, send)



def launch_gemm_part(plan: RsPlan, ws: Workspace, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     b_layout: str, timeout: int, *, tile_begin: int = 0, tile_end: int | None = None,
                     reset: bool = True, barrier: bool = True, trace: torch.Tensor | None = None) -> None:
    n_flags = plan.world * plan.tiles_per_chunk
    comm = CommArgs(ws.local, ws.bases_dev, ws.err, timeout, flags_off=plan.recv_flags_off,
                    recv_off=plan.recv_off, part_off=plan.part_off, part_flags_off=plan.part_flags_off,
                    n_reset_flags=n_flags, reset=reset, barrier=barrier and plan.design == "push",
                    recv=ws.view(plan.recv_off, (plan.m, plan.n), plan.dtype) if plan.recv_tma else None)
    if plan.send_tma:  # the whole walk in one launch (push)
        from tilefuse.tp import _gemm_rs_gluon

        if tile_begin != 0 or tile_end not in (None, plan.schedule.num_tiles):
            raise ValueError("the Gluon push kernel runs the whole tile walk in one launch")
        peer_recv = ws.peer_view(1 - plan.rank, plan.recv_off, (plan.m, plan.n), plan.dtype)
        _gemm_rs_gluon.launch(a, b, out, comm.recv, peer_recv, schedule=plan.schedule, rank=plan.rank,
                              config=plan.config, b_layout=b_layout, comm=comm, num_programs=plan.gemm_programs,
                              trace=trace, op_code=P.OP_CODES["gemm_rs"], use_timer=P.use_timer(a.device.type))
        return
    epi = EPI_RS_PUSH if plan.design == "push" else EPI_RS_LOCAL
    launch_gemm(a, b, out, schedule=plan.schedule, rank=plan.rank, config=plan.config, b_layout=b_layout,
                epilogue=epi.value, comm=comm, num_programs=plan.gemm_programs, tile_begin=tile_begin,
                tile_end=tile_end, trace=trace, op="gemm_rs")


def launch_forward(plan: RsPlan, ws: Workspace, timeout: int, *, barrier: bool = True,
                   trace: torch.Tensor | None = None) -> None:
    from tilefuse.tp._gemm_core import _order_tensor

    programs = plan.comm_programs
    cfg = plan.config
    dev = ws.local.device
    args = (
        ws.local.data_ptr(), ws.bases_dev, _order_tensor(plan.schedule.order, dev), plan.part_off,
        plan.part_flags_off, plan.recv_off, plan.recv_flags_off, plan.mc, plan.n, plan.peer_tiles, plan.rank,
        ws.err.data_ptr(), timeout, trace if trace is not None else ws.bases_dev,
    )
    kwargs = dict(
        DTYPE=_tl_dtype(plan.dtype), W=plan.world, NUM_PROGRAMS=programs, BM=cfg.block_m, BN=cfg.block_n,
        GROUP_M=cfg.group_m, BR=max(1, 16384 // cfg.block_n), BARRIER=barrier, TRACE=trace is not None,
        MAX_EVENTS=trace.shape[1] if trace is not None else 1, USE_TIMER=P.use_timer(dev.type), num_warps=8,
    )
    _rs_forward_kernel[(programs,)](*args, **kwargs)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def run_fused(plan: RsPlan, state, ws: Workspace, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
              b_layout: str, timeout: int, trace=None) -> None:
    """One rank's fused call. push: the GEMM alone (its program 0 runs the barrier). forward: the
    GEMM of the peer-owned tiles, then of the own tiles (which wait for the peers' forwarded
    partials), on the main stream; the forwarding kernel on the side stream beside them.

    The first call of a specialization runs the three launches one after another on the main
    stream: each kernel is then compiled and loaded by a launch that no running kernel waits
    on. (A kernel loaded while another spins on flags waits for it to finish: measured on 2 x
    H200, a first call at M = 272, N = 264, K = 72 hung until the timeout even though both
    kernels had been loaded ahead with ``warmup``.) Every later call overlaps."""
    gemm_trace = trace.buffer("gemm", plan.rank, plan.gemm_programs, a.device) if trace is not None else None
    if plan.design == "push":
        launch_gemm_part(plan, ws, a, b, out, b_layout, timeout, trace=gemm_trace)
        return
    own_trace = trace.buffer("gemm", plan.rank, plan.gemm_programs, a.device) if trace is not None else None
    comm_trace = trace.buffer("forward", plan.rank, plan.comm_programs, a.device) if trace is not None else None
    key = (plan, b_layout, timeout, None if trace is None else (gemm_trace.shape[1], comm_trace.shape[1]))
    main = torch.cuda.current_stream(a.device)
    side = state.side
    first = key not in state.loaded
    state.loaded.add(key)
    if not first:  # the forwarding kernel starts with the call: it copies tiles as they finish
        state.start_event.record(main)
        side.wait_event(state.start_event)
    launch_gemm_part(plan, ws, a, b, out, b_layout, timeout, tile_end=plan.peer_tiles, reset=False,
                     trace=gemm_trace)
    if first:
        launch_forward(plan, ws, timeout, trace=comm_trace)
    else:
        with torch.cuda.stream(side):
            launch_forward(plan, ws, timeout, trace=comm_trace)
        state.end_event.record(side)
    launch_gemm_part(plan, ws, a, b, out, b_layout, timeout, tile_begin=plan.peer_tiles, trace=own_trace)
    if not first:
        main.wait_event(state.end_event)


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
    config: GemmConfig | None = None,
    comm_programs: int | None = None,
    lag: int | None = None,
    num_programs: int | None = None,
    recv_tma: bool | None = None,
    send_tma: bool | None = None,
    timeout_s: float | None = None,
    trace=None,
):
    """``reduce_scatter(a @ b, dim 0, sum)`` over ``group`` (row-parallel layer).

    Args:
        a: ``[M, K]`` bf16 or fp16, contiguous: this rank's K slice of the activations; M must
            be divisible by the world size W (any such M); K a multiple of 8.
        b: ``[K, N]`` (``b_layout="kn"``) or nn.Linear's weight ``[N, K]`` (``"nk"``), same
            dtype, contiguous; N a multiple of 8.
        group: torch.distributed process group (default: the world).
        out: optional ``[M/W, N]`` output; rank r receives rows ``[r*M/W, (r+1)*M/W)``.
        path / design: force ``"fused"`` / ``"nccl"`` and the design (``"push"`` epilogue push,
            ``"forward"`` communication programs); by default the policy decides.
        config, comm_programs: GEMM tiles; programs of the forwarding kernel.
        lag: push's tile order: own tiles this many tiles behind the peer stream (None: the
            measured default; 0: all peer tiles first).
        num_programs: push's persistent programs, at most one per SM (None: one per SM).
        recv_tma: the owner's epilogue loads peer partials by TMA (None: the measured default).
        send_tma: push at W = 2 on Hopper: the Gluon kernel, whose pushed tiles' TMA stores drain
            under the next tile's main loop (None: the measured default).
        timeout_s: bound of every cross-GPU wait (default 60 s).
        trace: a :class:`tilefuse.tp.Trace`.

    Returns:
        ``[M/W, N]``: the sum over ranks of their partial products' rows of this rank, computed
        as the own fp32 partial plus each peer's partial rounded to the output dtype.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, layouts, alignment, options, M % W != 0.
        RuntimeError: no initialised process group; workspace growth inside graph capture.
        CommTimeoutError: a wait timed out in this or an earlier call.
    """
    from tilefuse.tp import _common, policy
    from tilefuse.tp._gemm_core import check_operands, gemm
    from tilefuse.tp.ag_gemm import DEFAULT_TIMEOUT_S
    from tilefuse.tp.symm import get_state

    k, n = check_operands(a, b, b_layout, "a")
    _common.check_options(config, comm_programs, timeout_s)
    g, rank, world = _common.resolve_group(group)
    m = a.shape[0]
    if m % world:
        raise ValueError(f"a has M = {m} rows, which must be divisible by the world size {world}")
    out = _common.check_out(out, (m // world, n), a)
    nodes = policy.group_nodes(g) if world > 1 else 1
    dec = policy.decide("gemm_rs", m, n, k, world, a.dtype, device_type=a.device.type, nodes=nodes, path=path,
                        design=design)
    if dec.path == "gemm":
        return gemm(a, b, out, b_layout=b_layout, config=config)
    if dec.path == "nccl":
        return _common.gemm_rs_nccl(a, b, out, g, b_layout, config)
    state = get_state(g, "gemm_rs", a.device)
    given = dict(config=config, comm_programs=comm_programs, lag=lag, num_programs=num_programs, recv_tma=recv_tma,
                 send_tma=send_tma)
    opts = _common.with_measured_options(given, dec.options)
    opts["gemm_programs"] = opts.pop("num_programs")
    plan = _make_plan_cached(dec.design, m, n, k, world, rank, a.dtype, a.device, **opts)
    ws = state.ensure(plan.nbytes)
    state.clear_flags(plan.flags_end)
    timeout = P.timeout_units(timeout_s or DEFAULT_TIMEOUT_S, a.device.type)
    run_fused(plan, state, ws, a, b, out, b_layout, timeout, trace)
    return out
