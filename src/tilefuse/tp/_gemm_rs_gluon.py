"""gemm_rs push with the pushed tiles' TMA stores drained under the next tile's main loop (Gluon).

The Triton kernel (``_gemm_core._persistent_gemm``, ``EPI_RS_PUSH``) stores a peer-owned tile
either thread by thread or by one TMA store, and in both cases the program waits until the
64 KiB have left the SM before it starts its next tile: Triton puts a ``cp.async.bulk.wait_group``
right behind every descriptor store of a loop it does not software-pipeline, and it does not
pipeline a tile loop with waits in it. With all programs pushing, the link paces that drain, so
the peer tile's epilogue took 5.6 µs against an 11 µs main loop (benchmarks/NOTES.md, fused
TP round 13). Here the store is issued and left in flight: the epilogue buffer's wait moves to
the next tile's epilogue, and the owner's flag of a pushed tile is raised there once the
stores have landed, one tile later, as in the Triton kernel.

Everything else is the Triton kernel's: the tile order (``_decode_tile``), the start barrier
and go word, the bounded waits, the owner's reduction in rank order (the partials by TMA), the
flag reset by the last program, the trace events. Besides: the next tile's first loads are
issued before this tile's epilogue and the next tile is decoded before this tile's main loop,
so neither waits in an epilogue; a program's first push is published at once, since its owner
reduces that tile in the first wave. W = 2 (the one peer's receive buffer is a host tensor
descriptor), chunks of whole tiles, Hopper. Gluon has no interpreter: CPU tests compile
this kernel for sm_90a; the GPU checks compare it with the sequential reference.
Measurements: benchmarks/NOTES.md, fused TP round 14.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilefuse.tp import _primitives as P
from tilefuse.tp._gemm_core import _decode_tile, _dummy, _order_tensor

_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@triton.jit
def _cta_sync():
    """Every thread of the program arrives (Gluon's own name for it differs between releases)."""
    tl.debug_barrier()


@gluon.jit
def _load_step(a_desc, b_desc, a_smem, b_smem, bars, step, a_row, col0, kk, STAGES: gl.constexpr,
               B_KN: gl.constexpr):
    """TMA loads of one K step (A rows, B columns) into ring slot ``step % STAGES``."""
    slot = step % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, kk], bar, a_smem.index(slot))
    if B_KN:
        tma.async_copy_global_to_shared(b_desc, [kk, col0], bar, b_smem.index(slot))
    else:
        tma.async_copy_global_to_shared(b_desc, [col0, kk], bar, b_smem.index(slot))


@gluon.jit
def _first_loads(a_desc, b_desc, a_smem, b_smem, bars, step, a_row, col0, k_steps, BK: gl.constexpr,
                 STAGES: gl.constexpr, B_KN: gl.constexpr):
    """The first ``STAGES - 1`` K steps of a tile (fewer if K is short); returns the next step."""
    for i in gl.static_range(STAGES - 1):
        if i < k_steps:
            _load_step(a_desc, b_desc, a_smem, b_smem, bars, step, a_row, col0, i * BK, STAGES, B_KN)
            step += 1
    return step


@gluon.jit
def _tile_rows(t, Mc, N, order_ptr, lag, W: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               GROUP_M: gl.constexpr):
    chunk, j, col = _decode_tile(t, Mc, N, order_ptr, lag, W, BM, BN, GROUP_M)
    return chunk, j, col, chunk * Mc + j * BM


@gluon.jit
def _publish(pend, USE_TIMER: gl.constexpr):
    """The stores of the last pushed tile have landed (all of this program's TMA stores are
    written, not only read out): raise its owner's flag. Returns the cleared address."""
    if pend != 0:
        P.bulk_stores_done(USE_TIMER)
        P.set_flag(pend.to(gl.pointer_type(gl.int32)), 1)
        pend = pend * 0
    return pend


@gluon.jit
def _reset_flags(ctl_ptr, flags_ptr, n_flags, num_programs, num_warps: gl.constexpr):
    """``P.finish_program`` with a laid-out zero block (Gluon tensors carry their layout)."""
    ZERO_BLOCK: gl.constexpr = 1024
    blocked: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    prev = gl.atomic_add(ctl_ptr + P.CTL_DONE_GEMM, 1, sem="acq_rel", scope="gpu")
    if prev == num_programs - 1:
        offs = gl.arange(0, ZERO_BLOCK, layout=blocked)
        for start in range(0, n_flags, ZERO_BLOCK):
            gl.store(flags_ptr + start + offs, gl.zeros([ZERO_BLOCK], gl.int32, layout=blocked),
                     mask=start + offs < n_flags)
        gl.atomic_xchg(ctl_ptr + P.CTL_GO_GEMM, 0, sem="release", scope="gpu")
        gl.atomic_xchg(ctl_ptr + P.CTL_DONE_GEMM, 0, sem="release", scope="gpu")


# As in _persistent_gemm: what moves with M is a plain runtime int (no compile per M).
@gluon.jit(do_not_specialize=("Mc", "rank", "lag", "tile_end", "num_programs", "n_reset_flags", "timeout"))
def rs_push_gluon_kernel(
    a_desc, b_desc, c_desc, r_desc, p_desc,
    N, K, Mc, rank,
    order_ptr, lag, tile_end, num_programs,
    ws_addr: gl.int64, bases_ptr, flags_off, n_reset_flags,
    err_addr: gl.int64, timeout, trace_ptr,
    W: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    B_KN: gl.constexpr, RESET: gl.constexpr, BARRIER: gl.constexpr, TRACE: gl.constexpr,
    MAX_EVENTS: gl.constexpr, USE_TIMER: gl.constexpr, OP: gl.constexpr, num_warps: gl.constexpr,
):
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    OUT_DTYPE: gl.constexpr = c_desc.dtype
    # Warps tile M in 16-row slabs, two warpgroups for the 128-row tile.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BN, 16])
    pid = gl.program_id(0)
    ctl_ptr = ws_addr.to(gl.pointer_type(gl.int32))
    err_ptr = err_addr.to(gl.pointer_type(gl.int32))
    flags = P.as_ptr(ws_addr + flags_off, gl.int32)
    tn = gl.cdiv(N, BN)
    tpc = gl.cdiv(Mc, BM) * tn
    k_steps = gl.cdiv(K, BK)
    if BARRIER:  # program 0 meets the peers (it is resident: grid <= SMs)
        if pid == 0:
            P.barrier_all(bases_ptr, ctl_ptr, err_ptr, timeout, rank, OP, W, USE_TIMER)
            gl.atomic_xchg(ctl_ptr + P.CTL_GO_GEMM, 1, sem="release", scope="gpu")

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    epi_smem = gl.allocate_shared_memory(OUT_DTYPE, [BM, BN], c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(r_bar, count=1)

    peer_flags = gl.load(bases_ptr + (rank + 1) % W) + flags_off  # W = 2: the one peer's flag words
    n_pushed = 0
    go_ok = 0  # set once this program has seen the start barrier's go word
    dead = 0  # the start barrier failed: no store into the peer's buffer (it may not exist any more)
    pend = gl.full([], 0, gl.int64)  # owner flag address of a pushed tile whose stores may be in flight
    r_phase = 0
    load_step = 0  # K steps issued / consumed by this program over all its tiles (ring slot, phase)
    use_step = 0
    ev = 0
    t = pid
    chunk, j, col, a_row = _tile_rows(t, Mc, N, order_ptr, lag, W, BM, BN, GROUP_M)
    if t < tile_end:
        load_step = _first_loads(a_desc, b_desc, a_smem, b_smem, bars, load_step, a_row, col * BN, k_steps, BK,
                                 STAGES, B_KN)
    while t < tile_end:
        if TRACE:
            t_start = P.now_ns(USE_TIMER)
        else:
            t_start = gl.full([], 0, gl.int64)
        wait_ns = t_start - t_start
        # Decoded now: the order table's load completes under the main loop, not in the epilogue.
        t_next = t + num_programs
        n_chunk, n_j, n_col, n_row = _tile_rows(t_next, Mc, N, order_ptr, lag, W, BM, BN, GROUP_M)
        acc = gl.zeros((BM, BN), gl.float32, layout=mma)
        for kt in range(k_steps):
            slot = use_step % STAGES
            mbarrier.wait(bars.index(slot), phase=(use_step // STAGES) & 1)
            if B_KN:
                acc = warpgroup_mma(a_smem.index(slot), b_smem.index(slot), acc, is_async=True)
            else:
                acc = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, is_async=True)
            # The MMA of step kt - 1 is done: its slot takes step kt + STAGES - 1.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            use_step += 1
            if kt + STAGES - 1 < k_steps:
                _load_step(a_desc, b_desc, a_smem, b_smem, bars, load_step, a_row, col * BN,
                           (kt + STAGES - 1) * BK, STAGES, B_KN)
                load_step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if TRACE:
            t_main = P.now_ns(USE_TIMER)
        else:
            t_main = t_start
        # The ring is empty: the next tile's first loads run under this epilogue.
        if t_next < tile_end:
            load_step = _first_loads(a_desc, b_desc, a_smem, b_smem, bars, load_step, n_row, n_col * BN, k_steps,
                                     BK, STAGES, B_KN)

        tic = j * tn + col
        # The last tile's store (pushed or own) was in flight through this tile's main loop: wait
        # until it has left the buffer; its owner's flag (if pushed) goes up once it has landed.
        if chunk != rank:
            if go_ok == 0:
                w0 = P.now_ns(USE_TIMER)
                P.wait_geq(ctl_ptr + P.CTL_GO_GEMM, 1, ctl_ptr, err_ptr, timeout, rank, OP, P.ROLE_GO, chunk, -1,
                           USE_TIMER)
                go_ok = 1
                dead = P.read_word(ctl_ptr + P.CTL_ABORT)  # the wait may have ended by abort
                wait_ns += P.now_ns(USE_TIMER) - w0
            w0 = P.now_ns(USE_TIMER)
            tma.store_wait(0)
            w1 = P.now_ns(USE_TIMER)
            if dead == 0:
                epi_smem.store(acc.to(OUT_DTYPE))
            w2 = P.now_ns(USE_TIMER)
            pend = _publish(pend, USE_TIMER)  # after the buffer write, before this tile's store (the
            # wait covers every store of the program)
            wait_ns += (w1 - w0) + (P.now_ns(USE_TIMER) - w2)  # traced: the waits for the last store
            if dead == 0:
                fence_async_shared()
                tma.async_copy_shared_to_global(p_desc, [rank * Mc + j * BM, col * BN], epi_smem)
                pend = peer_flags + (rank * tpc + tic) * 4
                if n_pushed == 0:  # the owner computes this tile in the first wave: publish it now,
                    tma.store_wait(0)  # not a whole tile later
                    pend = _publish(pend, USE_TIMER)
                n_pushed += 1
        else:
            # Publish before waiting for a peer: the peer may be waiting for this very flag
            # before it publishes the one this tile needs.
            w0 = P.now_ns(USE_TIMER)
            tma.store_wait(0)
            pend = _publish(pend, USE_TIMER)
            for s in gl.static_range(1, W):
                src = (rank + s) % W
                P.wait_geq(flags + src * tpc + tic, 1, ctl_ptr, err_ptr, timeout, rank, OP, P.ROLE_GEMM, chunk,
                           src * tpc + tic, USE_TIMER)
                P.fence_proxy_async(USE_TIMER)  # the peer's stores were acquired by the generic proxy
                mbarrier.expect(r_bar, r_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(r_desc, [src * Mc + j * BM, col * BN], r_bar, epi_smem)
                mbarrier.wait(r_bar, phase=r_phase)
                r_phase ^= 1
                acc += epi_smem.load(mma).to(gl.float32)
                _cta_sync()  # every warp has read the partial before the sum overwrites it
            wait_ns += P.now_ns(USE_TIMER) - w0
            epi_smem.store(acc.to(OUT_DTYPE))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [j * BM, col * BN], epi_smem)
        if TRACE:
            info = (chunk.to(gl.int64) << 40) | (j.to(gl.int64) << 20) | col.to(gl.int64)
            P.trace_event(trace_ptr, pid, ev, MAX_EVENTS, t_start, t_main, P.now_ns(USE_TIMER), wait_ns, info)
        ev += 1
        t = t_next
        chunk = n_chunk
        j = n_j
        col = n_col
        a_row = n_row
    tma.store_wait(0)
    pend = _publish(pend, USE_TIMER)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(r_bar)
    if RESET:
        _cta_sync()
        _reset_flags(ctl_ptr, flags, n_reset_flags, num_programs, num_warps)


def _nvmma_desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A Gluon descriptor: Gluon's TMA ops need the shared-memory layout in the descriptor."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPE[t.dtype])
    return TensorDescriptor.from_tensor(t, block, layout)


def launch(a, b, out, recv, peer_recv, *, schedule, rank, config, b_layout, comm, num_programs, trace,
           op_code: int, use_timer: bool):
    """Host side of ``rs_push_gluon_kernel``: descriptors of A ``[W * Mc, K]``, B, the output
    ``[Mc, N]``, this rank's receive buffer ``[W * Mc, N]`` and the peer's."""
    cfg = config
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if schedule.world != 2 or not schedule.aligned:
        raise ValueError(f"the Gluon push kernel takes W = 2 and chunks of whole tiles, got W = {schedule.world}, "
                         f"aligned {schedule.aligned}")
    tile_end = schedule.num_tiles
    programs = max(1, min(num_programs, tile_end))
    args = (
        _nvmma_desc(a, [bm, bk]), _nvmma_desc(b, [bk, bn] if b_layout == "kn" else [bn, bk]),
        _nvmma_desc(out, [bm, bn]),
        _nvmma_desc(recv, [bm, bn]), _nvmma_desc(peer_recv, [bm, bn]),
        schedule.n, a.shape[1], schedule.mc, rank,
        _order_tensor(schedule.order, a.device), schedule.lag_tiles, tile_end, programs,
        comm.ws.data_ptr(), comm.bases, comm.flags_off, comm.n_reset_flags,
        comm.err.data_ptr(), comm.timeout, trace if trace is not None else _dummy(a.device),
    )
    rs_push_gluon_kernel[(programs,)](
        *args, W=schedule.world, GROUP_M=schedule.group_m, STAGES=cfg.num_stages,
        B_KN=b_layout == "kn", RESET=comm.reset, BARRIER=comm.barrier, TRACE=trace is not None,
        MAX_EVENTS=trace.shape[1] if trace is not None else 1, USE_TIMER=use_timer, OP=op_code,
        num_warps=cfg.num_warps,
    )
