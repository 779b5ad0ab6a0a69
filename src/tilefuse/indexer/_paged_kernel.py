"""Triton kernel for the indexer decode logits over a paged KV cache (private; see ``paged.py``).

Schedule. One program per (row group, request, chunk of ``CHUNK`` keys), on one grid axis of
``G * B * ceil(max_context_len / CHUNK)`` programs, row groups fastest so that the groups
reading the same key tiles run side by side (the second read hits L2). Chunks are equal, so
the hardware block scheduler balances a skewed batch by itself; a chunk past its request's
length only writes the ``-inf`` tail (or exits). Every key is an independent output column,
so a split needs no reduction, and every output element depends on its own key row only: the
result is bitwise identical for any chunk size. (A persistent schedule over the balanced
metadata ranges measured 10-30 % slower on the H200, ``benchmarks/NOTES.md``: its programs
restart their load pipeline at every request they cross.)

Per program: the chunk's page ids are read once (so each key tile's address is known from
registers and its load can be issued as many stages ahead as there are buffers), the
request's queries and weights once, then per tile of ``BLOCK_N`` keys: gather the key rows
(a page holds ``BLOCK_KV`` tokens: values ``[BLOCK_KV, DQ]`` first, then ``BLOCK_KV`` 4-byte
scales), one ``tl.dot`` of ``[BLOCK_N, D] x [D, ROWS * HEADS_P]``, ReLU, the weighted head sum
of each query row (a reshape to ``[BLOCK_N, ROWS, HEADS_P]`` and one reduction) and a store
of ``[BLOCK_N, ROWS]``. A program scores ``ROWS`` of the request's ``next_n`` query rows (all
heads) in one dot, so ``G = ceil(next_n / ROWS)``.
Formats (``FMT``): 0 = FP8 (E4M3 dot, per-key fp32 scale after the head sum), 1 = MXFP8,
2 = MXFP4; MX operands are dequantised to bf16 in registers (exact) and run a bf16 dot, as
Hopper has no block-scaled MMA.

``clean_logits``: the tiles write ``-inf`` outside each row's window up to the request's key
extent; each chunk then fills its columns past that extent.
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
    q_ptr, q_sf_ptr, kv_ptr, kv_sf_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    max_context_len, max_blocks, chunks_per_request,
    stride_qb, stride_qt, stride_qh,
    stride_sfb, stride_sft,
    stride_w, stride_ctx, stride_bt,
    page_stride, page_stride_words,
    stride_out,
    NEXT_N: tl.constexpr, NEXT_N_P: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    D: tl.constexpr, BLOCK_KV: tl.constexpr, FMT: tl.constexpr, CTX_2D: tl.constexpr, CLEAN: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_FILL: tl.constexpr,
    NUM_STAGES: tl.constexpr, G: tl.constexpr,
):
    DQ: tl.constexpr = D // 2 if FMT == 2 else D  # value bytes per token
    SF_OFFSET: tl.constexpr = BLOCK_KV * DQ // 4  # first scale of a page, in 4-byte words
    NC: tl.constexpr = ROWS * HEADS_P  # dot columns: (query row, head) pairs
    CHUNK_PAGES: tl.constexpr = CHUNK // BLOCK_KV
    pid = tl.program_id(0)
    pid_g = pid % G
    unit = pid // G
    b64 = tl.cast(unit // chunks_per_request, tl.int64)
    chunk_lo = (unit % chunks_per_request) * CHUNK
    t_rows = pid_g * ROWS + tl.arange(0, ROWS)
    out_rows = out_ptr + (b64 * NEXT_N + t_rows) * stride_out
    # The chunk's page ids, read once: a key tile's address then depends on registers only,
    # so its load is issued as many stages ahead as there are buffers (a block-table load
    # inside the loop would hold each key load back by one memory latency). Read beside the
    # length, not after it. Entries past the request's pages may hold anything; the key
    # loads mask them by length.
    bt_row = bt_ptr + b64 * stride_bt
    first_page = chunk_lo // BLOCK_KV
    chunk_page_ids = first_page + tl.arange(0, CHUNK_PAGES)
    chunk_pages = tl.load(bt_row + chunk_page_ids, mask=chunk_page_ids < max_blocks, other=0)
    key_len = tl.minimum(_key_extent(ctx_ptr, stride_ctx, b64, NEXT_N, NEXT_N_P, CTX_2D), max_context_len)
    hi_tok = tl.minimum(chunk_lo + CHUNK, key_len)
    if chunk_lo < key_len:
        # Keys [chunk_lo, hi_tok) of request b64 for this program's query rows.
        # Columns of the dot: query row t = pid_g * ROWS + c // HEADS_P, head c % HEADS_P.
        c = tl.arange(0, NC)
        c_t = pid_g * ROWS + c // HEADS_P
        c_h = c % HEADS_P
        c_ok = (c_t < NEXT_N) & (c_h < NUM_HEADS)
        dq = tl.arange(0, DQ)
        # Exclusive end of each of this program's query rows.
        if CTX_2D:
            row_end = tl.load(ctx_ptr + b64 * stride_ctx + t_rows, mask=t_rows < NEXT_N, other=0)
        else:
            row_end = tl.load(ctx_ptr + b64 * stride_ctx) - NEXT_N + 1 + t_rows
        # Queries and weights of this request's rows.
        q_offs = b64 * stride_qb + c_t[:, None] * stride_qt + c_h[:, None] * stride_qh + dq[None, :]
        q_raw = tl.load(q_ptr + q_offs, mask=c_ok[:, None], other=0.0)
        if FMT == 0:
            q_op = q_raw
        else:
            q_sf = tl.load(q_sf_ptr + b64 * stride_sfb + c_t * stride_sft + c_h, mask=c_ok, other=0)
            q_op = _dequant_tile(q_raw, q_sf, NC, D, FMT)
        w = tl.load(w_ptr + (b64 * NEXT_N + c_t) * stride_w + c_h, mask=c_ok, other=0.0).to(tl.float32)

        for tile in tl.range(chunk_lo // BLOCK_N, tl.cdiv(hi_tok, BLOCK_N), num_stages=NUM_STAGES):
            j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            page_idx = j // BLOCK_KV
            in_table = page_idx < max_blocks
            j_ok = j < hi_tok
            ld_ok = j_ok & in_table
            page = tl.gather(chunk_pages, page_idx - first_page, 0).to(tl.int64)
            slot = j % BLOCK_KV
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
            tl.store(out_rows[None, :] + j[:, None], logits.to(out_rows.dtype.element_ty),
                     mask=j_ok[:, None] & (t_rows < NEXT_N)[None, :])
    if CLEAN:
        # -inf in this chunk's columns past the request's key extent (the tiles wrote the rest).
        f = tl.arange(0, BLOCK_FILL)
        fill = tl.full((ROWS, BLOCK_FILL), float("-inf"), tl.float32).to(out_rows.dtype.element_ty)
        fill_hi = tl.minimum(chunk_lo + CHUNK, max_context_len)
        for c0 in range(tl.maximum(chunk_lo, key_len), fill_hi, BLOCK_FILL):
            col = c0 + f
            tl.store(out_rows[:, None] + col[None, :], fill, mask=(t_rows < NEXT_N)[:, None] & (col < fill_hi)[None, :])
