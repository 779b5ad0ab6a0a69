"""Hopper prefill logits with the head loop written in Gluon (private; ``prefill.py`` is the op).

Same tile, grid and arithmetic as ``prefill_logits_kernel`` (64 query rows x 128 keys per
program, the key tile loaded once, heads walked in order, ``acc += relu(q_h . k) * w_h`` in
fp32), but the MMAs are issued asynchronously: head h+1's wgmma runs on the tensor cores while
the warps apply ReLU and the weights to head h's scores. Triton's ``tl.dot`` waits for each
non-accumulating dot before its consumer, so there the MMA and that CUDA-core epilogue add up
(benchmarks/NOTES.md, "Where the time goes"). Query tiles stream through a ring of ``NUM_BUF``
shared-memory buffers filled by TMA, one mbarrier per buffer.

Runs the 2-byte and 1-byte float operands the Triton kernel's FP8 path takes (E4M3, and f16
for MXFP8 renormalised into f16). Gluon has no interpreter, so this path is GPU-only; CPU tests
compile it for sm_90a and the GPU suite checks it bit for bit against the Triton kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPE = {torch.float8_e4m3fn: gl.float8e4nv, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@gluon.jit
def prefill_logits_gluon_kernel(
    q_desc, k_desc, k_scale_ptr,
    w_ptr, stride_w,
    ks_ptr, ke_ptr,
    out_ptr, stride_out,
    S_q, S_k,
    H: gl.constexpr, CLEAN: gl.constexpr, COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_Q: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    # One warpgroup per 64 rows along M; the MMA's N is the whole key tile.
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BLOCK_N, 256 // q_desc.dtype.primitive_bitwidth])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    pid_n = gl.program_id(0)
    pid_q = gl.program_id(1)
    q0 = pid_q * BLOCK_Q
    n0 = pid_n * BLOCK_N
    rows = q0 + gl.arange(0, BLOCK_Q, layout=row_l)
    cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
    row_ok = rows < S_q
    ks = gl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = gl.minimum(gl.load(ke_ptr + rows, mask=row_ok, other=0), S_k)
    valid = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None]) & row_ok[:, None]
    out_rows = out_ptr + rows.to(gl.int64)[:, None] * stride_out
    in_cols = row_ok[:, None] & (cols[None, :] < S_k)

    has_keys = row_ok & (ks < ke)
    lo = gl.min(gl.where(has_keys, ks, S_k), axis=0)
    hi = gl.max(gl.where(has_keys, ke, 0), axis=0)
    if (n0 >= hi) | (n0 + BLOCK_N <= lo):
        # No row of this tile sees these keys: no math, only the -inf of the full layout.
        if CLEAN and not COMPRESSED:
            fill = gl.full((BLOCK_Q, BLOCK_N), float("-inf"), gl.float32, layout=mma)
            gl.store(out_rows + cols[None, :], fill.to(out_ptr.dtype.element_ty), mask=in_cols)
    else:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF, BLOCK_Q, D], q_desc.layout)
        k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(k_bar, count=1)
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(q_bars.index(i), count=1)
        mbarrier.expect(k_bar, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n0, 0], k_bar, k_smem)
        for i in gl.static_range(NUM_BUF):  # H >= NUM_BUF (checked by the launcher)
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q0, i * D], q_bars.index(i), q_smem.index(i))

        w_rows = w_ptr + rows.to(gl.int64) * stride_w
        k_sf = gl.load(k_scale_ptr + cols, mask=cols < S_k, other=0.0)
        acc = gl.zeros((BLOCK_Q, BLOCK_N), gl.float32, layout=mma)
        k_t = k_smem.permute((1, 0))
        mbarrier.wait(k_bar, phase=0)

        mbarrier.wait(q_bars.index(0), phase=0)
        s_prev = warpgroup_mma(q_smem.index(0), k_t, acc, use_acc=False, is_async=True)
        w_prev = gl.load(w_rows, mask=row_ok, other=0.0).to(gl.float32)
        for h in range(1, H):
            buf = h % NUM_BUF
            mbarrier.wait(q_bars.index(buf), phase=(h // NUM_BUF) & 1)
            s_cur = warpgroup_mma(q_smem.index(buf), k_t, acc, use_acc=False, is_async=True)
            # Head h-1's MMA is done (head h's may still run): its buffer takes head h-1+NUM_BUF.
            s_prev = warpgroup_mma_wait(num_outstanding=1, deps=(s_prev, ))
            refill = h - 1 + NUM_BUF
            if refill < H:
                free = (h - 1) % NUM_BUF
                mbarrier.expect(q_bars.index(free), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q0, refill * D], q_bars.index(free), q_smem.index(free))
            w_cur = gl.load(w_rows + h, mask=row_ok, other=0.0).to(gl.float32)
            acc += gl.maximum(s_prev, 0.0) * w_prev[:, None]
            s_prev = s_cur
            w_prev = w_cur
        s_prev = warpgroup_mma_wait(num_outstanding=0, deps=(s_prev, ))
        acc += gl.maximum(s_prev, 0.0) * w_prev[:, None]
        mbarrier.invalidate(k_bar)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(q_bars.index(i))

        acc = acc * k_sf[None, :]
        if CLEAN and not COMPRESSED:
            acc = gl.where(valid, acc, float("-inf"))
        val = acc.to(out_ptr.dtype.element_ty)
        if COMPRESSED:
            # Column c of row i holds key ks[i] + c; only in-window keys are stored.
            gl.store(out_rows + (cols[None, :] - ks[:, None]), val, mask=valid)
        else:
            gl.store(out_rows + cols[None, :], val, mask=in_cols)


def launch(q, k, k_scale, weights, ks, ke, out, clean: bool, compressed: bool, block_q: int, block_n: int,
           num_warps: int, num_buf: int) -> None:
    """q [S_q, H, D] and k [S_k, D] in E4M3 or f16, the rest as the Triton kernel takes them."""
    s_q, h, d = q.shape
    s_k = k.shape[0]
    if num_buf < 1 or num_buf > h:
        raise ValueError(f"gluon prefill: num_stages (query buffers) must be in 1..H={h}, got {num_buf}")
    if block_q != 16 * num_warps:
        raise ValueError(f"gluon prefill: block_q must be 16 x num_warps (one MMA row slab per warp), "
                         f"got block_q={block_q}, num_warps={num_warps}")
    dt = _GL_DTYPE[q.dtype]
    q_block, k_block = [block_q, d], [block_n, d]
    q2 = q.view(s_q, h * d)
    q_desc = TensorDescriptor(q2, [s_q, h * d], [q2.stride(0), 1], q_block,
                              gl.NVMMASharedLayout.get_default_for(q_block, dt))
    k_desc = TensorDescriptor(k, [s_k, d], [k.stride(0), 1], k_block,
                              gl.NVMMASharedLayout.get_default_for(k_block, dt))
    grid = (triton.cdiv(s_k, block_n), triton.cdiv(s_q, block_q))
    prefill_logits_gluon_kernel[grid](
        q_desc, k_desc, k_scale, weights, weights.stride(0), ks, ke, out, out.stride(0), s_q, s_k,
        H=h, CLEAN=clean, COMPRESSED=compressed, NUM_BUF=num_buf, num_warps=num_warps)
