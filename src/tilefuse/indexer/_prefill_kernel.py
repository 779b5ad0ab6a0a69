"""Triton kernels for the indexer prefill logits (private; see ``prefill.py`` for the op).

One program owns a tile of ``BLOCK_Q`` query rows x ``BLOCK_N`` keys. It loads the key tile
once, walks the H heads (one ``tl.dot`` of [BLOCK_Q, D] x [D, BLOCK_N] each) and accumulates
``relu(score) * w`` in fp32, so the [rows, heads, keys] scores never leave registers. The
grid is 2-D over (key block, query block): with few query rows the key blocks alone fill the
SMs (a split over keys with no reduction, since every key is an independent output column).

Formats (``FMT``, codes from ``tilefuse.formats.FORMAT_CODE``): FP8 (per-key fp32 scale
applied after the head sum), MXFP8, MXFP4. Hopper has no block-scaled tensor-core
instruction: this kernel dequantises MX operands to bf16 in registers (exact: E4M3/E2M1 times
a power of two fits bf16) and runs a bf16 dot; the op's default MX paths first renormalise
rows into E4M3 / f16 and run the FP8-style loop (``prefill.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilefuse import _errors
from tilefuse._errors_kernel import report_error
from tilefuse.formats import FORMAT_CODE

FMT_FP8 = tl.constexpr(FORMAT_CODE["fp8"])
FMT_MXFP8 = tl.constexpr(FORMAT_CODE["mxfp8"])
FMT_MXFP4 = tl.constexpr(FORMAT_CODE["mxfp4"])
ERR_START_NEGATIVE = tl.constexpr(_errors.WINDOW_START_NEGATIVE)
ERR_INVERTED = tl.constexpr(_errors.WINDOW_INVERTED)
ERR_LONGER_THAN_ROW = tl.constexpr(_errors.WINDOW_LONGER_THAN_MAX_SEQLEN)

# Sizes and strides that change from call to call are not specialised (no recompile for a new
# S_q, S_k or row stride), nor the alignment of inputs an engine may slice anywhere (windows,
# weights, key scales): a kernel compiles once per model configuration.
_DYNAMIC = ["S_q", "S_k", "n_cols", "stride_qsf", "stride_w", "stride_out"]
_SLICEABLE = ["q_sf_ptr", "k_scale_ptr", "w_ptr", "ks_ptr", "ke_ptr"]


@triton.jit
def _ue8m0_byte_scale(packed, byte_idx):
    """fp32 ``2^(e-127)`` of byte ``byte_idx`` of each packed int32 (shapes broadcast)."""
    e = (packed >> (byte_idx * 8)) & 0xFF
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(code):
    """E2M1 nibble codes (int32, 0..15) to fp32 by assembling the bits."""
    sign = (code & 8) << 28
    e = (code >> 1) & 3
    m = code & 1
    normal = ((e + 126) << 23) | (m << 22)
    sub = tl.where(m == 1, 126 << 23, 0)  # e == 0: 0.0 or 0.5
    return (tl.where(e == 0, sub, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_fp4(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int8 [ROWS, COLS/2] of packed nibbles -> fp32 [ROWS, COLS] (element 2k = low nibble)."""
    b = packed.to(tl.int32) & 0xFF
    lo = _e2m1_to_f32(b & 0xF)
    hi = _e2m1_to_f32(b >> 4)
    return tl.reshape(tl.join(lo, hi), (ROWS, COLS))


@triton.jit
def _dequant_tile(raw, packed_sf, ROWS: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr):
    """MX tile [ROWS, D] (or [ROWS, D/2] packed FP4) with packed scales [ROWS] -> bf16 [ROWS, D]."""
    if FMT == FMT_MXFP4:
        vals = _unpack_fp4(raw, ROWS, D)
    else:
        vals = raw.to(tl.float32)
    blk = tl.arange(0, D) // 32
    return (vals * _ue8m0_byte_scale(packed_sf[:, None], blk[None, :])).to(tl.bfloat16)


@triton.jit
def _q_operand(q_desc, q0, h, qsf_rows, row_ok, D: tl.constexpr, FMT: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Head ``h`` of the query tile as a dot operand: raw E4M3 (FP8) or dequantised bf16 (MX)."""
    if FMT == FMT_FP8:
        q = q_desc.load([q0, h * D])
    else:
        DQ: tl.constexpr = D // 2 if FMT == FMT_MXFP4 else D
        q_sf = tl.load(qsf_rows + h, mask=row_ok, other=0)
        q = _dequant_tile(q_desc.load([q0, h * DQ]), q_sf, BLOCK_Q, D, FMT)
    return q


@triton.jit
def _add_relu_weighted(acc, s, w, ABS: tl.constexpr):
    """acc += relu(s) * w, or acc += |s| * w (one FMA with an operand modifier) when the
    linear half of relu(s) = (s + |s|) / 2 is in acc already (``relu_via_abs``)."""
    if ABS:
        r = tl.abs(s)
    else:
        r = tl.maximum(s, 0.0)
    return acc + r * w[:, None]


@triton.jit
def load_windows(ks_ptr, ke_ptr, rows, row_ok, S_k, n_cols, err_ptr, report, COMPRESSED: tl.constexpr):
    """The rows' windows ``[ks, ke)`` clamped into ``[0, S_k]`` (an inverted window is empty;
    compressed: cut at the row's ``n_cols`` columns), so that no value of the windows makes a
    read or write out of bounds. Where ``report`` holds (one program per row block) bad windows
    are recorded in the error record ``err_ptr``; those rows' logits are then not valid."""
    ks_in = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke_in = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    ks = tl.minimum(tl.maximum(ks_in, 0), S_k)
    ke = tl.minimum(tl.maximum(ke_in, ks), S_k)
    if COMPRESSED:
        ke = tl.minimum(ke, ks + n_cols)
    if report:
        report_error(err_ptr, ERR_START_NEGATIVE, row_ok & (ks_in < 0), rows)
        report_error(err_ptr, ERR_INVERTED, row_ok & (ks_in > ke_in), rows)
        if COMPRESSED:
            report_error(err_ptr, ERR_LONGER_THAN_ROW, row_ok & (tl.minimum(ke_in, S_k) - ks_in > n_cols), rows)
    return ks, ke


@triton.jit
def tile_sees_no_keys(ks, ke, row_ok, n0, S_k, BLOCK_N: tl.constexpr):
    """Whether no row of a tile (windows ``[ks, ke)`` from ``load_windows``, ``row_ok``) sees a
    key of ``[n0, n0 + BLOCK_N)``: such a tile needs no math."""
    has_keys = row_ok & (ks < ke)
    lo = tl.min(tl.where(has_keys, ks, S_k), axis=0)
    hi = tl.max(tl.where(has_keys, ke, 0), axis=0)
    return (n0 >= hi) | (n0 + BLOCK_N <= lo)


@triton.jit
def _store_logits(val, out_rows, key, ks, valid, row_ok, S_k, full, CLEAN: tl.constexpr, COMPRESSED: tl.constexpr):
    """Store a logits tile in either orientation ([row, key] or [key, row]): every operand comes
    broadcastable to ``val`` in that orientation (``out_rows`` the rows' base pointers, ``key``
    each element's key, ``ks`` its row's window start, ``valid`` whether the key is in its row's
    window, ``row_ok`` whether the row exists). Clean: -inf outside the windows; compressed:
    only in-window keys, key ``ks[i] + c`` at column ``c``. ``full``: every key of the tile is
    ``< S_k``; its store then has no key mask, so that it stays vectorised (``S_k`` is not
    specialised, so a mask on it is per element)."""
    if CLEAN and not COMPRESSED:
        val = tl.where(valid, val, float("-inf"))
    val = val.to(out_rows.dtype.element_ty)
    if COMPRESSED:
        tl.store(out_rows + (key - ks), val, mask=valid)
    elif full:
        tl.store(out_rows + key, val, mask=row_ok)
    else:
        tl.store(out_rows + key, val, mask=row_ok & (key < S_k))


@triton.jit
def _row_stride(stride, ptr):
    """The row stride of ``ptr``'s tensor, whose rows the wrappers check are 16-byte aligned,
    with that alignment made visible to the compiler. Strides are not specialised (no compile
    per shape); without it the row addresses lose their alignment: scalar accesses and spills."""
    per_16_bytes: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
    return stride // per_16_bytes * per_16_bytes


@triton.jit
def fill_skipped_tile(out_rows, cols, n0, row_ok, S_k, CLEAN: tl.constexpr, COMPRESSED: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """A [rows, keys] tile that no row sees (``tile_sees_no_keys``): only the -inf of the full
    layout when cleaning (``out_rows`` the rows' base pointers, ``cols`` the tile's keys)."""
    if CLEAN and not COMPRESSED:
        fill = tl.full((BLOCK_Q, BLOCK_N), float("-inf"), tl.float32)
        _store_logits(fill, out_rows, cols[None, :], None, None, row_ok[:, None], S_k, n0 + BLOCK_N <= S_k, False,
                      False)


@triton.jit(do_not_specialize=_DYNAMIC, do_not_specialize_on_alignment=_SLICEABLE)
def prefill_logits_kernel(
    q_desc, q_sf_ptr, stride_qsf, k_desc, k_scale_ptr, w_ptr, stride_w, ks_ptr, ke_ptr, out_ptr, stride_out,
    S_q, S_k, n_cols, err_ptr,
    H: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, CLEAN: tl.constexpr, COMPRESSED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_UNROLL: tl.constexpr,
    fix_q_ptr=None, fix_k_ptr=None, FIXUP: tl.constexpr = False,
    lin_desc=None, half_scale_ptr=None, LIN_PARTS: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    if FIXUP:
        # Second pass of MXFP4-on-FP8: only tiles holding a row the first pass could not
        # represent exactly are recomputed (bf16 upcast); every other program leaves at once.
        if (tl.load(fix_q_ptr + pid_q) | tl.load(fix_k_ptr + pid_n)) == 0:
            return
    stride_out = _row_stride(stride_out, out_ptr)
    q0 = pid_q * BLOCK_Q
    n0 = pid_n * BLOCK_N
    rows = q0 + tl.arange(0, BLOCK_Q)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < S_q
    ks, ke = load_windows(ks_ptr, ke_ptr, rows, row_ok, S_k, n_cols, err_ptr, pid_n == 0, COMPRESSED)
    valid = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None]) & row_ok[:, None]
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out

    if tile_sees_no_keys(ks, ke, row_ok, n0, S_k, BLOCK_N):
        fill_skipped_tile(out_rows, cols, n0, row_ok, S_k, CLEAN, COMPRESSED, BLOCK_Q, BLOCK_N)
        return

    w_rows = w_ptr + rows.to(tl.int64) * stride_w
    qsf_rows = q_sf_ptr + rows.to(tl.int64) * stride_qsf
    k_sf = tl.load(k_scale_ptr + cols, mask=cols < S_k, other=0)
    acc = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.float32)
    # One loop for all formats: FP8 feeds the raw E4M3 tiles to the dot, MX the bf16 upcast.
    if FMT == FMT_FP8:
        k = k_desc.load([n0, 0])
    else:
        k = _dequant_tile(k_desc.load([n0, 0]), k_sf, BLOCK_N, D, FMT)
    # relu_via_abs: acc starts as the linear term parts . k, the heads add |s| * w / c.
    for p in tl.static_range(LIN_PARTS):
        acc = tl.dot(lin_desc.load([q0, p * D]), tl.trans(k), acc)
    # Two heads per step let the second head's MMA run while the first one's ReLU*w runs.
    for h in range(0, H, HEAD_UNROLL):
        s0 = tl.dot(_q_operand(q_desc, q0, h, qsf_rows, row_ok, D, FMT, BLOCK_Q), tl.trans(k))
        w0 = tl.load(w_rows + h, mask=row_ok, other=0.0).to(tl.float32)
        if HEAD_UNROLL == 2:
            s1 = tl.dot(_q_operand(q_desc, q0, h + 1, qsf_rows, row_ok, D, FMT, BLOCK_Q), tl.trans(k))
            w1 = tl.load(w_rows + h + 1, mask=row_ok, other=0.0).to(tl.float32)
            acc = _add_relu_weighted(acc, s0, w0, LIN_PARTS > 0)
            acc = _add_relu_weighted(acc, s1, w1, LIN_PARTS > 0)
        else:
            acc = _add_relu_weighted(acc, s0, w0, LIN_PARTS > 0)
    if FMT == FMT_FP8:
        acc = acc * k_sf[None, :]
    if LIN_PARTS > 0:
        acc = acc * tl.load(half_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    _store_logits(acc, out_rows, cols[None, :], ks[:, None], valid, row_ok[:, None], S_k, n0 + BLOCK_N <= S_k,
                  CLEAN, COMPRESSED)


@triton.jit
def _few_rows_columns(r0, q_end, c_r, c_h, H: tl.constexpr, ROWS: tl.constexpr):
    """Rows ``[r0, r0 + ROWS)`` of the program's ``q_end`` and their (row, head) columns
    ``c_r``, ``c_h``: ``(rows, row_ok, c_ok, c_rows)``."""
    rows = r0 + tl.arange(0, ROWS)
    return rows, rows < q_end, (r0 + c_r < q_end) & (c_h < H), (r0 + c_r).to(tl.int64)


@triton.jit
def _few_rows_step(q_ptr, stride_qs, stride_qh, w_ptr, stride_w, r0, q_end, c_r, c_h, dq, H: tl.constexpr,
                   ROWS: tl.constexpr, ZERO: tl.constexpr):
    """One step of the few-row kernels: rows ``[r0, r0 + ROWS)`` of the program's ``q_end``,
    their (row, head) columns ``c_r``, ``c_h``, and those columns' query values ([columns,
    ``dq``], ``ZERO`` where masked) and fp32 weights: ``(rows, row_ok, c_ok, c_rows, q, w)``."""
    rows, row_ok, c_ok, c_rows = _few_rows_columns(r0, q_end, c_r, c_h, H, ROWS)
    q = tl.load(q_ptr + c_rows[:, None] * stride_qs + c_h[:, None] * stride_qh + dq[None, :], mask=c_ok[:, None],
                other=ZERO)
    w = tl.load(w_ptr + c_rows * stride_w + c_h, mask=c_ok, other=0.0).to(tl.float32)
    return rows, row_ok, c_ok, c_rows, q, w


@triton.jit
def _store_few_rows(x, k_scale, rows, row_ok, cols, ks_ptr, ke_ptr, out_ptr, stride_out, S_k, n_cols, err_ptr, pid_n,
                    ROWS: tl.constexpr, HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, CLEAN: tl.constexpr,
                    COMPRESSED: tl.constexpr):
    """The few-row kernels' step epilogue: the head sum of ``x`` (ReLU'd, weighted scores
    [BLOCK_N keys, ROWS * HEADS_P]) per row, times the keys' scale, stored as ROWS columns of
    ``BLOCK_N`` keys into each row's window."""
    if ROWS == 1:
        logits = tl.sum(x, axis=1)[:, None]
    else:
        logits = tl.sum(tl.reshape(x, (BLOCK_N, ROWS, HEADS_P)), axis=2)
    logits = logits * k_scale[:, None]  # [BLOCK_N, ROWS]
    ks, ke = load_windows(ks_ptr, ke_ptr, rows, row_ok, S_k, n_cols, err_ptr, pid_n == 0, COMPRESSED)
    valid = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :]) & row_ok[None, :]
    out_cols = out_ptr + rows.to(tl.int64)[None, :] * stride_out
    n0 = pid_n * BLOCK_N
    _store_logits(logits, out_cols, cols[:, None], ks[None, :], valid, row_ok[None, :], S_k, n0 + BLOCK_N <= S_k,
                  CLEAN, COMPRESSED)


@triton.jit(do_not_specialize=_DYNAMIC + ["stride_qs"], do_not_specialize_on_alignment=_SLICEABLE)
def prefill_heads_on_n_kernel(
    q_ptr, stride_qs, stride_qh,
    k_desc, k_scale_ptr,
    w_ptr, stride_w,
    ks_ptr, ke_ptr,
    out_ptr, stride_out,
    S_q, S_k, n_cols, err_ptr,
    H: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    CLEAN: tl.constexpr, COMPRESSED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """FP8 logits for few query rows with (query row, head) pairs on the MMA's N side.

    A program owns ``BLOCK_N`` keys x ``BLOCK_Q`` query rows. It loads the key tile once and
    walks the rows ``ROWS`` at a time: one dot of [BLOCK_N, D] x [D, ROWS * HEADS_P] per step
    (an MMA N of 64-128 instead of the query count), then ReLU, the weights and the head sum
    of each row (a reshape to [BLOCK_N, ROWS, HEADS_P] and one reduction), as the paged decode
    kernel scores its next_n rows. The rows' query loads are pipelined over the steps.
    """
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    stride_qs = _row_stride(stride_qs, q_ptr)
    stride_out = _row_stride(stride_out, out_ptr)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    NC: tl.constexpr = ROWS * HEADS_P
    c = tl.arange(0, NC)
    c_r = c // HEADS_P
    c_h = c % HEADS_P
    dq = tl.arange(0, D)
    k = k_desc.load([n0, 0])
    k_sf = tl.load(k_scale_ptr + cols, mask=cols < S_k, other=0)
    q_end = tl.minimum(S_q, (pid_q + 1) * BLOCK_Q)
    for r0 in tl.range(pid_q * BLOCK_Q, q_end, ROWS, num_stages=NUM_STAGES):
        rows, row_ok, c_ok, c_rows, q, w = _few_rows_step(q_ptr, stride_qs, stride_qh, w_ptr, stride_w, r0, q_end,
                                                         c_r, c_h, dq, H, ROWS, 0.0)
        x = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]
        _store_few_rows(x, k_sf, rows, row_ok, cols, ks_ptr, ke_ptr, out_ptr, stride_out, S_k, n_cols, err_ptr,
                        pid_n, ROWS, HEADS_P, BLOCK_N, CLEAN, COMPRESSED)


@triton.jit(do_not_specialize=["stride_out", "S_q", "S_k", "n_cols"],
            do_not_specialize_on_alignment=["ks_ptr", "ke_ptr"])
def fill_outside_windows_kernel(out_ptr, stride_out, ks_ptr, ke_ptr, S_q, S_k, n_cols,
                                COMPRESSED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    """``-inf`` in every column of a row outside its window: ``[0, ks) + [ke, S_k)`` in the full
    layout, ``[ke - ks, n_cols)`` in the compressed one. Writes nothing inside the windows
    (clamped as the logits kernels clamp them; those report bad values)."""
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < S_q
    ks, ke = load_windows(ks_ptr, ke_ptr, rows, row_ok, S_k, n_cols, ks_ptr, False, COMPRESSED)
    if COMPRESSED:
        outside = cols[None, :] >= (ke - ks)[:, None]
    else:
        outside = (cols[None, :] < ks[:, None]) | (cols[None, :] >= ke[:, None])
    mask = row_ok[:, None] & outside & (cols[None, :] < n_cols)
    fill = tl.full((BLOCK_Q, BLOCK_C), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * _row_stride(stride_out, out_ptr) + cols[None, :], fill, mask=mask)


@triton.jit
def _block_exponent_range(sf, NB: tl.constexpr):
    """Largest and smallest of the first ``NB`` UE8M0 bytes of each packed int32 (any shape)."""
    e_max = sf & 0xFF
    e_min = e_max
    for b in tl.static_range(1, NB):
        e = (sf >> (8 * b)) & 0xFF
        e_max = tl.maximum(e_max, e)
        e_min = tl.minimum(e_min, e)
    return e_max, e_min


@triton.jit
def _not_exact(sf, NB: tl.constexpr, SPAN_EXACT: tl.constexpr, FOLD_LIMIT: tl.constexpr):
    """Whether a row with packed scales ``sf`` does not renormalise exactly: its block exponents
    span more than ``SPAN_EXACT`` binades, or its row scale is beyond ``2^+-FOLD_LIMIT``."""
    e_max, e_min = _block_exponent_range(sf, NB)
    return ((e_max - e_min) > SPAN_EXACT) | (tl.abs(e_max - 127) > FOLD_LIMIT)


@triton.jit
def _pow2_biased(e):
    """fp32 ``2^(e - 127)`` of a biased exponent ``e`` in [0, 255] (0: the subnormal 2^-127, 255: inf)."""
    return tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _renormalised(raw, sf, D: tl.constexpr, FMT: tl.constexpr, ROWS: tl.constexpr):
    """MX rows ``raw`` [ROWS, D] (MXFP4: [ROWS, D/2] packed) with packed scales ``sf`` [ROWS],
    each renormalised by its largest block scale: (fp32 values [ROWS, D], that scale's biased
    exponent per row). The values are exact in E4M3 (MXFP4) or f16 (MXFP8) where the row is
    (``_not_exact``)."""
    e_max, _ = _block_exponent_range(sf, D // 32)
    if FMT == FMT_MXFP4:
        half = tl.arange(0, D // 2)
        b = raw.to(tl.int32) & 0xFF
        e = (sf[:, None] >> ((half // 16) * 8)[None, :]) & 0xFF
        scale = ((tl.maximum(e - e_max[:, None], -126) + 127) << 23).to(tl.float32, bitcast=True)
        vals = tl.reshape(tl.join(_e2m1_to_f32(b & 0xF) * scale, _e2m1_to_f32(b >> 4) * scale), (ROWS, D))
    else:
        col = tl.arange(0, D)
        e = (sf[:, None] >> ((col // 32) * 8)[None, :]) & 0xFF
        scale = ((tl.maximum(e - e_max[:, None], -126) + 127) << 23).to(tl.float32, bitcast=True)
        vals = raw.to(tl.float32) * scale
    return vals, e_max


@triton.jit
def _renormalise_tile(src_rows, sf, ok, dst_rows, D: tl.constexpr, FMT: tl.constexpr, BLOCK_R: tl.constexpr):
    """Store ``BLOCK_R`` MX rows (``src_rows``: each row's first element) renormalised by their
    largest block scale at ``dst_rows``; returns that scale's biased exponent per row."""
    DQ: tl.constexpr = D // 2 if FMT == FMT_MXFP4 else D
    ZERO: tl.constexpr = 0 if FMT == FMT_MXFP4 else 0.0  # (packed FP4 codes are int8)
    raw = tl.load(src_rows[:, None] + tl.arange(0, DQ)[None, :], mask=ok[:, None], other=ZERO)
    vals, e_max = _renormalised(raw, sf, D, FMT, BLOCK_R)
    tl.store(dst_rows[:, None] + tl.arange(0, D)[None, :], vals.to(dst_rows.dtype.element_ty), mask=ok[:, None])
    return e_max


@triton.jit
def _renormalise_query_pairs(pair, ok, q_ptr, stride_q, stride_qh, q_sf_ptr, stride_qsf, w_ptr, stride_w, q_rows_ptr,
                             w_rows_ptr, H: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, BLOCK_R: tl.constexpr):
    """Query (row, head) pairs ``pair`` (where ``ok``) renormalised into ``q_rows`` [S_q * H, D],
    their weights times the row scale into ``w_rows`` [S_q * H] (fp32)."""
    row = (pair // H).to(tl.int64)
    head = pair % H
    sf = tl.load(q_sf_ptr + row * stride_qsf + head, mask=ok, other=0x7F7F7F7F)
    e_max = _renormalise_tile(q_ptr + row * stride_q + head * stride_qh, sf, ok, q_rows_ptr + pair.to(tl.int64) * D,
                              D, FMT, BLOCK_R)
    w = tl.load(w_ptr + row * stride_w + head, mask=ok, other=0.0).to(tl.float32)
    tl.store(w_rows_ptr + pair, w * _pow2_biased(e_max), mask=ok)


@triton.jit(do_not_specialize=["stride_q", "stride_qsf", "stride_w", "stride_k", "S_q", "S_k"],
            do_not_specialize_on_alignment=["q_sf_ptr", "w_ptr", "k_sf_ptr"])
def mx_rows_renormalise_kernel(
    q_ptr, stride_q, q_sf_ptr, stride_qsf, w_ptr, stride_w,
    k_ptr, stride_k, k_sf_ptr,
    q_rows_ptr, w_rows_ptr, fix_q_ptr,
    k_rows_ptr, k_scale_ptr, fix_k_ptr,
    S_q, S_k,
    H: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
    SPAN_EXACT: tl.constexpr, FOLD_LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr, FIX_Q: tl.constexpr, FIX_K: tl.constexpr,
):
    """Both MX operands of the prefill op renormalised for the FP8-style head loop, in one launch.

    Element x of block b of a row becomes ``x * 2^(e_b - e_max)`` with ``e_max`` the row's
    largest block exponent. MXFP4 (``FMT`` 2, [n, D/2] packed) goes to E4M3: an E2M1 value
    times 2^-s lies on the E4M3 grid for s <= 8 (its subnormal step is 2^-9). MXFP8 (``FMT`` 1)
    goes to f16: an E4M3 value times 2^-s keeps every bit in f16 for s <= 15 (E4M3's lowest bit
    is 2^-9, f16's 2^-24). A row is exact when its block exponents span <= ``SPAN_EXACT`` and
    ``|e_max - 127| <= FOLD_LIMIT``.

    The first programs own the queries: ``BLOCK_R`` (row, head) pairs each, written to
    ``q_rows`` [S_q * H, D] with ``w_rows[i, h] = w[i, h] * 2^(e_max - 127)`` (fp32, [S_q, H]),
    and program ``p`` also writes ``fix_q[p]``: 1 when a row of query rows
    ``[p * FIX_Q, (p + 1) * FIX_Q)`` (any head) is not exact. The others own the keys: ``BLOCK_R``
    rows each to ``k_rows`` [S_k, D] with the fp32 row scale, and ``fix_k`` per ``FIX_K`` keys.
    The flags are read from the scales alone, so no program waits for another.
    """
    pid = tl.program_id(0)
    NB: tl.constexpr = D // 32
    DQ: tl.constexpr = D // 2 if FMT == FMT_MXFP4 else D
    n_q_progs = tl.maximum(tl.cdiv(S_q * H, BLOCK_R), tl.cdiv(S_q, FIX_Q))
    if pid < n_q_progs:
        pair = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        if pid * BLOCK_R < S_q * H:
            _renormalise_query_pairs(pair, pair < S_q * H, q_ptr, _row_stride(stride_q, q_ptr), DQ, q_sf_ptr,
                                     stride_qsf, w_ptr, stride_w, q_rows_ptr, w_rows_ptr, H, D, FMT, BLOCK_R)
        if pid * FIX_Q < S_q:
            # Sub-tiles of 16 rows x all heads keep the scale tile small at any H and FIX_Q.
            heads = tl.arange(0, HEADS_P)
            bad = tl.zeros((16, HEADS_P), dtype=tl.int32)
            for r0 in range(pid * FIX_Q, pid * FIX_Q + FIX_Q, 16):
                rows = r0 + tl.arange(0, 16)
                m = (rows < S_q)[:, None] & (heads < H)[None, :]
                sf = tl.load(q_sf_ptr + rows.to(tl.int64)[:, None] * stride_qsf + heads[None, :], mask=m,
                             other=0x7F7F7F7F)
                bad = bad | _not_exact(sf, NB, SPAN_EXACT, FOLD_LIMIT).to(tl.int32)
            tl.store(fix_q_ptr + pid, tl.max(tl.max(bad, axis=1), axis=0))
    else:
        pid -= n_q_progs
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < S_k
        if pid * BLOCK_R < S_k:
            sf = tl.load(k_sf_ptr + rows, mask=ok, other=0x7F7F7F7F)
            src = k_ptr + rows.to(tl.int64) * _row_stride(stride_k, k_ptr)
            e_max = _renormalise_tile(src, sf, ok, k_rows_ptr + rows.to(tl.int64) * D, D, FMT, BLOCK_R)
            tl.store(k_scale_ptr + rows, _pow2_biased(e_max), mask=ok)
        if pid * FIX_K < S_k:
            keys = pid * FIX_K + tl.arange(0, FIX_K)
            sf = tl.load(k_sf_ptr + keys, mask=keys < S_k, other=0x7F7F7F7F)
            bad = _not_exact(sf, NB, SPAN_EXACT, FOLD_LIMIT)
            tl.store(fix_k_ptr + pid, tl.max(bad.to(tl.int32), axis=0))


@triton.jit
def _upcast_scores(k_raw, k_sf, q_raw, q_sf, w, D: tl.constexpr, FMT: tl.constexpr, NC: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The ReLU'd weighted scores of a step from both operands' bf16 upcast, and the keys'
    scale (1: the upcast carries it)."""
    s = tl.dot(_dequant_tile(k_raw, k_sf, BLOCK_N, D, FMT), tl.trans(_dequant_tile(q_raw, q_sf, NC, D, FMT)))
    return tl.maximum(s, 0.0) * w[None, :], tl.full((BLOCK_N,), 1.0, tl.float32)


@triton.jit
def _mx_few_rows_from_raw(q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, w_ptr, stride_w, r0, q_end, c_r, c_h, dq,
                          k_raw, k_sf, k_rows, k_scale, upcast, H: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
                          ROWS: tl.constexpr, NC: tl.constexpr, BLOCK_N: tl.constexpr, SPAN_EXACT: tl.constexpr,
                          FOLD_LIMIT: tl.constexpr, UPCAST_ONLY: tl.constexpr):
    """A step of ``prefill_mx_few_rows_kernel`` from the MX query rows: renormalised in
    registers, or (``upcast`` or ``UPCAST_ONLY``, or a row of the step not exact) both operands'
    bf16 upcast.
    Returns ``(rows, row_ok, x, k_mul)``: the ReLU'd weighted scores and the keys' scale."""
    MMA: tl.constexpr = tl.float8e4nv if FMT == FMT_MXFP4 else tl.float16
    ZERO: tl.constexpr = 0 if FMT == FMT_MXFP4 else 0.0  # (packed FP4 codes are int8)
    rows, row_ok, c_ok, c_rows, q_raw, w = _few_rows_step(q_ptr, stride_qs, stride_qh, w_ptr, stride_w, r0, q_end,
                                                         c_r, c_h, dq, H, ROWS, ZERO)
    q_sf = tl.load(q_sf_ptr + c_rows * stride_qsf + c_h, mask=c_ok, other=0x7F7F7F7F)
    if UPCAST_ONLY:  # (the caller's steps all upcast: the in-register renormalisation is not compiled)
        x, k_mul = _upcast_scores(k_raw, k_sf, q_raw, q_sf, w, D, FMT, NC, BLOCK_N)
    else:
        q_bad = tl.max(_not_exact(q_sf, D // 32, SPAN_EXACT, FOLD_LIMIT).to(tl.int32), axis=0)
        if upcast | (q_bad != 0):
            x, k_mul = _upcast_scores(k_raw, k_sf, q_raw, q_sf, w, D, FMT, NC, BLOCK_N)
        else:
            q_vals, q_e = _renormalised(q_raw, q_sf, D, FMT, NC)
            s = tl.dot(k_rows, tl.trans(q_vals.to(MMA)))
            x = tl.maximum(s, 0.0) * (w * _pow2_biased(q_e))[None, :]
            k_mul = k_scale
    return rows, row_ok, x, k_mul


# Query (row, head) pairs an in-launch producer program renormalises (``PREPARED`` 2), and
# how many times a program waiting for its tiles reads a counter before it takes the bf16 upcast.
_PRODUCER_PAIRS = tl.constexpr(128)
_MAX_SPINS = tl.constexpr(1 << 22)


@triton.jit
def _count_out(counters, arrivals):
    """Arrival of one program at a tile's counters (``[ready, arrived]``): the last of the
    tile's ``arrivals`` programs (its producers after their ready count, its consumers after
    reading it) resets both to 0 for the next launch, so they need no clearing between calls."""
    if tl.atomic_add(counters + 1, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        tl.atomic_xchg(counters, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _count_ready(counters, arrivals):
    """A producer's part of its tile stored: counted ready (release, after a CTA barrier, so
    every thread's stores come first), then counted out."""
    tl.debug_barrier()
    tl.atomic_add(counters, 1, sem="release", scope="gpu")
    _count_out(counters, arrivals)


@triton.jit
def _produce_query_rows(tile, part, q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, w_ptr, stride_w, q_rows_ptr,
                        w_rows_ptr, counters, S_q, arrivals, H: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
                        BLOCK_Q: tl.constexpr):
    """Part ``part`` of query tile ``tile``'s (row, head) pairs renormalised (as the renormalise
    launch writes them), then counted ready."""
    local = part * _PRODUCER_PAIRS + tl.arange(0, _PRODUCER_PAIRS)
    pair = tile * (BLOCK_Q * H) + local
    _renormalise_query_pairs(pair, (local < BLOCK_Q * H) & (pair < S_q * H), q_ptr, stride_qs, stride_qh, q_sf_ptr,
                             stride_qsf, w_ptr, stride_w, q_rows_ptr, w_rows_ptr, H, D, FMT, _PRODUCER_PAIRS)
    _count_ready(counters, arrivals)


@triton.jit
def _wait_ready(counters, producers, arrivals):
    """Whether the tile's ``producers`` have counted its rows ready (acquire), read until they
    have or ``_MAX_SPINS`` reads have passed (then the caller takes the bf16 upcast)."""
    seen = tl.atomic_add(counters, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < producers) & (spins < _MAX_SPINS):
        seen = tl.atomic_add(counters, 0, sem="acquire", scope="gpu")
        spins += 1
    _count_out(counters, arrivals)
    return seen >= producers


@triton.jit
def _mx_few_rows_tile(pid_n, pid_q, q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, k_ptr, stride_k, k_scale_ptr,
                      w_ptr, stride_w, ks_ptr, ke_ptr, out_ptr, stride_out, q_rows_ptr, w_rows_ptr, fix_q_ptr, S_q,
                      S_k, n_cols, err_ptr, counters, producers, arrivals, H: tl.constexpr, HEADS_P: tl.constexpr,
                      D: tl.constexpr, FMT: tl.constexpr, ROWS: tl.constexpr, CLEAN: tl.constexpr,
                      COMPRESSED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                      NUM_STAGES: tl.constexpr, SPAN_EXACT: tl.constexpr, FOLD_LIMIT: tl.constexpr,
                      PREPARED: tl.constexpr):
    """One (key tile, query tile) program of ``prefill_mx_few_rows_kernel``."""
    NB: tl.constexpr = D // 32
    DQ: tl.constexpr = D // 2 if FMT == FMT_MXFP4 else D
    MMA: tl.constexpr = tl.float8e4nv if FMT == FMT_MXFP4 else tl.float16
    ZERO: tl.constexpr = 0 if FMT == FMT_MXFP4 else 0.0  # (packed FP4 codes are int8)
    # rows produced in this launch are read past L1 (written by other SMs during it)
    Q_CACHE: tl.constexpr = ".cg" if PREPARED >= 2 else ""
    if PREPARED >= 2:
        # the tile's rows not exact, from their scales (its producers each saw a part of them);
        # before the key tile, so that only the flag lives beside it
        t_rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        heads = tl.arange(0, HEADS_P)
        q_sf_tile = tl.load(q_sf_ptr + t_rows.to(tl.int64)[:, None] * stride_qsf + heads[None, :],
                            mask=(t_rows < S_q)[:, None] & (heads < H)[None, :], other=0x7F7F7F7F)
        q_bad = tl.max(tl.max(_not_exact(q_sf_tile, NB, SPAN_EXACT, FOLD_LIMIT).to(tl.int32), axis=1), axis=0)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    key_ok = cols < S_k
    NC: tl.constexpr = ROWS * HEADS_P
    c = tl.arange(0, NC)
    c_r = c // HEADS_P
    c_h = c % HEADS_P
    dq = tl.arange(0, DQ)
    k_sf = tl.load(k_scale_ptr + cols, mask=key_ok, other=0x7F7F7F7F)  # (UE8M0 1.0 past S_k)
    k_bad = tl.max(_not_exact(k_sf, NB, SPAN_EXACT, FOLD_LIMIT).to(tl.int32), axis=0)
    k_raw = tl.load(k_ptr + cols.to(tl.int64)[:, None] * stride_k + dq[None, :], mask=key_ok[:, None], other=ZERO)
    k_vals, k_e = _renormalised(k_raw, k_sf, D, FMT, BLOCK_N)
    k_rows = k_vals.to(MMA)
    k_scale = _pow2_biased(k_e)
    q_end = tl.minimum(S_q, (pid_q + 1) * BLOCK_Q)
    if PREPARED == 2:
        upcast = (k_bad | q_bad) != 0
        # (after the key tile's conversion, which overlaps the producers' work; a tile whose rows
        # did not come in time takes the bf16 upcast, as one with a row not exact)
        fast = _wait_ready(counters, producers, arrivals) & ~upcast
    elif PREPARED:
        # the program's rows are one block of the renormalise launch's flags
        upcast = (k_bad | tl.load(fix_q_ptr + pid_q)) != 0
        fast = ~upcast
    else:
        upcast = k_bad != 0
        fast = False
    if PREPARED and fast:
        # a loop of its own: the raw key tile is dead here (it is live in the other one)
        for r0 in tl.range(pid_q * BLOCK_Q, q_end, ROWS, num_stages=NUM_STAGES):
            rows, row_ok, c_ok, c_rows = _few_rows_columns(r0, q_end, c_r, c_h, H, ROWS)
            pair = c_rows * H + c_h
            q_vals = tl.load(q_rows_ptr + pair[:, None] * D + tl.arange(0, D)[None, :], mask=c_ok[:, None], other=0.0,
                             cache_modifier=Q_CACHE)
            w_rows = tl.load(w_rows_ptr + pair, mask=c_ok, other=0.0, cache_modifier=Q_CACHE)
            x = tl.maximum(tl.dot(k_rows, tl.trans(q_vals)), 0.0) * w_rows[None, :]
            _store_few_rows(x, k_scale, rows, row_ok, cols, ks_ptr, ke_ptr, out_ptr, stride_out, S_k, n_cols, err_ptr,
                            pid_n, ROWS, HEADS_P, BLOCK_N, CLEAN, COMPRESSED)
    else:
        for r0 in tl.range(pid_q * BLOCK_Q, q_end, ROWS, num_stages=NUM_STAGES):
            rows, row_ok, x, k_mul = _mx_few_rows_from_raw(
                q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, w_ptr, stride_w, r0, q_end, c_r, c_h, dq,
                k_raw, k_sf, k_rows, k_scale, upcast, H, D, FMT, ROWS, NC, BLOCK_N, SPAN_EXACT, FOLD_LIMIT,
                PREPARED >= 2)
            _store_few_rows(x, k_mul, rows, row_ok, cols, ks_ptr, ke_ptr, out_ptr, stride_out, S_k, n_cols, err_ptr,
                            pid_n, ROWS, HEADS_P, BLOCK_N, CLEAN, COMPRESSED)


@triton.jit(do_not_specialize=_DYNAMIC + ["stride_qs", "stride_k"],
            do_not_specialize_on_alignment=_SLICEABLE + ["counters_ptr"])
def prefill_mx_few_rows_kernel(
    q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf,
    k_ptr, stride_k, k_scale_ptr,
    w_ptr, stride_w,
    ks_ptr, ke_ptr,
    out_ptr, stride_out,
    q_rows_ptr, w_rows_ptr, fix_q_ptr,
    S_q, S_k, n_cols, err_ptr, counters_ptr,
    H: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, ROWS: tl.constexpr,
    CLEAN: tl.constexpr, COMPRESSED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, SPAN_EXACT: tl.constexpr, FOLD_LIMIT: tl.constexpr, PREPARED: tl.constexpr,
):
    """MX logits for few query rows in one launch: ``prefill_heads_on_n_kernel``'s layout
    ((query row, head) pairs on the MMA's N side) with each operand row renormalised in
    registers as ``mx_rows_renormalise_kernel`` stores it (E4M3 for MXFP4, f16 for MXFP8; the
    query's row scale folded into its weight, the key's applied to the head sum), so a step
    whose rows are all exact computes what the renormalise launch + the FP8-grid pass compute.
    A step with a row that is not exact (block exponents spanning more than ``SPAN_EXACT``
    binades, or a row scale past ``2^+-FOLD_LIMIT``) takes the bf16 upcast of both operands
    instead (the recompute pass's math). The grid is (key tiles, query tiles).

    ``PREPARED``, what comes renormalised from outside the program's registers. 1: the query
    rows, renormalised by ``mx_rows_renormalise_kernel`` (``q_rows``
    [S_q * H, D] in the MMA's dtype, ``w_rows`` the weights with the row scale folded in,
    ``fix_q`` 1 per ``BLOCK_Q`` rows holding one that is not exact), so a program converts only
    its key tile, once. ``PREPARED`` 2: the same rows written in this launch, by producer
    programs ahead of the others on a 1-D grid (``_PRODUCER_PAIRS`` pairs of one query tile each,
    then the (key tile, query tile) programs, key tiles fastest). A program waits for its tile's
    producers through ``counters_ptr`` (int32 ``[2 * query tiles]``: ready, arrived; zero between
    launches), which never waits for a program behind it on the grid: the producers wait for
    nothing. (A program that has read the counter ``_MAX_SPINS`` times computes its tile with
    the bf16 upcast instead: no wait is unbounded.) ``PREPARED`` 0: the query rows renormalised
    in registers; ``q_rows``, ``w_rows``, ``fix_q`` and ``counters`` are not read."""
    stride_qs = _row_stride(stride_qs, q_ptr)
    stride_k = _row_stride(stride_k, k_ptr)
    stride_out = _row_stride(stride_out, out_ptr)
    if PREPARED >= 2:
        parts: tl.constexpr = (BLOCK_Q * H + _PRODUCER_PAIRS - 1) // _PRODUCER_PAIRS
        n_k = tl.cdiv(S_k, BLOCK_N)
        q_tiles = tl.cdiv(S_q, BLOCK_Q)
        n_producers = q_tiles * parts
        pid = tl.program_id(0)
        if pid < n_producers:
            tile = pid // parts
            _produce_query_rows(tile, pid % parts, q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, w_ptr, stride_w,
                                q_rows_ptr, w_rows_ptr, counters_ptr + 2 * tile, S_q, n_k + parts, H, D, FMT, BLOCK_Q)
        else:
            pid -= n_producers
            pid_q = pid // n_k
            pid_n = pid % n_k
            _mx_few_rows_tile(pid_n, pid_q, q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, k_ptr, stride_k,
                              k_scale_ptr, w_ptr, stride_w, ks_ptr, ke_ptr, out_ptr, stride_out, q_rows_ptr,
                              w_rows_ptr, fix_q_ptr, S_q, S_k, n_cols, err_ptr, counters_ptr + 2 * pid_q, parts,
                              n_k + parts, H, HEADS_P, D, FMT, ROWS, CLEAN, COMPRESSED, BLOCK_Q, BLOCK_N,
                              NUM_STAGES, SPAN_EXACT, FOLD_LIMIT, PREPARED)
    else:
        _mx_few_rows_tile(tl.program_id(0), tl.program_id(1), q_ptr, stride_qs, stride_qh, q_sf_ptr, stride_qsf, k_ptr,
                          stride_k, k_scale_ptr, w_ptr, stride_w, ks_ptr, ke_ptr, out_ptr, stride_out, q_rows_ptr,
                          w_rows_ptr, fix_q_ptr, S_q, S_k, n_cols, err_ptr, counters_ptr, 0, 0, H, HEADS_P, D, FMT,
                          ROWS, CLEAN, COMPRESSED, BLOCK_Q, BLOCK_N, NUM_STAGES, SPAN_EXACT, FOLD_LIMIT, PREPARED)


@triton.jit(do_not_specialize=["stride_q", "stride_w"], do_not_specialize_on_alignment=["w_ptr"])
def linear_term_parts_kernel(q_ptr, stride_q, w_ptr, stride_w, parts_ptr, w_out_ptr, half_scale_ptr,
                             H: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr):
    """The linear term of ``relu(s) = (s + |s|) / 2`` for one FP8 query row (``relu_via_abs``).

    ``qc = sum_h w[h] * q[h]`` in fp32 (so ``sum_h w_h s_h = qc . k``), a power of two ``c`` that
    brings ``max |qc|`` into [128, 256), and ``PARTS`` E4M3 vectors whose sum approximates
    ``qc / c`` (each part rounds what the earlier ones left: ~4 more bits each). Writes the parts
    ``[PARTS * D]``, ``w / c`` (fp32) and ``c / 2``: the logits kernel then sums
    ``parts . k + sum_h (w_h / c) |s_h|`` and scales by ``c / 2``. ``c`` >= 2^-100 (an all-zero
    row takes c = 1): a combined row that small needs weights below ~2^-60, so ``w / c`` stays
    finite; upward ``c`` follows the row (``qc / c`` < 256 whenever ``qc`` is finite). One program per
    row: the row's [H, D] queries are one load, not a chain of H dependent ones.
    """
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, D)
    w = tl.load(w_ptr + row * stride_w + h, mask=h < H, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + row * _row_stride(stride_q, q_ptr) + h[:, None] * D + d[None, :], mask=(h < H)[:, None],
                other=0.0)
    qc = tl.sum(q.to(tl.float32) * w[:, None], axis=0)
    biggest = tl.max(tl.abs(qc), axis=0)
    e = (biggest.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_c = tl.where(biggest > 0, tl.maximum(e - 7, 27), 127)
    c = (e_c << 23).to(tl.float32, bitcast=True)
    inv_c = ((254 - e_c) << 23).to(tl.float32, bitcast=True)
    rest = qc * inv_c
    for p in tl.static_range(PARTS):
        part = tl.minimum(tl.maximum(rest, -448.0), 448.0).to(tl.float8e4nv)
        tl.store(parts_ptr + row * (PARTS * D) + p * D + d, part)
        rest = rest - part.to(tl.float32)
    tl.store(w_out_ptr + row * H + h, w * inv_c, mask=h < H)
    tl.store(half_scale_ptr + row, c * 0.5)
