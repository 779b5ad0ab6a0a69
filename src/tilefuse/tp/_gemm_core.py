"""Persistent Triton GEMM shared by ag_gemm and gemm_rs.

One kernel, specialised by constexprs:

* tile order: chunks in a given order (``_schedule.chunk_order``), banded super-tiles of
  ``group_m`` tile rows inside a chunk; tiles never straddle chunks;
* waits (``WAIT_A``, ag_gemm): A is the gathered ``[M, K]`` buffer; before a tile, a bounded wait
  on the flag of the band of rows it reads (the local shard is copied in band by band too: a
  second pipelined main loop over the caller's shard would double the shared memory);
* epilogue: ``EPI_LOCAL`` stores to the output; ``EPI_RS_PUSH`` stores peer-owned tiles into the
  owner's receive buffer and raises the owner's per-tile flag one tile later (so the remote
  stores drain while the next tile computes), then reduces its own tiles with the received
  partials.

Operands come through host tensor descriptors (TMA on Hopper); ``b`` may be ``[K, N]`` or
nn.Linear's ``[N, K]``. Accumulation is fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tilefuse._jit import Launcher, cdiv, rebased_descriptor
from tilefuse._validate import check_kernel_device
from tilefuse.tp import _primitives as P
from tilefuse.tp._common import tensor_desc as _desc
from tilefuse.tp._schedule import TileSchedule

EPI_LOCAL = tl.constexpr(0)
EPI_RS_PUSH = tl.constexpr(1)


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of the persistent GEMM (explicit, no run-time autotuning)."""

    block_m: int = 128  # output rows per tile
    block_n: int = 256  # output columns per tile
    block_k: int = 64  # reduction step
    group_m: int = 8  # tile rows walked together (L2 reuse of the B columns)
    num_stages: int = 3  # as in Triton
    num_warps: int = 8  # as in Triton
    # Flatten the tile loop and the K loop into one software-pipelined loop (``tl.range(...,
    # flatten=True)``), so the next tile's first loads are in flight during this tile's
    # epilogue; plain GEMM launches only (the fused epilogues keep the nested loops).
    flatten: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.group_m < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"invalid GemmConfig {self}")

    @functools.cached_property
    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# The two tiles ``default_config`` chooses between.
WIDE_TILE = GemmConfig(128, 256, 64, 8, 3, 8, flatten=True)
NARROW_TILE = GemmConfig(128, 128, 64, 8, 5, 8)


def _wave_efficiency(tiles: int, num_sms: int) -> float:
    """Fraction of the SM-slots of the last full wave count that ``tiles`` tiles keep busy."""
    return tiles / (cdiv(tiles, num_sms) * num_sms)


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> GemmConfig:
    """The 128x256x64 tile (3 stages, 8 warps, flattened tile and K loops) unless 128x128 tiles
    fill the last wave of ``num_sms`` programs clearly better (by more than 0.1 of the SM-slots),
    then 128x128x64 (5 stages, 8 warps, nested loops). Measured on H200 against cuBLAS with
    ``benchmarks/gemm_sweep.py``; the numbers are in ``benchmarks/NOTES.md``."""
    del k
    wide = _wave_efficiency(cdiv(m, 128) * cdiv(n, 256), num_sms)
    narrow = _wave_efficiency(cdiv(m, 128) * cdiv(n, 128), num_sms)
    if narrow > wide + 0.1:
        return NARROW_TILE
    return WIDE_TILE


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 programs on CPU (the interpreter runs them one
    after another, so more only costs time)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


# --------------------------------------------------------------------------------------------
# Triton helpers


@triton.jit
def _decode_tile(t, Mc, N, order_ptr, lag, W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """``TileSchedule.decode``: ``lag`` is ``TileSchedule.lag_tiles`` (0: whole chunks)."""
    tm = tl.cdiv(Mc, BM)
    tn = tl.cdiv(N, BN)
    tpc = tm * tn
    ci = t // tpc
    r = t % tpc
    if W > 1:  # interleaved: the peer stream, the own chunk ``lag`` positions behind it
        head = (W - 1) * lag
        tt = tl.maximum(t - head, 0)
        g = tt // W
        mid_end = head + W * (tpc - lag)
        in_lead = t < head
        in_tail = t >= mid_end
        own = in_tail | ((t >= head) & (tt % W == W - 1))
        slot = tl.where(in_lead, t, head + g * (W - 1) + tt % W)
        ci = tl.where(lag == 0, ci, tl.where(own, W - 1, slot % (W - 1)))
        r = tl.where(lag == 0, r, tl.where(own, tl.where(in_tail, t - mid_end + tpc - lag, g), slot // (W - 1)))
    chunk = tl.load(order_ptr + ci)
    width = GROUP_M * tn
    first = (r // width) * GROUP_M
    size = tl.minimum(tm - first, GROUP_M)
    j = first + (r % width) % size
    col = (r % width) // size
    return chunk, j, col


@triton.jit
def _mainloop(a_desc, a_row, b_desc, col0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              B_KN: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        a = a_desc.load([a_row, kt * BK])
        if B_KN:
            b = b_desc.load([kt * BK, col0])
            acc = tl.dot(a, b, acc)
        else:
            b = b_desc.load([col0, kt * BK])
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _tile_ptrs(base, row0, rows_valid, col0, N, BM: tl.constexpr, BN: tl.constexpr):
    """Pointers and mask of the ``BM x BN`` tile at ``(row0, col0)`` of a row-major ``[*, N]``
    array: the tile origin is one 64-bit scalar, the offsets inside the tile 32-bit (keeps
    the epilogue's registers low)."""
    origin = base + (row0.to(tl.int64) * N + col0)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    mask = (rows[:, None] < rows_valid) & ((col0 + cols)[None, :] < N)
    return origin + (rows[:, None] * N + cols[None, :]), mask


@triton.jit
def _store_rows(base, row0, rows_valid, col0, N, vals, BM: tl.constexpr, BN: tl.constexpr):
    ptrs, mask = _tile_ptrs(base, row0, rows_valid, col0, N, BM, BN)
    tl.store(ptrs, vals, mask=mask)


@triton.jit
def _reduce_own(acc, r_desc, ws_addr, j, col0, tic, tpc, Mc, N, rank, recv_off, flags_off, ctl_ptr, err_ptr,
                timeout, chunk, OUT_DTYPE: tl.constexpr, W: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, USE_TIMER: tl.constexpr, OP: tl.constexpr, RECV_TMA: tl.constexpr):
    """acc (own partial, fp32) + every peer's partial of this tile, in rank order from rank+1.
    ``RECV_TMA``: the partial comes through the receive buffer's tensor descriptor (a TMA load
    into shared memory) instead of per-thread loads (aligned chunks only)."""
    flags = P.as_ptr(ws_addr + flags_off, tl.int32)
    recv = P.as_ptr(ws_addr + recv_off, OUT_DTYPE)
    for s in tl.static_range(1, W):
        src = (rank + s) % W
        P.wait_geq(flags + src * tpc + tic, 1, ctl_ptr, err_ptr, timeout, rank, OP, P.ROLE_GEMM, chunk,
                   src * tpc + tic, USE_TIMER)
        if RECV_TMA:
            P.fence_proxy_async(USE_TIMER)  # the peer's stores were acquired by the generic proxy
            part = r_desc.load([src * Mc + j * BM, col0])
        else:
            ptrs, mask = _tile_ptrs(recv, src * Mc + j * BM, Mc - j * BM, col0, N, BM, BN)
            part = tl.load(ptrs, mask=mask, other=0.0)
        acc += part.to(tl.float32)
    return acc


# Everything that moves with M (rows, tile ranges, programs, lag, flag counts and targets) is a
# plain runtime int: Triton would otherwise specialise it (== 1, % 16) and compile again as M
# changes. N and K keep their specialisation: they are a layer's, fixed per layer.
# Addresses passed as ints (ws_addr, err_addr) are annotated int64: a CPU buffer's address can
# lie below 2^31 and would otherwise make another compile key than a device address.
RUNTIME_INTS = ("M", "Mc", "rank", "lag", "tile_begin", "tile_end", "num_programs", "band_tiles",
                "bands_per_chunk", "flag_target", "n_reset_flags", "timeout")


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _persistent_gemm(
    a_desc, l_desc, b_desc, c_desc, r_desc, out_ptr,
    M, N, K, Mc, rank,
    order_ptr, lag, tile_begin, tile_end, num_programs,
    ws_addr: tl.int64, bases_ptr, flags_off, band_tiles, bands_per_chunk, flag_target,
    recv_off, n_reset_flags,
    err_addr: tl.int64, timeout, trace_ptr,
    W: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    B_KN: tl.constexpr, EPI: tl.constexpr, WAIT_A: tl.constexpr,
    ALIGNED: tl.constexpr, RESET: tl.constexpr, BARRIER: tl.constexpr, TRACE: tl.constexpr,
    MAX_EVENTS: tl.constexpr, USE_TIMER: tl.constexpr, OP: tl.constexpr, FLATTEN: tl.constexpr = False,
    RECV_TMA: tl.constexpr = False, LOCAL_A: tl.constexpr = False,
):
    pid = tl.program_id(0)
    OUT_DTYPE = out_ptr.dtype.element_ty
    ctl_ptr = ws_addr.to(tl.pointer_type(tl.int32))
    err_ptr = err_addr.to(tl.pointer_type(tl.int32))
    tn = tl.cdiv(N, BN)
    tpc = tl.cdiv(Mc, BM) * tn
    if BARRIER:  # gemm_rs push: program 0 meets the peers (it is resident: grid <= SMs)
        if pid == 0:
            P.barrier_all(bases_ptr, ctl_ptr, err_ptr, timeout, rank, OP, W, USE_TIMER)
            tl.atomic_xchg(ctl_ptr + P.CTL_GO_GEMM, 1, sem="release", scope="gpu")

    go_ok = 0  # set once this program has seen the start barrier's go word
    dead = 0  # the start barrier failed: no store into a peer's buffers (it may not exist any more)
    pend = tl.full([], 0, tl.int64)  # address of a peer flag whose tile has not been released
    ev = 0
    for t in tl.range(tile_begin + pid, tile_end, num_programs, flatten=FLATTEN):
        chunk, j, col = _decode_tile(t, Mc, N, order_ptr, lag, W, BM, BN, GROUP_M)
        if TRACE:  # the clock is read only for traces (a volatile read per tile hinders FLATTEN)
            t_start = P.now_ns(USE_TIMER)
        else:
            t_start = tl.full([], 0, tl.int64)
        wait_ns = t_start - t_start
        remote = chunk != rank
        # ag_gemm: a launch of the own chunk's tiles alone may read its rows straight from the
        # caller's shard (LOCAL_A: l_desc, chunk-relative rows, no wait); else the rows come from
        # the gathered buffer band by band. (A per-tile choice between the two descriptors would
        # compile two pipelined main loops: twice the shared memory.)
        if WAIT_A and not LOCAL_A:
            band = chunk * bands_per_chunk + j // band_tiles
            flag = P.as_ptr(ws_addr + flags_off, tl.int32) + band
            P.wait_geq(flag, flag_target, ctl_ptr, err_ptr, timeout, rank, OP, P.ROLE_GEMM, chunk, band,
                       USE_TIMER)
            P.fence_proxy_async(USE_TIMER)
            wait_ns += P.now_ns(USE_TIMER) - t_start
        if LOCAL_A:
            acc = _mainloop(l_desc, j * BM, b_desc, col * BN, K, BM, BN, BK, B_KN)
        else:
            acc = _mainloop(a_desc, chunk * Mc + j * BM, b_desc, col * BN, K, BM, BN, BK, B_KN)
        if TRACE:
            t_main = P.now_ns(USE_TIMER)

        rows_valid = Mc - j * BM
        if EPI == EPI_LOCAL:
            if ALIGNED:
                c_desc.store([chunk * Mc + j * BM, col * BN], acc.to(OUT_DTYPE))
            else:
                _store_rows(out_ptr, chunk * Mc + j * BM, rows_valid, col * BN, N, acc.to(OUT_DTYPE), BM, BN)
        else:
            tic = j * tn + col
            if pend != 0:  # the previous peer tile's stores have drained under this mainloop
                P.set_flag(pend.to(tl.pointer_type(tl.int32)), 1)
                pend = pend * 0
            if remote:
                if go_ok == 0:
                    w0 = P.now_ns(USE_TIMER)
                    P.wait_geq(ctl_ptr + P.CTL_GO_GEMM, 1, ctl_ptr, err_ptr, timeout, rank, OP, P.ROLE_GO,
                               chunk, -1, USE_TIMER)
                    go_ok = 1
                    dead = P.read_word(ctl_ptr + P.CTL_ABORT)  # the wait may have ended by abort
                    wait_ns += P.now_ns(USE_TIMER) - w0
                if dead == 0:
                    dst = P.peer_ptr(bases_ptr, chunk, recv_off, OUT_DTYPE)
                    _store_rows(dst, rank * Mc + j * BM, rows_valid, col * BN, N, acc.to(OUT_DTYPE), BM, BN)
                    pend = tl.load(bases_ptr + chunk) + flags_off + (rank * tpc + tic) * 4
            else:
                w0 = P.now_ns(USE_TIMER)
                acc = _reduce_own(acc, r_desc, ws_addr, j, col * BN, tic, tpc, Mc, N, rank, recv_off, flags_off,
                                  ctl_ptr, err_ptr, timeout, chunk, OUT_DTYPE, W, BM, BN, USE_TIMER, OP, RECV_TMA)
                wait_ns += P.now_ns(USE_TIMER) - w0
                if ALIGNED:
                    c_desc.store([j * BM, col * BN], acc.to(OUT_DTYPE))
                else:
                    _store_rows(out_ptr, j * BM, rows_valid, col * BN, N, acc.to(OUT_DTYPE), BM, BN)
        if TRACE:
            info = (chunk.to(tl.int64) << 40) | (j.to(tl.int64) << 20) | col.to(tl.int64)
            P.trace_event(trace_ptr, pid, ev, MAX_EVENTS, t_start, t_main, P.now_ns(USE_TIMER), wait_ns, info)
        ev += 1
    if pend != 0:
        P.set_flag(pend.to(tl.pointer_type(tl.int32)), 1)
    if RESET:
        P.finish_program(ctl_ptr, P.CTL_DONE_GEMM, P.CTL_GO_GEMM, num_programs,
                         P.as_ptr(ws_addr + flags_off, tl.int32), n_reset_flags, 1024)


# --------------------------------------------------------------------------------------------
# Host side


@dataclass
class CommArgs:
    """Workspace arguments of a fused launch (all byte offsets are the same on every rank)."""

    ws: torch.Tensor  # local workspace (uint8)
    bases: torch.Tensor  # int64[W]: every rank's workspace base address, on the workspace's device
    err: torch.Tensor  # int32[8] error record (pinned host memory on a GPU)
    timeout: int  # ns on a GPU, spins in the interpreter
    flags_off: int = P.FLAGS_OFFSET
    band_tiles: int = 1
    bands_per_chunk: int = 1
    flag_target: int = 1
    recv_off: int = 0
    n_reset_flags: int = 0
    recv: torch.Tensor | None = None  # the receive buffer [W * Mc, N]: partials loaded by TMA
    reset: bool = True
    barrier: bool = False  # program 0 runs the start barrier (gemm_rs push)


_B_LAYOUTS = ("kn", "nk")


def launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    schedule: TileSchedule,
    rank: int,
    config: GemmConfig,
    b_layout: str = "kn",
    epilogue: int = 0,
    wait_a: bool = False,
    comm: CommArgs | None = None,
    num_programs: int | None = None,
    tile_begin: int = 0,
    tile_end: int | None = None,
    trace: torch.Tensor | None = None,
    op: str = "gemm",
    a_local: torch.Tensor | None = None,
) -> None:
    """Launch the persistent GEMM on the current stream. Shapes are checked by the callers;
    ``a`` is ``[W * Mc, K]`` (or the gathered buffer), ``out`` ``[W * Mc, N]`` (local epilogue)
    or ``[Mc, N]`` (gemm_rs epilogues). ``a_local``: ``[Mc, K]``, the rows of chunk ``rank``,
    read from there instead of from ``a`` (ag_gemm: the caller's shard, not yet staged); the
    launch's tiles must all be of chunk ``rank``."""
    _gemm_launcher(*_launch_args(a, b, out, schedule=schedule, rank=rank, config=config, b_layout=b_layout,
                                 epilogue=epilogue, wait_a=wait_a, comm=comm, num_programs=num_programs,
                                 tile_begin=tile_begin, tile_end=tile_end, trace=trace, op=op, a_local=a_local))


def _launch_args(a, b, out, *, schedule, rank, config, b_layout, epilogue, wait_a, comm, num_programs, tile_begin,
                 tile_end, trace, op, a_local) -> tuple:
    """``(key, grid, arguments, options)`` of :func:`launch_gemm`'s launch; the arguments start
    with the five descriptors and ``out`` (:func:`gemm` reuses the rest per layout)."""
    if b_layout not in _B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {_B_LAYOUTS}, got {b_layout!r}")
    cfg = config
    k = a.shape[1]
    n = schedule.n
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    device = a.device
    a_desc = _desc(a, [bm, bk])
    l_desc = _desc(a_local, [bm, bk]) if a_local is not None else a_desc
    b_desc = _desc(b, [bk, bn] if b_layout == "kn" else [bn, bk])
    c_desc = _desc(out, [bm, bn])
    recv_tma = comm is not None and comm.recv is not None and schedule.aligned
    # Without it the kernel never reads r_desc; c_desc stands in (same type: no new specialization).
    r_desc = _desc(comm.recv, [bm, bn]) if recv_tma else c_desc
    tile_end = schedule.num_tiles if tile_end is None else tile_end
    programs = num_programs or num_sms(device)
    programs = max(1, min(programs, tile_end - tile_begin))
    order = _order_tensor(schedule.order, device)
    if comm is None:
        dummy = _dummy(device)
        # Unused by a plain GEMM; real addresses keep the argument types (int64) stable.
        comm_vals = dict(ws_addr=dummy.data_ptr(), bases=dummy, flags_off=0, band_tiles=1, bands_per_chunk=1,
                         flag_target=1, recv_off=0, n_reset=0,
                         err_addr=dummy.data_ptr(), timeout=1, reset=False, barrier=False)
    else:
        comm_vals = dict(ws_addr=comm.ws.data_ptr(), bases=comm.bases, flags_off=comm.flags_off,
                         band_tiles=comm.band_tiles, bands_per_chunk=comm.bands_per_chunk,
                         flag_target=comm.flag_target, recv_off=comm.recv_off, n_reset=comm.n_reset_flags,
                         err_addr=comm.err.data_ptr(), timeout=comm.timeout, reset=comm.reset,
                         barrier=comm.barrier)
    max_events = trace.shape[1] if trace is not None else 1
    if trace is not None and trace.shape[0] < programs:
        raise ValueError(f"trace buffer has {trace.shape[0]} rows, needs {programs}")
    c = comm_vals
    args = (
        a_desc, l_desc, b_desc, c_desc, r_desc, out,
        a.shape[0], n, k, schedule.mc, rank,
        order, schedule.lag_tiles, tile_begin, tile_end, programs,
        c["ws_addr"], c["bases"], c["flags_off"], c["band_tiles"], c["bands_per_chunk"], c["flag_target"],
        c["recv_off"], c["n_reset"],
        c["err_addr"], c["timeout"], trace if trace is not None else _dummy(device),
    )
    consts = (  # W, BM, BN, BK, GROUP_M, B_KN, EPI, WAIT_A, ALIGNED, RESET, BARRIER, TRACE, MAX_EVENTS,
        # USE_TIMER, OP, FLATTEN, RECV_TMA, LOCAL_A: the kernel's constexprs in signature order
        schedule.world, bm, bn, bk, schedule.group_m, b_layout == "kn", epilogue, wait_a, schedule.aligned,
        c["reset"], c["barrier"], trace is not None, max_events, P.use_timer(device.type), P.OP_CODES[op],
        cfg.flatten and epilogue == EPI_LOCAL.value and not wait_a and comm is None and trace is None,
        recv_tma, a_local is not None)
    # What else Triton specialises on: the tensors' dtypes, the alignment of the caller's output
    # and trace buffers, and the value class of the ints that are not runtime ints.
    key = (consts, cfg.num_warps, cfg.num_stages, a.dtype, out.dtype, out.data_ptr() % 16 == 0,
           None if trace is None else trace.data_ptr() % 16 == 0,
           _int_class(n), _int_class(k), _int_class(c["ws_addr"]), _int_class(c["err_addr"]),
           _int_class(c["flags_off"]), _int_class(c["recv_off"]))
    return key, (programs,), args + consts, cfg.launch_options


def _int_class(v: int) -> tuple:
    """What Triton's specialisation reads of a plain int argument: 1, divisible by 16, i32 or i64."""
    return v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31)


_gemm_launcher = Launcher(_persistent_gemm)


_ORDER_CACHE: dict = {}
_DUMMY_CACHE: dict = {}


def _order_tensor(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (order, str(device))
    t = _ORDER_CACHE.get(key)
    if t is None:
        t = torch.tensor(order, dtype=torch.int32, device=device)
        _ORDER_CACHE[key] = t
    return t


def _dummy(device: torch.device) -> torch.Tensor:
    key = str(device)
    t = _DUMMY_CACHE.get(key)
    if t is None:
        t = torch.zeros(8, dtype=torch.int64, device=device)
        _DUMMY_CACHE[key] = t
    return t


def check_operands(a: torch.Tensor, b: torch.Tensor, b_layout: str, name_a: str = "a") -> tuple[int, int]:
    """Validate dtypes, layouts and 16-byte alignment; return ``(K, N)``."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"{name_a} and b must be torch.Tensor")
    if b_layout not in _B_LAYOUTS:
        raise ValueError(f"b_layout must be 'kn' ([K, N]) or 'nk' (nn.Linear [N, K]), got {b_layout!r}")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{name_a} must be bfloat16 or float16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"b must have {name_a}'s dtype {a.dtype}, got {b.dtype}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{name_a} and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{name_a} and b must be on one device, got {a.device} and {b.device}")
    check_kernel_device(a, name_a)
    k = a.shape[1]
    kb, n = (b.shape[0], b.shape[1]) if b_layout == "kn" else (b.shape[1], b.shape[0])
    if kb != k:
        raise ValueError(f"inner dimensions differ: {name_a} has K = {k}, b ({b_layout}) has K = {kb}")
    if k == 0 or n == 0:  # (an empty dim would otherwise fail the stride check below, misleadingly)
        raise ValueError(f"K = {k} and N = {n} must be positive")
    if k % 8 or n % 8:
        raise ValueError(f"K = {k} and N = {n} must be multiples of 8 (16-byte rows for TMA)")
    for name, t in ((name_a, a), ("b", b)):
        if t.stride(1) != 1 or t.stride(0) != t.shape[1]:
            raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary")
    return k, n


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    b_layout: str = "kn",
    config: GemmConfig | None = None,
    chunks: int = 1,
    order: str = "natural",
    rank: int = 0,
    lag: int = 0,
    num_programs: int | None = None,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b`` (or ``a @ b.T`` for ``b_layout='nk'``) by the persistent kernel alone: the
    engine of the fused ops, benchmarked on its own against cuBLAS. ``chunks``/``order``/``rank``/
    ``lag`` select the tile order the fused ops use (``_schedule``)."""
    layout = None
    if trace is None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        layout = (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16, b.shape, b.stride(), b.dtype, b.device,
                  b.data_ptr() % 16, None if out is None else (out.__class__, out.shape, out.stride(), out.dtype,
                                                                out.device, out.data_ptr() % 16),
                  b_layout, config, chunks, order, rank, lag, num_programs)
        plan = _plain_plans.get(layout)
        if plan is not None:  # checked and planned for this layout: the descriptors are the call's
            key, grid, tail, options, (a_template, b_template, c_template), fast = plan
            if out is None:
                out = torch.empty(a.shape[0], tail[0], dtype=a.dtype, device=a.device)
            launch = fast[0]
            if launch is not None and launch(a, b, out):
                return out
            a_desc, c_desc = rebased_descriptor(a_template, a), rebased_descriptor(c_template, out)
            args = (a_desc, a_desc, rebased_descriptor(b_template, b), c_desc, c_desc, out, a.shape[0], *tail)
            _gemm_launcher(key, grid, args, options)
            if launch is None:  # a, b and out change per call: the descriptors over them and C's pointer
                fast[0] = _gemm_launcher.partial(key, grid, args, options, live=((0, 1), 2, (3, 4, 5)))
            return out
    k, n = check_operands(a, b, b_layout)
    m = a.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {a.dtype} tensor of shape {(m, n)}")
    cfg, sched = _gemm_plan(m, n, k, a.device, config, chunks, order, rank, lag)
    key, grid, args, options = _launch_args(a, b, out, schedule=sched, rank=rank, config=cfg, b_layout=b_layout,
                                            epilogue=0, wait_a=False, comm=None, num_programs=num_programs,
                                            tile_begin=0, tile_end=None, trace=trace, op="gemm", a_local=None)
    if layout is not None:
        if len(_plain_plans) >= _MAX_PLANS:
            _plain_plans.clear()
        templates = tuple(rebased_descriptor(args[i], None) for i in (0, 2, 3))  # a, b, out
        _plain_plans[layout] = (key, grid, args[7:], options, templates, [None])
    _gemm_launcher(key, grid, args, options)
    return out


# Plain GEMM launches by argument layout (shapes, strides, dtypes, devices, alignment, options):
# the checks and the plan run once per layout; once the layout's launch is proven direct, a call
# passes its three tensors to the layout's partial launch (Launcher.partial: nothing rebuilt,
# the descriptors' encodings remembered per address).
_plain_plans: dict[tuple, tuple] = {}
_MAX_PLANS = 1024


@functools.lru_cache(maxsize=256)
def _gemm_plan(m, n, k, device, config, chunks, order, rank, lag) -> tuple[GemmConfig, TileSchedule]:
    """The tile config and the schedule of a plain GEMM (per shape: not rebuilt every call)."""
    from tilefuse.tp._schedule import chunk_order, chunk_rows

    cfg = config or default_config(m, n, k, num_sms(device))
    sched = TileSchedule(chunk_rows(m, chunks), n, chunks, cfg.block_m, cfg.block_n, cfg.group_m,
                         tuple(chunk_order(order, rank, chunks)), lag)
    return cfg, sched
