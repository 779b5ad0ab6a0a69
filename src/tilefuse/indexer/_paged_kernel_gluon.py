"""Hopper decode logits over a paged FP8 cache with the key-tile loop written in Gluon (private;
``paged.py`` is the op and picks this kernel with ``PagedConfig(gluon=True)``).

Why. ``paged_logits_kernel`` (``_paged_kernel.py``) runs each key tile as one serial chain:
its ``tl.dot`` is waited for right after issue (Triton waits for a non-accumulating dot before
anything else runs), then the ReLU, weights and head sum, a shared-memory round trip of the
head sums to the store's layout, and the store; the next tile's MMA cannot start before that
store. Here the MMAs are issued asynchronously: tile t's wgmma runs on the tensor cores while
the warps apply, scale and store tile t-1's scores (benchmarks/NOTES.md, "Decode: where a
program's ~1 us per tile goes").

Same grid, schedule, tile order and contract as the Triton kernel: one program per (row group,
request, chunk of pages), every key an independent output column, the chunk's page ids read
once (a tile's page id is a masked sum over that vector, one warp reduction), the same
clamping (a key past the table's width or on a page id outside ``[0, num_blocks)`` reads row 0
of the view and scores NaN; lengths clamped to the output width), the same error reports, the
``-inf`` fill when cleaning, the same runtime (unspecialised) integer arguments.

The tile. 64 keys on the MMA's M side, the program's ``ROWS * HEADS_P`` (query row, head)
columns on its N side (16 to 128), K = D; one warpgroup (4 warps), or with ``num_warps=8``
and an even number of rows two warpgroups, each with the columns of half of the rows (half
the score registers a thread). The queries are
loaded once with pointer loads into an NVMMA shared buffer, the B operand of every MMA.
Key values come by TMA from a host descriptor over the cache viewed as rows of D bytes (page
``p``'s values are rows ``p * page_bytes / D`` on) into a ring of ``NUM_BUF`` buffers, one
mbarrier each, the first ``NUM_BUF`` tiles requested before the loop; a tile on pages smaller
than 64 tokens is one box per page into the matching rows of its buffer. Key scales keep
the pointer load, issued four tiles ahead of their use.

The loop keeps exactly one MMA in flight and waits for zero outstanding groups, the pattern
ptxas keeps asynchronous (``_prefill_kernel_gluon.py``): wait for tile t's buffer, issue its
MMA over the score tile whose values were consumed last (``use_acc=False``), refill tile
t-1's buffer (its MMA is done) with tile ``t - 1 + NUM_BUF``, apply and store tile t-1's
scores, then wait. Unrolled by two with two score tiles, so no accumulator is copied while an
MMA runs. The refill comes after the issue so that nothing but the wait for the keys stands
between one MMA's end and the next one's start (refilled before the issue, ptxas moved the
ReLU and weights of the finished tile into that gap, out from under the next MMA). The
per-key head sums are stored straight from the MMA layout (of the four lanes of a quad
holding a key's sum, one stores it), without the layout change through shared memory. The
queries, weights and row ends are loaded before the first key requests, which wait for the
page ids.

Not supported here (``paged.py`` runs the Triton kernel instead): MX formats, tiles other
than 64 keys, more than 128 dot columns, cache layouts without the TMA view (a page stride
that is not a multiple of D, an unaligned offset, pages that are neither a multiple of 64
tokens nor 8, 16 or 32), GPUs other than sm_90, and the CPU interpreter (Gluon has none:
importing this module under ``TRITON_INTERPRET=1`` works, launching does not; CPU tests
compile it for sm_90a).
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

from tilefuse import _errors as E
from tilefuse._jit import Launcher, host_descriptor
from tilefuse.indexer._paged_kernel import DYNAMIC_ARGS

ERR_LEN_NEGATIVE = gl.constexpr(E.CONTEXT_LEN_NEGATIVE)
ERR_LEN_PAST_WIDTH = gl.constexpr(E.CONTEXT_LEN_PAST_WIDTH)
ERR_LEN_PAST_TABLE = gl.constexpr(E.CONTEXT_LEN_PAST_TABLE)
ERR_PAGE_ID = gl.constexpr(E.PAGE_ID_OUT_OF_RANGE)
ERR_INDEX = gl.constexpr(E.INDEX_OUT_OF_RANGE)

# Keys per tile (the MMA's M side, one warpgroup) and the widest (row, head) side it takes.
BLOCK_N = 64
MAX_COLUMNS = 128


def num_warps_for(rows: int, columns: int, asked: int) -> int:
    """Warps of a launch: 8 (two warpgroups, each with half of the columns: whole query rows)
    where ``asked`` is 8 or more and the rows split evenly, else 4."""
    return 8 if asked >= 8 and rows % 2 == 0 and columns >= 32 else 4


@gluon.jit
def _report(err_ptr, CODE: gl.constexpr, bad, detail):
    """``_errors_kernel.report_error`` for Gluon: mark error ``CODE`` with ``detail`` where ``bad``."""
    zero = detail * 0
    gl.store(err_ptr + 2 * CODE + zero, zero + 1, mask=bad)
    gl.store(err_ptr + 2 * CODE + 1 + zero, detail, mask=bad)


@gluon.jit
def _page_of(ids, slots, first_page, j0, max_blocks, num_blocks, BLOCK_KV: gl.constexpr,
             MAX_CHUNK_PAGES: gl.constexpr):
    """Page id of key ``j0`` (int64, one warp reduction over the chunk's ids) and whether it is
    one: inside the table's width and inside the cache."""
    page_idx = j0 // BLOCK_KV
    # Clamped so that tiles past the chunk's end (whose loads are masked) stay in range.
    slot = gl.minimum(gl.maximum(page_idx - first_page, 0), MAX_CHUNK_PAGES - 1)
    page = gl.sum(gl.where(slots == slot, ids, 0), axis=0).to(gl.int64)
    page_ok = (page_idx < max_blocks) & (page >= 0) & (page < num_blocks)
    return page, page_ok


@gluon.jit
def _request_tile(kv_desc, k_smem, bars, ids, slots, first_page, tile, max_blocks, num_blocks, page_rows,
                  BLOCK_KV: gl.constexpr, MAX_CHUNK_PAGES: gl.constexpr, NUM_BUF: gl.constexpr, i):
    """TMA of key tile ``tile`` (the program's ``i``-th) into buffer ``i % NUM_BUF``: one box per
    page it covers; a key without a page reads row 0 of the view (and scores NaN)."""
    BN: gl.constexpr = k_smem.shape[1]
    BOX_N: gl.constexpr = kv_desc.block_type.shape[0]
    buf = i % NUM_BUF
    bar = bars.index(buf)
    mbarrier.expect(bar, BN * kv_desc.block_type.shape[1] * kv_desc.dtype.primitive_bitwidth // 8)
    for part in gl.static_range(BN // BOX_N):
        j0 = tile * BN + part * BOX_N
        page, page_ok = _page_of(ids, slots, first_page, j0, max_blocks, num_blocks, BLOCK_KV, MAX_CHUNK_PAGES)
        row = gl.where(page_ok, page * page_rows + j0 % BLOCK_KV, 0).to(gl.int32)
        if BN == BOX_N:
            tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, k_smem.index(buf))
        else:
            tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, k_smem.index(buf).slice(part * BOX_N, BOX_N))


@gluon.jit
def _refill(kv_desc, k_smem, bars, ids, slots, first_page, t_lo, n_tiles, max_blocks, num_blocks, page_rows,
            BLOCK_KV: gl.constexpr, MAX_CHUNK_PAGES: gl.constexpr, NUM_BUF: gl.constexpr, i):
    """Tile ``i``'s MMA is done: its buffer takes tile ``i + NUM_BUF``, if the chunk has one."""
    later = i + NUM_BUF
    if later < n_tiles:
        _request_tile(kv_desc, k_smem, bars, ids, slots, first_page, t_lo + later, max_blocks, num_blocks,
                      page_rows, BLOCK_KV, MAX_CHUNK_PAGES, NUM_BUF, later)


@gluon.jit
def _issue(k_smem, bars, q_t, s, i, NUM_BUF: gl.constexpr):
    """Start tile ``i``'s MMA once its keys have landed; overwrites ``s`` (already consumed)."""
    buf = i % NUM_BUF
    mbarrier.wait(bars.index(buf), phase=(i // NUM_BUF) & 1)
    return warpgroup_mma(k_smem.index(buf), q_t, s, use_acc=False, is_async=True)


@gluon.jit
def _key_scales(sf_ptr, ids, slots, first_page, tile, hi_tok, max_blocks, num_blocks, page_words,
                BLOCK_N: gl.constexpr, BLOCK_KV: gl.constexpr, MAX_CHUNK_PAGES: gl.constexpr, layout: gl.constexpr):
    """The fp32 scales of tile ``tile``'s keys (``sf_ptr``: the first page's first scale), 0 past
    ``hi_tok`` and for keys without a page (nothing is read for those)."""
    BOX_N: gl.constexpr = BLOCK_N if BLOCK_N < BLOCK_KV else BLOCK_KV
    k = gl.arange(0, BLOCK_N, layout=layout)
    ok = tile * BLOCK_N + k < hi_tok
    if BOX_N == BLOCK_N:
        j0 = tile * BLOCK_N
        page, page_ok = _page_of(ids, slots, first_page, j0, max_blocks, num_blocks, BLOCK_KV, MAX_CHUNK_PAGES)
        offs = page * page_words + (j0 % BLOCK_KV + k)
        ok = ok & page_ok
    else:
        offs = gl.zeros([BLOCK_N], gl.int64, layout=layout)
        for part in gl.static_range(BLOCK_N // BOX_N):
            j0 = tile * BLOCK_N + part * BOX_N
            page, page_ok = _page_of(ids, slots, first_page, j0, max_blocks, num_blocks, BLOCK_KV, MAX_CHUNK_PAGES)
            other = (k // BOX_N) != part
            offs = gl.where(other, offs, page * page_words + (j0 % BLOCK_KV - part * BOX_N + k))
            ok = ok & (other | page_ok)
    return gl.load(sf_ptr + offs, mask=ok, other=0.0)


@gluon.jit
def _head_sums(x, ROWS: gl.constexpr, HEADS_P: gl.constexpr):
    """[keys, ROWS * HEADS_P] -> the sum over each query row's heads: [keys] for one row (the
    MMA layout's row slice), else [keys, ROWS] (a layout inferred from the reshape, no value
    held twice by a thread)."""
    if ROWS == 1:
        out = gl.sum(x, axis=1)
    else:
        out = gl.sum(gl.reshape(x, [x.shape[0], ROWS, HEADS_P]), axis=2)
    return out


@gluon.jit
def _store_tile(s, w, sf, tile, ids, slots, first_page, hi_tok, max_blocks, num_blocks, row_end, row_ok, out_rows,
                ROWS: gl.constexpr, HEADS_P: gl.constexpr, BLOCK_KV: gl.constexpr, MAX_CHUNK_PAGES: gl.constexpr,
                CLEAN: gl.constexpr):
    """Logits of tile ``tile`` from its scores ``s``: ReLU, weights, head sums, key scales, the
    -inf outside each row's window (``CLEAN``), NaN for keys without a page; stored below ``hi_tok``."""
    BLOCK_N: gl.constexpr = s.shape[0]
    BOX_N: gl.constexpr = BLOCK_N if BLOCK_N < BLOCK_KV else BLOCK_KV
    logits = _head_sums(gl.maximum(s, 0.0) * w[None, :], ROWS, HEADS_P)
    if ROWS == 1:  # [keys]; the row's values are scalars
        j = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=logits.type.layout)
        logits = logits * sf
        if CLEAN:
            logits = gl.where(j < row_end, logits, float("-inf"))
    else:  # [keys, ROWS]
        j = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, logits.type.layout))
        logits = logits * sf[:, None]
        if CLEAN:
            logits = gl.where(j[:, None] < row_end[None, :], logits, float("-inf"))
    # A key without a page (past the table's width, or a page id outside the cache): NaN.
    for part in gl.static_range(BLOCK_N // BOX_N):
        _, page_ok = _page_of(ids, slots, first_page, tile * BLOCK_N + part * BOX_N, max_blocks, num_blocks,
                              BLOCK_KV, MAX_CHUNK_PAGES)
        if BOX_N == BLOCK_N:
            logits = gl.where(page_ok, logits, float("nan"))
        else:
            keep = (((j % BLOCK_N) // BOX_N) != part) | page_ok
            logits = gl.where(keep if ROWS == 1 else keep[:, None], logits, float("nan"))
    if ROWS == 1:
        gl.store(out_rows + j, logits.to(out_rows.dtype.element_ty), mask=(j < hi_tok) & row_ok)
    else:
        gl.store(out_rows[None, :] + j[:, None], logits.to(out_rows.dtype.element_ty),
                 mask=(j < hi_tok)[:, None] & row_ok[None, :])


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def paged_logits_gluon_kernel(
    q_ptr, q_sf_ptr, kv_cache_ptr, w_ptr, ctx_ptr, bt_ptr, idx_ptr, out_ptr, err_ptr,
    batch, max_context_len, max_blocks, num_blocks, chunk_pages, chunks_per_request,
    stride_qb, stride_qt, stride_qh,
    stride_sfb, stride_sft,
    stride_w, stride_ctx, stride_bt,
    page_units, stride_out,
    kv_desc,
    NEXT_N: gl.constexpr, NEXT_N_P: gl.constexpr, NUM_HEADS: gl.constexpr, HEADS_P: gl.constexpr,
    D: gl.constexpr, BLOCK_KV: gl.constexpr, CTX_2D: gl.constexpr, CLEAN: gl.constexpr,
    HAS_INDICES: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, MAX_CHUNK_PAGES: gl.constexpr,
    PAGE_UNIT: gl.constexpr, Q_UNIT: gl.constexpr, BLOCK_FILL: gl.constexpr, NUM_BUF: gl.constexpr,
    G: gl.constexpr, num_warps: gl.constexpr,
):
    # The arguments are paged_logits_kernel's (q_sf_ptr and the scale strides unused: FP8
    # only), with the key descriptor first among the constants and the ring depth NUM_BUF.
    # One warpgroup, or two splitting the columns (each then holds whole query rows).
    WARPS_N: gl.constexpr = num_warps // 4
    gl.static_assert(num_warps == 4 * WARPS_N and (WARPS_N == 1 or (WARPS_N == 2 and ROWS % 2 == 0)),
                     "4 warps, or 8 with an even number of rows")
    gl.static_assert(BLOCK_N == 64, "64-key tiles")
    gl.static_assert(NUM_BUF >= 2, "tile i's keys are requested before tile i-1's MMA is issued")
    NC: gl.constexpr = ROWS * HEADS_P  # dot columns: (query row, head) pairs
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS_N],
                                                  instr_shape=[16, NC // WARPS_N, 32])
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    # The layout of a tile's head sums (``_head_sums``): with one row, the keys' vector; else
    # [keys, rows], key vectors in its slice 1, row vectors in its slice 0.
    out_l: gl.constexpr = _head_sums(gl.zeros([BLOCK_N, NC], gl.float32, mma), ROWS, HEADS_P).type.layout
    key_l: gl.constexpr = out_l if ROWS == 1 else gl.SliceLayout(1, out_l)
    # The page ids whole in every warp: their reductions stay in a warp.
    IDS_PER_LANE: gl.constexpr = MAX_CHUNK_PAGES // 32 if MAX_CHUNK_PAGES > 32 else 1
    ids_l: gl.constexpr = gl.BlockedLayout([IDS_PER_LANE], [32], [num_warps], [0])
    TPW_D: gl.constexpr = D // 16  # lanes along a query row (16 bytes each)
    q_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_D, TPW_D], [num_warps, 1], [1, 0])

    kv_sf_ptr = kv_cache_ptr.to(gl.pointer_type(gl.float32), bitcast=True)
    pid = gl.program_id(0)
    pid_g = pid % G
    unit = pid // G
    b64 = (unit // chunks_per_request).to(gl.int64)
    chunk_idx = unit % chunks_per_request
    chunk = chunk_pages * BLOCK_KV
    chunk_lo = chunk_idx * chunk
    # The chunk's page ids, read once beside the length (see _paged_kernel.py).
    bt_row = bt_ptr + b64 * stride_bt
    first_page = chunk_lo // BLOCK_KV
    slots = gl.arange(0, MAX_CHUNK_PAGES, layout=ids_l)
    chunk_page_ids = first_page + slots
    chunk_pages_ok = (slots < chunk_pages) & (chunk_page_ids < max_blocks)
    ids = gl.load(bt_row + chunk_page_ids, mask=chunk_pages_ok, other=0)
    # Scalar loads of the lengths, not a reduced vector: the loop's bounds then stay uniform
    # (see _paged_kernel._key_extent).
    longest = gl.load(ctx_ptr + b64 * stride_ctx)
    shortest = longest
    if CTX_2D:
        for t in gl.static_range(1, NEXT_N):
            n_t = gl.load(ctx_ptr + b64 * stride_ctx + t)
            longest = gl.maximum(longest, n_t)
            shortest = gl.minimum(shortest, n_t)
    extent = gl.maximum(longest, 0)
    if (pid_g == 0) & (chunk_idx == 0):
        b32 = b64.to(gl.int32)
        _report(err_ptr, ERR_LEN_NEGATIVE, shortest < 0, b32)
        _report(err_ptr, ERR_LEN_PAST_WIDTH, extent > max_context_len, b32)
        _report(err_ptr, ERR_LEN_PAST_TABLE, extent > max_blocks * BLOCK_KV, b32)
        if HAS_INDICES:
            req = gl.load(idx_ptr + b64)
            _report(err_ptr, ERR_INDEX, (req < 0) | (req >= batch), req)
    key_len = gl.minimum(extent, max_context_len)
    hi_tok = gl.minimum(chunk_lo + chunk, key_len)
    if chunk_lo < key_len:
        used = chunk_pages_ok & (chunk_page_ids * BLOCK_KV < hi_tok)
        _report(err_ptr, ERR_PAGE_ID, used & ((ids < 0) | (ids >= num_blocks)), ids)
        page_bytes = page_units.to(gl.int64) * PAGE_UNIT
        page_rows = page_bytes // D
        t_lo = chunk_lo // BLOCK_N
        n_tiles = (hi_tok + BLOCK_N - 1) // BLOCK_N - t_lo

        # Queries of this program's rows [(row, head), D] (loaded first: the TMA issue below
        # waits for the page ids), weights per (row, head) column.
        cq = gl.arange(0, NC, layout=gl.SliceLayout(1, q_l))
        cq_t = pid_g * ROWS + cq // HEADS_P
        cq_h = cq % HEADS_P
        cq_ok = (cq_t < NEXT_N) & (cq_h < NUM_HEADS)
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
        q_offs = (b64 * stride_qb + cq_t[:, None] * stride_qt + cq_h[:, None] * stride_qh) * Q_UNIT + dq[None, :]
        q_raw = gl.load(q_ptr + q_offs, mask=cq_ok[:, None], other=0.0)
        c = gl.arange(0, NC, layout=col_l)
        c_t = pid_g * ROWS + c // HEADS_P
        c_h = c % HEADS_P
        c_ok = (c_t < NEXT_N) & (c_h < NUM_HEADS)
        w = gl.load(w_ptr + (b64 * NEXT_N + c_t) * stride_w + c_h, mask=c_ok, other=0.0).to(gl.float32)
        # This program's query rows (scalars for one row): output rows, and the exclusive end of
        # each row's window.
        if ROWS == 1:
            t_rows = pid_g
        else:
            t_rows = pid_g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, out_l))
        row_ok = t_rows < NEXT_N
        out_rows = out_ptr + (b64 * NEXT_N + t_rows) * stride_out
        if CTX_2D:
            row_end = gl.load(ctx_ptr + b64 * stride_ctx + t_rows, mask=row_ok, other=0)
        else:
            row_end = longest - NEXT_N + 1 + t_rows
        # The key ring, its first NUM_BUF tiles requested.
        k_smem = gl.allocate_shared_memory(kv_desc.dtype, [NUM_BUF, BLOCK_N, D], kv_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(NUM_BUF):
            if i < n_tiles:
                _request_tile(kv_desc, k_smem, bars, ids, slots, first_page, t_lo + i, max_blocks, num_blocks,
                              page_rows, BLOCK_KV, MAX_CHUNK_PAGES, NUM_BUF, i)

        sf_ptr = kv_sf_ptr + BLOCK_KV * D // 4
        page_words = page_bytes // 4
        # Scales four tiles ahead of their use: sf_a holds tile i-1's at step i, sf_b, sf_c and
        # sf_d the next three tiles'.
        sf_a = _key_scales(sf_ptr, ids, slots, first_page, t_lo, hi_tok, max_blocks, num_blocks, page_words,
                           BLOCK_N, BLOCK_KV, MAX_CHUNK_PAGES, key_l)
        sf_b = _key_scales(sf_ptr, ids, slots, first_page, t_lo + 1, hi_tok, max_blocks, num_blocks, page_words,
                           BLOCK_N, BLOCK_KV, MAX_CHUNK_PAGES, key_l)
        sf_c = _key_scales(sf_ptr, ids, slots, first_page, t_lo + 2, hi_tok, max_blocks, num_blocks, page_words,
                           BLOCK_N, BLOCK_KV, MAX_CHUNK_PAGES, key_l)
        sf_d = _key_scales(sf_ptr, ids, slots, first_page, t_lo + 3, hi_tok, max_blocks, num_blocks, page_words,
                           BLOCK_N, BLOCK_KV, MAX_CHUNK_PAGES, key_l)
        # The queries into shared memory: the MMA's B operand, K-major.
        q_smem = gl.allocate_shared_memory(q_raw.dtype, [NC, D], kv_desc.layout, q_raw)
        fence_async_shared()
        q_t = q_smem.permute((1, 0))

        s1 = gl.zeros([BLOCK_N, NC], gl.float32, mma)
        s0 = _issue(k_smem, bars, q_t, s1, 0, NUM_BUF)
        s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, ))
        # Tile i's MMA runs under tile i-1's epilogue, exactly one MMA in flight; right after its
        # issue, tile i-1's buffer (its MMA is done) takes tile i-1+NUM_BUF.
        for i in range(1, n_tiles - 1, 2):
            s1 = _issue(k_smem, bars, q_t, s1, i, NUM_BUF)
            _refill(kv_desc, k_smem, bars, ids, slots, first_page, t_lo, n_tiles, max_blocks, num_blocks, page_rows,
                    BLOCK_KV, MAX_CHUNK_PAGES, NUM_BUF, i - 1)
            _store_tile(s0, w, sf_a, t_lo + i - 1, ids, slots, first_page, hi_tok, max_blocks, num_blocks, row_end,
                        row_ok, out_rows, ROWS, HEADS_P, BLOCK_KV, MAX_CHUNK_PAGES, CLEAN)
            sf_e = _key_scales(sf_ptr, ids, slots, first_page, t_lo + i + 3, hi_tok, max_blocks, num_blocks,
                               page_words, BLOCK_N, BLOCK_KV, MAX_CHUNK_PAGES, key_l)
            s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s1, ))
            s0 = _issue(k_smem, bars, q_t, s0, i + 1, NUM_BUF)
            _refill(kv_desc, k_smem, bars, ids, slots, first_page, t_lo, n_tiles, max_blocks, num_blocks, page_rows,
                    BLOCK_KV, MAX_CHUNK_PAGES, NUM_BUF, i)
            _store_tile(s1, w, sf_b, t_lo + i, ids, slots, first_page, hi_tok, max_blocks, num_blocks, row_end,
                        row_ok, out_rows, ROWS, HEADS_P, BLOCK_KV, MAX_CHUNK_PAGES, CLEAN)
            sf_f = _key_scales(sf_ptr, ids, slots, first_page, t_lo + i + 4, hi_tok, max_blocks, num_blocks,
                               page_words, BLOCK_N, BLOCK_KV, MAX_CHUNK_PAGES, key_l)
            s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, ))
            sf_a, sf_b, sf_c, sf_d = sf_c, sf_d, sf_e, sf_f
        if n_tiles % 2 == 0:  # the last tile's MMA under the one before it
            s1 = _issue(k_smem, bars, q_t, s1, n_tiles - 1, NUM_BUF)
            _refill(kv_desc, k_smem, bars, ids, slots, first_page, t_lo, n_tiles, max_blocks, num_blocks, page_rows,
                    BLOCK_KV, MAX_CHUNK_PAGES, NUM_BUF, n_tiles - 2)
            _store_tile(s0, w, sf_a, t_lo + n_tiles - 2, ids, slots, first_page, hi_tok, max_blocks, num_blocks,
                        row_end, row_ok, out_rows, ROWS, HEADS_P, BLOCK_KV, MAX_CHUNK_PAGES, CLEAN)
            s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s1, ))
            _store_tile(s1, w, sf_b, t_lo + n_tiles - 1, ids, slots, first_page, hi_tok, max_blocks, num_blocks,
                        row_end, row_ok, out_rows, ROWS, HEADS_P, BLOCK_KV, MAX_CHUNK_PAGES, CLEAN)
        else:
            _store_tile(s0, w, sf_a, t_lo + n_tiles - 1, ids, slots, first_page, hi_tok, max_blocks, num_blocks,
                        row_end, row_ok, out_rows, ROWS, HEADS_P, BLOCK_KV, MAX_CHUNK_PAGES, CLEAN)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))
    if CLEAN:
        # -inf in this chunk's columns past the request's key extent (the tiles wrote the rest).
        FILL_PER_LANE: gl.constexpr = BLOCK_FILL // (32 * num_warps) if BLOCK_FILL > 32 * num_warps else 1
        fill_l: gl.constexpr = gl.BlockedLayout([1, FILL_PER_LANE], [1, 32], [1, num_warps], [1, 0])
        f = gl.arange(0, BLOCK_FILL, layout=gl.SliceLayout(0, fill_l))
        t_fill = pid_g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, fill_l))
        fill_rows = out_ptr + (b64 * NEXT_N + t_fill) * stride_out
        fill = gl.full([ROWS, BLOCK_FILL], float("-inf"), out_ptr.dtype.element_ty, fill_l)
        fill_hi = gl.minimum(chunk_lo + chunk, max_context_len)
        for c0 in range(gl.maximum(chunk_lo, key_len), fill_hi, BLOCK_FILL):
            col = c0 + f
            gl.store(fill_rows[:, None] + col[None, :], fill,
                     mask=(t_fill < NEXT_N)[:, None] & (col < fill_hi)[None, :])


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------
@functools.cache
def _smem_layout(d: int):
    """The key rows' (and queries') shared layout: rows of ``d`` E4M3 bytes, swizzled by row."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, d), element_bitwidth=8, rank=2)


def kv_descriptor(values, rows: int, d: int, box: int):
    """The key values' descriptor: ``values`` (the cache as E4M3) viewed as ``[rows, d]``, boxes
    of ``box`` rows (a page, or a 64-key tile of a larger page)."""
    return host_descriptor(TensorDescriptor, values, [rows, d], [d, 1], [box, d], layout=_smem_layout(d))


# ``launcher(key, grid, args, options)``: ``args`` every parameter of ``paged_logits_gluon_kernel``
# in order (``num_warps`` among them: Triton takes the launch option from it).
launcher = Launcher(paged_logits_gluon_kernel)
arg_names = launcher.arg_names
