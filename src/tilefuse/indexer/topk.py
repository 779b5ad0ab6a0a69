"""Indexer logits followed by a per-row top-k, without the full logits in memory.

Public ops:

* :func:`fp8_fp4_mqa_topk` — prefill: for every query row the first ``topk`` key positions of
  :func:`tilefuse.fp8_fp4_mqa_logits` over its window ``[ks, ke)``;
* :func:`fp8_fp4_paged_mqa_topk` — decode: the same over the rows of
  :func:`tilefuse.fp8_fp4_paged_mqa_logits` (positions are token indices within the request).

Contract (bit for bit): positions ordered by (logit descending, position ascending) over the
valid window, as the unfused op computes the logits; rows with fewer than ``topk`` valid
positions end in ``-1``. ``-0.0`` ties ``+0.0``; a NaN logit (none arise from finite inputs
and weights) ranks after every number, before the ``-1`` padding.

How: the keys are cut into chunks of ``chunk_k`` columns (prefill: and the query rows into
blocks of ``chunk_q``). Each chunk's logits come from the unfused op itself on a slice (prefill:
``q[r0:r1]``, ``k[lo:hi]`` with the windows shifted and clamped, and the launch configuration
the op picks for all S_q rows passed explicitly; decode: block-table columns
``[lo / block_kv, hi / block_kv)`` with 2-D lengths shifted and clamped), so every value is
the unfused op's value by construction: a logit depends on its own (row, key) only, and slices
start on whole tiles (prefill: 128 rows, 256 keys) or pages (decode). A Triton kernel
(``_topk_kernel``) then collects the chunk's keys above each row's running bar into a per-row
candidate buffer of int64 keys, cut back to its ``topk`` largest (a select by counts at a
halved bound) whenever it could overflow; the last chunk sorts each row's ``topk`` once. A
row's first chunk starts its bar where at least ``topk`` of the chunk's ``2 W`` group maxima
lie (exact, and on random logits only ~1.4 W keys get past it, whatever the chunk's width). The
workspace is one chunk of logits plus ``2 W`` keys (the buffer, ``W = next_pow2(topk)``), a
count and a bar per row of the block, independent of S_k; :func:`topk_bytes_moved` gives the
traffic beside the unfused pair's.

Decode rows few and short enough (:func:`decode_whole_rows`: their logits and candidates
within 256 MiB) are taken whole instead: one logits launch over the rows' lengths, then each
row's top-k split over several programs (``_topk_rows_across_programs``: digit histograms summed
by atomics, the keys at or above the topk-th key's top 24 bits appended to the row's
candidates; then the merge kernel's select, from those 24 bits on, and sort), so that a batch of
a few requests fills the GPU; the workspace is bounded by that limit rather than by the chunk.

The result is always sorted: the one sort a row is a small part of the work (an unsorted
variant is not offered).

These ops add no host synchronisation of their own: window and length errors are found by the
merge kernel and raised at the next op call or by :func:`tilefuse.check_errors` (see
``tilefuse._errors``); each chunk's logits op runs on windows and lengths valid by
construction (their checks are on the device too, so no chunk syncs). Under ``torch.compile``
the ops are ``torch.library`` custom ops with fake implementations; eager calls run the same
implementation without the dispatcher, and the eager calls of the commonest kind (decode: whole
rows; prefill: one row block and one chunk) go by a plan per argument layout (checked on its
first call: ``_DecodePlan``, ``_PrefillPlan``). They write into ``out=`` if given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import torch

import tilefuse
from tilefuse import _config, _jit, _validate
from tilefuse._device import capability_major
from tilefuse._errors import checked, deferred, error_record, raise_pending, raise_pending_fast
from tilefuse._jit import Launcher, cdiv, next_power_of_2
from tilefuse._validate import check_kernel_device, expect, expect_int, expect_tensor
from tilefuse.formats import format_of
from tilefuse.indexer import _layout, paged, prefill
from tilefuse.indexer import _topk_kernel as kern

_INDEX_DTYPE = torch.int32
# Logits bytes one prefill chunk may take: 512 rows of 65536 fp32 logits (128 MiB; past an
# H100's or H200's 50 MB L2, as 64 MiB already was). At topk 2048, 512-row blocks measured
# 1.31x the sorted pair at 2048 x 32768 against 1.09x for 256 (benchmarks/NOTES.md, round (19)).
_WORKSPACE_BYTES = 128 << 20
# Decode rows taken whole (``decode_whole_rows``): their logits and the candidate buffers
# beside them (12 B a column at fp32). Memory held, not traffic: the logits op writes and the
# passes read only the columns within each row's length. 256 MiB (against 96: B64 ctx 128K
# 1.28x -> 1.38x the sorted pair, next_n 2 1.49x -> 1.67x on an H100; benchmarks/NOTES.md,
# round (26)).
_WHOLE_ROWS_BYTES = 256 << 20
# Key columns a chunk, in state widths W: decode 32 W (against 8 W, rows not taken whole: B256
# next_n 2 ctx 64K 1.38x -> 1.49x the sorted pair, B64 ctx 32K 1.09x -> 1.15x on an H100;
# benchmarks/NOTES.md, round (21)); prefill 32 W (with the first chunk's bar from its group
# maxima a wider chunk takes about as many keys into its buffer, ~1.4 W on random logits, and
# one chunk a row drops a second chunk's selects: 4096 x 65536 1.25x -> 1.30x the sorted pair,
# 2048 x 131072 1.29x -> 1.33x against 16 W on an H100, round (25)).
_DECODE_CHUNK_STATES = 32
_PREFILL_CHUNK_STATES = 32
_MIN_CHUNK, _MAX_CHUNK = 2048, 65536
# Prefill row blocks are whole multiples of this (the query tiles of every prefill kernel, so
# the MX paths' per-tile recompute flags match the unfused op's).
_ROW_BLOCK = 128
# Prefill chunks start on whole key tiles of every prefill kernel (the widest is 256 keys): the
# MX paths recompute flagged key tiles exactly, so the tiling must match the unfused op's.
_PREFILL_KEY_TILE = 256
# Smallest state: the kernels' blocks are at least 16 wide.
_MIN_STATE = 16
# One row a merge program on a GPU (a program's per-row vectors are replicated in every thread:
# at 8 or more rows the select spills hundreds of bytes), but at least 32 keys a program: triton
# 3.6 never finishes compiling a [1, 16] state (its layout-conversion pass loops). Through the
# interpreter (CPU tensors) rows share programs up to this many keys: its cost is per program
# and operation, and the kernel's code is the same for any row count.
_MIN_KEYS_PER_PROGRAM = 32
_INTERPRETER_KEYS_PER_PROGRAM = 2048
# Keys of a program's rows that a select compacts at a time (at least 16 a row): the whole 2 W
# buffer as one register tile held the topk-2048 programs to 128-198 registers a thread.
_SELECT_PIECE_KEYS = 1024
# The merge programs of topk 1025-2048 (W 2048, 8 warps) capped at 64 registers, four an SM: at
# the 99-112 that ptxas takes otherwise (two an SM) the scan hides less of its loads' latency
# (benchmarks/NOTES.md). Wider states hold larger tiles a thread: not capped, not measured.
_MERGE_MAXNREG = 64
_MERGE_MAXNREG_WIDTH = 2048
# Prefill calls of several row blocks or key chunks: each chunk's merge on a side stream, beside
# the next chunk's logits (1: 5-8% faster at 2048 x 32768 .. 4096 x 65536 on an H100, level at
# one step; benchmarks/NOTES.md, round (19)), or after them on the caller's stream (0).
_OVERLAP_MERGES = 1
# Decode calls of several key chunks, the same way (1: B256 next_n 2 ctx 64K 1.30x -> 1.37x the
# sorted pair on an H100; benchmarks/NOTES.md, round (20)), or not (0); each op has its own.
_OVERLAP_DECODE_MERGES = 1
# A merge of a first chunk raises each row's bar before its scan to what at least topk of the
# chunk's 2 W group maxima reach (``_topk_kernel._groups_bar``; 1), or scans from an empty bar (0).
# 1: 1.07x -> 1.16x the sorted pair at 2048 x 32768, 1.10x -> 1.31x at 512 x 8192, decode B256
# next_n 2 ctx 64K 1.25x -> 1.30x on an H100 (benchmarks/NOTES.md, round (19)).
_FIRST_CHUNK_BAR = 1
# The last chunk sorts W keys in one program's registers: compiled for sm_90a in 25 s at topk
# 16384, 104 s with 21.7 KB of spills at 32768, not within 400 s at 65536 (benchmarks/NOTES.md):
# larger values get a clear error, not a compile that does not end.
_MAX_TOPK = 1 << 14
_MAX_POSITION = 2**31 - 2  # keys hold 0x7FFFFFFF - position in 31 bits, above the empty slot


def state_width(topk: int) -> int:
    """``W``: the next power of two >= topk (the final sort's width; the candidate buffer holds
    ``2 W`` keys)."""
    return max(_MIN_STATE, next_power_of_2(topk))


def _gpu_rows_per_program(w: int) -> int:
    """Rows a merge program holds on a GPU (``_MIN_KEYS_PER_PROGRAM``: one a program from W 32)."""
    return max(_MIN_KEYS_PER_PROGRAM // w, 1)


def _groups_bar(w: int, rows_per_program: int) -> bool:
    """Whether a first chunk's merge raises its bar from the chunk's group maxima: the setting,
    where a program's 2 W words a row fit in registers as a select holds its buffer (topk up to
    2048 on a GPU; above it the maxima would spill, and the chunk is scanned from an empty bar)."""
    return bool(_FIRST_CHUNK_BAR) and 2 * w * rows_per_program <= kern.SELECT_HELD_KEYS


def default_chunk_k(topk: int, align: int, states: int | None = None) -> int:
    """Key columns per chunk: ``states * W`` (decode: ``_DECODE_CHUNK_STATES``, read per call)
    within [2048, 65536], rounded up to ``align`` (each chunk is one logits launch and one merge
    launch)."""
    states = _DECODE_CHUNK_STATES if states is None else states
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, states * state_width(topk)))
    return cdiv(chunk, align) * align


def default_prefill_chunk_k(topk: int) -> int:
    """The prefill op's key columns per chunk: ``32 W`` (65536 at topk 2048) on whole key tiles."""
    return default_chunk_k(topk, _PREFILL_KEY_TILE, _PREFILL_CHUNK_STATES)


def default_chunk_q(chunk_k: int, logits_dtype: torch.dtype) -> int:
    """Prefill query rows per block: as many multiples of 128 as keep one chunk of logits within
    ``_WORKSPACE_BYTES`` (at least 128)."""
    per_row = chunk_k * logits_dtype.itemsize
    return max(_ROW_BLOCK, _WORKSPACE_BYTES // per_row // _ROW_BLOCK * _ROW_BLOCK)


def decode_whole_rows(rows: int, max_context_len: int, logits_dtype: torch.dtype) -> bool:
    """Whether the decode op (``chunk_k=None``) takes its rows whole: the logits of all rows at
    once, then each row's top-k split over several programs (``_topk_rows_across_programs``),
    when those logits and their candidate keys (int64, one slot a column) take at most
    ``_WHOLE_ROWS_BYTES``. Chunks instead leave one program a row to the merge, which is 1.3-9x
    slower than the split at the rows and widths where both were timed (``benchmarks/NOTES.md``)."""
    per_key = logits_dtype.itemsize + 8
    return rows * max_context_len * per_key <= _WHOLE_ROWS_BYTES


def topk_bytes_moved(rows: int, n_keys: int, topk: int, chunk_k: int, logits_bytes: int = 4,
                     chunk_q: int | None = None) -> dict:
    """Bytes of logits, state and result traffic of one call, beside the unfused pair's.

    ``rows`` x ``n_keys`` logits of ``logits_bytes`` each. Unfused: the logits op writes them
    and a top-k reads them at least once, then writes int32 indices. Chunked (these ops): the
    same logits writes and reads, but into a workspace of ``min(rows, chunk_q) * chunk_k`` logits
    and as many candidate buffers (``2 W`` int64 keys a row; in L2 when they fit, so they need
    not reach HBM), plus a row's count and bar (12 bytes) stored after every chunk but the last
    and loaded before every chunk but the first, plus the indices. The candidates (keys above a
    row's running bar, each stored once and loaded once or twice) depend on the values:
    ``candidates_random`` is their bytes for keys in random order. With the first chunk's bar
    from its group maxima (``_FIRST_CHUNK_BAR``, topk up to 2048; it also reads the first chunk
    a second time), a first chunk of ``c`` keys in ``g = c / 2 W`` keys a group takes about ``c (1 - (1 -
    topk / 2 W)^(1 / g))`` (~1.4 W at topk = W), later keys ``topk * ln(n / c)`` a row of ``n``;
    without it ``topk * (1 + ln(n / topk))`` (a bar that rises at every key; it rises a select
    at a time, so a little more). Keys in ascending order make every key a candidate.
    Inputs (q, keys, weights) are read alike by both and left out.
    """
    logits = rows * n_keys * logits_bytes
    indices = rows * topk * 4
    chunks = max(1, cdiv(n_keys, chunk_k))
    segments, maxima, keep = _across_segments(rows, n_keys, topk)
    key_passes = 2 if keep else kern.pass_levels(maxima) + 1
    maxima_bytes = rows * segments * _ACROSS_BLOCK * 8 if keep else 0
    state = rows * 12 * 2 * (chunks - 1)
    block = rows if chunk_q is None else min(rows, chunk_q)
    first = min(chunk_k, n_keys)
    w = state_width(topk)
    bar = _groups_bar(w, _gpu_rows_per_program(w))
    groups_bar = rows * first * logits_bytes if bar else 0
    if n_keys <= topk:
        per_row = n_keys
    elif bar:
        width = 2 * w
        per_row = first * (1 - (1 - topk / width) ** (width / max(first, width))) + topk * math.log(n_keys / first)
    else:
        per_row = topk * (1 + math.log(n_keys / topk))
    return {
        "unfused": 2 * logits + indices,
        # decode_whole_rows: the logits written once and read by the passes across programs
        # that read keys (in L2 when they fit; over group maxima kept between the passes the
        # first and the compaction, the first writing the maxima and the second digit pass
        # reading them), a histogram of 3 x 256 int32 a row, the candidates (about topk a row)
        "whole_rows_total": (1 + key_passes) * logits + 2 * maxima_bytes
        + rows * (kern.RADIX_LEVELS << kern.RADIX_BITS) * 4 + rows * min(topk, n_keys) * 16 + indices,
        "whole_rows_workspace_bytes": rows * max(n_keys, 1) * (logits_bytes + 8),
        "chunked_total": 2 * logits + groups_bar + state + indices,
        "chunked_workspace_bytes": block * (min(chunk_k, max(n_keys, 1)) * logits_bytes + 2 * w * 8
                                            + 12),
        "chunked_hbm_if_l2_resident": state + indices,
        "candidates_random": round(rows * per_row * 8 * 2),
    }


def _check_topk_args(logits_dtype, topk, chunk_k, align: int, rows: int, out, device, return_values) -> None:
    expect(logits_dtype in (torch.float32, torch.bfloat16), TypeError,
           f"logits_dtype: expected float32 or bfloat16, got {logits_dtype}")
    expect_int(topk, "topk", 1)
    expect(topk <= _MAX_TOPK, ValueError, f"topk: at most {_MAX_TOPK}, got {topk}")
    expect(isinstance(return_values, bool), TypeError, f"return_values: expected a bool, got {return_values!r}")
    if chunk_k is not None:
        expect_int(chunk_k, "chunk_k", 1)
        expect(chunk_k % align == 0, ValueError, f"chunk_k: must be a multiple of {align} here, got {chunk_k}")
    if out is not None:
        expect_tensor(out, "out")
        expect(out.dtype == _INDEX_DTYPE, TypeError, f"out: expected int32, got {out.dtype}")
        expect(tuple(out.shape) == (rows, topk) and out.stride(1) == 1, ValueError,
               f"out: expected [{rows}, {topk}] with unit last stride, got shape {tuple(out.shape)} "
               f"strides {out.stride()}")
        expect(out.device == device, ValueError, f"out: expected device {device}, got {out.device}")


def _outputs(rows: int, topk: int, logits_dtype, device, out, return_values: bool):
    if out is None:
        out = torch.empty((rows, topk), dtype=_INDEX_DTYPE, device=device)
    values = torch.empty((rows, topk), dtype=logits_dtype, device=device) if return_values else None
    return out, values


# The kernels' launches by a key computed here (``tilefuse._jit.Launcher``): Triton's binder
# costs more host time than a launch, and the decode op over whole rows makes five of them.
_merge_launch = Launcher(kern.topk_merge_chunk_kernel)
_pass_launch = Launcher(kern.topk_rows_pass_kernel)


def _aligned(*tensors) -> tuple:
    """What Triton specialises on in a pointer argument: its address divisible by 16."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def _merge(logits, bars, candidates, counts, lo: int, width: int, win_a, win_b, n_keys: int, key_limit: int,
           next_n: int, ctx_stride: int, row_base: int, out, values, topk: int, mode: int, first: bool,
           final: bool, hist: torch.Tensor | None = None, partials: dict | None = None,
           maxima: bool = False, sized: bool = False) -> None:
    """Merge logits columns ``[0, width)`` (positions ``lo + c``) of every row of ``out`` into
    its candidates (``candidates``: one buffer a row; ``counts``, ``bars``: its count and bar
    between chunks); ``row_base`` is the first row's index in the op's output (for error
    messages). With ``hist`` (a final merge after ``_topk_rows_across_programs``' passes; over
    group maxima with ``maxima``) the rows' counts and histograms are zeroed after use.
    ``partials``: partial launches by launch key, for callers whose ``next_n``, ``ctx_stride``
    and ``row_base`` never change (taken and kept there); ``sized``: the launch of a recorded
    one-chunk call follows its sizes (:func:`_plan_merge_sized`)."""
    rows, w = out.shape[0], state_width(topk)
    rows_per_program = _gpu_rows_per_program(w)
    # The interpreter: row blocks (the kernel registry sets the row cap to 0 to compile the
    # GPU's launches).
    if logits.device.type == "cpu" and _INTERPRETER_KEYS_PER_PROGRAM:
        rows_per_program = max(rows_per_program, min(next_power_of_2(rows), _INTERPRETER_KEYS_PER_PROGRAM // w))
    piece = min(2 * w, max(16, _SELECT_PIECE_KEYS // rows_per_program))
    vals = out if values is None else values
    err = error_record(out.device)
    consts = (topk, w, w.bit_length() - 1, rows_per_program, mode, first, final, values is not None, piece,
              0 if hist is None else 2 if maxima else 1, first and _groups_bar(w, rows_per_program))
    warps = max(1, min(8, rows_per_program * w // 256))
    if hist is not None and warps == 8 and rows_per_program == 1:  # the last step after the passes
        warps = _ACROSS_LAST_STEP_WARPS
    if hist is None:
        hist = counts  # (not read without RESET)
    key = (consts, warps, logits.dtype, vals.dtype, win_a.dtype, win_b.dtype,
           _aligned(logits, bars, candidates, counts, hist, win_a, win_b, out, vals, err))
    grid = cdiv(rows, rows_per_program)
    fast = partials.get(key) if partials is not None else None
    stride_v = 0 if values is None else values.stride(0)
    if fast is not None and fast(logits, logits.stride(0), bars, candidates, candidates.stride(0), counts, hist, rows,
                                 win_a, win_b, n_keys, key_limit, lo, width, out, out.stride(0), vals, stride_v, grid):
        return
    args = (logits, logits.stride(0), bars, candidates, candidates.stride(0), counts, hist,
            rows, row_base, win_a, win_b, n_keys, key_limit, next_n, ctx_stride,
            lo, width,
            out, out.stride(0), vals, stride_v,
            err, *consts)
    options = {"num_warps": warps}
    if w == _MERGE_MAXNREG_WIDTH:
        options["maxnreg"] = _MERGE_MAXNREG
    _merge_launch(key, (grid,), args, options, sized=_plan_merge_sized(rows_per_program) if sized else None)
    if partials is not None and fast is None:
        # every argument but next_n, ctx_stride, row_base, the error record and the constexprs
        fast = _merge_launch.partial(key, (grid,), args, options,
                                     live=(0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 15, 16, 17, 18, 19, 20),
                                     live_grid=(18,))
        if fast is not None:
            partials[key] = fast


# Rows split over programs (``_topk_rows_across_programs``): programs a launch aims at (four an
# SM of an H200's 132), the fewest keys of a row's width a program gets, and the keys a program
# reads at a time (its blocks are block-cyclic over the row's programs).
_ACROSS_PROGRAMS = 4 * 132
_ACROSS_MIN_SEGMENT = 2048
_ACROSS_BLOCK = 1024
_PASS_OPTIONS = {"num_warps": 4}

# Warps of the last step after the passes (one program a row, W >= 2048): 16 halves each
# thread's share of the row's select and sort where the rows leave SMs idle (against 8, the
# merge's: B8 ctx 64K 1.25x -> 1.51x the sorted pair, B64 ctx 32K 1.18x -> 1.25x, level at one
# row on an H100; benchmarks/NOTES.md, round (21)).
_ACROSS_LAST_STEP_WARPS = 16
# The digit passes over the largest key of each program's columns (1; at least 2 W groups a
# row, so a row takes at least 2 W / _ACROSS_BLOCK programs) instead of every key (0): a
# histogram of a program's BLOCK maxima once, not of each block it reads (B64 ctx 32K 1.03x ->
# 1.18x the sorted pair on an H100, level at 1 row; benchmarks/NOTES.md, round (20)).
_ACROSS_GROUP_MAXIMA = 1


# Histograms and counts of the passes across programs: RADIX_LEVELS x 2^RADIX_BITS int32 and one
# int32 a row, zero between calls (the last step zeroes what the passes summed), so a buffer
# per device and stream is kept for calls of up to _KEPT_ROWS rows (4096: 12 MiB) instead of an
# allocation and a fill launch per call.
_HIST_INTS = kern.RADIX_LEVELS << kern.RADIX_BITS
_KEPT_ROWS = 4096


class _KeptHistograms(NamedTuple):
    key: tuple  # (device, stream)
    hist: torch.Tensor
    counts: torch.Tensor
    rows: int


_kept_histograms: dict[tuple, _KeptHistograms] = {}


def _take_histograms(rows: int, device: torch.device) -> tuple:
    """``(kept, hist, counts)``: zeroed histograms and counts for ``rows`` rows on the current
    stream of ``device``. ``kept``: the stream's kept buffer, taken out of ``_kept_histograms``
    for this call (:func:`_put_back_histograms` after its last launch): a call that fails
    between its launches never puts a half-used buffer back, and a call on the same stream from
    another thread meanwhile gets a buffer of its own. None where the call has a zeroed buffer
    of its own: more rows than kept, or a call being captured into a CUDA graph (the fill is a
    node of the graph, which may be replayed on any stream beside the calls on this one)."""
    stream, capturing = prefill._stream_and_capture(device.index if device.type == "cuda" else -1)
    if capturing or rows > _KEPT_ROWS:
        zeroed = torch.zeros(rows * (_HIST_INTS + 1), dtype=torch.int32, device=device)
        return None, zeroed[:rows * _HIST_INTS], zeroed[rows * _HIST_INTS:]
    key = (device, stream)
    kept = _kept_histograms.pop(key, None)
    if kept is None or kept.rows < rows:
        zeroed = torch.zeros(_KEPT_ROWS * (_HIST_INTS + 1), dtype=torch.int32, device=device)
        kept = _KeptHistograms(key, zeroed[:_KEPT_ROWS * _HIST_INTS], zeroed[_KEPT_ROWS * _HIST_INTS:], _KEPT_ROWS)
    return kept, kept.hist, kept.counts


def _put_back_histograms(kept: _KeptHistograms | None) -> None:
    """The buffer of :func:`_take_histograms` kept for the stream's next call (once the launches
    that zero it are queued)."""
    if kept is not None:
        _kept_histograms[kept.key] = kept


def _across_segments(rows: int, n_keys: int, topk: int,
                     segments: int | None = None) -> tuple[int, bool, bool]:
    """``(segments, maxima, keep)`` of :func:`_topk_rows_across_programs`: the programs a row
    (given, or as many as fill ``_ACROSS_PROGRAMS`` with at least ``_ACROSS_MIN_SEGMENT`` keys
    each, and 2 W groups where ``_ACROSS_GROUP_MAXIMA``), whether the passes go over group
    maxima, and whether those are kept between the passes (a row's ``n_keys`` candidate slots
    hold its programs' ``segments x _ACROSS_BLOCK`` maxima; else the second digit pass reads
    the keys again)."""
    groups = 2 * state_width(topk)
    if segments is None:
        segments = max(1, min(cdiv(_ACROSS_PROGRAMS, max(rows, 1)), cdiv(n_keys, _ACROSS_MIN_SEGMENT)))
        if _ACROSS_GROUP_MAXIMA:
            segments = max(segments, cdiv(groups, _ACROSS_BLOCK))
    maxima = bool(_ACROSS_GROUP_MAXIMA) and segments * _ACROSS_BLOCK >= groups
    return segments, maxima, maxima and segments * _ACROSS_BLOCK <= n_keys


def _topk_rows_across_programs(logits, win_a, win_b, topk: int, mode: int = kern.WIN_PREFILL, next_n: int = 1,
                               ctx_stride: int = 1, segments: int | None = None, values: bool = False,
                               out: torch.Tensor | None = None, out_values: torch.Tensor | None = None,
                               partials: dict | None = None):
    """The top-k of each row of ``logits [R, N]`` (columns are positions; windows as the merge
    kernel reads them) by a radix select across ``segments`` programs a row: the histograms of
    the keys' top three 8-bit digits (each among the keys sharing the digits above it with the
    row's topk-th key), then every key at or above those 24 bits appended to the row's
    candidates, then the merge kernel's last step (a select from those 24 bits on, a sort, the
    writes), which zeroes the histograms and counts (:func:`_take_histograms`). With
    ``_ACROSS_GROUP_MAXIMA`` (where ``segments`` x ``_ACROSS_BLOCK`` >= 2 W) the digits are the
    top two of the topk-th largest group maximum (``topk_rows_pass_kernel``'s MAXIMA), a bound
    below the row's topk-th key, and the last step selects from the top. For the decode rows
    taken whole (:func:`decode_whole_rows`), where one program a row leaves most of the GPU
    idle. Writes ``out`` / ``out_values`` when given; ``partials``: the launches as partial
    launches by launch key, for a caller whose ``next_n``, ``ctx_stride`` and ``topk`` never
    change (taken and kept there). Returns ``(indices, values or None)``."""
    rows, n_keys = logits.shape
    dev = logits.device
    segments, maxima, keep = _across_segments(rows, n_keys, topk, segments)
    if out is None:
        out = torch.empty((rows, topk), dtype=torch.int32, device=dev)
    if out_values is None and values:
        out_values = torch.empty((rows, topk), dtype=logits.dtype, device=dev)
    if rows == 0:
        return out, out_values
    candidates = torch.empty((rows, max(n_keys, 1)), dtype=torch.int64, device=dev)
    kept, hist, counts = _take_histograms(rows, dev)
    aligned = _aligned(logits, win_a, win_b, hist, candidates, counts)
    stride_l, stride_c = logits.stride(0), candidates.stride(0)
    for p in range(kern.pass_levels(maxima) + 1):
        consts = (p, mode, _ACROSS_BLOCK, maxima, keep)
        key = (consts, logits.dtype, win_a.dtype, win_b.dtype, aligned)
        fast = partials.get(key) if partials is not None else None
        if fast is not None and fast(logits, stride_l, win_a, win_b, n_keys, segments, hist, candidates, stride_c,
                                     counts, rows):
            continue
        args = (logits, stride_l, win_a, win_b, n_keys, next_n, ctx_stride, segments,
                hist, candidates, stride_c, counts, topk, *consts)
        _pass_launch(key, (rows, segments), args, _PASS_OPTIONS)
        if partials is not None and fast is None:
            # every argument but next_n, ctx_stride, topk and the constexprs; the grid (rows, segments)
            fast = _pass_launch.partial(key, (rows, segments), args, _PASS_OPTIONS,
                                        live=(0, 1, 2, 3, 4, 7, 8, 9, 10, 11), live_grid=(10, 5))
            if fast is not None:
                partials[key] = fast
    # The last step reads a bar a row and uses it only after a scan, which it has none of here:
    # any int64 memory of a row each does (no allocation on the call's path).
    bars = candidates
    _merge(logits, bars, candidates, counts, 0, 0, win_a, win_b, n_keys, n_keys, next_n, ctx_stride, 0, out,
           out_values, topk, mode, first=False, final=True, hist=hist, partials=partials, maxima=maxima)
    _put_back_histograms(kept)
    return out, out_values


# Eager decode calls over whole rows of at most this many keys (``max_context_len``): one merge
# program a row over the whole row (the logits and one launch) instead of the passes across
# programs and their last step (four launches over group maxima), since launches, not GPU time,
# bound such calls eagerly (benchmarks/NOTES.md, rounds (22) and (23): one merge is ahead to
# 32768 keys, and at 64K keys only for one row). Captured into a CUDA graph a call keeps the
# passes (less GPU time). 0: never.
_EAGER_ONE_MERGE_KEYS = 32768


def _decode_rows_topk(logits, context_lens, topk: int, mode: int, next_n: int, ctx_stride: int, out, values,
                      partials: dict | None = None) -> None:
    """The top-k of decode rows taken whole (``logits [R, max_context_len]``) into ``out`` /
    ``values``: one merge a row for short rows of an eager call (``_EAGER_ONE_MERGE_KEYS``),
    else :func:`_topk_rows_across_programs`. Both give the same bits."""
    rows, n_keys = logits.shape
    dev = logits.device
    if rows and n_keys <= _EAGER_ONE_MERGE_KEYS and not prefill._stream_and_capture(
            dev.index if dev.type == "cuda" else -1)[1]:
        bars, candidates, counts = _workspace(rows, topk, 1, dev)
        _merge(logits, bars, candidates, counts, 0, n_keys, context_lens, context_lens, n_keys, n_keys, next_n,
               ctx_stride, 0, out, values, topk, mode, first=True, final=True, partials=partials)
        return
    _topk_rows_across_programs(logits, context_lens, context_lens, topk, mode, next_n, ctx_stride, out=out,
                               out_values=values, partials=partials)


_merge_streams: dict[int, torch.cuda.Stream] = {}


def _merge_stream(device: torch.device, steps: int, enabled: int) -> torch.cuda.Stream | None:
    """The side stream a device's merges run on (made once a device; calls from several streams
    at once serialise their merges there), or None: the op's setting (``enabled``) off, one
    step, not CUDA."""
    if not (enabled and steps > 1 and device.type == "cuda"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _merge_streams.get(index)
    if stream is None:
        stream = _merge_streams[index] = torch.cuda.Stream(device=index)
    return stream


class _SideMerges:
    """A call's merges on the side stream of :func:`_merge_stream`, each beside the next step's
    logits. Two logits buffers taken in turn: a step's logits wait for the merge that read its
    buffer two steps before, so the memory stays two chunks whatever the host's lead."""

    def __init__(self, side: torch.cuda.Stream, rows: int, cols: int, logits_dtype, device: torch.device):
        self.side, self.main = side, torch.cuda.current_stream(device)
        side.wait_stream(self.main)  # (joins a graph capture too)
        self.ring = [_layout.new_logits(rows, cols, logits_dtype, device) for _ in range(2)]
        self.merged: list = [None, None]
        self.step = self.slot = 0

    def buffer(self, rows: int, cols: int) -> torch.Tensor:
        """The next step's logits buffer, once the merge that last read it is done."""
        self.slot, self.step = self.step % 2, self.step + 1
        if self.merged[self.slot] is not None:
            self.main.wait_event(self.merged[self.slot])
        return self.ring[self.slot][:rows, :cols]

    @contextlib.contextmanager
    def merging(self):
        """The step's merge on the side stream, after the caller's launches so far (the merges
        keep their order there)."""
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            yield
        self.merged[self.slot] = self.side.record_event()

    def join(self) -> None:
        self.main.wait_stream(self.side)


def _chunks(n_keys: int, chunk_k: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` column ranges; one empty range when there are no keys (the rows still get -1)."""
    return [(lo, min(lo + chunk_k, n_keys)) for lo in range(0, max(n_keys, 1), chunk_k)]


def _span(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """``t[lo:hi]``, or ``t`` itself where that is all of it (no view made: most calls are one
    row block and one chunk)."""
    if t is None or (lo == 0 and hi == t.shape[0]):
        return t
    return t[lo:hi]


# One chunk's merge (FIRST and FINAL, no passes before it) neither reads nor writes a bar or a
# count: one pair of one-element tensors a device stands in for them, so such a call allocates
# its candidate buffer alone.
_unread_bar_and_count: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(rows: int, topk: int, n_chunks: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bars, candidates, counts)``: a row's int64 bar, its buffer of ``2 W`` int64 keys and
    its int32 count, carried between chunks. One chunk goes straight from empty to the result:
    no bar or count needed then (``_unread_bar_and_count``)."""
    candidates = torch.empty((rows, 2 * state_width(topk)), dtype=torch.int64, device=device)
    if n_chunks > 1:
        return (torch.empty(rows, dtype=torch.int64, device=device), candidates,
                torch.empty(rows, dtype=torch.int32, device=device))
    unread = _unread_bar_and_count.get(device)
    if unread is None:
        unread = _unread_bar_and_count[device] = (torch.empty(1, dtype=torch.int64, device=device),
                                                  torch.empty(1, dtype=torch.int32, device=device))
    return unread[0], candidates, unread[1]


# ---------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------
def _prefill_config(q: torch.Tensor, q_sf: torch.Tensor | None, k: torch.Tensor, logits_dtype) -> prefill.PrefillConfig:
    """The launch configuration the unfused op picks for the call's S_q rows and S_k keys."""
    fmt = format_of(q, q_sf)
    head_dim = q.shape[2] * 2 if fmt == "mxfp4" else q.shape[2]
    return prefill.resolve_config(fmt, q.shape[1], head_dim, q.shape[0], None, logits_dtype,
                                  capability_major(q.device), k.shape[0])


def _run_mqa_topk(
    q: torch.Tensor,
    q_sf: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    logits_dtype: torch.dtype,
    topk: int,
    chunk_q: int,
    chunk_k: int,
    out: torch.Tensor,
    values: torch.Tensor | None,
) -> None:
    s_q, s_k = q.shape[0], k.shape[0]
    cfg = _prefill_config(q, q_sf, k, logits_dtype)  # pinned for every slice
    chunks = _chunks(s_k, chunk_k)
    bars, candidates, counts = _workspace(min(s_q, chunk_q), topk, len(chunks), q.device)
    steps = cdiv(max(s_q, 1), chunk_q) * len(chunks)
    side = _merge_stream(q.device, steps, _OVERLAP_MERGES)
    ring = None if side is None else _SideMerges(side, min(s_q, chunk_q), min(s_k, chunk_k), logits_dtype, q.device)
    with deferred():  # a chunk's errors surface at the next call, not the next chunk
        for r0 in range(0, max(s_q, 1), chunk_q):
            r1 = min(r0 + chunk_q, s_q)
            ks_r, ke_r, out_r, val_r = (_span(t, r0, r1) for t in (ks, ke, out, values))
            q_rows = (_span(q, r0, r1), _span(q_sf, r0, r1))
            w_r = _span(weights, r0, r1)
            for c, (lo, hi) in enumerate(chunks):
                width = hi - lo
                if lo == 0:
                    # The logits kernel clamps windows into [0, width] as below and reports the
                    # bad ones as the merge does: no launches (the only chunk of most calls).
                    ks_c, ke_c = ks_r, ke_r
                else:  # (raw, a window starting before the chunk would be reported negative)
                    ks_c = (ks_r - lo).clamp(0, width)
                    ke_c = torch.maximum((ke_r - lo).clamp(0, width), ks_c)
                buffer = None if ring is None else ring.buffer(r1 - r0, width)
                logits = tilefuse.fp8_fp4_mqa_logits(q_rows, (_span(k, lo, hi), _span(k_scale, lo, hi)), w_r, ks_c,
                                                     ke_c, clean_logits=False, logits_dtype=logits_dtype, config=cfg,
                                                     out=buffer)
                if r1 == r0:
                    continue
                with contextlib.nullcontext() if ring is None else ring.merging():
                    _merge(logits, bars, candidates, counts, lo, width, ks_r, ke_r, s_k, s_k, 1, 0, r0, out_r, val_r,
                           topk, kern.WIN_PREFILL, first=c == 0, final=c == len(chunks) - 1)
    if ring is not None:
        ring.join()


class _PrefillPlan:
    """An eager prefill call of one row block and one key chunk, by its layout: its checks
    passed, the logits launch configuration of its size class, a bar and a count that a
    one-chunk merge never reads nor writes, the merge's pre-bound launches by launch key, and
    ``replay``: the call's launches recorded once and replayed with each later call's tensors
    and sizes (``tilefuse._jit.replay``), or the tries to record them so far (an int), or
    ``_jit.NOT_REPLAYABLE`` (MX formats: their tile counters follow the stream)."""

    __slots__ = ("cfg", "device", "bars", "counts", "partials", "replay")

    def __init__(self, cfg: prefill.PrefillConfig, device: torch.device, fp8: bool):
        self.cfg, self.device = cfg, device
        self.bars = torch.empty(1, dtype=torch.int64, device=device)
        self.counts = torch.empty(1, dtype=torch.int32, device=device)
        self.partials: dict = {}
        self.replay = 0 if fp8 else _jit.NOT_REPLAYABLE


# Plans by layout: what the op's checks read but S_q and S_k (the logits op's signature, the
# size class its config follows), plus topk, return_values, out's and schedule_meta's layout,
# and the alignment of the windows and out (the merge's replayed launch specialises on it).
_prefill_plans: dict[tuple, _PrefillPlan] = {}
_MAX_PREFILL_PLANS = 4096


def _prefill_plan_key(q_values, q_sf, k, k_scale, weights, ks, ke, topk, logits_dtype, return_values, out,
                      schedule_meta) -> tuple:
    """The layout key of a prefill call (AttributeError, TypeError, IndexError where an argument
    is not what the op takes: the checks then say what is wrong)."""
    overrides = _config._overrides.get("prefill")
    device = q_values.device
    return (prefill._signature(q_values, q_sf, k, k_scale, weights, ks, ke, 0, logits_dtype),
            prefill.size_class(q_values.shape[0], k.shape[0]), topk.__class__, topk,
            return_values.__class__, return_values,
            None if out is None else (out.shape[1:], out.stride(), out.dtype, out.get_device(), out.data_ptr() & 15),
            None if schedule_meta is None else (schedule_meta.__class__, schedule_meta.dtype, schedule_meta.dim()),
            tuple(sorted(overrides.items())) if overrides else None,
            # (the merge kernel specialises on these pointers' alignment; the plan replays its launch)
            ks.data_ptr() & 15, ke.data_ptr() & 15,
            # on the CPU, whether a kernel runs at all follows the interpreter (and which, the
            # architecture the tests pose as)
            device.type == "cuda" or (_validate.interpreter_enabled(), capability_major(device)))


def _one_step(s_q: int, s_k: int, topk: int, logits_dtype) -> bool:
    """Whether a call with the default chunks is one row block and one key chunk."""
    chunk_k = default_prefill_chunk_k(topk)
    return 1 <= s_q <= default_chunk_q(chunk_k, logits_dtype) and 1 <= s_k <= chunk_k


def _plan_merge_sized(rows_per_program: int) -> tuple:
    """The one-chunk merge's grid and size arguments (logits row stride, rows, n_keys, key_limit,
    the chunk's width) from the plan's sizes ``(S_q, S_k, S_k, logits row stride)``
    (``tilefuse._jit.replay``)."""
    def sized(s_q, s_k, n_cols, stride_l):
        return (-(-s_q // rows_per_program),), (stride_l, s_q, s_k, s_k, n_cols), ()

    return sized, (1, 7, 11, 12, 16), ()


def _prefill_plan_launches(plan: _PrefillPlan, q_values, q_sf, k, k_scale, weights, ks, ke, logits, out, values,
                           topk: int, partials: dict | None) -> None:
    """The plan's two launches (the logits of the call's inputs, checked when the plan was
    made, into ``logits``, then one merge over them), the merge's buffer as scratch of a
    replayable call; the merge by the plan's partial launches where given (a recorded call has
    none: a partial launch is not recorded)."""
    s_q, s_k = q_values.shape[0], k.shape[0]
    w = state_width(topk)
    candidates = _jit.scratch(s_q, 2 * w, dtype=torch.int64, device=plan.device,
                              sized=lambda s_q, *_: (s_q, 2 * w))
    prefill._run(q_values, q_sf, k, k_scale, weights, ks, ke, False, 0, plan.cfg, logits)
    _merge(logits, plan.bars, candidates, plan.counts, 0, s_k, ks, ke, s_k, s_k, 1, 0, 0, out, values, topk,
           kern.WIN_PREFILL, first=True, final=True, partials=partials, sized=True)


def _run_prefill_plan(plan: _PrefillPlan, q_values, q_sf, k, k_scale, weights, ks, ke, logits_dtype, topk: int,
                      out, values) -> None:
    s_q, s_k = q_values.shape[0], k.shape[0]
    # (rows padded as the logits op's own output: its kernels store whole 16-element rows)
    logits = _layout.new_logits(s_q, s_k, logits_dtype, plan.device)
    args = (q_values, q_sf, k, k_scale, weights, ks, ke, logits, out, values)
    replay = plan.replay
    if replay.__class__ is int:  # record this call's launches
        with _jit.recorded_launches() as recording:
            _prefill_plan_launches(plan, *args, topk, None if recording is not None else plan.partials)
        if recording is not None:  # (None: another thread is recording; next time)
            plan.replay = _jit.replay_or_try_again(recording, args,
                                                   (plan.bars, plan.counts, error_record(plan.device)), replay)
        return
    # (False: a launch declined, nothing launched from it on: the ordinary launches)
    if replay is _jit.NOT_REPLAYABLE or not replay((s_q, s_k, s_k, logits.stride(0)), *args):
        _prefill_plan_launches(plan, *args, topk, plan.partials)


def _make_prefill_plan(key, q_values, q_sf, k, k_scale, weights, ks, ke, logits_dtype) -> _PrefillPlan:
    """A one-step call's plan (its arguments checked by the op already, but for what the logits
    op checks: checked here, as the plan's launches skip that op's wrapper)."""
    prefill._check_inputs(q_values, q_sf, k, k_scale, weights, ks, ke, 0, logits_dtype)
    plan = _PrefillPlan(_prefill_config(q_values, q_sf, k, logits_dtype), q_values.device, q_sf is None)
    if len(_prefill_plans) >= _MAX_PREFILL_PLANS:
        _prefill_plans.clear()
    _prefill_plans[key] = plan
    return plan


def _prefill_by_plan(q_values, q_sf, k, k_scale, weights, ks, ke, topk, logits_dtype, return_values, out,
                     schedule_meta):
    """``(key, result)``: the call made by its layout's plan where there is one and the call is
    one step (result not None), else ``(key or None, None)`` for the checked path."""
    try:
        key = _prefill_plan_key(q_values, q_sf, k, k_scale, weights, ks, ke, topk, logits_dtype, return_values,
                                out, schedule_meta)
        plan = _prefill_plans.get(key)
    except (AttributeError, TypeError, IndexError, RuntimeError):  # not tensors, unhashable: the checks say which
        return None, None
    if plan is None:
        return key, None
    s_q, s_k = q_values.shape[0], k.shape[0]
    if not (prefill._sizes_agree(q_values, q_sf, k, k_scale, weights, ks, ke)
            and _one_step(s_q, s_k, topk, logits_dtype) and (out is None or out.shape[0] == s_q)):
        return key, None
    raise_pending_fast(plan.device)
    out, values = _outputs(s_q, topk, logits_dtype, plan.device, out, return_values)
    _run_prefill_plan(plan, q_values, q_sf, k, k_scale, weights, ks, ke, logits_dtype, topk, out, values)
    return key, ((out, values) if return_values else out)


@torch.library.custom_op("tilefuse::mqa_topk", mutates_args=("out", "values"))
def _mqa_topk(
    q: torch.Tensor, q_sf: torch.Tensor | None, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
    ks: torch.Tensor, ke: torch.Tensor, logits_dtype: torch.dtype, topk: int, chunk_q: int, chunk_k: int,
    out: torch.Tensor, values: torch.Tensor | None,
) -> None:
    _run_mqa_topk(q, q_sf, k, k_scale, weights, ks, ke, logits_dtype, topk, chunk_q, chunk_k, out, values)


@_mqa_topk.register_fake
def _mqa_topk_fake(q, q_sf, k, k_scale, weights, ks, ke, logits_dtype, topk, chunk_q, chunk_k, out, values):
    return None


def fp8_fp4_mqa_topk(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    topk: int = 2048,
    logits_dtype: torch.dtype = torch.float32,
    schedule_meta: torch.Tensor | None = None,
    *,
    return_values: bool = False,
    out: torch.Tensor | None = None,
    chunk_k: int | None = None,
    chunk_q: int | None = None,
):
    """The ``topk`` best keys of every query row under :func:`tilefuse.fp8_fp4_mqa_logits`.

    Args:
        q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, logits_dtype: as for
            :func:`tilefuse.fp8_fp4_mqa_logits` (FP8, MXFP8, MXFP4; fp32/bf16 weights; the
            logits dtype the ranking reads, so bf16 logits tie more often).
        topk: positions per row (1 to 16384).
        schedule_meta: accepted as the logits op does (from ``get_mqa_logits_metadata``); the
            result does not depend on it.
        return_values: also return each position's logit (``-inf`` at ``-1``; ``-0.0`` comes
            back as ``+0.0``).
        out: int32 ``[S_q, topk]`` to write the indices into (last stride 1).
        chunk_k: key columns per chunk, a multiple of 256 (default: :func:`default_prefill_chunk_k`).
        chunk_q: query rows per block, a multiple of 128 (default: :func:`default_chunk_q`,
            about 128 MiB of logits a chunk).

    Returns:
        int32 ``[S_q, topk]``: key positions (indices into ``kv``) by (logit descending,
        position ascending) within ``[ks, min(ke, S_k))``, then ``-1``; with ``return_values``
        ``(indices, values)``.

    Raises:
        TypeError, ValueError: the logits op's errors for its arguments; a bad ``topk``,
        ``chunk_k``, ``out`` or ``schedule_meta``. Bad window values (``ks < 0``, ``ks > ke``)
        raise :class:`tilefuse.DeviceValueError` at the next call or ``tilefuse.check_errors()``.
    """
    q_values, q_sf = prefill.split_query(q)
    k, k_scale = prefill.split_keys(kv)
    # Eager one-step calls by their layout's plan (checked mode: the checked path).
    plan_key = None
    if chunk_k is None and chunk_q is None and not checked() and not torch.compiler.is_compiling():
        plan_key, result = _prefill_by_plan(q_values, q_sf, k, k_scale, weights, cu_seq_len_k_start,
                                            cu_seq_len_k_end, topk, logits_dtype, return_values, out, schedule_meta)
        if result is not None:
            return result
    for name, t in (("q", q_values), ("kv[0]", k), ("kv[1]", k_scale),
                    ("cu_seq_len_k_start", cu_seq_len_k_start), ("cu_seq_len_k_end", cu_seq_len_k_end)):
        expect_tensor(t, name)
    s_q = q_values.shape[0] if q_values.dim() else 0
    check_kernel_device(q_values, "q")
    for name, t in (("cu_seq_len_k_start", cu_seq_len_k_start), ("cu_seq_len_k_end", cu_seq_len_k_end)):
        prefill.check_window_bound(t, name, s_q)
        expect(t.device == q_values.device, ValueError, f"{name}: expected device {q_values.device}, got {t.device}")
    expect(k.dim() >= 1 and k.shape[0] <= _MAX_POSITION, ValueError,
           f"kv[0]: at most {_MAX_POSITION} keys, got shape {tuple(k.shape)}")
    if schedule_meta is not None:
        expect_tensor(schedule_meta, "schedule_meta")
        expect(schedule_meta.dtype == torch.int32 and schedule_meta.dim() == 2, ValueError,
               f"schedule_meta: expected int32 [1 + num_q_blocks, 2] from get_mqa_logits_metadata, got "
               f"{schedule_meta.dtype} {tuple(schedule_meta.shape)}")
    _check_topk_args(logits_dtype, topk, chunk_k, _PREFILL_KEY_TILE, s_q, out, q_values.device, return_values)
    if chunk_q is not None:
        expect_int(chunk_q, "chunk_q", 1)
        expect(chunk_q % _ROW_BLOCK == 0, ValueError, f"chunk_q: must be a multiple of {_ROW_BLOCK}, got {chunk_q}")
    raise_pending(q_values.device)
    chunk_k = chunk_k or default_prefill_chunk_k(topk)
    chunk_q = chunk_q or default_chunk_q(chunk_k, logits_dtype)
    out, values = _outputs(s_q, topk, logits_dtype, q_values.device, out, return_values)
    if plan_key is not None and _one_step(s_q, k.shape[0], topk, logits_dtype):
        # eager, one step: the next calls of this layout skip the checks
        plan = _make_prefill_plan(plan_key, q_values, q_sf, k, k_scale, weights, cu_seq_len_k_start,
                                  cu_seq_len_k_end, logits_dtype)
        _run_prefill_plan(plan, q_values, q_sf, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                          logits_dtype, topk, out, values)
        return (out, values) if return_values else out
    # Eager: the implementation without the dispatcher (the custom op's wrapper was most of the
    # eager cost of a call: benchmarks/NOTES.md); under torch.compile the custom op, one node.
    run = _mqa_topk if torch.compiler.is_compiling() else _run_mqa_topk
    run(q_values, q_sf, k, k_scale, weights, cu_seq_len_k_start, cu_seq_len_k_end, logits_dtype, topk,
        chunk_q, chunk_k, out, values)
    return (out, values) if return_values else out


# ---------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------
def _run_paged_mqa_topk(
    q: torch.Tensor,
    q_sf: torch.Tensor | None,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    logits_dtype: torch.dtype,
    indices: torch.Tensor | None,
    topk: int,
    chunk_k: int,
    out: torch.Tensor,
    values: torch.Tensor | None,
) -> None:
    b, next_n, h, dq = q.shape
    fmt = format_of(q, q_sf)
    block_kv = kv_cache.shape[1]
    cfg = paged.resolve_paged_config(fmt, next_n, h, dq * 2 if fmt == "mxfp4" else dq, block_kv)
    mode = kern.WIN_DECODE_1D if context_lens.dim() == 1 else kern.WIN_DECODE_2D
    ctx_stride = context_lens.stride(0) if context_lens.dim() == 2 else 1
    if chunk_k == 0:  # whole rows: one logits launch (its checks see the lengths), the top-k across programs
        with deferred():
            logits = tilefuse.fp8_fp4_paged_mqa_logits((q, q_sf), kv_cache, weights, context_lens, block_table,
                                                       schedule_meta, max_context_len, False, logits_dtype, indices,
                                                       config=cfg)
            _decode_rows_topk(logits, context_lens, topk, mode, next_n, ctx_stride, out, values)
        return
    # Keys a row may have: the output's width, and what the block table can address.
    covered = min(max_context_len, block_table.shape[1] * block_kv)
    # Row (b, t) sees [0, ends[b, t]), as 2-D lengths (contiguous, >= 0).
    if context_lens.dim() == 1:
        ends = context_lens[:, None] - (next_n - 1) + torch.arange(next_n, dtype=torch.int32, device=q.device)
    else:
        ends = context_lens
    ends = ends.clamp(min=0).to(torch.int32)
    chunks = _chunks(covered, chunk_k)
    bars, candidates, counts = _workspace(b * next_n, topk, len(chunks), q.device)
    side = _merge_stream(q.device, len(chunks) if b else 1, _OVERLAP_DECODE_MERGES)
    ring = None if side is None else _SideMerges(side, b * next_n, min(covered, chunk_k), logits_dtype, q.device)
    with deferred():  # a chunk's errors surface at the next call, not the next chunk
        for c, (lo, hi) in enumerate(chunks):
            width = hi - lo
            lens_c = (ends - lo).clamp(0, width).contiguous()
            table_c = block_table[:, lo // block_kv: cdiv(hi, block_kv)]
            meta_c = tilefuse.get_paged_mqa_logits_metadata(lens_c, block_kv, schedule_meta.shape[0] - 1)
            buffer = None if ring is None else ring.buffer(b * next_n, width)
            logits = tilefuse.fp8_fp4_paged_mqa_logits((q, q_sf), kv_cache, weights, lens_c, table_c, meta_c, width,
                                                       False, logits_dtype, indices, out=buffer, config=cfg)
            if b:
                with contextlib.nullcontext() if ring is None else ring.merging():
                    _merge(logits, bars, candidates, counts, lo, width, context_lens, context_lens, max_context_len,
                           covered, next_n, ctx_stride, 0, out, values, topk, mode, first=c == 0,
                           final=c == len(chunks) - 1)
    if ring is not None:
        ring.join()


@torch.library.custom_op("tilefuse::paged_mqa_topk", mutates_args=("out", "values"))
def _paged_mqa_topk(
    q: torch.Tensor, q_sf: torch.Tensor | None, kv_cache: torch.Tensor, weights: torch.Tensor,
    context_lens: torch.Tensor, block_table: torch.Tensor, schedule_meta: torch.Tensor, max_context_len: int,
    logits_dtype: torch.dtype, indices: torch.Tensor | None, topk: int, chunk_k: int, out: torch.Tensor,
    values: torch.Tensor | None,
) -> None:
    _run_paged_mqa_topk(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                        logits_dtype, indices, topk, chunk_k, out, values)


@_paged_mqa_topk.register_fake
def _paged_mqa_topk_fake(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                         logits_dtype, indices, topk, chunk_k, out, values):
    return None


# ---------------------------------------------------------------------------------------
# Decode over whole rows: the plan per argument layout (eager calls)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    """What the decode op's eager calls over whole rows of one argument layout launch, checked
    once: the logits op's plan (``paged._launch``), then the passes and the last step (the rank
    step or the final merge) of ``_topk_rows_across_programs`` as partial launches
    (``partials``, by launch key; a key without one yet launches the ordinary way and makes
    it). Any batch size and ``max_context_len`` whose rows are taken whole
    (:func:`decode_whole_rows`) use it."""

    paged_plan: paged._Plan
    next_n: int
    mode: int
    ctx_stride: int
    device: torch.device
    partials: dict = dataclasses.field(default_factory=dict, compare=False)


# Plans by argument layout: what the op's checks and the logits op's read, except the batch size
# and ``max_context_len`` (as their class: 0, 1, more, as the logits op's plans), plus ``topk``,
# ``return_values`` and the output's layout.
_decode_plans: dict[tuple, _DecodePlan] = {}
_MAX_DECODE_PLANS = 4096


def _decode_plan_key(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                     topk, logits_dtype, indices, return_values, out) -> tuple:
    """The layout key of a decode call (AttributeError, TypeError where an argument is not what
    the op takes: the checks then say what is wrong)."""
    overrides = _config._overrides.get("paged")
    return (*paged.inputs_layout_key(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                                     indices),
            None if out is None else (out.shape[1:], out.stride(), out.dtype, out.get_device()),
            max_context_len.__class__, min(max_context_len, 2), topk.__class__, topk,
            return_values.__class__, return_values, logits_dtype,
            tuple(sorted(overrides.items())) if overrides else None)


def _make_decode_plan(key, q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                      max_context_len, logits_dtype, indices) -> _DecodePlan:
    """A call's plan (its arguments checked by the op already; the logits op checks its own)."""
    next_n = q_values.shape[1]
    # (the logits op's own config: its default and the overrides, as it resolves them itself)
    paged_plan = paged._plan_for(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                                 max_context_len, False, logits_dtype, indices, None, None)
    ctx_2d = context_lens.dim() == 2
    plan = _DecodePlan(paged_plan, next_n, kern.WIN_DECODE_2D if ctx_2d else kern.WIN_DECODE_1D,
                       context_lens.stride(0) if ctx_2d else 1, q_values.device)
    if len(_decode_plans) >= _MAX_DECODE_PLANS:
        _decode_plans.clear()
    _decode_plans[key] = plan
    return plan


def _run_decode_plan(plan: _DecodePlan, q_values, q_sf, kv_cache, weights, context_lens, block_table,
                     max_context_len: int, logits_dtype, indices, topk: int, out, values) -> None:
    """The whole rows' logits (one launch of the logits op's plan), then their top-k."""
    logits = paged.new_logits(q_values.shape[0] * plan.next_n, max_context_len, logits_dtype, plan.device)
    paged._launch(plan.paged_plan, q_values, q_sf, kv_cache, weights, context_lens, block_table, indices, logits,
                  max_context_len)
    _decode_rows_topk(logits, context_lens, topk, plan.mode, plan.next_n, plan.ctx_stride, out, values,
                      plan.partials)


def _decode_by_plan(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                    topk, logits_dtype, indices, return_values, out):
    """``(key, result)``: the call made by its layout's plan where there is one and the call's
    sizes fit it (result not None), else ``(key or None, None)`` for the checked path."""
    try:
        key = _decode_plan_key(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                               max_context_len, topk, logits_dtype, indices, return_values, out)
        plan = _decode_plans.get(key)
    except (AttributeError, TypeError, IndexError):  # not tensors, or unhashable: the checks say which
        return None, None
    if plan is None:
        return key, None
    # The batch dims against q's, max_context_len's range, whole rows: else the checked path.
    b = q_values.shape[0]
    rows = b * plan.next_n
    if not (paged.batch_dims_agree(b, rows, q_sf, weights, context_lens, block_table, indices)
            and (out is None or out.shape[0] == rows) and max_context_len <= _MAX_POSITION + 1
            and decode_whole_rows(rows, max_context_len, logits_dtype)):
        return key, None
    raise_pending_fast(plan.device)
    out, values = _outputs(rows, topk, logits_dtype, plan.device, out, return_values)
    _run_decode_plan(plan, q_values, q_sf, kv_cache, weights, context_lens, block_table, max_context_len,
                     logits_dtype, indices, topk, out, values)
    return key, ((out, values) if return_values else out)


def fp8_fp4_paged_mqa_topk(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    topk: int = 2048,
    logits_dtype: torch.dtype = torch.float32,
    indices: torch.Tensor | None = None,
    *,
    return_values: bool = False,
    out: torch.Tensor | None = None,
    chunk_k: int | None = None,
):
    """The ``topk`` best tokens of every decode row under :func:`tilefuse.fp8_fp4_paged_mqa_logits`.

    Args:
        q, kv_cache, weights, context_lens, block_table, max_context_len, logits_dtype,
            indices: as for :func:`tilefuse.fp8_fp4_paged_mqa_logits` (1-D or 2-D lengths).
        schedule_meta: ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)``;
            its row count sets the workers of each chunk's metadata; the result does not
            depend on it.
        topk: positions per row (1 to 16384).
        return_values: also return each position's logit (``-inf`` at ``-1``; ``-0.0`` comes
            back as ``+0.0``).
        out: int32 ``[B * next_n, topk]`` to write the indices into (last stride 1).
        chunk_k: token columns per chunk, a multiple of the page size ``block_kv``. Default:
            whole rows where :func:`decode_whole_rows` says so (one logits launch, each row's
            top-k split over several programs), else chunks of :func:`default_chunk_k`.

    Returns:
        int32 ``[B * next_n, topk]``: token indices within the request, row ``b * next_n + t``,
        by (logit descending, position ascending) over the row's valid tokens, then ``-1``;
        with ``return_values`` ``(indices, values)``.

    Raises:
        TypeError, ValueError: the logits op's errors for its arguments; a bad ``topk``,
        ``chunk_k``, ``out``, ``context_lens`` or ``schedule_meta``. Bad lengths (negative,
        over ``max_context_len``, longer than the block table) raise
        :class:`tilefuse.DeviceValueError` at the next call or ``tilefuse.check_errors()``.
    """
    q_values, q_sf = prefill.split_query(q)
    # Eager calls over whole rows by their layout's plan (checked mode: the logits op's host
    # checks run, so the checked path).
    plan_key = None
    if chunk_k is None and not checked() and not torch.compiler.is_compiling():
        plan_key, result = _decode_by_plan(q_values, q_sf, kv_cache, weights, context_lens, block_table,
                                           schedule_meta, max_context_len, topk, logits_dtype, indices,
                                           return_values, out)
        if result is not None:
            return result
    for name, t in (("q", q_values), ("kv_cache", kv_cache), ("context_lens", context_lens),
                    ("block_table", block_table), ("schedule_meta", schedule_meta)):
        expect_tensor(t, name)
    check_kernel_device(q_values, "q")
    expect(q_values.dim() == 4, ValueError, f"q: expected [B, next_n, H, D], got shape {tuple(q_values.shape)}")
    expect(kv_cache.dim() == 4, ValueError,
           f"kv_cache: expected [num_blocks, block_kv, 1, width], got shape {tuple(kv_cache.shape)}")
    b, next_n = q_values.shape[:2]
    expect(context_lens.dtype == torch.int32, TypeError, f"context_lens: expected int32, got {context_lens.dtype}")
    expect(tuple(context_lens.shape) in ((b,), (b, next_n)) and context_lens.stride(-1) == 1, ValueError,
           f"context_lens: expected [{b}] or [{b}, {next_n}] with unit last stride, got shape "
           f"{tuple(context_lens.shape)}")
    expect(block_table.dim() == 2, ValueError, f"block_table: expected [B, max_blocks], got {tuple(block_table.shape)}")
    expect(schedule_meta.dtype == torch.int32 and schedule_meta.dim() == 2 and schedule_meta.shape[0] >= 2, ValueError,
           f"schedule_meta: expected int32 [num_sms + 1, 2] from get_paged_mqa_logits_metadata, got "
           f"{schedule_meta.dtype} {tuple(schedule_meta.shape)}")
    expect_int(max_context_len, "max_context_len", 0)
    expect(max_context_len <= _MAX_POSITION + 1, ValueError,
           f"max_context_len: at most {_MAX_POSITION + 1}, got {max_context_len}")
    block_kv = kv_cache.shape[1]
    _check_topk_args(logits_dtype, topk, chunk_k, max(1, block_kv), b * next_n, out, q_values.device, return_values)
    raise_pending(q_values.device)
    if chunk_k is not None:
        chunk = chunk_k
    elif decode_whole_rows(b * next_n, max_context_len, logits_dtype):
        chunk = 0
    else:
        chunk = default_chunk_k(topk, max(1, block_kv))
    out, values = _outputs(b * next_n, topk, logits_dtype, q_values.device, out, return_values)
    if chunk == 0 and plan_key is not None:  # eager, whole rows: the next calls of this layout skip the checks
        plan = _make_decode_plan(plan_key, q_values, q_sf, kv_cache, weights, context_lens, block_table,
                                 schedule_meta, max_context_len, logits_dtype, indices)
        _run_decode_plan(plan, q_values, q_sf, kv_cache, weights, context_lens, block_table, max_context_len,
                         logits_dtype, indices, topk, out, values)
        return (out, values) if return_values else out
    run = _paged_mqa_topk if torch.compiler.is_compiling() else _run_paged_mqa_topk  # as the prefill op
    run(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
        max_context_len, logits_dtype, indices, topk, chunk, out, values)
    return (out, values) if return_values else out


# ---------------------------------------------------------------------------------------
# Warm-up
# ---------------------------------------------------------------------------------------
def warmup_calls(fmt: str, num_heads: int, head_dim: int, topk: int, weights_dtype: torch.dtype,
                 logits_dtype: torch.dtype, device, block_kv: int = 64, next_n: int = 1, prefill_calls: bool = True,
                 decode_calls: bool = True) -> dict[str, list]:
    """Calls (``"prefill_topk"``, ``"decode_topk"``) that run every kernel variant the fused ops
    can launch for this model configuration and ``topk``, on zero inputs: the chunks' logits
    kernels (prefill: one call of each size class whose config no smaller call has; decode:
    1-D and 2-D lengths, and ``indices`` at next_n 1), every merge variant (one chunk, and
    first / middle / last chunks, each with and without values) and, for decode, whole rows
    (their logits launch, the passes of the top-k across programs and their last step, as a
    captured call or rows past ``_EAGER_ONE_MERGE_KEYS`` take them; shorter rows of an eager
    call take the one-chunk merge). After them, any sizes, windows,
    lengths and chunk counts compile nothing.

    Raises:
        ValueError / TypeError: a configuration the ops reject.
    """
    expect_int(topk, "topk", 1)
    expect(topk <= _MAX_TOPK, ValueError, f"topk: at most {_MAX_TOPK}, got {topk}")
    device = torch.device(device)
    calls: dict[str, list] = {}
    if prefill_calls:
        calls["prefill_topk"] = _prefill_warmup(fmt, num_heads, head_dim, topk, weights_dtype, logits_dtype, device)
    if decode_calls:
        calls["decode_topk"] = _decode_warmup(fmt, num_heads, head_dim, topk, weights_dtype, logits_dtype, device,
                                              block_kv, next_n)
    return calls


def _prefill_warmup(fmt, num_heads, head_dim, topk, weights_dtype, logits_dtype, device) -> list:
    def call(s_q: int, s_k: int, chunk_k: int | None = None, return_values: bool = False):
        def run() -> None:
            q, kv = prefill._zero_inputs(fmt, s_q, s_k, num_heads, head_dim, device)
            w = torch.zeros(s_q, num_heads, dtype=weights_dtype, device=device)
            ks = torch.zeros(s_q, dtype=torch.int32, device=device)
            ke = torch.full((s_q,), s_k, dtype=torch.int32, device=device)
            fp8_fp4_mqa_topk(q, kv, w, ks, ke, topk, logits_dtype, return_values=return_values, chunk_k=chunk_k)
        return run

    sizes = prefill.warmup_sizes(fmt, num_heads, head_dim, logits_dtype, device)
    calls = [call(s_q, s_k) for s_q, s_k in sizes]  # each size class's logits kernels
    s_q = sizes[0][0]  # the merge's variants: one chunk, then three (first, middle, last)
    for values in (False, True):
        calls += [call(s_q, _PREFILL_KEY_TILE, _PREFILL_KEY_TILE, values),
                  call(s_q, 2 * _PREFILL_KEY_TILE + 1, _PREFILL_KEY_TILE, values)]
    return calls


@contextlib.contextmanager
def _whole_rows_by_the_passes():
    """Decode rows taken whole go through the passes across programs whatever their length, as
    a call being captured into a CUDA graph does (the warm-up's eager calls compile them so).
    It sets a module setting for the block: for the warm-up at start-up, not beside other calls."""
    global _EAGER_ONE_MERGE_KEYS
    saved, _EAGER_ONE_MERGE_KEYS = _EAGER_ONE_MERGE_KEYS, 0
    try:
        yield
    finally:
        _EAGER_ONE_MERGE_KEYS = saved


def _decode_warmup(fmt, num_heads, head_dim, topk, weights_dtype, logits_dtype, device, block_kv, next_n) -> list:
    def call(ctx_2d: bool, chunks: int, return_values: bool = False, with_indices: bool = False,
             whole: bool = False, batch: int = 2, length: int | None = None):
        if length is None:
            length = (chunks - 1) * block_kv + 1

        def run() -> None:
            # whole rows by the passes and their last step, as a captured call or longer rows take
            # them (an eager call of short rows takes one merge a row: the one-chunk merge's kernel)
            with _whole_rows_by_the_passes() if whole else contextlib.nullcontext():
                launch()

        def launch() -> None:
            pages = cdiv(length, block_kv)
            cache = paged.new_paged_kv_cache(batch * pages, block_kv, head_dim, fmt, device=device)
            table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
            (values, sf), _ = prefill._zero_inputs(fmt, batch * next_n, 1, num_heads, head_dim, device)
            q = (values.view(batch, next_n, *values.shape[1:]),
                 None if sf is None else sf.view(batch, next_n, num_heads))
            w = torch.zeros(batch * next_n, num_heads, dtype=weights_dtype, device=device)
            lens = torch.full((batch, next_n) if ctx_2d else (batch,), length, dtype=torch.int32, device=device)
            idx = torch.arange(batch, dtype=torch.int32, device=device) if with_indices else None
            meta = paged.get_paged_mqa_logits_metadata(lens, block_kv, 1, idx)
            fp8_fp4_paged_mqa_topk(q, cache, w, lens, table, meta, length, topk, logits_dtype, idx,
                                   return_values=return_values, chunk_k=None if whole else block_kv)
        return run

    calls = [call(ctx_2d, chunks, values) for ctx_2d in (False, True) for chunks in (1, 3) for values in (False, True)]
    # whole rows of 129 keys read theirs again in the second digit pass; rows of 8 W keep their
    # programs' maxima between the passes (_across_segments' KEEP)
    long_rows = max(8 * state_width(topk), 4 * _ACROSS_BLOCK)
    calls += [call(ctx_2d, 3, values, whole=True, batch=2, length=length) for ctx_2d in (False, True)
              for values in (False, True) for length in (None, long_rows)]
    if next_n == 1:
        calls += [call(False, 1, with_indices=True), call(False, 3, with_indices=True, whole=True)]
    return calls
