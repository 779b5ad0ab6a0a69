"""Hopper decode logits over a paged FP8 cache: a persistent, warp-specialised Gluon kernel
(private; ``paged.py`` is the op and picks it with ``PagedConfig(persistent=True)``).

Why. The other decode kernels (``_paged_kernel.py``, ``_paged_kernel_gluon.py``) run one
program per (request, chunk of pages) whose warps both issue the key loads and score them: a
program's loads wait behind its own epilogue and barriers, and its prologue (page ids,
queries, the first loads) is paid per chunk. Here, as in DeepGEMM's SM90 kernel, a fixed grid
of programs (``ctas_per_sm`` per SM) walks the batch's key tiles laid end to end, each
program an equal share, and inside a program a one-warp producer partition does every load
while a four-warp consumer partition only waits, multiplies and stores:

* producer: for each request it enters, the queries ``[next_n * H, D]`` by TMA into a
  two-slot ring, with the request's weights (as fp32), row ends, key count and tile count
  stored beside them; for each 64-key tile, the page ids (32 block-table entries read at a
  time by the warp's lanes), one TMA box of values and one of scales per page the tile
  covers into a ``NUM_BUF``-deep ring, and a flag per key saying whether its page is one (a
  key past the table's width or on a page id outside ``[0, num_blocks)`` reads row 0 of the
  view instead, and scores NaN);
* consumer: per tile, one wgmma of ``[64 keys, D] x [D, next_n * H]`` (keys on M, all query
  rows and heads on N), ReLU, weights, each row's head sum (in registers, shuffles across the
  quad), the key scales, and the stores from the MMA layout; then, when cleaning, its share
  of the ``-inf`` columns past each request's keys.

Nothing in a program's loop waits on another program or on a CTA barrier of the whole
program; two or three programs an SM interleave one's epilogue with another's MMA. Each
program finds its share itself from the lengths (one pass over them, or two past
``BLOCK_B`` requests), so ``schedule_meta`` is not read and cannot be stale. Results are
bitwise those of the other kernels' FP8 path: every key is an independent output column and
its logit is computed by the same operations in the same order.

The first program reports bad lengths and request ids; the producer reports the bad page
ids it meets, into the error record (``tilefuse._errors``).

Applies to: FP8, H a power of two, ``next_pow2(next_n) * H`` in [16, 256], D 32/64/128, pages of 32
tokens or a multiple of 64 (one box per page a tile covers: each lands 128-byte aligned in
shared memory, as TMA requires), queries whose rows are
evenly strided (a 2-D view ``[B * next_n * H, D]``), caches whose value rows and scales the
TMA views read; elsewhere ``paged.py`` runs another kernel. Like the other Gluon kernels it
has no interpreter: CPU tests compile it for sm_90a.
"""

from __future__ import annotations

import functools

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

from tilefuse._jit import Launcher, host_descriptor
from tilefuse.indexer._paged_kernel_gluon import (
    ERR_INDEX,
    ERR_LEN_NEGATIVE,
    ERR_LEN_PAST_TABLE,
    ERR_LEN_PAST_WIDTH,
    ERR_PAGE_ID,
    _head_sums,
    _report,
    _smem_layout,
)

# Keys per tile (the MMA's M side, one warpgroup) and the (row, head) columns one MMA takes.
KEYS_PER_TILE, MIN_DOT_COLUMNS, MAX_DOT_COLUMNS = 64, 16, 256  # (for the host)
BLOCK_N = gl.constexpr(KEYS_PER_TILE)
MIN_COLUMNS, MAX_COLUMNS = gl.constexpr(MIN_DOT_COLUMNS), gl.constexpr(MAX_DOT_COLUMNS)
# Requests a program's share search reads at a time.
BLOCK_B = gl.constexpr(1024)
# Registers of the producer warp (the consumer warpgroup gets the rest of the program's).
PRODUCER_REGS = gl.constexpr(40)

# A barrier of the calling partition's warps (triton 3.6 names it thread_barrier).
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _request_lengths(ctx_ptr, stride_ctx, b, ok, NEXT_N: gl.constexpr, CTX_2D: gl.constexpr):
    """Longest and shortest length of requests ``b`` (0 where not ``ok``); scalars or vectors."""
    longest = gl.load(ctx_ptr + b * stride_ctx, mask=ok, other=0)
    shortest = longest
    if CTX_2D:
        for t in gl.static_range(1, NEXT_N):
            n_t = gl.load(ctx_ptr + b * stride_ctx + t, mask=ok, other=0)
            longest = gl.maximum(longest, n_t)
            shortest = gl.minimum(shortest, n_t)
    return longest, shortest


@gluon.jit
def _work(longest, ok, max_context_len, CLEAN: gl.constexpr):
    """A request's keys (its longest row, clamped to the output), 64-key tiles and ``-inf``
    columns past its keys (when cleaning)."""
    key_len = gl.minimum(gl.maximum(longest, 0), max_context_len)
    tiles = (key_len + BLOCK_N - 1) // BLOCK_N
    if CLEAN:
        fill = gl.where(ok, max_context_len - key_len, 0)
    else:
        fill = key_len * 0
    return key_len, tiles, fill


@gluon.jit
def _locate(sizes, ok, carry, target, found, start):
    """One block of requests (``sizes`` of work, ``ok`` those that exist, ``carry`` work
    before the block) into the running count ``found`` of requests whose work ends at or
    before ``target`` and the largest such end ``start``; returns them and the carry after."""
    ends = carry + gl.associative_scan(sizes, 0, _add)
    before = ok & (ends <= target)
    found += gl.sum(before.to(gl.int32), axis=0)
    start = gl.maximum(start, gl.max(gl.where(before, ends, 0), axis=0))
    return found, start, carry + gl.sum(sizes, axis=0)


@gluon.jit
def _bounds(total, pid, programs):
    """Program ``pid``'s equal share ``[lo, hi)`` of ``total`` units of work."""
    return pid * total // programs, (pid + 1) * total // programs


@gluon.jit
def _block_work(ctx_ptr, stride_ctx, b, batch, max_context_len, NEXT_N: gl.constexpr, CTX_2D: gl.constexpr,
                CLEAN: gl.constexpr):
    """Requests ``b`` (a block): which exist, their longest and shortest lengths, and their work
    (tiles, ``-inf`` columns) as int64."""
    ok = b < batch
    longest, shortest = _request_lengths(ctx_ptr, stride_ctx, b.to(gl.int64), ok, NEXT_N, CTX_2D)
    _, tiles, fill = _work(longest, ok, max_context_len, CLEAN)
    return ok, longest, shortest, tiles.to(gl.int64), fill.to(gl.int64)


@gluon.jit
def _report_lengths(err_ptr, idx_ptr, b, ok, longest, shortest, batch, max_context_len, max_blocks,
                    BLOCK_KV: gl.constexpr, HAS_INDICES: gl.constexpr):
    """Bad lengths and request ids of requests ``b`` (a block) into the error record."""
    _report(err_ptr, ERR_LEN_NEGATIVE, ok & (shortest < 0), b)
    _report(err_ptr, ERR_LEN_PAST_WIDTH, ok & (longest > max_context_len), b)
    _report(err_ptr, ERR_LEN_PAST_TABLE, ok & (longest > max_blocks * BLOCK_KV), b)
    if HAS_INDICES:
        req = gl.load(idx_ptr + b, mask=ok, other=0)
        _report(err_ptr, ERR_INDEX, ok & ((req < 0) | (req >= batch)), req)


@gluon.jit
def _share(ctx_ptr, idx_ptr, err_ptr, batch, max_context_len, max_blocks, stride_ctx,
           NEXT_N: gl.constexpr, BLOCK_KV: gl.constexpr, CTX_2D: gl.constexpr, CLEAN: gl.constexpr,
           HAS_INDICES: gl.constexpr, num_warps: gl.constexpr):
    """This program's share of the batch's tiles (and of its ``-inf`` columns): the first
    request and the tile within it, the number of tiles, and the same for the columns. The
    first program also reports bad lengths and request ids."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    b_l: gl.constexpr = gl.BlockedLayout([BLOCK_B // (32 * num_warps)], [32], [num_warps], [0])
    rows = gl.arange(0, BLOCK_B, layout=b_l)
    zero = pid.to(gl.int64) * 0
    if batch <= BLOCK_B:  # one read of the lengths
        ok, longest, shortest, tiles, fill = _block_work(ctx_ptr, stride_ctx, rows, batch, max_context_len, NEXT_N,
                                                         CTX_2D, CLEAN)
        if pid == 0:
            _report_lengths(err_ptr, idx_ptr, rows, ok, longest, shortest, batch, max_context_len, max_blocks,
                            BLOCK_KV, HAS_INDICES)
        t_lo, t_hi = _bounds(gl.sum(tiles, axis=0), pid, programs)
        f_lo, f_hi = _bounds(gl.sum(fill, axis=0), pid, programs)
        found_t, start_t, _ = _locate(tiles, ok, zero, t_lo, pid * 0, zero)
        found_f, start_f, _ = _locate(fill, ok, zero, f_lo, pid * 0, zero)
    else:  # two: the totals (and the reports), then where the share starts
        total_t = zero
        total_f = zero
        for b0 in range(0, batch, BLOCK_B):
            ok, longest, shortest, tiles, fill = _block_work(ctx_ptr, stride_ctx, b0 + rows, batch, max_context_len,
                                                             NEXT_N, CTX_2D, CLEAN)
            total_t += gl.sum(tiles, axis=0)
            total_f += gl.sum(fill, axis=0)
            if pid == 0:
                _report_lengths(err_ptr, idx_ptr, b0 + rows, ok, longest, shortest, batch, max_context_len,
                                max_blocks, BLOCK_KV, HAS_INDICES)
        t_lo, t_hi = _bounds(total_t, pid, programs)
        f_lo, f_hi = _bounds(total_f, pid, programs)
        found_t = pid * 0
        found_f = found_t
        start_t = zero
        start_f = zero
        carry_t = zero
        carry_f = zero
        for b0 in range(0, batch, BLOCK_B):
            ok, _, _, tiles, fill = _block_work(ctx_ptr, stride_ctx, b0 + rows, batch, max_context_len, NEXT_N,
                                                CTX_2D, CLEAN)
            found_t, start_t, carry_t = _locate(tiles, ok, carry_t, t_lo, found_t, start_t)
            found_f, start_f, carry_f = _locate(fill, ok, carry_f, f_lo, found_f, start_f)
    return (found_t, (t_lo - start_t).to(gl.int32), (t_hi - t_lo).to(gl.int32),
            found_f, f_lo - start_f, f_hi - f_lo)


@gluon.jit
def _publish(q_desc, w_ptr, ctx_ptr, q_smem, w_smem, info_smem, rows_smem, q_ready, q_empty, b, longest, qc,
             max_context_len, stride_w, stride_ctx,
             NEXT_N: gl.constexpr, NEXT_N_P: gl.constexpr, NUM_HEADS: gl.constexpr, CTX_2D: gl.constexpr):
    """Request ``b`` (its longest row ``longest``) into slot ``qc % 2`` of the request ring
    (producer): its queries by TMA, its weights as fp32, its key count, tile count and row
    ends; returns the key and tile counts."""
    NC: gl.constexpr = NEXT_N_P * NUM_HEADS
    slot = qc % 2
    mbarrier.wait(q_empty.index(slot), ((qc // 2) & 1) ^ 1)
    # Arrival one of two: the queries' bytes (with next_n not a power of two, the box's last
    # rows are the next request's, or past the queries' end and zero: their weights are 0).
    mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [(b * NEXT_N * NUM_HEADS).to(gl.int32), 0], q_ready.index(slot),
                                    q_smem.index(slot))
    key_len = gl.minimum(gl.maximum(longest, 0), max_context_len)
    n_tiles = (key_len + BLOCK_N - 1) // BLOCK_N
    W_PER_LANE: gl.constexpr = NC // 32 if NC > 32 else 1
    w_l: gl.constexpr = gl.BlockedLayout([W_PER_LANE], [32], [1], [0])
    c = gl.arange(0, NC, layout=w_l)
    w = gl.load(w_ptr + (b * NEXT_N + c // NUM_HEADS) * stride_w + c % NUM_HEADS, mask=c // NUM_HEADS < NEXT_N,
                other=0.0).to(gl.float32)
    w_smem.index(slot).store(w)
    r_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    t = gl.arange(0, NEXT_N_P, layout=r_l)
    if CTX_2D:
        row_end = gl.load(ctx_ptr + b * stride_ctx + t, mask=t < NEXT_N, other=0)
    else:
        row_end = longest - NEXT_N + 1 + t
    rows_smem.index(slot).store(row_end)
    k = gl.arange(0, 4, layout=r_l)
    info = gl.where(k == 0, key_len, gl.where(k == 1, n_tiles, b.to(gl.int32)))
    info_smem.index(slot).store(info)
    # Arrival two: the stores above, made by every lane before it.
    _partition_barrier()
    mbarrier.arrive(q_ready.index(slot), count=1)
    return key_len, n_tiles


@gluon.jit
def _producer(q_desc, kv_desc, sf_desc, w_ptr, ctx_ptr, bt_ptr, err_ptr,
              k_smem, sf_smem, ok_smem, q_smem, w_smem, info_smem, rows_smem,
              k_ready, k_empty, q_ready, q_empty,
              b_first, i_first, count, batch, max_context_len, max_blocks, num_blocks, page_rows,
              stride_w, stride_ctx, stride_bt,
              NEXT_N: gl.constexpr, NEXT_N_P: gl.constexpr, NUM_HEADS: gl.constexpr, D: gl.constexpr,
              BLOCK_KV: gl.constexpr, CTX_2D: gl.constexpr, NUM_BUF: gl.constexpr):
    BOX: gl.constexpr = BLOCK_N if BLOCK_N < BLOCK_KV else BLOCK_KV
    PARTS: gl.constexpr = BLOCK_N // BOX
    SF_COL: gl.constexpr = BLOCK_KV * D // 4  # a page's first scale, in 4-byte words
    TILE_BYTES: gl.constexpr = BLOCK_N * D + BLOCK_N * 4
    lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    flag_l: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_l)
    key = gl.arange(0, BLOCK_N, layout=flag_l)
    if count > 0:
        b = b_first.to(gl.int64)
        i = i_first
        longest, _ = _request_lengths(ctx_ptr, stride_ctx, b, b < batch, NEXT_N, CTX_2D)
        key_len, n_tiles = _publish(q_desc, w_ptr, ctx_ptr, q_smem, w_smem, info_smem, rows_smem, q_ready, q_empty,
                                    b, longest, 0, max_context_len, stride_w, stride_ctx, NEXT_N, NEXT_N_P, NUM_HEADS,
                                    CTX_2D)
        qc = 1
        # 32 block-table entries of request b from page ``base`` on (a multiple of 32), read by
        # the lanes; a tile's pages lie in one such window.
        base = i * 0 - 64
        ids = lane * 0
        for step in range(count):
            buf = step % NUM_BUF
            mbarrier.wait(k_empty.index(buf), ((step // NUM_BUF) & 1) ^ 1)
            # Arrival one of two: the bytes the TMA copies below bring.
            mbarrier.expect(k_ready.index(buf), TILE_BYTES)
            first_page = i * BLOCK_N // BLOCK_KV
            if (first_page < base) | (first_page >= base + 32):
                base = first_page - first_page % 32
                entry = base + lane
                # Entries past the request's keys are not read.
                ids = gl.load(bt_ptr + b * stride_bt + entry,
                              mask=(entry < max_blocks) & (entry * BLOCK_KV < key_len), other=0)
            flags = key * 0
            for part in gl.static_range(PARTS):
                j0 = i * BLOCK_N + part * BOX
                page_idx = j0 // BLOCK_KV
                page = gl.sum(gl.where(lane == page_idx - base, ids, 0), axis=0)
                in_table = page_idx < max_blocks
                in_cache = (page >= 0) & (page < num_blocks)
                _report(err_ptr, ERR_PAGE_ID, in_table & (in_cache == 0), page)
                page_ok = in_table & in_cache
                flags = gl.where(key // BOX == part, page_ok.to(gl.int32), flags)
                row = gl.where(page_ok, page.to(gl.int64) * page_rows + j0 % BLOCK_KV, 0).to(gl.int32)
                if PARTS == 1:
                    tma.async_copy_global_to_shared(kv_desc, [row, 0], k_ready.index(buf), k_smem.index(buf))
                else:
                    tma.async_copy_global_to_shared(kv_desc, [row, 0], k_ready.index(buf),
                                                    k_smem.index(buf).slice(part * BOX, BOX))
                tma.async_copy_global_to_shared(sf_desc, [gl.where(page_ok, page, 0), SF_COL + j0 % BLOCK_KV],
                                                k_ready.index(buf), sf_smem.index(buf).slice(part, 1))
            ok_smem.index(buf).store(flags)
            # Arrival two: the flags, stored by every lane before it.
            _partition_barrier()
            mbarrier.arrive(k_ready.index(buf), count=1)
            i += 1
            if (i == n_tiles) & (step + 1 < count):
                # The next request with keys (one exists: the share has tiles left).
                b += 1
                i = 0
                longest, _ = _request_lengths(ctx_ptr, stride_ctx, b, b < batch, NEXT_N, CTX_2D)
                while (gl.minimum(longest, max_context_len) <= 0) & (b + 1 < batch):
                    b += 1
                    longest, _ = _request_lengths(ctx_ptr, stride_ctx, b, b < batch, NEXT_N, CTX_2D)
                key_len, n_tiles = _publish(q_desc, w_ptr, ctx_ptr, q_smem, w_smem, info_smem, rows_smem, q_ready,
                                            q_empty, b, longest, qc, max_context_len, stride_w, stride_ctx, NEXT_N,
                                            NEXT_N_P, NUM_HEADS, CTX_2D)
                qc += 1
                base = i * 0 - 64


@gluon.jit
def _take_request(q_ready, info_smem, qc, info_l: gl.constexpr):
    """Wait for slot ``qc % 2`` of the request ring (consumer): key count, tile count, request."""
    slot = qc % 2
    mbarrier.wait(q_ready.index(slot), (qc // 2) & 1)
    info = info_smem.index(slot).load(info_l)
    k = gl.arange(0, 4, layout=info_l)
    key_len = gl.sum(gl.where(k == 0, info, 0), axis=0)
    n_tiles = gl.sum(gl.where(k == 1, info, 0), axis=0)
    b = gl.sum(gl.where(k == 2, info, 0), axis=0).to(gl.int64)
    return key_len, n_tiles, b


@gluon.jit
def _part_of_request(w_smem, rows_smem, slot, T0: gl.constexpr, ROWS: gl.constexpr, NUM_HEADS: gl.constexpr,
                     col_l: gl.constexpr, row_l: gl.constexpr, num_warps: gl.constexpr):
    """The weights of query rows ``T0 .. T0 + ROWS`` (their columns) and their row ends (a scalar
    for one row) from slot ``slot`` of the request ring."""
    w = w_smem.index(slot).slice(T0 * NUM_HEADS, ROWS * NUM_HEADS).load(col_l)
    if ROWS == 1:
        row_end = gl.sum(rows_smem.index(slot).slice(T0, 1).load(gl.BlockedLayout([1], [32], [num_warps], [0])),
                         axis=0)
    else:
        row_end = rows_smem.index(slot).slice(T0, ROWS).load(row_l)
    return w, row_end


@gluon.jit
def _store_rows(s, w, sf, ok, j, b, key_len, row_end, out_ptr, stride_out, T0: gl.constexpr, ROWS: gl.constexpr,
                NEXT_N: gl.constexpr, NUM_HEADS: gl.constexpr, CLEAN: gl.constexpr, row_l: gl.constexpr):
    """Logits of query rows ``T0 .. T0 + ROWS`` of request ``b`` for the tile's keys ``j`` from their
    scores ``s`` ([keys, ROWS * NUM_HEADS]): ReLU, weights, head sums, key scales, the -inf
    outside each row's window (CLEAN), NaN for keys without a page; rows past next_n not stored."""
    logits = _head_sums(gl.maximum(s, 0.0) * w[None, :], ROWS, NUM_HEADS)
    if ROWS == 1:
        logits = logits * sf
        if CLEAN:
            logits = gl.where(j < row_end, logits, float("-inf"))
        # A key without a page (past the table's width, or a page id outside the cache): NaN.
        logits = gl.where(ok != 0, logits, float("nan"))
        if T0 < NEXT_N:
            gl.store(out_ptr + (b * NEXT_N + T0) * stride_out + j, logits.to(out_ptr.dtype.element_ty),
                     mask=j < key_len)
    else:
        t = T0 + gl.arange(0, ROWS, layout=row_l)
        logits = logits * sf[:, None]
        if CLEAN:
            logits = gl.where(j[:, None] < row_end[None, :], logits, float("-inf"))
        logits = gl.where((ok != 0)[:, None], logits, float("nan"))
        out_rows = out_ptr + (b * NEXT_N + t) * stride_out
        gl.store(out_rows[None, :] + j[:, None], logits.to(out_ptr.dtype.element_ty),
                 mask=(j < key_len)[:, None] & (t < NEXT_N)[None, :])


@gluon.jit
def _first_half_out(k_smem, q_smem, sf_view, ok_smem, w_smem, rows_smem, s0, s1, buf, slot, i, b, key_len, out_ptr,
                    stride_out, HALF: gl.constexpr, ROWS_H: gl.constexpr, NEXT_N: gl.constexpr,
                    NUM_HEADS: gl.constexpr, CLEAN: gl.constexpr, col_l: gl.constexpr, key_l: gl.constexpr,
                    row_l: gl.constexpr, num_warps: gl.constexpr):
    """With SPLIT: tile ``i`` (ring buffer ``buf``, request slot ``slot``) has its second half's
    MMA issued into ``s1``, then its first half's logits (``s0``, done) stored under it; returns
    the MMA in flight and the tile's key scales, page flags and keys."""
    s1 = warpgroup_mma(k_smem.index(buf), q_smem.index(slot).slice(HALF, HALF).permute((1, 0)), s1, use_acc=False,
                       is_async=True)
    sf = sf_view.index(buf).load(key_l)
    ok = ok_smem.index(buf).load(key_l)
    j = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
    w, row_end = _part_of_request(w_smem, rows_smem, slot, 0, ROWS_H, NUM_HEADS, col_l, row_l, num_warps)
    _store_rows(s0, w, sf, ok, j, b, key_len, row_end, out_ptr, stride_out, 0, ROWS_H, NEXT_N, NUM_HEADS, CLEAN, row_l)
    return s1, sf, ok, j


@gluon.jit
def _consumer(k_smem, sf_smem, ok_smem, q_smem, w_smem, info_smem, rows_smem,
              k_ready, k_empty, q_ready, q_empty, ctx_ptr, out_ptr,
              i_first, count, bf_first, cf_first, f_count, batch, max_context_len, stride_ctx, stride_out,
              NEXT_N: gl.constexpr, NEXT_N_P: gl.constexpr, NUM_HEADS: gl.constexpr, CTX_2D: gl.constexpr,
              CLEAN: gl.constexpr, NUM_BUF: gl.constexpr, BLOCK_FILL: gl.constexpr, SPLIT: gl.constexpr,
              num_warps: gl.constexpr):
    NC: gl.constexpr = NEXT_N_P * NUM_HEADS
    info_l: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    sf_view = sf_smem._reinterpret(gl.float32, [NUM_BUF, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # An MMA's columns (all, or with SPLIT half of them) and the query rows they hold.
    COLS: gl.constexpr = NC // (1 + SPLIT)
    ROWS_P: gl.constexpr = NEXT_N_P // (1 + SPLIT)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, COLS, 32])
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    out_l: gl.constexpr = _head_sums(gl.zeros([BLOCK_N, COLS], gl.float32, mma), ROWS_P, NUM_HEADS).type.layout
    if ROWS_P == 1:
        key_l: gl.constexpr = out_l
        row_l: gl.constexpr = out_l  # (unused)
    else:
        key_l: gl.constexpr = gl.SliceLayout(1, out_l)
        row_l: gl.constexpr = gl.SliceLayout(0, out_l)
    if SPLIT:
        # The columns in two halves, each the heads of half the rows: one half's MMA in flight
        # under the other half's epilogue (tile t's second half under its first half's, tile
        # t + 1's first half under tile t's second half's), never one across the loop's end.
        HALF: gl.constexpr = COLS
        ROWS_H: gl.constexpr = ROWS_P
        if count > 0:
            # (a half's weights and row ends are read from the request's slot at its epilogue,
            # not held: the slot of a request is handed back after its last tile's second half)
            i = i_first
            key_len, n_tiles, b = _take_request(q_ready, info_smem, 0, info_l)
            slot = 0
            qc = 1
            s0 = gl.zeros([BLOCK_N, HALF], gl.float32, mma)
            s1 = gl.zeros([BLOCK_N, HALF], gl.float32, mma)
            mbarrier.wait(k_ready.index(0), 0)
            s0 = warpgroup_mma(k_smem.index(0), q_smem.index(0).slice(0, HALF).permute((1, 0)), s0, use_acc=False,
                               is_async=True)
            s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, ))
            for step in range(count - 1):
                buf = step % NUM_BUF
                s1, sf, ok, j = _first_half_out(k_smem, q_smem, sf_view, ok_smem, w_smem, rows_smem, s0, s1, buf, slot,
                                                i, b, key_len, out_ptr, stride_out, HALF, ROWS_H, NEXT_N, NUM_HEADS,
                                                CLEAN, col_l, key_l, row_l, num_warps)
                s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s1, ))
                # Every warp has read the buffer (both MMAs done) before it is handed back.
                _partition_barrier()
                mbarrier.arrive(k_empty.index(buf), count=1)
                b_prev, len_prev, slot_prev = b, key_len, slot
                i += 1
                if i == n_tiles:
                    key_len, n_tiles, b = _take_request(q_ready, info_smem, qc, info_l)
                    slot = qc % 2
                    qc += 1
                    i = 0
                nbuf = (step + 1) % NUM_BUF
                mbarrier.wait(k_ready.index(nbuf), ((step + 1) // NUM_BUF) & 1)
                s0 = warpgroup_mma(k_smem.index(nbuf), q_smem.index(slot).slice(0, HALF).permute((1, 0)), s0,
                                   use_acc=False, is_async=True)
                w, row_end = _part_of_request(w_smem, rows_smem, slot_prev, ROWS_H, ROWS_H, NUM_HEADS, col_l, row_l,
                                              num_warps)
                _store_rows(s1, w, sf, ok, j, b_prev, len_prev, row_end, out_ptr, stride_out, ROWS_H, ROWS_H, NEXT_N,
                            NUM_HEADS, CLEAN, row_l)
                if slot != slot_prev:  # the previous request's slot, read for the last time above
                    _partition_barrier()
                    mbarrier.arrive(q_empty.index(slot_prev), count=1)
                s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, ))
            # The share's last tile.
            s1, sf, ok, j = _first_half_out(k_smem, q_smem, sf_view, ok_smem, w_smem, rows_smem, s0, s1,
                                            (count - 1) % NUM_BUF, slot, i, b, key_len, out_ptr, stride_out, HALF,
                                            ROWS_H, NEXT_N, NUM_HEADS, CLEAN, col_l, key_l, row_l, num_warps)
            s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s1, ))
            w, row_end = _part_of_request(w_smem, rows_smem, slot, ROWS_H, ROWS_H, NUM_HEADS, col_l, row_l, num_warps)
            _store_rows(s1, w, sf, ok, j, b, key_len, row_end, out_ptr, stride_out, ROWS_H, ROWS_H, NEXT_N, NUM_HEADS,
                        CLEAN, row_l)
    else:
        if count > 0:
            i = i_first
            key_len, n_tiles, b = _take_request(q_ready, info_smem, 0, info_l)
            w, row_end = _part_of_request(w_smem, rows_smem, 0, 0, NEXT_N_P, NUM_HEADS, col_l, row_l, num_warps)
            qc = 1
            s = gl.zeros([BLOCK_N, NC], gl.float32, mma)
            for step in range(count):
                buf = step % NUM_BUF
                slot = (qc - 1) % 2
                mbarrier.wait(k_ready.index(buf), (step // NUM_BUF) & 1)
                s = warpgroup_mma(k_smem.index(buf), q_smem.index(slot).permute((1, 0)), s, use_acc=False,
                                  is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                sf = sf_view.index(buf).load(key_l)
                ok = ok_smem.index(buf).load(key_l)
                # Every warp has read the buffer before it is handed back.
                _partition_barrier()
                mbarrier.arrive(k_empty.index(buf), count=1)
                j = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
                _store_rows(s, w, sf, ok, j, b, key_len, row_end, out_ptr, stride_out, 0, NEXT_N_P, NEXT_N, NUM_HEADS,
                            CLEAN, row_l)
                i += 1
                if (i == n_tiles) & (step + 1 < count):
                    _partition_barrier()
                    mbarrier.arrive(q_empty.index(slot), count=1)
                    key_len, n_tiles, b = _take_request(q_ready, info_smem, qc, info_l)
                    w, row_end = _part_of_request(w_smem, rows_smem, qc % 2, 0, NEXT_N_P, NUM_HEADS, col_l, row_l,
                                                  num_warps)
                    qc += 1
                    i = 0
    if CLEAN:
        # This program's share of the -inf columns past each request's keys.
        FILL_PER_LANE: gl.constexpr = BLOCK_FILL // (32 * num_warps) if BLOCK_FILL > 32 * num_warps else 1
        fill_l: gl.constexpr = gl.BlockedLayout([1, FILL_PER_LANE], [1, 32], [1, num_warps], [1, 0])
        f = gl.arange(0, BLOCK_FILL, layout=gl.SliceLayout(0, fill_l))
        tf = gl.arange(0, NEXT_N_P, layout=gl.SliceLayout(1, fill_l))
        fill = gl.full([NEXT_N_P, BLOCK_FILL], float("-inf"), out_ptr.dtype.element_ty, fill_l)
        bf = bf_first.to(gl.int64)
        col = cf_first
        left = f_count
        while (left > 0) & (bf < batch):
            longest, _ = _request_lengths(ctx_ptr, stride_ctx, bf, bf < batch, NEXT_N, CTX_2D)
            lo = gl.minimum(gl.maximum(longest, 0), max_context_len) + col
            hi = gl.minimum(lo + left, max_context_len)
            rows = out_ptr + (bf * NEXT_N + tf) * stride_out
            for c0 in range(lo, hi, BLOCK_FILL):
                cols = c0 + f
                gl.store(rows[:, None] + cols[None, :], fill, mask=(tf < NEXT_N)[:, None] & (cols < hi)[None, :])
            left -= hi - lo
            bf += 1
            col = col * 0


@gluon.jit(do_not_specialize=("w_ptr", "ctx_ptr", "bt_ptr", "idx_ptr", "out_ptr", "err_ptr", "batch",
                              "max_context_len", "max_blocks", "num_blocks", "page_rows", "stride_w", "stride_ctx",
                              "stride_bt", "stride_out"))
def paged_logits_ws_kernel(
    q_desc, kv_desc, sf_desc, w_ptr, ctx_ptr, bt_ptr, idx_ptr, out_ptr, err_ptr,
    batch, max_context_len, max_blocks, num_blocks, page_rows,
    stride_w, stride_ctx, stride_bt, stride_out,
    NEXT_N: gl.constexpr, NEXT_N_P: gl.constexpr, NUM_HEADS: gl.constexpr, D: gl.constexpr,
    BLOCK_KV: gl.constexpr, CTX_2D: gl.constexpr, CLEAN: gl.constexpr, HAS_INDICES: gl.constexpr,
    NUM_BUF: gl.constexpr, BLOCK_FILL: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "one consumer warpgroup")
    gl.static_assert(not SPLIT or NEXT_N_P >= 2, "columns split by query rows")
    NC: gl.constexpr = NEXT_N_P * NUM_HEADS
    gl.static_assert(NC >= MIN_COLUMNS and NC <= MAX_COLUMNS, "16 to 256 (row, head) columns")
    BOX: gl.constexpr = BLOCK_N if BLOCK_N < BLOCK_KV else BLOCK_KV
    PARTS: gl.constexpr = BLOCK_N // BOX
    # (a TMA copy's shared destination is 128-byte aligned: each part's scale box starts there)
    gl.static_assert(PARTS == 1 or BOX * 4 % 128 == 0, "pages of at least 32 tokens")
    b_first, i_first, count, bf_first, cf_first, f_count = _share(
        ctx_ptr, idx_ptr, err_ptr, batch, max_context_len, max_blocks, stride_ctx, NEXT_N, BLOCK_KV, CTX_2D, CLEAN,
        HAS_INDICES, num_warps)

    # Ring slots of 1-D buffers: a rank-1 layout (the leading dimension indexes the slot).
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    k_smem = gl.allocate_shared_memory(kv_desc.dtype, [NUM_BUF, BLOCK_N, D], kv_desc.layout)
    sf_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, PARTS, BOX], sf_desc.layout)
    ok_smem = gl.allocate_shared_memory(gl.int32, [NUM_BUF, BLOCK_N], plain)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, NC, D], q_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [2, NC], plain)
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 4], plain)
    rows_smem = gl.allocate_shared_memory(gl.int32, [2, NEXT_N_P], plain)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # The ready barriers complete on the producer's two arrivals (one with the TMA bytes);
    # the empty ones on the consumer's one.
    for n in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(n), count=2)
        mbarrier.init(k_empty.index(n), count=1)
    for n in gl.static_range(2):
        mbarrier.init(q_ready.index(n), count=2)
        mbarrier.init(q_empty.index(n), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (k_smem, sf_smem, ok_smem, q_smem, w_smem, info_smem, rows_smem, k_ready, k_empty, q_ready,
                     q_empty, ctx_ptr, out_ptr, i_first, count, bf_first, cf_first, f_count, batch, max_context_len,
                     stride_ctx, stride_out, NEXT_N, NEXT_N_P, NUM_HEADS, CTX_2D, CLEAN, NUM_BUF, BLOCK_FILL, SPLIT,
                     num_warps)),
        (_producer, (q_desc, kv_desc, sf_desc, w_ptr, ctx_ptr, bt_ptr, err_ptr, k_smem, sf_smem, ok_smem, q_smem,
                     w_smem, info_smem, rows_smem, k_ready, k_empty, q_ready, q_empty, b_first, i_first, count,
                     batch, max_context_len, max_blocks, num_blocks, page_rows, stride_w, stride_ctx, stride_bt, NEXT_N,
                     NEXT_N_P, NUM_HEADS, D, BLOCK_KV, CTX_2D, NUM_BUF)),
    ], [1], [PRODUCER_REGS])


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------
@functools.cache
def _scales_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def q_descriptor(q2d, rows: int, d: int, row_stride: int, columns: int):
    """The queries viewed as ``[rows, d]`` E4M3 rows (row stride ``row_stride``), a request's
    ``columns`` rows a box (laid out as the key values, ``kv_descriptor``)."""
    return host_descriptor(TensorDescriptor, q2d, [rows, d], [row_stride, 1], [columns, d], layout=_smem_layout(d))


def sf_descriptor(words, num_blocks: int, page_words: int, data_words: int, box: int):
    """The cache as fp32 words ``[num_blocks, data_words]`` (row stride ``page_words``): a page's
    scales are words ``block_kv * D / 4`` on; boxes of ``box`` scales."""
    return host_descriptor(TensorDescriptor, words, [num_blocks, data_words], [page_words, 1], [1, box],
                           layout=_scales_layout())


launcher = Launcher(paged_logits_ws_kernel)
arg_names = launcher.arg_names
