"""Triton kernels for the indexer decode logits over a paged KV cache (private; see ``paged.py``).

Schedule. One program per (row group, request, chunk of ``chunk_pages`` pages), on one grid
axis of ``G * B * chunks_per_request`` programs, row groups fastest so that the groups reading
the same key tiles run side by side (the second read hits L2). Chunks are equal, so the
hardware block scheduler balances a skewed batch by itself, and one long request is split over
as many SMs as it has chunks; a chunk past its request's length only writes the ``-inf`` tail
(or exits). Every key is an independent output column, so a split needs no reduction, and
every output element depends on its own key row only: the result is bitwise identical for any
chunk size. (A persistent schedule over the balanced metadata ranges measured slower on the
H200, ``benchmarks/NOTES.md``: its programs restart their load pipeline at every request they
cross.) The chunk size is a runtime value: the launch picks it per batch without a compile.

Per program: the chunk's page ids are read once (so each key tile's address is known from
registers and its load can be issued as many stages ahead as there are buffers), the
request's queries and weights once, then per tile of ``BLOCK_N`` keys: gather the key rows
(a page holds ``BLOCK_KV`` tokens: values ``[BLOCK_KV, DQ]`` first, then ``BLOCK_KV`` 4-byte
scales), one ``tl.dot`` of ``[BLOCK_N, D] x [D, ROWS * HEADS_P]``, ReLU, the weighted head sum
of each query row (a reshape to ``[BLOCK_N, ROWS, HEADS_P]`` and one reduction) and a store
of ``[BLOCK_N, ROWS]``. A program scores ``ROWS`` of the request's ``next_n`` query rows (all
heads) in one dot, so ``G = ceil(next_n / ROWS)``. ``HEAD_SUM_MMA`` (an option) runs the head
sum on the tensor cores instead: ``relu(S) [BLOCK_N, ROWS * HEADS_P]`` times a selection matrix
holding each row's weights ``[ROWS * HEADS_P, OUT_P]`` in one tf32 dot (``OUT_P`` = ROWS padded
to the dot's smallest side), leaving the ReLU as the only per-element CUDA-core work.
Formats (``FMT``): 0 = FP8 (E4M3 dot, per-key fp32 scale after the head sum), 1 = MXFP8,
2 = MXFP4; MX operands are dequantised to bf16 in registers (exact) and run a bf16 dot, as
Hopper has no block-scaled MMA.

``TMA`` (``PagedConfig(tma=True)``, the FP8 default): the key values come from ``kv_desc``, a host
tensor descriptor over the cache viewed as rows of ``DQ`` bytes (E4M3, or int8 for MXFP4), in
which page ``p``'s values are rows ``p * page_bytes / DQ`` on. A tile is one box of
``BOX_N = min(BLOCK_N, BLOCK_KV)`` rows per page it covers, each scored as its own dot, so the
per-element address math and the page-id ``tl.gather`` go: one scalar page id per box (a
masked sum over the chunk's id vector, one warp reduction) and one TMA copy, pipelined like the
pointer loads. Scales keep the pointer load. The launch takes this path only where the layout
allows it (``paged._tma_view``) and gives the gather path's bits.

Bad values never lead to an access out of bounds: lengths are clamped to the output width, a
key past the block table's width or on a page id outside ``[0, num_blocks)`` reads nothing
(a TMA box of such keys reads row 0 of the view instead, inside the cache) and scores NaN.
The first program of each request reports bad lengths and request ids, every program the bad
page ids it meets, into the error record (``tilefuse._errors``).

``clean_logits``: the tiles write ``-inf`` outside each row's window up to the request's key
extent; each chunk then fills its columns past that extent.

Integer arguments that change from call to call (lengths, widths, counts, strides), and the
alignment of the small tensors' pointers, are not specialised (``do_not_specialize``), so one
compile per model configuration serves every batch and every slice of an engine's buffers.
The page stride is passed in units of ``PAGE_UNIT`` bytes (16 when it is a multiple of 16), and
the query strides in units of ``Q_UNIT`` elements (16 when all are multiples of 16), so the key
and query loads keep their 16-byte vectorisation without specialising on the strides' values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilefuse import _errors as E
from tilefuse._errors_kernel import report_error
from tilefuse.indexer._prefill_kernel import FMT_FP8, FMT_MXFP4, _dequant_tile

_ERR_LEN_NEGATIVE = tl.constexpr(E.CONTEXT_LEN_NEGATIVE)
_ERR_LEN_PAST_WIDTH = tl.constexpr(E.CONTEXT_LEN_PAST_WIDTH)
_ERR_LEN_PAST_TABLE = tl.constexpr(E.CONTEXT_LEN_PAST_TABLE)
_ERR_PAGE_ID = tl.constexpr(E.PAGE_ID_OUT_OF_RANGE)
_ERR_INDEX = tl.constexpr(E.INDEX_OUT_OF_RANGE)

# Runtime arguments of paged_logits_kernel that must not select a compile: the integers, and
# the pointers whose alignment changes with the caller's slicing and whose accesses are scalar
# (the queries' and the cache's stay specialised: their loads are vectorised).
DYNAMIC_ARGS = ("batch", "max_context_len", "max_blocks", "num_blocks", "chunk_pages", "chunks_per_request",
                "stride_qb", "stride_qt", "stride_qh", "stride_sfb", "stride_sft", "stride_w", "stride_ctx",
                "stride_bt", "page_units", "stride_out",
                "q_sf_ptr", "w_ptr", "ctx_ptr", "bt_ptr", "idx_ptr", "out_ptr", "err_ptr")


@triton.jit
def _key_extent(ctx_ptr, stride_ctx, b, NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr, CTX_2D: tl.constexpr):
    """Keys request ``b`` reads: its length (1-D) or its longest row (2-D), at least 0; and
    its shortest length (negative when one is bad)."""
    if CTX_2D:
        # Scalar loads, not a vector load and a reduction: the extent sets the loop's bounds,
        # and a reduced vector keeps them (and what follows from them) in per-thread
        # registers instead of uniform ones (+23 registers a thread at next_n 2, a program
        # fewer an SM).
        n = tl.load(ctx_ptr + b * stride_ctx)
        lo = n
        for t in tl.static_range(1, NEXT_N):
            n_t = tl.load(ctx_ptr + b * stride_ctx + t)
            n = tl.maximum(n, n_t)
            lo = tl.minimum(lo, n_t)
    else:
        n = tl.load(ctx_ptr + b * stride_ctx)
        lo = n
    return tl.maximum(n, 0), lo


@triton.jit
def _score_keys(k_raw, k_sf, j, j_ok, page_ok, q_op, w, w_sel, row_end, out_rows, row_ok, N: tl.constexpr,
                D: tl.constexpr, FMT: tl.constexpr, ROWS: tl.constexpr, HEADS_P: tl.constexpr, CLEAN: tl.constexpr,
                HEAD_SUM_MMA: tl.constexpr):
    """Logits of ``N`` keys (values ``k_raw``, scales ``k_sf``, positions ``j``) for the program's
    query rows, stored where ``j_ok`` and the row are; NaN where ``page_ok`` (a key without a page)
    is false."""
    if FMT == FMT_FP8:
        k_op = k_raw
    else:
        k_op = _dequant_tile(k_raw, k_sf, N, D, FMT)
    # ReLU, weights, then the head sum of each query row: logits [N, OUT_P].
    if HEAD_SUM_MMA:
        relu = tl.maximum(tl.dot(k_op, tl.trans(q_op)), 0.0)
        logits = tl.dot(relu, w_sel, input_precision="tf32")
    else:
        x = tl.maximum(tl.dot(k_op, tl.trans(q_op)), 0.0) * w[None, :]
        if ROWS == 1:
            logits = tl.sum(x, axis=1)[:, None]
        else:
            logits = tl.sum(tl.reshape(x, (N, ROWS, HEADS_P)), axis=2)
    if FMT == FMT_FP8:
        logits = logits * k_sf[:, None]
    if CLEAN:
        logits = tl.where(j[:, None] < row_end[None, :], logits, float("-inf"))
    # A key without a page (past the table's width, or a page id outside the cache):
    # NaN, never a read out of bounds.
    logits = tl.where(page_ok, logits, float("nan"))
    tl.store(out_rows[None, :] + j[:, None], logits.to(out_rows.dtype.element_ty),
             mask=j_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def paged_logits_kernel(
    q_ptr, q_sf_ptr, kv_cache_ptr, w_ptr, ctx_ptr, bt_ptr, idx_ptr, out_ptr, err_ptr,
    batch, max_context_len, max_blocks, num_blocks, chunk_pages, chunks_per_request,
    stride_qb, stride_qt, stride_qh,
    stride_sfb, stride_sft,
    stride_w, stride_ctx, stride_bt,
    page_units, stride_out,
    NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    D: tl.constexpr, BLOCK_KV: tl.constexpr, FMT: tl.constexpr, CTX_2D: tl.constexpr, CLEAN: tl.constexpr,
    HAS_INDICES: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MAX_CHUNK_PAGES: tl.constexpr,
    PAGE_UNIT: tl.constexpr, Q_UNIT: tl.constexpr, BLOCK_FILL: tl.constexpr, NUM_STAGES: tl.constexpr, G: tl.constexpr,
    HEAD_SUM_MMA: tl.constexpr, kv_desc, TMA: tl.constexpr,
):
    DQ: tl.constexpr = D // 2 if FMT == FMT_MXFP4 else D  # value bytes per token
    SF_OFFSET: tl.constexpr = BLOCK_KV * DQ // 4  # first scale of a page, in 4-byte words
    NC: tl.constexpr = ROWS * HEADS_P  # dot columns: (query row, head) pairs
    # Output columns per program: the rows, padded to a dot's side when the head sum is a dot.
    OUT_P: tl.constexpr = (ROWS if ROWS >= 16 else 16) if HEAD_SUM_MMA else ROWS
    # One uint8 buffer: values as E4M3 (or packed FP4 bytes), scales as 4-byte words.
    kv_ptr = kv_cache_ptr.to(tl.pointer_type(tl.int8 if FMT == FMT_MXFP4 else tl.float8e4nv), bitcast=True)
    kv_sf_ptr = kv_cache_ptr.to(tl.pointer_type(tl.float32 if FMT == FMT_FP8 else tl.int32), bitcast=True)
    pid = tl.program_id(0)
    pid_g = pid % G
    unit = pid // G
    b64 = tl.cast(unit // chunks_per_request, tl.int64)
    chunk_idx = unit % chunks_per_request
    chunk = chunk_pages * BLOCK_KV
    chunk_lo = chunk_idx * chunk
    r_out = tl.arange(0, OUT_P)
    t_rows = pid_g * ROWS + r_out
    row_ok = (r_out < ROWS) & (t_rows < NEXT_N)
    out_rows = out_ptr + (b64 * NEXT_N + t_rows) * stride_out
    # The chunk's page ids, read once: a key tile's address then depends on registers only,
    # so its load is issued as many stages ahead as there are buffers (a block-table load
    # inside the loop would hold each key load back by one memory latency). Read beside the
    # length, not after it. Entries past the request's pages may hold anything; the key
    # loads mask them by length and by page range.
    bt_row = bt_ptr + b64 * stride_bt
    first_page = chunk_lo // BLOCK_KV
    slots = tl.arange(0, MAX_CHUNK_PAGES)
    chunk_page_ids = first_page + slots
    chunk_pages_ok = (slots < chunk_pages) & (chunk_page_ids < max_blocks)
    chunk_pages_of = tl.load(bt_row + chunk_page_ids, mask=chunk_pages_ok, other=0)
    extent, shortest = _key_extent(ctx_ptr, stride_ctx, b64, NEXT_N, NEXT_N_P, CTX_2D)
    if (pid_g == 0) & (chunk_idx == 0):
        report_error(err_ptr, _ERR_LEN_NEGATIVE, shortest < 0, b64.to(tl.int32))
        report_error(err_ptr, _ERR_LEN_PAST_WIDTH, extent > max_context_len, b64.to(tl.int32))
        report_error(err_ptr, _ERR_LEN_PAST_TABLE, extent > max_blocks * BLOCK_KV, b64.to(tl.int32))
        if HAS_INDICES:
            req = tl.load(idx_ptr + b64)
            report_error(err_ptr, _ERR_INDEX, (req < 0) | (req >= batch), req)
    key_len = tl.minimum(extent, max_context_len)
    hi_tok = tl.minimum(chunk_lo + chunk, key_len)
    if chunk_lo < key_len:
        # Page ids this chunk uses must lie in the cache (checked once per program).
        used = chunk_pages_ok & (chunk_page_ids * BLOCK_KV < hi_tok)
        report_error(err_ptr, _ERR_PAGE_ID, used & ((chunk_pages_of < 0) | (chunk_pages_of >= num_blocks)),
                     chunk_pages_of)
        # Keys [chunk_lo, hi_tok) of request b64 for this program's query rows.
        # Columns of the dot: query row t = pid_g * ROWS + c // HEADS_P, head c % HEADS_P.
        c = tl.arange(0, NC)
        c_t = pid_g * ROWS + c // HEADS_P
        c_h = c % HEADS_P
        c_ok = (c_t < NEXT_N) & (c_h < NUM_HEADS)
        dq = tl.arange(0, DQ)
        # Exclusive end of each of this program's query rows.
        if CTX_2D:
            row_end = tl.load(ctx_ptr + b64 * stride_ctx + t_rows, mask=row_ok, other=0)
        else:
            row_end = tl.load(ctx_ptr + b64 * stride_ctx) - NEXT_N + 1 + t_rows
        # Queries and weights of this request's rows.
        q_offs = (b64 * stride_qb + c_t[:, None] * stride_qt + c_h[:, None] * stride_qh) * Q_UNIT + dq[None, :]
        q_raw = tl.load(q_ptr + q_offs, mask=c_ok[:, None], other=0.0)
        if FMT == FMT_FP8:
            q_op = q_raw
        else:
            q_sf = tl.load(q_sf_ptr + b64 * stride_sfb + c_t * stride_sft + c_h, mask=c_ok, other=0)
            q_op = _dequant_tile(q_raw, q_sf, NC, D, FMT)
        w = tl.load(w_ptr + (b64 * NEXT_N + c_t) * stride_w + c_h, mask=c_ok, other=0.0).to(tl.float32)
        if HEAD_SUM_MMA:
            # Column r of the selection holds row r's weights at its own heads, 0 elsewhere.
            w_sel = tl.where((c // HEADS_P)[:, None] == r_out[None, :], w[:, None], 0.0)
        else:
            w_sel = w
        page_bytes = page_units.to(tl.int64) * PAGE_UNIT

        if TMA:
            # One box of BOX_N keys per page a tile covers (the tile itself when it lies in one
            # page): BOX_N rows of the value rows' view, from row page * page_rows + slot.
            BOX_N: tl.constexpr = BLOCK_N if BLOCK_N < BLOCK_KV else BLOCK_KV
            page_rows = page_bytes // DQ
            box = tl.arange(0, BOX_N)
            for tile in tl.range(chunk_lo // BLOCK_N, tl.cdiv(hi_tok, BLOCK_N), num_stages=NUM_STAGES):
                for part in tl.static_range(BLOCK_N // BOX_N):
                    j0 = tile * BLOCK_N + part * BOX_N
                    page_idx = j0 // BLOCK_KV
                    slot0 = j0 % BLOCK_KV
                    # The page id, one scalar per box (as the gather path, clamped so that the
                    # pipeliner's iterations past the loop's end stay in range).
                    slot_in_chunk = tl.minimum(tl.maximum(page_idx - first_page, 0), MAX_CHUNK_PAGES - 1)
                    page = tl.sum(tl.where(slots == slot_in_chunk, chunk_pages_of, 0), axis=0).to(tl.int64)
                    page_ok = (page_idx < max_blocks) & (page >= 0) & (page < num_blocks)
                    # A key without a page loads row 0 (and scores NaN): the box never leaves the view.
                    row = tl.where(page_ok, page * page_rows + slot0, 0).to(tl.int32)
                    k_raw = kv_desc.load([row, 0])
                    j = j0 + box
                    j_ok = j < hi_tok
                    k_sf = tl.load(kv_sf_ptr + page * page_bytes // 4 + SF_OFFSET + slot0 + box, mask=j_ok & page_ok,
                                   other=0)
                    _score_keys(k_raw, k_sf, j, j_ok, page_ok, q_op, w, w_sel, row_end, out_rows, row_ok,
                                BOX_N, D, FMT, ROWS, HEADS_P, CLEAN, HEAD_SUM_MMA)
        else:
            for tile in tl.range(chunk_lo // BLOCK_N, tl.cdiv(hi_tok, BLOCK_N), num_stages=NUM_STAGES):
                j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                page_idx = j // BLOCK_KV
                in_table = page_idx < max_blocks
                # The software pipeliner computes this gather for tiles past the loop's end too
                # (only the loads are predicated): the index is clamped so that it is in range for
                # every iteration it may be evaluated at. Out of range, the gather reads past its
                # shared-memory scratch, which faulted on the H200 (block_kv 32, next_n 6, H 64).
                slot_in_chunk = tl.minimum(tl.maximum(page_idx - first_page, 0), MAX_CHUNK_PAGES - 1)
                page = tl.gather(chunk_pages_of, slot_in_chunk, 0).to(tl.int64)
                page_ok = in_table & (page >= 0) & (page < num_blocks)
                j_ok = j < hi_tok
                ld_ok = j_ok & page_ok
                slot = j % BLOCK_KV
                page_base = page * page_bytes
                k_raw = tl.load(kv_ptr + (page_base + slot * DQ)[:, None] + dq[None, :], mask=ld_ok[:, None],
                                other=0.0)
                k_sf = tl.load(kv_sf_ptr + page_base // 4 + SF_OFFSET + slot, mask=ld_ok, other=0)
                _score_keys(k_raw, k_sf, j, j_ok, page_ok[:, None], q_op, w, w_sel, row_end, out_rows, row_ok,
                            BLOCK_N, D, FMT, ROWS, HEADS_P, CLEAN, HEAD_SUM_MMA)
    if CLEAN:
        # -inf in this chunk's columns past the request's key extent (the tiles wrote the rest).
        f = tl.arange(0, BLOCK_FILL)
        fill = tl.full((OUT_P, BLOCK_FILL), float("-inf"), tl.float32).to(out_rows.dtype.element_ty)
        fill_hi = tl.minimum(chunk_lo + chunk, max_context_len)
        for c0 in range(tl.maximum(chunk_lo, key_len), fill_hi, BLOCK_FILL):
            col = c0 + f
            tl.store(out_rows[:, None] + col[None, :], fill, mask=row_ok[:, None] & (col < fill_hi)[None, :])


@triton.jit(do_not_specialize=("ctx_ptr", "meta_ptr", "batch", "stride_ctx", "num_sms"))
def paged_schedule_kernel(ctx_ptr, meta_ptr, batch, stride_ctx, num_sms,
                          NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr, CTX_2D: tl.constexpr,
                          BLOCK_KV: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
    """DeepGEMM's split of the batch's pages over ``num_sms`` workers: row ``w`` of ``meta`` is
    (request, page) where page ``w * P // num_sms`` of the ``P`` pages laid end to end lies.

    One program per ``BLOCK_W`` workers; each walks the lengths twice (the total, then the
    running page count; once where the batch fits one block of ``BLOCK_B``, its usual case):
    the request of target page ``p`` is the number of requests ending at or before it, its
    page ``p`` minus the largest such end.
    """
    w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    rows = tl.arange(0, BLOCK_B)
    req = tl.zeros((BLOCK_W,), tl.int64)
    start = tl.zeros((BLOCK_W,), tl.int64)
    carry = tl.cast(0, tl.int64)
    if batch <= BLOCK_B:
        ext, ok = _key_extent_block(ctx_ptr, stride_ctx, rows, batch, NEXT_N, NEXT_N_P, CTX_2D)
        target = w.to(tl.int64) * tl.sum((ext + BLOCK_KV - 1) // BLOCK_KV, axis=0) // num_sms
        req, start, carry = _workers_in_block(ext, ok, carry, target, req, start, BLOCK_KV)
    else:
        total = tl.cast(0, tl.int64)
        for b0 in range(0, batch, BLOCK_B):
            ext, _ = _key_extent_block(ctx_ptr, stride_ctx, b0 + rows, batch, NEXT_N, NEXT_N_P, CTX_2D)
            total += tl.sum((ext + BLOCK_KV - 1) // BLOCK_KV, axis=0)
        target = w.to(tl.int64) * total // num_sms
        for b0 in range(0, batch, BLOCK_B):
            ext, ok = _key_extent_block(ctx_ptr, stride_ctx, b0 + rows, batch, NEXT_N, NEXT_N_P, CTX_2D)
            req, start, carry = _workers_in_block(ext, ok, carry, target, req, start, BLOCK_KV)
    page = tl.where(req < batch, target - start, 0)
    live = w <= num_sms
    tl.store(meta_ptr + 2 * w, req.to(tl.int32), mask=live)
    tl.store(meta_ptr + 2 * w + 1, page.to(tl.int32), mask=live)


@triton.jit
def _workers_in_block(ext, ok, carry, target, req, start, BLOCK_KV: tl.constexpr):
    """One block of requests (extents ``ext``, existing ``ok``, ``carry`` pages before it) into
    each worker's running request count ``req`` and largest request end ``start`` at or before
    its ``target`` page; returns them and the carry after the block."""
    ends = carry + tl.cumsum((ext + BLOCK_KV - 1) // BLOCK_KV, axis=0)
    before = ok[:, None] & (ends[:, None] <= target[None, :])
    req += tl.sum(before.to(tl.int64), axis=0)
    start = tl.maximum(start, tl.max(tl.where(before, ends[:, None], 0), axis=0))
    return req, start, tl.max(tl.where(ok, ends, carry), axis=0)


@triton.jit
def _key_extent_block(ctx_ptr, stride_ctx, b, batch, NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr,
                      CTX_2D: tl.constexpr):
    """Key extents (int64, >= 0) of requests ``b`` (a block), and which of them exist."""
    ok = b < batch
    if CTX_2D:
        t = tl.arange(0, NEXT_N_P)
        lens = tl.load(ctx_ptr + b.to(tl.int64)[:, None] * stride_ctx + t[None, :],
                       mask=ok[:, None] & (t < NEXT_N)[None, :], other=0)
        n = tl.max(lens, axis=1)
    else:
        n = tl.load(ctx_ptr + b.to(tl.int64) * stride_ctx, mask=ok, other=0)
    return tl.maximum(n, 0).to(tl.int64), ok
