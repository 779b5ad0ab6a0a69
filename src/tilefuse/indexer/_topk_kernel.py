"""Triton kernel of the chunked top-k: merge one chunk of logits into a running per-row top-k.

Each (position, value) pair becomes one int64 key whose signed order is the contract's order:

* high 32 bits: the fp32 value's bits mapped to an int32 of the same order (negative values
  have their magnitude bits flipped); ``-0.0`` maps like ``+0.0`` (they tie, as IEEE compares
  them) and every NaN maps to ``INT32_MIN``, below ``-inf``: a NaN logit ranks after every
  number and before the ``-1`` padding, ties among NaNs broken by position;
* low 32 bits: ``0x7FFFFFFF - position``, so of equal values the smaller position is larger.

Keys are unique per row (the position is in them), so the order is total and the result
exact whatever the ties. ``INT64_MIN`` is the empty slot (no valid key reaches it: positions
stay below ``2^31 - 1``); it decodes to index ``-1`` and value ``-inf``.

A row's state is ``W`` keys (``W`` a power of two >= topk) sorted descending in a workspace
between chunks and in registers inside one; its ``topk``-th key is the bar a new key must beat.
A chunk is scanned in blocks of ``W / 4`` columns: the keys above the bar are compacted (a
prefix sum of the mask gives each its slot) into the row's candidate buffer of ``W`` keys in
global memory, and the buffer is merged into the state only when it could overflow with the
next block, and at the last chunk's end (its keys and count carry over the other chunk ends).
The merge sorts the buffer ascending, takes the elementwise maximum with the descending state
(the ``W`` largest of both, as a bitonic sequence) and sorts that with a bitonic merge
(``log2 W`` stages); then the bar rises. Keys below a bar are below the final ``topk``-th key
(bars only rise), so dropping them is exact. A program of one row first raises its bar from a
histogram of the first chunk's keys (``_radix_bar``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilefuse import _errors
from tilefuse._errors_kernel import report_error

EMPTY_KEY = tl.constexpr(-(2**63))
_INT32_MIN = tl.constexpr(-(2**31))
_POS_MASK = tl.constexpr(0x7FFFFFFF)
_WINDOW_START_NEGATIVE = tl.constexpr(_errors.WINDOW_START_NEGATIVE)
_WINDOW_INVERTED = tl.constexpr(_errors.WINDOW_INVERTED)
_CONTEXT_LEN_NEGATIVE = tl.constexpr(_errors.CONTEXT_LEN_NEGATIVE)
_CONTEXT_LEN_PAST_WIDTH = tl.constexpr(_errors.CONTEXT_LEN_PAST_WIDTH)
_CONTEXT_LEN_PAST_TABLE = tl.constexpr(_errors.CONTEXT_LEN_PAST_TABLE)

# Window modes: how a row's valid positions [start, end) come from the arguments.
# (Plain ints for the launch site, constexpr copies for the kernels.)
WIN_PREFILL = 0  # start = ks[row], end = min(ke[row], n_keys)
WIN_DECODE_1D = 1  # start = 0, end = ctx[b] - next_n + 1 + t (row = b * next_n + t)
WIN_DECODE_2D = 2  # start = 0, end = ctx[b, t]
_WIN_PREFILL = tl.constexpr(WIN_PREFILL)
_WIN_DECODE_1D = tl.constexpr(WIN_DECODE_1D)


@triton.jit
def _order_keys(values, pos):
    """int64 keys of fp32 ``values`` at int32 ``pos`` (see the module docstring)."""
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _INT32_MIN, 0, bits)  # -0.0 -> +0.0
    ordered = bits ^ ((bits >> 31) & _POS_MASK)
    ordered = tl.where(values != values, _INT32_MIN, ordered)
    return (ordered.to(tl.int64) << 32) | (-pos + _POS_MASK).to(tl.int64)


@triton.jit
def _row_window(win_a_ptr, win_b_ptr, row, row_base, n_keys, key_limit, next_n, ctx_stride, err_ptr,
                MODE: tl.constexpr, CHECK: tl.constexpr):
    """A row's valid ``[start, end)``, clamped to ``[0, n_keys]``; with CHECK, bad values are
    reported (decode: a length over ``n_keys`` = max_context_len, or over ``key_limit`` = the
    keys the block table holds)."""
    if MODE == _WIN_PREFILL:
        ks = tl.load(win_a_ptr + row)
        ke = tl.load(win_b_ptr + row)
        if CHECK:
            report_error(err_ptr, _WINDOW_START_NEGATIVE, ks < 0, (row + row_base).to(tl.int32))
            report_error(err_ptr, _WINDOW_INVERTED, ks > ke, (row + row_base).to(tl.int32))
        start = tl.minimum(tl.maximum(ks, 0), n_keys)
        end = tl.maximum(tl.minimum(ke, n_keys), start)
    else:
        b = (row // next_n).to(tl.int32)
        if MODE == _WIN_DECODE_1D:
            ctx = tl.load(win_a_ptr + b)
            end = ctx - next_n + 1 + row % next_n
        else:
            ctx = tl.load(win_a_ptr + b * ctx_stride + row % next_n)
            end = ctx
        if CHECK:
            report_error(err_ptr, _CONTEXT_LEN_NEGATIVE, ctx < 0, b)
            report_error(err_ptr, _CONTEXT_LEN_PAST_WIDTH, ctx > n_keys, b)
            report_error(err_ptr, _CONTEXT_LEN_PAST_TABLE, ctx > key_limit, b)
        end = tl.minimum(tl.maximum(end, 0), n_keys)
        start = end * 0
    return start, end


@triton.jit
def _half_clean(x, ROWS: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr, flip):
    """Compare-and-swap of every pair ``(i, i + HALF)`` inside blocks of ``2 * HALF`` along each
    row of ``x [ROWS, W]``: the smaller first, or the larger where ``flip`` (per block or a
    scalar) is 1. Pairs are split out with reshapes, so no cross-lane reductions are needed."""
    n: tl.constexpr = ROWS * W // (2 * HALF)
    a, b = tl.split(tl.permute(tl.reshape(x, [n, 2, HALF]), (0, 2, 1)))
    lo = tl.minimum(a, b)
    hi = tl.maximum(a, b)
    swap = flip != 0
    pairs = tl.join(tl.where(swap, hi, lo), tl.where(swap, lo, hi))
    return tl.reshape(tl.permute(pairs, (0, 2, 1)), [ROWS, W])


@triton.jit
def _sort_rows(x, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr, DESCENDING: tl.constexpr):
    """Bitonic sort of each row of ``x [ROWS, W]``."""
    for k in tl.static_range(1, LOG_W):
        for i in tl.static_range(k):
            # Pairs (j, j + 2^(k-1-i)); blocks of 2^k alternate direction (as the final direction:
            # flipped when descending); a row's length is a multiple of 2^(k+1), so the parity is
            # the same counted per row.
            block = (tl.arange(0, ROWS * W >> (k - i)) << (k - i)) >> k
            x = _half_clean(x, ROWS, W, 1 << (k - 1 - i), ((block & 1) ^ DESCENDING)[:, None])
    return _merge_bitonic(x, ROWS, W, LOG_W, DESCENDING)


@triton.jit
def _merge_bitonic(x, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr, DESCENDING: tl.constexpr):
    """Sort each row of ``x [ROWS, W]``, a bitonic sequence: LOG_W half-cleaner stages instead
    of a full sort's LOG_W * (LOG_W + 1) / 2."""
    for i in tl.static_range(LOG_W):
        x = _half_clean(x, ROWS, W, W >> (i + 1), DESCENDING)
    return x


@triton.jit
def _kth(state, slot, TOPK: tl.constexpr):
    """Each row's TOPK-th key (the bar a new key must clear), ``[ROWS]``."""
    return tl.max(tl.where(slot[None, :] == TOPK - 1, state, EMPTY_KEY), axis=1)


@triton.jit
def _merge_candidates(state, cand_rows, count, slot, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """``state`` with each row's first ``count`` keys of its candidate buffer merged in."""
    # The candidates were stored by other threads of the program; the barrier after the load
    # keeps the next block's stores behind it.
    tl.debug_barrier()
    cand = tl.load(cand_rows + slot[None, :], mask=slot[None, :] < count[:, None], other=EMPTY_KEY)
    tl.debug_barrier()
    # Candidates ascending against the state descending: the elementwise maximum is the W
    # largest of both, bitonic.
    return _merge_bitonic(tl.maximum(state, _sort_rows(cand, ROWS, W, LOG_W, 0)), ROWS, W, LOG_W, 1)


@triton.jit
def _radix_bar(row_logits, lo, hi, walk_lo, n_scan, chunk_lo, kth, TOPK: tl.constexpr, BLOCK: tl.constexpr,
               BITS: tl.constexpr):
    """One row's bar raised by a histogram of its keys in this chunk (ROWS = 1): the keys' top
    BITS bits (an arithmetic shift keeps their order) counted over the ``n_scan`` blocks of the
    walk; the highest bin whose keys and those of the bins above number ``TOPK`` or more holds
    the chunk's TOPK-th key, which the final TOPK-th key cannot be below. So every key below
    that bin's lowest key can be dropped: the bar becomes that key - 1, if higher."""
    BINS: tl.constexpr = 1 << BITS
    SHIFT: tl.constexpr = 64 - BITS
    col = tl.arange(0, BLOCK)
    hist = tl.zeros([BINS], tl.int32)
    for i in range(0, n_scan):
        pos = walk_lo + i * BLOCK + col
        inside = (pos >= lo) & (pos < hi)
        v = tl.load(row_logits + (pos - chunk_lo), mask=inside, other=0.0).to(tl.float32)
        bins = ((_order_keys(v, pos) >> SHIFT) + BINS // 2).to(tl.int32)
        hist += tl.histogram(bins, BINS, mask=inside)
    # Keys in bins >= b, for b from the top: the first rank that reaches TOPK names the bin.
    from_top = tl.cumsum(tl.flip(hist, 0), 0)
    rank = tl.min(tl.where(from_top >= TOPK, tl.arange(0, BINS), BINS), axis=0)
    b = BINS - 1 - rank
    # Bin 0 (and no bin: fewer keys than TOPK) raise nothing; bin 0's lowest key is EMPTY_KEY.
    edge = (b - BINS // 2).to(tl.int64) << SHIFT
    return tl.where(b > 0, tl.maximum(kth, edge - 1), kth)


# Runtime ints that change with the shape or the chunk: not specialised, so no recompiles.
@triton.jit(do_not_specialize=["n_rows", "row_base", "stride_l", "stride_s", "stride_c", "n_keys", "key_limit",
                               "next_n", "ctx_stride", "chunk_lo", "chunk_width", "stride_i", "stride_v"])
def topk_merge_chunk_kernel(
    logits_ptr, stride_l,
    state_ptr, stride_s,
    cand_ptr, stride_c, count_ptr,
    n_rows, row_base, win_a_ptr, win_b_ptr, n_keys, key_limit, next_n, ctx_stride,
    chunk_lo, chunk_width,
    idx_ptr, stride_i, val_ptr, stride_v,
    err_ptr,
    TOPK: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr,
    FIRST: tl.constexpr, FINAL: tl.constexpr, WRITE_VALUES: tl.constexpr, RADIX_BITS: tl.constexpr = 0,
):
    """ROWS rows a program: merge each row's valid keys of logits columns ``[0, chunk_width)``
    (positions ``chunk_lo + c``) into its state; FIRST starts from an empty state (and checks the
    rows' windows), FINAL writes the first TOPK indices (and values) instead of the state.
    ``cand_ptr`` holds W keys a row (the candidate buffer) and ``count_ptr`` how many each row's
    holds between launches: the buffer is merged when it could overflow and at the last chunk
    only, so its keys carry over chunk ends (FIRST starts it empty).

    The rows walk the union of their windows in blocks of W / 4 columns (rows of one program
    have near windows in the usual layouts: causal, zig-zag, decode), each row masked to its
    own; the candidates of all rows are merged when any row's buffer could overflow."""
    tl.static_assert(W >= TOPK)
    tl.static_assert(W == 1 << LOG_W)
    BLOCK: tl.constexpr = W // 4
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = row < n_rows
    row = tl.where(live, row, 0)  # dead rows reread row 0 and store nothing
    start, end = _row_window(win_a_ptr, win_b_ptr, row, row_base, n_keys, key_limit, next_n, ctx_stride, err_ptr, MODE,
                             FIRST)
    lo = tl.maximum(start, chunk_lo)
    hi = tl.where(live, tl.minimum(end, chunk_lo + chunk_width), lo)
    slot = tl.arange(0, W)
    cell = row[:, None] * stride_s + slot[None, :]
    if FIRST:
        # Empty, as a load that reads nothing: with a constant here, triton 3.6 never finishes
        # compiling the variants that store the state at small ROWS x W (its layout-conversion
        # pass loops); the load gives the state the layout of its store.
        state = tl.load(state_ptr + cell, mask=row[:, None] < 0, other=EMPTY_KEY)
    else:
        state = tl.load(state_ptr + cell)
    kth = _kth(state, slot, TOPK)
    cand_rows = cand_ptr + row[:, None] * stride_c
    # Keys in each row's candidate buffer, <= W - BLOCK between blocks (and chunks).
    if FIRST:
        count = tl.zeros([ROWS], tl.int32)
    else:
        count = tl.load(count_ptr + row, mask=live, other=0)
    walk_lo = tl.min(tl.where(lo < hi, lo, chunk_lo + chunk_width), axis=0)
    walk_hi = tl.max(tl.where(lo < hi, hi, 0), axis=0)
    row_logits = logits_ptr + row[:, None] * stride_l
    col = tl.arange(0, BLOCK)
    # Counted from the span, so that no loop bound passes the int32 range; at the last chunk one
    # block past the walk's end (nothing inside it) merges what the buffers still hold.
    n_span = tl.cdiv(tl.maximum(walk_hi - walk_lo, 0), BLOCK)
    if FINAL:
        n_blocks = n_span + 1
    else:
        n_blocks = n_span
    if RADIX_BITS > 0 and FIRST:  # later chunks: the state's bar is already the k-th of more keys
        tl.static_assert(ROWS == 1)
        kth = _radix_bar(logits_ptr + row * stride_l, lo, hi, walk_lo, n_span, chunk_lo, kth, TOPK, BLOCK,
                         RADIX_BITS)
    for i in range(0, n_blocks):
        pos = walk_lo + i * BLOCK + col[None, :]
        inside = (pos >= lo[:, None]) & (pos < hi[:, None])
        v = tl.load(row_logits + (pos - chunk_lo), mask=inside, other=0.0).to(tl.float32)
        keys = _order_keys(v, pos)
        above = inside & (keys > kth[:, None])
        taken = above.to(tl.int32)
        # Slots count[r] .. count[r] + BLOCK - 1 < W: in the buffer whatever the values.
        tl.store(cand_rows + (count[:, None] + tl.cumsum(taken, axis=1) - 1), keys, mask=above)
        count += tl.sum(taken, axis=1)
        most = tl.max(count, axis=0)
        if (most > W - BLOCK) | (FINAL & (i == n_blocks - 1) & (most > 0)):
            state = _merge_candidates(state, cand_rows, count, slot, ROWS, W, LOG_W)
            kth = _kth(state, slot, TOPK)
            count = tl.zeros([ROWS], tl.int32)
    if FINAL:
        out = live[:, None] & (slot[None, :] < TOPK)
        empty = state == EMPTY_KEY
        idx = tl.where(empty, -1, -state.to(tl.int32) + _POS_MASK)  # the low 32 bits
        tl.store(idx_ptr + row[:, None] * stride_i + slot[None, :], idx, mask=out)
        if WRITE_VALUES:
            hi_bits = (state >> 32).to(tl.int32)
            bits = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ _POS_MASK)
            val = tl.where(empty, float("-inf"), bits.to(tl.float32, bitcast=True))
            tl.store(val_ptr + row[:, None] * stride_v + slot[None, :], val.to(val_ptr.dtype.element_ty), mask=out)
    else:
        tl.store(state_ptr + cell, state, mask=live[:, None])
        tl.store(count_ptr + row, count, mask=live)
