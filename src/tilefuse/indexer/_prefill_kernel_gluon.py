"""Hopper prefill logits with the head loop written in Gluon (private; ``prefill.py`` is the op).

Same tile, grid and arithmetic as ``prefill_logits_kernel`` (64 query rows x 128 keys per
program, the key tile loaded once, heads walked in order, ``acc += relu(q_h . k) * w_h`` in
fp32), but the MMAs are issued asynchronously: head h+1's wgmma runs on the tensor cores while
the warps apply ReLU and the weights to head h's scores. Triton's ``tl.dot`` waits for each
non-accumulating dot before its consumer, so there the MMA and that CUDA-core epilogue add up
(benchmarks/NOTES.md, "Where the time goes"). Query tiles stream through a ring of ``NUM_BUF``
shared-memory buffers filled by TMA, one mbarrier per buffer.

One schedule, ``prefill_logits_gluon_kernel``: the 2-D grid, one tile per program (a
persistent grid walking the same tiles ran 2-3% slower: NOTES, sweep 11). One head loop,
``_head_loop``: one MMA in flight under the other head's epilogue (a "pairs" loop, issuing two
heads' MMAs together and applying the first under the second, was measured slower: NOTES,
round 6). The kernel runs the 2-byte and 1-byte float operands the Triton kernel's FP8 path
takes (E4M3, and f16 for MXFP8 renormalised into f16). Gluon has no interpreter, so this path
is GPU-only; CPU tests compile it for sm_90a and the GPU suite checks it bit for bit against
the Triton kernel.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tilefuse import _errors
from tilefuse._jit import Launcher, host_descriptor
from tilefuse.indexer._prefill_kernel import _DYNAMIC, _SLICEABLE

ERR_START_NEGATIVE = gl.constexpr(_errors.WINDOW_START_NEGATIVE)
ERR_INVERTED = gl.constexpr(_errors.WINDOW_INVERTED)
ERR_LONGER_THAN_ROW = gl.constexpr(_errors.WINDOW_LONGER_THAN_MAX_SEQLEN)
_GL_DTYPE = {torch.float8_e4m3fn: gl.float8e4nv, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@gluon.jit
def _issue(q_smem, q_bars, k_t, s, head, NUM_BUF: gl.constexpr):
    """Start head ``head``'s MMA once its query tile has landed; overwrites ``s``."""
    buf = head % NUM_BUF
    mbarrier.wait(q_bars.index(buf), phase=(head // NUM_BUF) & 1)
    return warpgroup_mma(q_smem.index(buf), k_t, s, use_acc=False, is_async=True)


@gluon.jit
def _apply(acc, s, w, ABS: gl.constexpr):
    """acc += relu(s) * w per row; with ``ABS`` (``relu_via_abs``: the linear half of
    relu(s) = (s + |s|) / 2 is in acc already) acc += |s| * w, one FMA per score."""
    if ABS:
        # abs.f32 in the asm: written as gl.abs, LLVM turns the abs of the last head's scores
        # (bitcast from the wgmma wait's integer registers) into an integer AND, and ptxas then
        # dropped that head's wgmma (its contribution read as 0 on an H200).
        acc = gl.inline_asm_elementwise("{ .reg .f32 a; abs.f32 a, $1; fma.rn.f32 $0, a, $2, $3; }", "=f,f,f,f",
                                        [s, gl.broadcast(w[:, None], s)[0], acc], dtype=gl.float32,
                                        is_pure=True, pack=1)
    else:
        acc += gl.maximum(s, 0.0) * w[:, None]
    return acc


@gluon.jit
def _overlap(q_smem, q_bars, k_t, s, head, acc, s_done, w_done, NUM_BUF: gl.constexpr, ABS: gl.constexpr):
    """Start head ``head``'s MMA into ``s`` and, while it runs, apply the finished scores
    ``s_done`` (weights ``w_done``) to ``acc``: ``(s, acc)``."""
    return _issue(q_smem, q_bars, k_t, s, head, NUM_BUF), _apply(acc, s_done, w_done, ABS)


@gluon.jit
def _refill(q_desc, q_smem, q_bars, head, q0, H: gl.constexpr, D: gl.constexpr, NUM_BUF: gl.constexpr):
    """Head ``head``'s MMA is done: its buffer takes the query tile of head ``head + NUM_BUF``, if any."""
    buf = head % NUM_BUF
    later = head + NUM_BUF
    if later < H:
        mbarrier.expect(q_bars.index(buf), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q0, later * D], q_bars.index(buf), q_smem.index(buf))


@gluon.jit
def _head_loop(q_desc, q_smem, q_bars, k_t, w_rows, row_ok, q0, H: gl.constexpr, D: gl.constexpr,
               NUM_BUF: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
               mma: gl.constexpr, REFILL_EVERY: gl.constexpr = 1, lin_smem=None, LIN_PARTS: gl.constexpr = 0):
    """sum_h relu(q_h . k) * w_h for one tile, heads in order (the ring already holds requests
    for heads 0 .. NUM_BUF - 1).

    Two score tiles alternate: while one head's MMA runs, the warps apply ReLU and the weight to
    the other's scores. Exactly one MMA is in flight at any time and every wait is for zero
    outstanding groups, the pattern ptxas keeps asynchronous; each MMA writes over the tile
    whose scores were just consumed (use_acc=False), and the loop is unrolled by two, so no
    accumulator is copied or redefined while an MMA runs (either makes ptxas serialise every
    wgmma: NOTES, round 6). ``REFILL_EVERY`` 2 refills the ring two buffers at a time, after
    every second head (one set of CTA barriers around the TMA issue per two heads).
    ``LIN_PARTS`` > 0: acc starts as the linear term, ``LIN_PARTS`` accumulating MMAs of the
    parts in ``lin_smem`` issued with head 0's, and each head adds |s| * w."""
    ABS: gl.constexpr = LIN_PARTS > 0
    acc = gl.zeros((BLOCK_Q, BLOCK_N), gl.float32, layout=mma)
    for p in gl.static_range(LIN_PARTS):
        acc = warpgroup_mma(lin_smem.index(p), k_t, acc, use_acc=p > 0, is_async=True)
    s0 = _issue(q_smem, q_bars, k_t, gl.zeros((BLOCK_Q, BLOCK_N), gl.float32, layout=mma), 0, NUM_BUF)
    s1 = gl.zeros((BLOCK_Q, BLOCK_N), gl.float32, layout=mma)
    w0 = gl.load(w_rows, mask=row_ok, other=0.0).to(gl.float32)
    w1 = gl.load(w_rows + 1, mask=row_ok, other=0.0).to(gl.float32)
    if LIN_PARTS > 0:
        s0, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s0, acc))
    else:
        s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, ))
    if REFILL_EVERY == 1:
        _refill(q_desc, q_smem, q_bars, 0, q0, H, D, NUM_BUF)
    for h in range(0, H - 2, 2):
        s1, acc = _overlap(q_smem, q_bars, k_t, s1, h + 1, acc, s0, w0, NUM_BUF, ABS)
        w0 = gl.load(w_rows + h + 2, mask=row_ok, other=0.0).to(gl.float32)
        s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s1, ))
        if REFILL_EVERY == 1:
            _refill(q_desc, q_smem, q_bars, h + 1, q0, H, D, NUM_BUF)
        else:  # heads h and h + 1 are done: both their buffers take later heads
            _refill(q_desc, q_smem, q_bars, h, q0, H, D, NUM_BUF)
            _refill(q_desc, q_smem, q_bars, h + 1, q0, H, D, NUM_BUF)
        s0, acc = _overlap(q_smem, q_bars, k_t, s0, h + 2, acc, s1, w1, NUM_BUF, ABS)
        w1 = gl.load(w_rows + h + 3, mask=row_ok, other=0.0).to(gl.float32)
        s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, ))
        if REFILL_EVERY == 1:
            _refill(q_desc, q_smem, q_bars, h + 2, q0, H, D, NUM_BUF)
    s1, acc = _overlap(q_smem, q_bars, k_t, s1, H - 1, acc, s0, w0, NUM_BUF, ABS)
    s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s1, ))
    if REFILL_EVERY == 1:
        _refill(q_desc, q_smem, q_bars, H - 1, q0, H, D, NUM_BUF)
    return _apply(acc, s1, w1, ABS)


@gluon.jit
def _store_tile(val, rows, ks, ke, q0, n0, out_ptr, stride_out, S_q, S_k, CLEAN: gl.constexpr,
                COMPRESSED: gl.constexpr, mma: gl.constexpr):
    """Write a [rows, keys] tile: -inf outside the windows when cleaning, only in-window keys
    (at column key - ks) in the compressed layout. As in the Triton kernel's ``_store_logits``,
    a tile whose keys all lie below ``S_k`` stores without a key mask (vectorised), and the
    row stride carries the 16-byte alignment the wrapper checks (neither is specialised); one
    whose rows also all lie below ``S_q`` stores with no mask at all (a mask on the runtime S_q
    costs a compare per element: NOTES, round of 2026-12-02). Rows past ``S_q`` have the empty
    window ``ks = ke = 0`` (``_tile_window``), so ``valid`` needs no row term."""
    BLOCK_Q: gl.constexpr = val.shape[0]
    BLOCK_N: gl.constexpr = val.shape[1]
    # _prefill_kernel._row_stride inline: a Gluon kernel cannot reference a @triton.jit helper
    # that the interpreter has wrapped (CPU runs import this module with TRITON_INTERPRET=1).
    PER_16_BYTES: gl.constexpr = 128 // out_ptr.dtype.element_ty.primitive_bitwidth
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    row_ok = rows < S_q
    out_rows = out_ptr + rows.to(gl.int64)[:, None] * (stride_out // PER_16_BYTES * PER_16_BYTES)
    valid = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    if CLEAN and not COMPRESSED:
        val = gl.where(valid, val, float("-inf"))
    val = val.to(out_ptr.dtype.element_ty)
    if COMPRESSED:
        gl.store(out_rows + (cols[None, :] - ks[:, None]), val, mask=valid)
    elif (n0 + BLOCK_N <= S_k) & (q0 + BLOCK_Q <= S_q):
        gl.store(out_rows + cols[None, :], val)
    elif n0 + BLOCK_N <= S_k:
        gl.store(out_rows + cols[None, :], val, mask=row_ok[:, None])
    else:
        gl.store(out_rows + cols[None, :], val, mask=row_ok[:, None] & (cols[None, :] < S_k))


@gluon.jit
def _report(err_ptr, CODE: gl.constexpr, bad, rows):
    """``_errors_kernel.report_error`` for Gluon: mark error ``CODE`` with a row where ``bad``."""
    zero = rows * 0
    gl.store(err_ptr + 2 * CODE + zero, zero + 1, mask=bad)
    gl.store(err_ptr + 2 * CODE + 1 + zero, rows, mask=bad)


@gluon.jit
def _tile_window(ks_ptr, ke_ptr, q0, n0, S_q, S_k, n_cols, err_ptr, report, COMPRESSED: gl.constexpr,
                 BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, row_l: gl.constexpr):
    """The tile at (q0, n0): its rows, their windows (clamped as ``_prefill_kernel.load_windows``
    clamps them, bad ones recorded where ``report`` holds) and whether no row sees its keys."""
    rows = q0 + gl.arange(0, BLOCK_Q, layout=row_l)
    row_ok = rows < S_q
    ks_in = gl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke_in = gl.load(ke_ptr + rows, mask=row_ok, other=0)
    ks = gl.minimum(gl.maximum(ks_in, 0), S_k)
    ke = gl.minimum(gl.maximum(ke_in, ks), S_k)
    if COMPRESSED:
        ke = gl.minimum(ke, ks + n_cols)
    if report:
        _report(err_ptr, ERR_START_NEGATIVE, row_ok & (ks_in < 0), rows)
        _report(err_ptr, ERR_INVERTED, row_ok & (ks_in > ke_in), rows)
        if COMPRESSED:
            _report(err_ptr, ERR_LONGER_THAN_ROW, row_ok & (gl.minimum(ke_in, S_k) - ks_in > n_cols), rows)
    has_keys = row_ok & (ks < ke)
    lo = gl.min(gl.where(has_keys, ks, S_k), axis=0)
    hi = gl.max(gl.where(has_keys, ke, 0), axis=0)
    empty = (n0 >= hi) | (n0 + BLOCK_N <= lo)
    return rows, ks, ke, empty


@gluon.jit
def _fill_skipped(rows, ks, ke, q0, n0, out_ptr, stride_out, S_q, S_k, CLEAN: gl.constexpr, COMPRESSED: gl.constexpr,
                  BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, mma: gl.constexpr):
    """A tile no row sees: no math, only the -inf of the full layout."""
    if CLEAN and not COMPRESSED:
        fill = gl.full((BLOCK_Q, BLOCK_N), float("-inf"), gl.float32, layout=mma)
        _store_tile(fill, rows, ks, ke, q0, n0, out_ptr, stride_out, S_q, S_k, False, False, mma)


@gluon.jit
def _load_first_queries(q_desc, q_smem, q_bars, q0, D: gl.constexpr, NUM_BUF: gl.constexpr):
    """Heads 0 .. NUM_BUF - 1 of the tile at row q0 into the ring (H >= NUM_BUF: the launcher checks)."""
    for i in gl.static_range(NUM_BUF):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q0, i * D], q_bars.index(i), q_smem.index(i))


@gluon.jit(do_not_specialize=_DYNAMIC, do_not_specialize_on_alignment=_SLICEABLE)
def prefill_logits_gluon_kernel(
    q_desc, k_desc, k_scale_ptr,
    w_ptr, stride_w,
    ks_ptr, ke_ptr,
    out_ptr, stride_out,
    S_q, S_k, n_cols, err_ptr,
    H: gl.constexpr, CLEAN: gl.constexpr, COMPRESSED: gl.constexpr, NUM_BUF: gl.constexpr,
    num_warps: gl.constexpr, REFILL_EVERY: gl.constexpr = 1,
    lin_desc=None, half_scale_ptr=None, LIN_PARTS: gl.constexpr = 0,
):
    BLOCK_Q: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    # Warps tile M in 16-row slabs; with more warps than slabs, the warpgroups split the keys
    # (fewer registers per score tile, at twice the shared-memory reads of the query tile).
    WARPS_M: gl.constexpr = BLOCK_Q // 16
    WARPS_N: gl.constexpr = num_warps // WARPS_M
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
        instr_shape=[16, BLOCK_N // WARPS_N, 256 // q_desc.dtype.primitive_bitwidth])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    pid_n = gl.program_id(0)
    pid_q = gl.program_id(1)
    q0 = pid_q * BLOCK_Q
    n0 = pid_n * BLOCK_N
    rows, ks, ke, empty = _tile_window(ks_ptr, ke_ptr, q0, n0, S_q, S_k, n_cols, err_ptr, pid_n == 0, COMPRESSED,
                                       BLOCK_Q, BLOCK_N, row_l)
    row_ok = rows < S_q
    if empty:
        _fill_skipped(rows, ks, ke, q0, n0, out_ptr, stride_out, S_q, S_k, CLEAN, COMPRESSED, BLOCK_Q, BLOCK_N,
                      mma)
    else:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF, BLOCK_Q, D], q_desc.layout)
        k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(k_bar, count=1)
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(q_bars.index(i), count=1)
        if LIN_PARTS > 0:  # the linear term's parts arrive with the key tile
            lin_smem = gl.allocate_shared_memory(lin_desc.dtype, [LIN_PARTS, BLOCK_Q, D], lin_desc.layout)
            mbarrier.expect(k_bar, k_desc.block_type.nbytes + LIN_PARTS * lin_desc.block_type.nbytes)
            for p in gl.static_range(LIN_PARTS):
                tma.async_copy_global_to_shared(lin_desc, [q0, p * D], k_bar, lin_smem.index(p))
        else:
            lin_smem = q_smem  # unused
            mbarrier.expect(k_bar, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n0, 0], k_bar, k_smem)
        _load_first_queries(q_desc, q_smem, q_bars, q0, D, NUM_BUF)

        w_rows = w_ptr + rows.to(gl.int64) * stride_w
        k_t = k_smem.permute((1, 0))
        mbarrier.wait(k_bar, phase=0)
        acc = _head_loop(q_desc, q_smem, q_bars, k_t, w_rows, row_ok, q0, H, D, NUM_BUF, BLOCK_Q, BLOCK_N, mma,
                         REFILL_EVERY, lin_smem, LIN_PARTS)
        mbarrier.invalidate(k_bar)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(q_bars.index(i))

        # Column vectors of the MMA layout hold 32 values per thread: built only now, so the
        # loop keeps its registers for the three [64, 128] tiles.
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
        acc = acc * gl.load(k_scale_ptr + cols, mask=cols < S_k, other=0.0)[None, :]
        if LIN_PARTS > 0:
            acc = acc * gl.load(half_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        _store_tile(acc, rows, ks, ke, q0, n0, out_ptr, stride_out, S_q, S_k, CLEAN, COMPRESSED, mma)


@functools.cache
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPE[dtype])


_launcher = Launcher(prefill_logits_gluon_kernel)
# Per launch key: the shared-memory layouts of the query and key tiles (checked once).
_layouts: dict[tuple, tuple] = {}


def _checked_layouts(key, d: int, h: int, dtype, block_q: int, block_n: int, num_warps: int, num_buf: int,
                     refill_every: int, n_parts: int, parts_dtype) -> tuple:
    if num_buf < 2 or num_buf > h:
        raise ValueError(f"gluon prefill: num_stages (query buffers) must be in 2..H={h}, got {num_buf}")
    if block_q not in (64, 128) or num_warps % (block_q // 16):
        raise ValueError(f"gluon prefill: block_q must be 64 or 128 with num_warps a multiple of block_q / 16, "
                         f"got block_q={block_q}, num_warps={num_warps}")
    if refill_every not in (1, 2) or (refill_every == 2 and num_buf < 3):
        raise ValueError(f"gluon prefill: refill_every must be 1, or 2 with num_buf >= 3, got {refill_every} "
                         f"(num_buf {num_buf})")
    if n_parts and (dtype != torch.float8_e4m3fn or parts_dtype != dtype):
        raise ValueError(f"gluon prefill: the linear-term parts run E4M3 queries only, got q {dtype}, "
                         f"parts {parts_dtype}")
    layouts = _layouts[key] = (_smem_layout((block_q, d), dtype), _smem_layout((block_n, d), dtype))
    return layouts


def launch(q, k, k_scale, weights, ks, ke, out, clean: bool, compressed: bool, err, block_q: int, block_n: int,
           num_warps: int, num_buf: int, refill_every: int = 1, lin_parts=None, half_scale=None) -> None:
    """q [S_q, H, D] and k [S_k, D] in E4M3 or f16, the rest as the Triton kernel takes them.
    ``refill_every``: query buffers refilled after every head (1) or two at a time (2, needs
    num_buf >= 3). ``lin_parts`` (E4M3 ``[S_q, P * D]``) and ``half_scale`` (fp32 ``[S_q]``):
    the linear term of ``relu_via_abs`` from ``linear_term_parts_kernel``, whose ``w / c`` is
    then ``weights``. ``err``: the device's error record."""
    s_q, h, d = q.shape
    s_k = k.shape[0]
    n_parts = 0 if lin_parts is None else lin_parts.shape[1] // d
    key = (d, h, q.dtype, block_q, block_n, num_warps, num_buf, refill_every, clean, compressed, n_parts,
           weights.dtype, out.dtype)
    layouts = _layouts.get(key)
    if layouts is None:
        layouts = _checked_layouts(key, d, h, q.dtype, block_q, block_n, num_warps, num_buf, refill_every, n_parts,
                                   None if lin_parts is None else lin_parts.dtype)
    q_layout, k_layout = layouts
    q_block = [block_q, d]
    # Rows of q may be padded (stride(0) >= H * D); heads and head dim are contiguous (checked).
    q_desc = host_descriptor(TensorDescriptor, q, [s_q, h * d], [q.stride(0), 1], q_block, layout=q_layout)
    k_desc = host_descriptor(TensorDescriptor, k, [s_k, d], [k.stride(0), 1], [block_n, d], layout=k_layout)
    lin_desc = q_desc
    if n_parts:
        lin_desc = host_descriptor(TensorDescriptor, lin_parts, [s_q, n_parts * d], [lin_parts.stride(0), 1], q_block,
                                   layout=q_layout)
    # num_warps is a parameter of the Gluon kernel: Triton takes the launch option from it
    _launcher(key, (-(-s_k // block_n), -(-s_q // block_q)), (
        q_desc, k_desc, k_scale, weights, weights.stride(0), ks, ke, out, out.stride(0), s_q, s_k, out.shape[1], err,
        h, clean, compressed, num_buf, num_warps, refill_every, lin_desc,
        half_scale if n_parts else err,  # (unused without the linear term: our own buffer, always aligned)
        n_parts), sized=_sized(block_q, block_n))


@functools.cache
def _sized(block_q: int, block_n: int):
    """How the launch follows the op's sizes ``(S_q, S_k, n_cols, out row stride)``
    (``tilefuse._jit.replay``): the grid, the size arguments, the rows of q, k and the linear term."""
    def sized(s_q, s_k, n_cols, stride_out):
        return (-(-s_k // block_n), -(-s_q // block_q)), (stride_out, s_q, s_k, n_cols), (s_q, s_k, s_q)

    return sized, (8, 9, 10, 11), (0, 1, 19)
