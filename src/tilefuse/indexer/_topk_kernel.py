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

A row's candidates live in a buffer of ``CAP = 2 W`` keys (``W`` a power of two >= topk) in
global memory, with a count and a bar carried between chunks: every key in the buffer is above
the bar, and the row's final ``topk`` keys are among them. A chunk is scanned in blocks of
``W / 2`` columns: the keys above the bar are compacted into the buffer (a prefix sum of the
mask gives each its slot). When the buffer could overflow with the next block, a **select**
shrinks it to exactly its ``topk`` largest keys: its ``topk``-th key is found by counting the
keys at or above a bound halved pass by pass (``_select``), the keys at or above it are compacted
back and it becomes the bar. Keys below a bar are below the final ``topk``-th key (bars only
rise), so dropping them is exact. The last chunk ends with a select and one bitonic sort of the
``W`` survivors: a row is sorted once, whatever its length.
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

# Rows split over programs (``topk_rows_pass_kernel``): the keys' top RADIX_LEVELS digits of
# RADIX_BITS each (the first signed: the keys' order is signed). 8-bit digits: `tl.histogram`'s
# work per key grows with the bins a lane owns (8 at 256 bins, 64 at 2048), so three narrow
# passes cost less than two 11-bit ones (a 256-bin pass measured ~1.1 SM cycles a key on the
# H200: benchmarks/NOTES.md).
RADIX_BITS = 8
RADIX_LEVELS = 3
_RADIX_BITS = tl.constexpr(RADIX_BITS)
_RADIX_LEVELS = tl.constexpr(RADIX_LEVELS)
_RADIX_BINS = tl.constexpr(1 << RADIX_BITS)


def pass_levels(maxima: bool) -> int:
    """The digit passes of ``topk_rows_pass_kernel`` before its compaction (the PASS of that
    number): RADIX_LEVELS over the keys; over group maxima one fewer, since the last step then
    selects from the top and the bar need only lie at or below the row's topk-th key: a 16-bit
    bar keeps the keys of one 16-bit bin more than a 24-bit bar would, a small share of a row."""
    return RADIX_LEVELS - 1 if maxima else RADIX_LEVELS


# A select holds its buffer's high words in registers up to this many a program (16 a thread
# at topk 2048's 8 warps; larger buffers would spill them, so they are counted from memory).
# The first chunk's group maxima (``_groups_bar``) are held the same way, so the merge's launch
# asks for them only where its 2 W words a row fit this.
SELECT_HELD_KEYS = 4096
_SELECT_HELD_KEYS = tl.constexpr(SELECT_HELD_KEYS)


@triton.jit
def _order_words(values):
    """The keys' high words: fp32 ``values`` as int32 of the same order (see the module docstring)."""
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _INT32_MIN, 0, bits)  # -0.0 -> +0.0
    ordered = bits ^ ((bits >> 31) & _POS_MASK)
    return tl.where(values != values, _INT32_MIN, ordered)


@triton.jit
def _order_keys(values, pos):
    """int64 keys of fp32 ``values`` at int32 ``pos`` (see the module docstring)."""
    return (_order_words(values).to(tl.int64) << 32) | (-pos + _POS_MASK).to(tl.int64)


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
    # One compare a pair and two selects a word, the direction folded into the compare's
    # predicate (a minimum, a maximum and a choice between them took twice the instructions).
    # Equal keys (only empty slots) may swap: the result is the same.
    swap = (a > b) != (flip != 0)
    pairs = tl.join(tl.where(swap, b, a), tl.where(swap, a, b))
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
def _buffer_piece(cand_rows, p, piece, count, PIECE: tl.constexpr):
    """Piece ``p`` of each row's buffer (slots ``p * PIECE + piece``): ``(valid, keys)``, the
    slots past a row's ``count`` empty."""
    slot = p * PIECE + piece[None, :]
    valid = slot < count[:, None]
    return valid, tl.load(cand_rows + slot, mask=valid, other=EMPTY_KEY)


@triton.jit
def _kth_bins(hist, need, b_idx):
    """Per row of ``hist [ROWS, BINS]``: the highest bin whose keys, with those of the bins
    above it, number at least ``need``; the keys in that bin; the keys in the bins above it."""
    from_top = tl.flip(tl.cumsum(tl.flip(hist, 1), 1), 1)
    b = tl.max(tl.where(from_top >= need[:, None], b_idx, -1), axis=1)
    in_b = tl.sum(tl.where(b_idx == b[:, None], hist, 0), axis=1)
    above = tl.sum(tl.where(b_idx > b[:, None], hist, 0), axis=1)
    return b, in_b, above


@triton.jit
def _rows_prefix_and_need(hist_rows, topk, DIGITS: tl.constexpr):
    """From the passes' histograms (``hist_rows [ROWS, 1]``: each row's RADIX_LEVELS x
    2^RADIX_BITS counts, level d's bins counting the keys that share the digits chosen at the
    levels above): each row's topk-th key's top DIGITS digits as a signed number, and how many
    of the keys sharing them belong to the row's top ``topk`` (the keys above those digits all
    do). A row of fewer than topk keys keeps all: its bins are its lowest. After the last pass,
    the radix select's state after its first RADIX_LEVELS passes, read instead of counted again."""
    b_idx = tl.arange(0, _RADIX_BINS)[None, :]
    hist = tl.load(hist_rows + b_idx)
    need = tl.minimum(tl.sum(hist, axis=1), topk)
    b, _, above = _kth_bins(hist, need, b_idx)
    prefix = (b - _RADIX_BINS // 2).to(tl.int64)
    need -= above
    for d in tl.static_range(1, DIGITS):
        b, _, above = _kth_bins(tl.load(hist_rows + d * _RADIX_BINS + b_idx), need, b_idx)
        prefix = (prefix << _RADIX_BITS) | b.to(tl.int64)
        need -= above
    return prefix, need


@triton.jit
def _quarter_slots(start, t0, t1, t2, t3):
    """Slots after ``start`` (a row's next free slot) for four quarters' keys, ``t0`` .. ``t3``
    ones where a thread's key of that quarter is taken: one prefix sum of the threads' totals,
    a thread's keys stored one after another. ``(s0, s1, s2, s3, taken)``: each quarter's slots
    and the keys each row takes."""
    total = t0 + t1 + t2 + t3
    s0 = start[:, None] + tl.cumsum(total, axis=1) - total
    return s0, s0 + t0, s0 + t0 + t1, s0 + t0 + t1 + t2, tl.sum(total, axis=1)


@triton.jit
def _compact(cand_rows, count, bar, thr, n_pieces, TOPK: tl.constexpr, ROWS: tl.constexpr, PIECE: tl.constexpr):
    """The rows holding more than TOPK keys keep their keys ``>= thr`` (TOPK of them), moved to
    the buffer's start piece by piece: a piece's kept keys go below its own end, so no piece is
    overwritten before every thread has read it. ``(count, bar)`` after it. A piece is read as
    four coalesced quarters, one key each a thread, with one prefix sum of the threads' totals
    (as the merge's scan: the kept keys' order becomes the threads')."""
    quarter = tl.arange(0, PIECE // 4)
    shrunk = count > TOPK
    moved = shrunk[:, None]
    kept = tl.zeros([ROWS], tl.int32)
    new_bar = tl.full([ROWS], 0x7FFFFFFFFFFFFFFF, tl.int64)
    for p in range(0, n_pieces):
        v0, x0 = _buffer_piece(cand_rows, 4 * p, quarter, count, PIECE // 4)
        v1, x1 = _buffer_piece(cand_rows, 4 * p + 1, quarter, count, PIECE // 4)
        v2, x2 = _buffer_piece(cand_rows, 4 * p + 2, quarter, count, PIECE // 4)
        v3, x3 = _buffer_piece(cand_rows, 4 * p + 3, quarter, count, PIECE // 4)
        k0, k1 = v0 & (x0 >= thr[:, None]), v1 & (x1 >= thr[:, None])
        k2, k3 = v2 & (x2 >= thr[:, None]), v3 & (x3 >= thr[:, None])
        d0, d1, d2, d3, taken = _quarter_slots(kept, k0.to(tl.int32), k1.to(tl.int32), k2.to(tl.int32),
                                               k3.to(tl.int32))
        tl.debug_barrier()  # every thread has read this piece before it is overwritten
        tl.store(cand_rows + d0, x0, mask=k0 & moved)
        tl.store(cand_rows + d1, x1, mask=k1 & moved)
        tl.store(cand_rows + d2, x2, mask=k2 & moved)
        tl.store(cand_rows + d3, x3, mask=k3 & moved)
        kept += taken
        least = tl.minimum(tl.minimum(tl.where(k0, x0, 0x7FFFFFFFFFFFFFFF), tl.where(k1, x1, 0x7FFFFFFFFFFFFFFF)),
                           tl.minimum(tl.where(k2, x2, 0x7FFFFFFFFFFFFFFF), tl.where(k3, x3, 0x7FFFFFFFFFFFFFFF)))
        new_bar = tl.minimum(new_bar, tl.min(least, axis=1))
    tl.debug_barrier()  # the compacted buffer is read by other threads next
    count = tl.where(shrunk, kept, count)
    bar = tl.where(shrunk, new_bar, bar)
    return count, bar


@triton.jit
def _count_at_least(words, valid, t):
    """Per row: how many of its valid ``words`` are >= ``t`` (one int32 a row)."""
    return tl.sum((valid & (words >= t[:, None])).to(tl.int32), axis=1)


@triton.jit
def _count_in_memory(pairs, count, t, value, n_tiles, TIES: tl.constexpr, TILE: tl.constexpr):
    """``_count_at_least`` over a row's first ``count`` keys read from memory TILE at a time
    (``pairs``: the buffer as int32 words, low then high): the keys whose high word is >= t, or
    (TIES) whose high word is ``value`` and low word >= t."""
    c = tl.zeros(count.shape, tl.int32)
    slot0 = tl.arange(0, TILE)[None, :]
    for i in range(0, n_tiles):
        slot = i * TILE + slot0
        valid = slot < count[:, None]
        hi_word = tl.load(pairs + 2 * slot + 1, mask=valid, other=_INT32_MIN)
        if TIES:
            lo_word = tl.load(pairs + 2 * slot, mask=valid, other=0)
            c += tl.sum((valid & (hi_word == value[:, None].to(tl.int32)) & (lo_word >= t[:, None])).to(tl.int32),
                        axis=1)
        else:
            c += _count_at_least(hi_word, valid, t)
    return c


@triton.jit
def _bisect_rank(words, valid, need, lo, hi, at_lo, above_hi, pairs, count, value, n_tiles,
                 IN_MEMORY: tl.constexpr, TIES: tl.constexpr, TILE: tl.constexpr):
    """Per row, the largest ``t`` in ``[lo, hi]`` with at least ``need`` valid ``words`` >= t,
    by halving the interval (one count a pass). Invariants on entry: ``at_lo`` words are >= lo
    (at least ``need``) and ``above_hi`` (fewer than ``need``) are > hi. Returns ``(t, at_t,
    above_t)``: the words >= t and > t. A pass that finds exactly ``need`` words >= its midpoint
    stops the row there (those words are the answer whatever lies below). IN_MEMORY: the words
    are counted from memory instead (``_count_in_memory``; ``words``, ``valid`` unused)."""
    while tl.max((lo < hi).to(tl.int32), axis=0) > 0:
        open_ = lo < hi
        mid = (lo + (hi - lo + 1) // 2).to(tl.int32)  # in [lo, hi]: fits the words' type
        if IN_MEMORY:
            c = _count_in_memory(pairs, count, mid, value, n_tiles, TIES, TILE)
        else:
            c = _count_at_least(words, valid, mid)
        up = open_ & (c >= need)
        down = open_ & (c < need)
        lo = tl.where(up, mid, lo)
        at_lo = tl.where(up, c, at_lo)
        hi = tl.where(down, mid - 1, tl.where(up & (c == need), mid, hi))
        above_hi = tl.where(down, c, above_hi)
    return lo, at_lo, above_hi


@triton.jit
def _interval_below_prefix(prefix0, need0, TOPK: tl.constexpr, START: tl.constexpr):
    """The search's start when the TOPK-th key's top START * RADIX_BITS bits are ``prefix0``
    and ``need0`` of the keys sharing them are wanted: ``(lo, hi, above)``, the high words
    sharing that prefix and the keys above them (TOPK - need0)."""
    KNOWN: tl.constexpr = 32 - START * _RADIX_BITS  # the high word's bits below the prefix
    lo = prefix0 << KNOWN
    hi = ((prefix0 + 1) << KNOWN) - 1
    return lo, hi, (TOPK - need0).to(tl.int32)


@triton.jit
def _kth_key_in_memory(cand_rows, count, prefix0, need0, TOPK: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
                       START: tl.constexpr):
    """``_kth_key_in_registers``' search with every pass reading the buffer from memory TILE keys
    at a time: for buffers too large to hold (topk above 2048), and for candidates after the
    passes that outnumber the buffer (many keys tied with the TOPK-th in its top START *
    RADIX_BITS bits)."""
    pairs = cand_rows.to(tl.pointer_type(tl.int32))
    n_tiles = tl.cdiv(tl.max(count, axis=0), TILE)
    shrunk = count > TOPK
    if START == 0:
        lo = tl.full([ROWS], 0x7FFFFFFF, tl.int32)
        hi = tl.full([ROWS], _INT32_MIN, tl.int32)
        slot0 = tl.arange(0, TILE)[None, :]
        for i in range(0, n_tiles):
            slot = i * TILE + slot0
            valid = slot < count[:, None]
            hi_word = tl.load(pairs + 2 * slot + 1, mask=valid, other=_INT32_MIN)
            lo = tl.minimum(lo, tl.min(tl.where(valid, hi_word, 0x7FFFFFFF), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(valid, hi_word, _INT32_MIN), axis=1))
        lo = lo.to(tl.int64)
        hi = hi.to(tl.int64)
        above = tl.zeros([ROWS], tl.int32)
    else:
        lo, hi, above = _interval_below_prefix(prefix0, need0, TOPK, START)
    lo = tl.where(shrunk, lo, hi)
    value, at_value, above = _bisect_rank(count, count, TOPK, lo, hi, count, above, pairs, count, lo, n_tiles, True,
                                          False, TILE)
    thr = value << 32
    ties = shrunk & (at_value > TOPK)
    if tl.max(ties.to(tl.int32), axis=0) > 0:
        # Low words of valid keys lie in [1, 0x7FFFFFFF]: the interval needs no pass of its own.
        hi2 = tl.full([ROWS], 0x7FFFFFFF, tl.int64)
        lo2 = tl.where(ties, 0, hi2)
        low, _, _ = _bisect_rank(count, count, TOPK - above, lo2, hi2, at_value - above, tl.zeros([ROWS], tl.int32),
                                 pairs, count, value, n_tiles, True, True, TILE)
        thr = tl.where(ties, thr | low, thr)
    return thr


@triton.jit
def _kth_key_in_registers(cand_rows, count, prefix0, need0, TOPK: tl.constexpr, ROWS: tl.constexpr,
                          CAP: tl.constexpr, START: tl.constexpr):
    """The TOPK-th key of each row holding more than TOPK (and at most CAP) keys: ``_select``'s
    search over the buffer's high words held in registers."""
    slot = tl.arange(0, CAP)[None, :]
    valid = slot < count[:, None]
    pairs = cand_rows.to(tl.pointer_type(tl.int32)) + 2 * slot  # little-endian: low word, high word
    hi_word = tl.load(pairs + 1, mask=valid, other=_INT32_MIN)
    shrunk = count > TOPK
    if START == 0:
        lo = tl.min(tl.where(valid, hi_word, 0x7FFFFFFF), axis=1).to(tl.int64)
        hi = tl.max(tl.where(valid, hi_word, _INT32_MIN), axis=1).to(tl.int64)
        above = tl.zeros([ROWS], tl.int32)
    else:
        lo, hi, above = _interval_below_prefix(prefix0, need0, TOPK, START)
    lo = tl.where(shrunk, lo, hi)  # rows that keep what they hold search nothing
    value, at_value, above = _bisect_rank(hi_word, valid, TOPK, lo, hi, count, above, pairs, count, lo, 0, False,
                                          False, 16)
    thr = value << 32
    # Keys tied at that value across the TOPK-th: their positions decide (low words, unique).
    ties = shrunk & (at_value > TOPK)
    if tl.max(ties.to(tl.int32), axis=0) > 0:
        tied = valid & (hi_word == value[:, None].to(tl.int32)) & ties[:, None]
        lo_word = tl.load(pairs, mask=tied, other=0)  # 0x7FFFFFFF - position: >= 1 for a valid key
        lo2 = tl.min(tl.where(tied, lo_word, 0x7FFFFFFF), axis=1).to(tl.int64)
        hi2 = tl.max(tl.where(tied, lo_word, 0), axis=1).to(tl.int64)
        lo2 = tl.where(ties, lo2, hi2)
        low, _, _ = _bisect_rank(lo_word, tied, TOPK - above, lo2, hi2, at_value - above,
                                 tl.zeros([ROWS], tl.int32), pairs, count, lo, 0, False, False, 16)
        thr = tl.where(ties, thr | low, thr)
    return thr


@triton.jit
def _select(cand_rows, count, bar, prefix0, need0, TOPK: tl.constexpr, ROWS: tl.constexpr, CAP: tl.constexpr,
            PIECE: tl.constexpr, START: tl.constexpr, AFTER_PASSES: tl.constexpr):
    """Each row's buffer (its first ``count`` keys) cut to its TOPK largest keys, compacted to
    the buffer's start: ``(count, bar)`` after it. Rows holding TOPK keys or fewer keep them.

    The TOPK-th key is found by counts, not histograms: the buffer's high words (the values)
    held in registers, an interval of them halved until exactly TOPK keys lie at or above its
    midpoint or it is one value (one compare and one sum a key a pass); where values tie across
    the TOPK-th key, the same over the tied keys' low words (the positions: unique). START > 0:
    the top START * RADIX_BITS bits of the TOPK-th key are ``prefix0`` and ``need0`` of the keys
    sharing them are wanted (the keys above them number TOPK - need0), so the interval of high
    words starts 2^(32 - START * RADIX_BITS) wide. Buffers of more than _SELECT_HELD_KEYS keys a
    program (topk above 2048) and candidates after the passes that outnumber CAP (keys tied with
    the TOPK-th in those bits) are counted from memory instead, PIECE keys a row at a time.
    AFTER_PASSES: the candidates of the passes across programs, which may outnumber CAP (a
    scan keeps at most CAP keys a row)."""
    tl.debug_barrier()  # the buffer was stored by other threads of the program
    shrunk = count > TOPK
    if CAP > _SELECT_HELD_KEYS // ROWS:  # too many words to hold a thread: counted from memory
        thr = _kth_key_in_memory(cand_rows, count, prefix0, need0, TOPK, ROWS, PIECE, START)
    elif not AFTER_PASSES:
        thr = _kth_key_in_registers(cand_rows, count, prefix0, need0, TOPK, ROWS, CAP, START)
    elif tl.max(count, axis=0) <= CAP:
        thr = _kth_key_in_registers(cand_rows, count, prefix0, need0, TOPK, ROWS, CAP, START)
    else:  # after the passes: ties can leave more candidates than CAP
        thr = _kth_key_in_memory(cand_rows, count, prefix0, need0, TOPK, ROWS, PIECE, START)
    n_pieces = tl.cdiv(tl.max(tl.where(shrunk, count, 0), axis=0), PIECE)
    return _compact(cand_rows, count, bar, thr, n_pieces, TOPK, ROWS, PIECE)


@triton.jit
def _groups_bar(row_logits, walk_lo, walk_hi, lo, hi, chunk_lo, bar, TOPK: tl.constexpr, ROWS: tl.constexpr,
                CAP: tl.constexpr):
    """Each row's bar raised before its first chunk is scanned: the chunk's columns cut into CAP
    groups (group g: columns ``walk_lo + g + j CAP``), the largest high word ``t`` that at least
    TOPK groups' largest keys reach. Those keys are TOPK distinct keys of the row at or above
    ``t << 32``, so the row's final TOPK-th key is too, and dropping every key below it is exact.
    One read of the chunk (from L2) and one search over CAP words held in registers, against
    the selects of a scan from an empty bar (one per ~W / 2 keys taken). Rows with fewer than
    TOPK groups holding a number keep their bar."""
    col = tl.arange(0, CAP)[None, :]
    best = tl.full([ROWS, CAP], _INT32_MIN, tl.int32)
    for j in range(0, tl.cdiv(tl.maximum(walk_hi - walk_lo, 0), CAP)):
        pos = walk_lo + j * CAP + col
        inside = (pos >= lo[:, None]) & (pos < hi[:, None])
        v = tl.load(row_logits + (pos - chunk_lo), mask=inside, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.where(inside, _order_words(v), _INT32_MIN))
    valid = best > _INT32_MIN  # (a NaN's word is INT32_MIN too: such a group counts for nothing)
    n_valid = tl.sum(valid.to(tl.int32), axis=1)
    enough = n_valid >= TOPK
    hi_w = tl.max(best, axis=1).to(tl.int64)
    lo_w = tl.where(enough, tl.min(tl.where(valid, best, 0x7FFFFFFF), axis=1).to(tl.int64), hi_w)
    t, _, _ = _bisect_rank(best, valid, TOPK, lo_w, hi_w, n_valid, tl.zeros([ROWS], tl.int32), best, n_valid, lo_w,
                           0, False, False, 16)
    # t > INT32_MIN where enough: the bar stays above the empty key
    return tl.where(enough, tl.maximum(bar, (t << 32) - 1), bar)


@triton.jit
def _load_columns(row_logits, start, cols, lo, hi, chunk_lo):
    """fp32 logits of columns ``start + cols`` of each row, 0 outside its window (not read)."""
    pos = start + cols[None, :]
    inside = (pos >= lo[:, None]) & (pos < hi[:, None])
    return tl.load(row_logits + (pos - chunk_lo), mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _load_block(row_logits, start, quarter, lo, hi, chunk_lo, BLOCK: tl.constexpr):
    """The four quarters of the block of BLOCK columns at ``start`` (``_load_columns``)."""
    return (_load_columns(row_logits, start, quarter, lo, hi, chunk_lo),
            _load_columns(row_logits, start + BLOCK // 4, quarter, lo, hi, chunk_lo),
            _load_columns(row_logits, start + BLOCK // 2, quarter, lo, hi, chunk_lo),
            _load_columns(row_logits, start + 3 * (BLOCK // 4), quarter, lo, hi, chunk_lo))


@triton.jit
def _keys_above(v, start, cols, lo, hi, bar):
    """The keys of ``v`` (columns ``start + cols``, masked to each row's window) above the row's
    bar: ``(keys, above, taken)``, ``taken`` the same as int32 ones and zeros."""
    pos = start + cols[None, :]
    inside = (pos >= lo[:, None]) & (pos < hi[:, None])
    keys = _order_keys(v, pos)
    above = inside & (keys > bar[:, None])
    return keys, above, above.to(tl.int32)


@triton.jit
def _write_keys(idx_rows, val_rows, keys, slot, mask, WRITE_VALUES: tl.constexpr):
    """Store ``keys`` at ``slot`` of their rows: the position as the index (-1 for the empty
    key), with WRITE_VALUES the fp32 value (-inf for the empty key) in the output's dtype."""
    empty = keys == EMPTY_KEY
    idx = tl.where(empty, -1, -keys.to(tl.int32) + _POS_MASK)  # the low 32 bits
    tl.store(idx_rows + slot, idx, mask=mask)
    if WRITE_VALUES:
        hi_bits = (keys >> 32).to(tl.int32)
        bits = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ _POS_MASK)
        val = tl.where(empty, float("-inf"), bits.to(tl.float32, bitcast=True))
        tl.store(val_rows + slot, val.to(val_rows.dtype.element_ty), mask=mask)


@triton.jit
def _write_sorted(cand_rows, count, live, idx_rows, val_rows, TOPK: tl.constexpr, W: tl.constexpr,
                  LOG_W: tl.constexpr, ROWS: tl.constexpr, WRITE_VALUES: tl.constexpr):
    """The first ``count`` keys of each row's buffer (at most W: after a select) sorted and
    written as the row's first TOPK results (-1 past ``count``)."""
    tl.debug_barrier()  # the buffer was compacted by other threads of the program
    w_slot = tl.arange(0, W)
    x = tl.load(cand_rows + w_slot[None, :], mask=w_slot[None, :] < count[:, None], other=EMPTY_KEY)
    state = _sort_rows(x, ROWS, W, LOG_W, 1)
    _write_keys(idx_rows, val_rows, state, w_slot[None, :], live[:, None] & (w_slot[None, :] < TOPK), WRITE_VALUES)


# Runtime ints that change with the shape or the chunk: not specialised, so no recompiles.
@triton.jit(do_not_specialize=["n_rows", "row_base", "stride_l", "stride_c", "n_keys", "key_limit",
                               "next_n", "ctx_stride", "chunk_lo", "chunk_width", "stride_i", "stride_v"])
def topk_merge_chunk_kernel(
    logits_ptr, stride_l,
    bar_ptr, cand_ptr, stride_c, count_ptr, hist_ptr,
    n_rows, row_base, win_a_ptr, win_b_ptr, n_keys, key_limit, next_n, ctx_stride,
    chunk_lo, chunk_width,
    idx_ptr, stride_i, val_ptr, stride_v,
    err_ptr,
    TOPK: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr,
    FIRST: tl.constexpr, FINAL: tl.constexpr, WRITE_VALUES: tl.constexpr, PIECE: tl.constexpr,
    RESET: tl.constexpr, GROUPS_BAR: tl.constexpr,
):
    """ROWS rows a program: collect each row's valid keys of logits columns ``[0, chunk_width)``
    (positions ``chunk_lo + c``) above its bar into its candidate buffer (``cand_ptr``: 2 W keys
    a row; ``count_ptr`` / ``bar_ptr``: its count and bar between launches). FIRST starts empty
    (and checks the rows' windows), FINAL writes the first TOPK indices (and values).
    RESET (with FINAL, after ``topk_rows_pass_kernel``'s passes; 1: over the keys, 2: over
    group maxima): each row's count and its histograms (``hist_ptr``: RADIX_LEVELS x
    2^RADIX_BITS int32 a row) stored back as zeros, ready for the next call's passes; no launch
    of the call reads them after this one.
    GROUPS_BAR (with FIRST): the rows' bars raised from the chunk's group maxima before the scan
    (``_groups_bar``).

    The rows walk the union of their windows in blocks of W / 2 columns (rows of one program
    have near windows in the usual layouts: causal, zig-zag, decode), each row masked to its
    own; the buffers of all rows are cut (``_select``) when any could overflow."""
    tl.static_assert(W >= TOPK)
    tl.static_assert(W == 1 << LOG_W)
    CAP: tl.constexpr = 2 * W
    BLOCK: tl.constexpr = W // 2
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = row < n_rows
    row = tl.where(live, row, 0)  # dead rows reread row 0 and store nothing
    start, end = _row_window(win_a_ptr, win_b_ptr, row, row_base, n_keys, key_limit, next_n, ctx_stride, err_ptr, MODE,
                             FIRST)
    lo = tl.maximum(start, chunk_lo)
    hi = tl.where(live, tl.minimum(end, chunk_lo + chunk_width), lo)
    cand_rows = cand_ptr + row[:, None] * stride_c
    if FIRST:
        count = tl.zeros([ROWS], tl.int32)
        bar = tl.full([ROWS], EMPTY_KEY, tl.int64)
    else:
        count = tl.load(count_ptr + row, mask=live, other=0)
        bar = tl.load(bar_ptr + row, mask=live, other=EMPTY_KEY)
    walk_lo = tl.min(tl.where(lo < hi, lo, chunk_lo + chunk_width), axis=0)
    walk_hi = tl.max(tl.where(lo < hi, hi, 0), axis=0)
    row_logits = logits_ptr + row[:, None] * stride_l
    if GROUPS_BAR:
        bar = _groups_bar(row_logits, walk_lo, walk_hi, lo, hi, chunk_lo, bar, TOPK, ROWS, CAP)
    quarter = tl.arange(0, BLOCK // 4)
    # Counted from the span, so that no loop bound passes the int32 range.
    n_blocks = tl.cdiv(tl.maximum(walk_hi - walk_lo, 0), BLOCK)
    # The next block's four loads are issued before this block's keys are compacted, so their
    # latency hides behind the prefix sum and the stores (past the walk they read nothing).
    # Loaded in their own iteration, ptxas (at 64 registers) waits for each load before the
    # next, whatever order they are written in: one load a warp in flight.
    v0, v1, v2, v3 = _load_block(row_logits, walk_lo, quarter, lo, hi, chunk_lo, BLOCK)
    for i in range(0, n_blocks):
        # Four coalesced quarters a block, one key each a thread: one prefix sum of the threads'
        # totals instead of one over each thread's four keys; the buffer's order is the threads'
        # (never read: keys are unique, the final sort orders them).
        base = walk_lo + i * BLOCK
        k0, a0, t0 = _keys_above(v0, base, quarter, lo, hi, bar)
        k1, a1, t1 = _keys_above(v1, base + BLOCK // 4, quarter, lo, hi, bar)
        k2, a2, t2 = _keys_above(v2, base + BLOCK // 2, quarter, lo, hi, bar)
        k3, a3, t3 = _keys_above(v3, base + 3 * (BLOCK // 4), quarter, lo, hi, bar)
        v0, v1, v2, v3 = _load_block(row_logits, base + BLOCK, quarter, lo, hi, chunk_lo, BLOCK)
        # Slots count[r] .. count[r] + BLOCK - 1 < CAP: in the buffer whatever the values.
        s0, s1, s2, s3, taken = _quarter_slots(count, t0, t1, t2, t3)
        tl.store(cand_rows + s0, k0, mask=a0)
        tl.store(cand_rows + s1, k1, mask=a1)
        tl.store(cand_rows + s2, k2, mask=a2)
        tl.store(cand_rows + s3, k3, mask=a3)
        count += taken
        if tl.max(count, axis=0) > CAP - BLOCK:
            count, bar = _select(cand_rows, count, bar, bar, count, TOPK, ROWS, CAP, PIECE, 0, False)
    if FINAL:
        if RESET == 1:
            # After the passes: their histograms hold the TOPK-th key's top RADIX_LEVELS digits.
            hist_rows = hist_ptr + row[:, None] * (_RADIX_LEVELS * _RADIX_BINS)
            prefix0, need0 = _rows_prefix_and_need(hist_rows, TOPK, _RADIX_LEVELS)
            count, bar = _select(cand_rows, count, bar, prefix0, need0, TOPK, ROWS, CAP, PIECE, _RADIX_LEVELS, True)
        elif RESET == 2:  # after passes over group maxima: their digits are not the TOPK-th key's
            count, bar = _select(cand_rows, count, bar, bar, count, TOPK, ROWS, CAP, PIECE, 0, True)
        else:
            count, bar = _select(cand_rows, count, bar, bar, count, TOPK, ROWS, CAP, PIECE, 0, False)
        _write_sorted(cand_rows, count, live, idx_ptr + row[:, None] * stride_i, val_ptr + row[:, None] * stride_v,
                      TOPK, W, LOG_W, ROWS, WRITE_VALUES)
        if RESET:
            tl.debug_barrier()  # every thread has loaded the counts
            tl.store(count_ptr + row, tl.zeros([ROWS], tl.int32), mask=live)
            bins = tl.arange(0, _RADIX_BINS)
            hist_rows = hist_ptr + row[:, None] * (_RADIX_LEVELS * _RADIX_BINS) + bins[None, :]
            for d in tl.static_range(_RADIX_LEVELS):
                tl.store(hist_rows + d * _RADIX_BINS, tl.zeros([ROWS, _RADIX_BINS], tl.int32), mask=live[:, None])
    else:
        tl.store(count_ptr + row, count, mask=live)
        tl.store(bar_ptr + row, bar, mask=live)


# ---------------------------------------------------------------------------------------
# Rows split over programs: a radix select across the programs of a row
# ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_l", "n_keys", "next_n", "ctx_stride", "segments", "stride_c", "topk"])
def topk_rows_pass_kernel(
    logits_ptr, stride_l, win_a_ptr, win_b_ptr, n_keys, next_n, ctx_stride, segments,
    hist_ptr, cand_ptr, stride_c, count_ptr, topk,
    PASS: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, MAXIMA: tl.constexpr, KEEP: tl.constexpr = False,
):
    """One pass of program (row, s) over the row's window, BLOCK keys at a time: blocks s, s +
    segments, s + 2 segments ... (block-cyclic, so a row shorter than the logits' width still
    spreads over all its programs). PASS d < LEVELS (:func:`pass_levels`): the histogram of the
    keys' d-th digit among the keys that share the digits above it with the row's topk-th key
    (read from the levels above); PASS LEVELS: every key at or above those digits appended to the
    row's candidates (a slot range reserved by an atomic add on its count: topk keys plus the
    others sharing all the digits with the topk-th). Histograms are summed into ``hist_ptr``
    (RADIX_LEVELS x 2^RADIX_BITS int32 a row) and the appended keys counted in ``count_ptr``,
    both zero before PASS 0: the merge launch after the passes (``RESET``) leaves them so.
    MAXIMA: the digit passes count the largest key of each group instead of every key (a
    program's group ``c``: its keys at column ``c`` of its blocks; a row's groups are distinct
    keys, so its topk-th key is at or above the topk-th largest group maximum, whose top digits
    the passes find). The keys at or above those digits are then topk and a few more where the
    row has at least 2 topk groups (``segments * BLOCK >= 2 W``: each key its own group in
    rows shorter than that), and the histograms count the maxima, not the keys
    (``RESET == 2``: the last step's select starts from the top), two digit passes, not three
    (:func:`pass_levels`). KEEP (with MAXIMA, where the row's candidate slots hold ``segments *
    BLOCK`` keys): PASS 0 keeps its maxima in the slots ``[seg * BLOCK, (seg + 1) * BLOCK)``
    (the appends of the last pass come after) and the next digit pass reads those instead of
    the keys."""
    row = tl.program_id(0)
    seg = tl.program_id(1)
    start, end = _row_window(win_a_ptr, win_b_ptr, row, 0, n_keys, n_keys, next_n, ctx_stride, count_ptr, MODE,
                             False)
    hist_row = hist_ptr + row.to(tl.int64) * (_RADIX_LEVELS * _RADIX_BINS)
    row_logits = logits_ptr + row.to(tl.int64) * stride_l
    cand_row = cand_ptr + row.to(tl.int64) * stride_c
    col = tl.arange(0, BLOCK)
    LEVELS: tl.constexpr = _RADIX_LEVELS - MAXIMA  # (pass_levels)
    SHIFT: tl.constexpr = 64 - (PASS + 1) * _RADIX_BITS  # this pass's digit (PASS < LEVELS)
    if PASS > 0:
        prefix, _ = _rows_prefix_and_need(hist_row + tl.zeros([1, 1], tl.int64), topk, PASS)
        prefix = tl.sum(prefix, axis=0)  # (one row)
    local = tl.zeros([_RADIX_BINS], tl.int32)
    kept_maxima = cand_row + seg.to(tl.int64) * BLOCK + col
    if MAXIMA and PASS < LEVELS:
        if KEEP and PASS > 0:
            best = tl.load(kept_maxima)  # PASS 0's
        else:
            best = tl.full([BLOCK], EMPTY_KEY, tl.int64)  # (valid keys lie above it)
    # Counted in blocks from the window's start, positions in int64: no bound passes int32.
    if (not MAXIMA) or (not KEEP) or PASS == 0 or PASS == LEVELS:  # (kept maxima: no keys to read)
        for i in range(seg, tl.cdiv(end - start, BLOCK), segments):
            pos = start.to(tl.int64) + i * BLOCK + col
            inside = pos < end
            v = tl.load(row_logits + pos, mask=inside, other=0.0).to(tl.float32)
            keys = _order_keys(v, pos.to(tl.int32))
            if MAXIMA and PASS < LEVELS:
                best = tl.maximum(best, tl.where(inside, keys, EMPTY_KEY))
            elif PASS == 0:
                digit = ((keys >> SHIFT) + _RADIX_BINS // 2).to(tl.int32)
                local += tl.histogram(digit, _RADIX_BINS, mask=inside)
            elif PASS < LEVELS:
                digit = ((keys >> SHIFT) & (_RADIX_BINS - 1)).to(tl.int32)
                local += tl.histogram(digit, _RADIX_BINS, mask=inside & ((keys >> (SHIFT + _RADIX_BITS)) == prefix))
            else:
                keep = inside & (keys >= (prefix << (64 - LEVELS * _RADIX_BITS)))
                taken = keep.to(tl.int32)
                first_slot = tl.atomic_add(count_ptr + row, tl.sum(taken, axis=0), sem="relaxed")
                tl.store(cand_row + (first_slot + tl.cumsum(taken, 0) - 1), keys, mask=keep)
    if MAXIMA and PASS < LEVELS:  # one histogram of the program's column maxima
        held = best != EMPTY_KEY
        if PASS == 0:
            if KEEP:
                tl.store(kept_maxima, best)
            local = tl.histogram(((best >> SHIFT) + _RADIX_BINS // 2).to(tl.int32), _RADIX_BINS, mask=held)
        else:
            local = tl.histogram(((best >> SHIFT) & (_RADIX_BINS - 1)).to(tl.int32), _RADIX_BINS,
                                 mask=held & ((best >> (SHIFT + _RADIX_BITS)) == prefix))
    if PASS < LEVELS:
        bins = tl.arange(0, _RADIX_BINS)
        tl.atomic_add(hist_row + PASS * _RADIX_BINS + bins, local, mask=local > 0, sem="relaxed")
