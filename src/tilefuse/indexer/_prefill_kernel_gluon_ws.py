"""Hopper prefill logits, warp-specialised (private; measured against ``_prefill_kernel_gluon``).

One program takes 2 x 64 query rows and 128 keys. A loader warp streams each row block's query
tiles (one per head) through its own ring of shared-memory buffers; two consumer warpgroups,
one per 64-row block, run the head loop of ``_prefill_kernel_gluon`` with one MMA at a time and
take turns at the tensor cores (two mbarriers pass the turn: consumer A issues head h, hands the
turn to B, waits for its MMA and applies ReLU and the weight while B's MMA runs). Inside one
warpgroup ptxas places the epilogue by register dependencies only and hides about half of it
under the MMA (NOTES, round 6); across two warpgroups the warp schedulers interleave them. The
arithmetic per row block is the 2-D kernel's, so the bits are the same.
"""

from __future__ import annotations

import inspect
import os

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilefuse.indexer._prefill_kernel_gluon import _GL_DTYPE

# Experiment switch: 0 lets the two consumer warpgroups issue their MMAs without taking turns.
_TURN = gl.constexpr(os.environ.get("TILEFUSE_WS_TURN", "1") == "1")
WS_LIST_API = "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


@gluon.jit
def _rows_window(ks_ptr, ke_ptr, rows, S_q, S_k):
    row_ok = rows < S_q
    ks = gl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = gl.minimum(gl.load(ke_ptr + rows, mask=row_ok, other=0), S_k)
    return row_ok, ks, ke


@gluon.jit
def _store_block(val, rows, ks, ke, n0, out_ptr, stride_out, S_q, S_k, CLEAN, COMPRESSED, mma: gl.constexpr):
    """``_prefill_kernel_gluon._store_tile`` without branches: inside a partition the flags
    arrive as values, and triton 3.6 fails to lower the branches on them (an LLVM assertion in
    ConvertTritonGPUToLLVM, measured); selects give the same stores."""
    BN: gl.constexpr = val.shape[1]
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    row_ok = rows < S_q
    valid = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None]) & row_ok[:, None]
    inside = row_ok[:, None] & (cols[None, :] < S_k)
    fill = CLEAN & (COMPRESSED == 0)
    val = gl.where(valid | (fill == 0), val, float("-inf")).to(out_ptr.dtype.element_ty)
    shift = gl.where(COMPRESSED != 0, ks, 0)
    out_rows = out_ptr + rows.to(gl.int64)[:, None] * stride_out
    gl.store(out_rows + (cols[None, :] - shift[:, None]), val, mask=gl.where(COMPRESSED != 0, valid, inside))


@gluon.jit
def _consumer(C: gl.constexpr, q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w,
              ks_ptr, ke_ptr, k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H: gl.constexpr,
              CLEAN: gl.constexpr, COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr, SELF_LOAD: gl.constexpr):
    """Row block C (rows q0 + 64 C ..): the head loop, one MMA at a time, taking turns with the
    other block's warpgroup at the tensor cores."""
    BQ: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_smem.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 256 // q_desc.dtype.primitive_bitwidth])
    rows = q0 + C * BQ + gl.arange(0, BQ, layout=gl.SliceLayout(1, mma))
    row_ok, ks, ke = _rows_window(ks_ptr, ke_ptr, rows, S_q, S_k)
    w_rows = w_ptr + rows.to(gl.int64) * stride_w
    if SELF_LOAD:  # no loader partition: this warpgroup streams its own query tiles
        if C == 0:
            mbarrier.expect(k_bar, k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [n0, 0], k_bar, k_smem)
        for i in range(NUM_BUF):  # a loop: constexpr arguments reach worker partitions as values
            mbarrier.expect(q_ready.index(C * NUM_BUF + i), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q0 + C * BQ, i * D], q_ready.index(C * NUM_BUF + i),
                                            q_smem.index(C * NUM_BUF + i))
    k_t = k_smem.permute((1, 0))
    acc = gl.zeros((BQ, BN), gl.float32, layout=mma)
    s = gl.zeros((BQ, BN), gl.float32, layout=mma)
    mbarrier.wait(k_bar, phase=0)
    for h in range(H):
        slot = C * NUM_BUF + h % NUM_BUF
        mbarrier.wait(q_ready.index(slot), phase=(h // NUM_BUF) & 1)
        if _TURN:
            mbarrier.wait(turn.index(C), phase=(h & 1) ^ (1 - C))
        s = warpgroup_mma(q_smem.index(slot), k_t, s, use_acc=False, is_async=True)
        if _TURN:
            mbarrier.arrive(turn.index(1 - C), count=1)
        w = gl.load(w_rows + h, mask=row_ok, other=0.0).to(gl.float32)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if SELF_LOAD:
            if h + NUM_BUF < H:
                mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q0 + C * BQ, (h + NUM_BUF) * D], q_ready.index(slot),
                                                q_smem.index(slot))
        else:
            mbarrier.arrive(q_empty.index(slot), count=1)
        acc += gl.maximum(s, 0.0) * w[:, None]
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    acc = acc * gl.load(k_scale_ptr + cols, mask=cols < S_k, other=0.0)[None, :]
    _store_block(acc, rows, ks, ke, n0, out_ptr, stride_out, S_q, S_k, CLEAN, COMPRESSED, mma)


@gluon.jit
def _consumer0(q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w, ks_ptr, ke_ptr,
               k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H: gl.constexpr, CLEAN: gl.constexpr,
               COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr, SELF_LOAD: gl.constexpr):
    _consumer(0, q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w, ks_ptr, ke_ptr,
              k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H, CLEAN, COMPRESSED, NUM_BUF, SELF_LOAD)


@gluon.jit
def _consumer1(q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w, ks_ptr, ke_ptr,
               k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H: gl.constexpr, CLEAN: gl.constexpr,
               COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr, SELF_LOAD: gl.constexpr):
    _consumer(1, q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w, ks_ptr, ke_ptr,
              k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H, CLEAN, COMPRESSED, NUM_BUF, SELF_LOAD)


@gluon.jit
def _loader(q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w, ks_ptr, ke_ptr,
            k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H: gl.constexpr, CLEAN: gl.constexpr,
            COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr, SELF_LOAD: gl.constexpr):
    """The key tile once, then both row blocks' query tiles head by head into their rings."""
    BQ: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(k_bar, k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], k_bar, k_smem)
    for h in range(H):
        for c in gl.static_range(2):
            slot = c * NUM_BUF + h % NUM_BUF
            mbarrier.wait(q_empty.index(slot), phase=((h // NUM_BUF) & 1) ^ 1)
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q0 + c * BQ, h * D], q_ready.index(slot), q_smem.index(slot))


@gluon.jit
def prefill_logits_gluon_ws_kernel(
    q_desc, k_desc, k_scale_ptr, w_ptr, stride_w, ks_ptr, ke_ptr, out_ptr, stride_out, S_q, S_k,
    H: gl.constexpr, CLEAN: gl.constexpr, COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr, SELF_LOAD: gl.constexpr,
    WS_LIST: gl.constexpr, num_warps: gl.constexpr,
):
    BQ: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 256 // q_desc.dtype.primitive_bitwidth])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    pid_n = gl.program_id(0)
    pid_q = gl.program_id(1)
    q0 = pid_q * (2 * BQ)
    n0 = pid_n * BN
    # Skip the tile when no row of either block sees its keys (the 2-D kernel's test, 128 rows).
    r0 = q0 + gl.arange(0, BQ, layout=row_l)
    ok0, ks0, ke0 = _rows_window(ks_ptr, ke_ptr, r0, S_q, S_k)
    ok1, ks1, ke1 = _rows_window(ks_ptr, ke_ptr, r0 + BQ, S_q, S_k)
    h0 = ok0 & (ks0 < ke0)
    h1 = ok1 & (ks1 < ke1)
    lo = gl.minimum(gl.min(gl.where(h0, ks0, S_k), axis=0), gl.min(gl.where(h1, ks1, S_k), axis=0))
    hi = gl.maximum(gl.max(gl.where(h0, ke0, 0), axis=0), gl.max(gl.where(h1, ke1, 0), axis=0))
    empty = (n0 >= hi) | (n0 + BN <= lo)
    if empty:
        if CLEAN and not COMPRESSED:
            fill = gl.full((BQ, BN), float("-inf"), gl.float32, layout=mma)
            _store_block(fill, r0, ks0, ke0, n0, out_ptr, stride_out, S_q, S_k, False, False, mma)
            _store_block(fill, r0 + BQ, ks1, ke1, n0, out_ptr, stride_out, S_q, S_k, False, False, mma)
    else:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NUM_BUF, BQ, D], q_desc.layout)
        k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(k_bar, count=1)
        for i in gl.static_range(2 * NUM_BUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        args = (q_desc, k_desc, k_smem, q_smem, k_bar, q_ready, q_empty, turn, w_ptr, stride_w, ks_ptr, ke_ptr,
                k_scale_ptr, out_ptr, stride_out, q0, n0, S_q, S_k, H, CLEAN, COMPRESSED, NUM_BUF, SELF_LOAD)
        # The two calling conventions of gl.warp_specialize (triton 3.6 / 3.8+).
        if SELF_LOAD:
            if WS_LIST:
                gl.warp_specialize([(_consumer0, args), (_consumer1, args)], [4], [CONSUMER_REGS])
            else:
                gl.warp_specialize(args, _consumer0, args, [_consumer1], [4], [CONSUMER_REGS])
        elif WS_LIST:
            gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, LOADER_WARPS],
                               [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize(args, _consumer0, args, [_consumer1, _loader], [4, LOADER_WARPS],
                               [CONSUMER_REGS, LOADER_REGS])


def launch(q, k, k_scale, weights, ks, ke, out, clean: bool, compressed: bool, num_buf: int = 4,
           consumer_regs: int = 200, loader_regs: int = 40, loader_warps: int = 1, self_load: bool = False,
           maxnreg: int | None = 168):
    """q [S_q, H, D] and k [S_k, D] in E4M3 or f16, the rest as ``_prefill_kernel_gluon.launch``."""
    s_q, h, d = q.shape
    s_k = k.shape[0]
    if num_buf < 1 or num_buf > h:
        raise ValueError(f"gluon ws prefill: num_buf must be in 1..H={h}, got {num_buf}")
    dt = _GL_DTYPE[q.dtype]
    q_block, k_block = [64, d], [128, d]
    q_desc = TensorDescriptor(q, [s_q, h * d], [q.stride(0), 1], q_block,
                              gl.NVMMASharedLayout.get_default_for(q_block, dt))
    k_desc = TensorDescriptor(k, [s_k, d], [k.stride(0), 1], k_block,
                              gl.NVMMASharedLayout.get_default_for(k_block, dt))
    grid = (triton.cdiv(s_k, 128), triton.cdiv(s_q, 128))
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    return prefill_logits_gluon_ws_kernel[grid](
        q_desc, k_desc, k_scale, weights, weights.stride(0), ks, ke, out, out.stride(0), s_q, s_k,
        H=h, CLEAN=clean, COMPRESSED=compressed, NUM_BUF=num_buf, CONSUMER_REGS=consumer_regs,
        LOADER_REGS=loader_regs, LOADER_WARPS=loader_warps, SELF_LOAD=self_load, WS_LIST=WS_LIST_API,
        num_warps=4, **extra)
