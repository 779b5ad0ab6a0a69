"""Triton kernel for the indexer decode logits over a paged KV cache (private; see ``paged.py``).

Work split. The schedule metadata gives each of ``W`` workers a contiguous range of the
batch's pages, ``[meta[w], meta[w + 1])`` in (request, page) order, balanced over the pages
of the whole batch; a request's keys are therefore split over several workers when the
batch is small (B = 1 spreads one request over every SM). Every key is an independent output
column, so a split needs no reduction. The grid is ``(G, SPLITS, W)``:

* ``W`` workers from the metadata;
* ``SPLITS`` programs per worker take its tiles round-robin (more loads in flight per SM
  without asking the caller for more metadata rows);
* ``G`` row groups: a program scores ``ROWS`` of the request's ``next_n`` query rows (all
  heads) in one dot, so ``G = ceil(next_n / ROWS)``; the groups of one worker run side by side
  and read the same key tiles, the second read hitting L2.

Tiles are ``BLOCK_N`` keys aligned to multiples of ``BLOCK_N`` within the request, whatever
the worker boundaries, and every output element depends on its own key row only, so the
result is bitwise identical for any metadata or worker count.

Per tile: gather the key rows through the block table (a page holds ``BLOCK_KV`` tokens:
values ``[BLOCK_KV, DQ]`` first, then ``BLOCK_KV`` 4-byte scales), one ``tl.dot`` of
``[BLOCK_N, D] x [D, ROWS * HEADS_P]``, ReLU, the weighted head sum of each query row (a
reshape to ``[BLOCK_N, ROWS, HEADS_P]`` and one reduction) and a store of ``[BLOCK_N, ROWS]``.
Formats (``FMT``): 0 = FP8 (E4M3 dot, per-key fp32 scale after the head sum), 1 = MXFP8,
2 = MXFP4; MX operands are dequantised to bf16 in registers (exact) and run a bf16 dot, as
Hopper has no block-scaled MMA.

``clean_logits``: the tiles write ``-inf`` outside each row's window up to the request's key
extent; the columns past it are filled by a second loop, request ``b`` going to program
``b mod (W * SPLITS)``, independent of the metadata.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.indexer._prefill_kernel import _dequant_tile

FMT_FP8 = 0
FMT_MXFP8 = 1
FMT_MXFP4 = 2


@triton.jit
def _key_extent(ctx_ptr, stride_ctx, b, NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr, CTX_2D: tl.constexpr):
    """Keys request ``b`` reads: its length (1-D) or its longest row (2-D), at least 0."""
    if CTX_2D:
        t = tl.arange(0, NEXT_N_P)
        n = tl.max(tl.load(ctx_ptr + b * stride_ctx + t, mask=t < NEXT_N, other=0), axis=0)
    else:
        n = tl.load(ctx_ptr + b * stride_ctx)
    return tl.maximum(n, 0)


@triton.jit
def paged_logits_kernel(
    q_ptr, q_sf_ptr, kv_ptr, kv_sf_ptr, w_ptr, ctx_ptr, bt_ptr, meta_ptr, out_ptr,
    num_requests, max_context_len, max_blocks, chunks_per_request,
    stride_qb, stride_qt, stride_qh,
    stride_sfb, stride_sft,
    stride_w, stride_ctx, stride_bt,
    page_stride, page_stride_words,
    stride_out,
    NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    D: tl.constexpr, BLOCK_KV: tl.constexpr, FMT: tl.constexpr, CTX_2D: tl.constexpr, CLEAN: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, BLOCK_FILL: tl.constexpr,
    NUM_STAGES: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr,
):
    # One grid axis (no 65535 limit), row groups fastest so that the groups reading the same
    # key tiles run side by side: pid = (unit * SPLITS + split) * G + group.
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % SPLITS
    unit = pid // (G * SPLITS)
    DQ: tl.constexpr = D // 2 if FMT == 2 else D  # value bytes per token
    SF_OFFSET: tl.constexpr = BLOCK_KV * DQ // 4  # first scale of a page, in 4-byte words
    NC: tl.constexpr = ROWS * HEADS_P  # dot columns: (query row, head) pairs

    # Columns of the dot: query row t = pid_g * ROWS + c // HEADS_P, head c % HEADS_P.
    c = tl.arange(0, NC)
    c_t = pid_g * ROWS + c // HEADS_P
    c_h = c % HEADS_P
    c_ok = (c_t < NEXT_N) & (c_h < NUM_HEADS)
    dq = tl.arange(0, DQ)
    t_rows = pid_g * ROWS + tl.arange(0, ROWS)

    CHUNKS: tl.constexpr = CHUNK > 0
    if CHUNKS:
        # Unit = (request, chunk of CHUNK keys): one request per program.
        b_first = unit // chunks_per_request
        b_stop = b_first + 1
        chunk_lo = (unit % chunks_per_request) * CHUNK
    else:
        # Unit = metadata worker: pages [(b_first, p_first), (b_last, p_last)).
        b_first = tl.load(meta_ptr + 2 * unit)
        p_first = tl.load(meta_ptr + 2 * unit + 1)
        b_last = tl.load(meta_ptr + 2 * unit + 2)
        p_last = tl.load(meta_ptr + 2 * unit + 3)
        b_stop = tl.minimum(b_last + 1, num_requests)
    for b in range(b_first, b_stop):
        b64 = tl.cast(b, tl.int64)
        key_len = tl.minimum(_key_extent(ctx_ptr, stride_ctx, b, NEXT_N, NEXT_N_P, CTX_2D), max_context_len)
        if CHUNKS:
            lo_tok = chunk_lo
            hi_tok = tl.minimum(chunk_lo + CHUNK, key_len)
        else:
            lo_page = tl.where(b == b_first, p_first, 0)
            hi_page = tl.where(b == b_last, p_last, tl.cdiv(key_len, BLOCK_KV))
            lo_tok = lo_page * BLOCK_KV
            hi_tok = tl.minimum(hi_page * BLOCK_KV, key_len)
        # Exclusive end of each of this program's query rows.
        if CTX_2D:
            row_end = tl.load(ctx_ptr + b * stride_ctx + t_rows, mask=t_rows < NEXT_N, other=0)
        else:
            row_end = tl.load(ctx_ptr + b * stride_ctx) - NEXT_N + 1 + t_rows

        # Queries and weights of this request's rows, loaded once per (worker, request).
        q_offs = b64 * stride_qb + c_t[:, None] * stride_qt + c_h[:, None] * stride_qh + dq[None, :]
        q_raw = tl.load(q_ptr + q_offs, mask=c_ok[:, None], other=0.0)
        if FMT == 0:
            q_op = q_raw
        else:
            q_sf = tl.load(q_sf_ptr + b64 * stride_sfb + c_t * stride_sft + c_h, mask=c_ok, other=0)
            q_op = _dequant_tile(q_raw, q_sf, NC, D, FMT)
        w = tl.load(w_ptr + (b64 * NEXT_N + c_t) * stride_w + c_h, mask=c_ok, other=0.0).to(tl.float32)

        bt_row = bt_ptr + b64 * stride_bt
        if CHUNKS:
            # The chunk's page ids, read once: a key tile's address then depends on registers
            # only, so its load can be issued as many stages ahead as there are buffers (a
            # block-table load inside the loop would hold each key load back by one latency).
            CHUNK_PAGES: tl.constexpr = CHUNK // BLOCK_KV
            first_page = chunk_lo // BLOCK_KV
            chunk_page_ids = first_page + tl.arange(0, CHUNK_PAGES)
            chunk_pages = tl.load(bt_row + chunk_page_ids,
                                  mask=(chunk_page_ids < max_blocks) & (chunk_page_ids * BLOCK_KV < hi_tok), other=0)
        out_rows = out_ptr + (b64 * NEXT_N + t_rows) * stride_out
        for tile in tl.range(lo_tok // BLOCK_N + pid_s, tl.cdiv(hi_tok, BLOCK_N), SPLITS, num_stages=NUM_STAGES):
            j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            page_idx = j // BLOCK_KV
            in_table = page_idx < max_blocks
            j_ok = (j >= lo_tok) & (j < hi_tok)
            if CHUNKS:
                page = tl.gather(chunk_pages, page_idx - first_page, 0).to(tl.int64)
            else:
                page = tl.load(bt_row + page_idx, mask=j_ok & in_table, other=0).to(tl.int64)
            slot = j % BLOCK_KV
            ld_ok = j_ok & in_table
            k_raw = tl.load(kv_ptr + (page * page_stride + slot * DQ)[:, None] + dq[None, :],
                            mask=ld_ok[:, None], other=0.0)
            k_sf = tl.load(kv_sf_ptr + page * page_stride_words + SF_OFFSET + slot, mask=ld_ok, other=0)
            if FMT == 0:
                k_op = k_raw
            else:
                k_op = _dequant_tile(k_raw, k_sf, BLOCK_N, D, FMT)
            # ReLU, weights, then the head sum of each query row: logits [BLOCK_N, ROWS].
            x = tl.maximum(tl.dot(k_op, tl.trans(q_op)), 0.0) * w[None, :]
            if ROWS == 1:
                logits = tl.sum(x, axis=1)[:, None]
            else:
                logits = tl.sum(tl.reshape(x, (BLOCK_N, ROWS, HEADS_P)), axis=2)
            if FMT == 0:
                logits = logits * k_sf[:, None]
            if CLEAN:
                logits = tl.where(j[:, None] < row_end[None, :], logits, float("-inf"))
            # A key past the block table's width has no page: NaN, never a read out of bounds.
            logits = tl.where(in_table[:, None], logits, float("nan"))
            tl.store(out_rows[None, :] + j[:, None], logits.to(out_ptr.dtype.element_ty),
                     mask=j_ok[:, None] & (t_rows < NEXT_N)[None, :])

        if CHUNKS and CLEAN:
            # This chunk's columns past the request's key extent (the tiles cover the rest).
            f = tl.arange(0, BLOCK_FILL)
            fill = tl.full((ROWS, BLOCK_FILL), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
            fill_hi = tl.minimum(chunk_lo + CHUNK, max_context_len)
            for c0 in range(tl.maximum(chunk_lo, key_len), fill_hi, BLOCK_FILL):
                col = c0 + f
                tl.store(out_rows[:, None] + col[None, :], fill,
                         mask=(t_rows < NEXT_N)[:, None] & (col < fill_hi)[None, :])

    if CLEAN and not CHUNKS:
        # Columns past each request's key extent: -inf, split over programs by request.
        prog = unit * SPLITS + pid_s
        nprog = tl.num_programs(0) // G
        f = tl.arange(0, BLOCK_FILL)
        fill = tl.full((ROWS, BLOCK_FILL), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
        for b in range(prog, num_requests, nprog):
            b64 = tl.cast(b, tl.int64)
            start = tl.minimum(_key_extent(ctx_ptr, stride_ctx, b, NEXT_N, NEXT_N_P, CTX_2D), max_context_len)
            out_rows = out_ptr + (b64 * NEXT_N + t_rows) * stride_out
            for c0 in range((start // BLOCK_FILL) * BLOCK_FILL, max_context_len, BLOCK_FILL):
                col = c0 + f
                mask = (t_rows < NEXT_N)[:, None] & ((col >= start) & (col < max_context_len))[None, :]
                tl.store(out_rows[:, None] + col[None, :], fill, mask=mask)
