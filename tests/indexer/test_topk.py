"""Indexer top-k (prefill and decode) against the contract, bit for bit: the unfused logits op's
logits, ranked by the reference (value descending, position ascending over the valid window,
then -1). Chunks are forced small so the merge path runs many times per row; ties, -inf and
NaN logits, empty rows, windows not aligned to any chunk, ``topk`` larger than the window,
every format, both APIs, ``out=``, reruns, device-side value errors and bad arguments. The
merge kernel also runs on given logits (ascending, where every key is a candidate, descending,
ties, NaN, -inf) with small candidate buffers, so they are merged many times a chunk.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import triton
import triton.language as tl

import tilefuse
from tilefuse import _jit
from tilefuse import formats as F
from tilefuse import reference as R
from tilefuse.bench.suites import topk as suite
from tilefuse.indexer import _prefill_kernel as prefill_kernel
from tilefuse.indexer import _topk_kernel as kern
from tilefuse.indexer import paged, topk
from tilefuse.indexer import windows as W

from ..conftest import DEVICE, ON_GPU

NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 3


def shapes(cpu, gpu):
    return gpu if ON_GPU else cpu


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, NaN included (-0.0 and +0.0 are equal: the values come back as +0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


# ---------------------------------------------------------------------------------------
# The reference's order, by hand
# ---------------------------------------------------------------------------------------
def test_reference_order_by_hand():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [1.0, 3.0, 3.0, -0.0, 0.0, nan, -inf, 2.0],
        [nan, 5.0, -inf, nan, 4.0, 4.0, 1.0, 0.0],
    ])
    valid = torch.tensor([
        [True, True, True, True, True, True, True, False],  # the 2.0 is outside the window
        [True, False, True, True, True, True, False, False],
    ])
    idx, val = R.topk_of_logits(logits, valid, 8)
    assert idx.tolist() == [[1, 2, 0, 3, 4, 6, 5, -1], [4, 5, 2, 0, 3, -1, -1, -1]]
    assert _equal(val[0, :7], torch.tensor([3.0, 3.0, 1.0, 0.0, 0.0, -inf, nan]))
    assert val[1, 5:].isneginf().all()
    idx3, _ = R.topk_of_logits(logits, valid, 3)
    assert torch.equal(idx3, idx[:, :3])


# ---------------------------------------------------------------------------------------
# The merge kernel on given logits: orders that make every key a candidate, ties, flushes
# ---------------------------------------------------------------------------------------
def merge_chunks(logits, ks, ke, k_top, chunk_k, mode=kern.WIN_PREFILL, next_n=1):
    """The ops' chunk loop on a given logits matrix: ``(indices, values)`` of the merge kernel.
    Prefill: windows ``[ks, ke)``; decode: ``ks`` are the lengths (1-D or 2-D), ``ke`` unused."""
    rows, n = logits.shape
    chunks = topk._chunks(n, chunk_k)
    bars, candidates, counts = topk._workspace(rows, k_top, len(chunks), logits.device)
    candidates.fill_(7)  # scratch: nothing may depend on what it held
    counts.fill_(99)  # the first chunk starts the carried counts and bars
    bars.fill_(2**62)
    out = torch.full((rows, k_top), 12345, dtype=torch.int32, device=logits.device)
    values = torch.empty((rows, k_top), dtype=logits.dtype, device=logits.device)
    ctx_stride = ks.stride(0) if ks.dim() == 2 else 1
    for c, (lo, hi) in enumerate(chunks):
        topk._merge(logits[:, lo:hi].contiguous(), bars, candidates, counts, lo, hi - lo, ks, ke, n, n, next_n,
                    ctx_stride, 0, out, values, k_top, mode, first=c == 0, final=c == len(chunks) - 1)
    tilefuse.check_errors()
    return out, values


def _pattern(name, rows, n, g):
    """fp32 logits ``[rows, n]`` in an order that stresses the merge."""
    pos = torch.arange(n, dtype=torch.float32)[None, :].expand(rows, n)
    if name == "ascending":  # every key beats the bar: the buffer fills at every block
        return pos + torch.arange(rows)[:, None]
    if name == "descending":  # the first buffer holds the answer; nothing later is a candidate
        return -pos
    if name == "equal":  # one value: the order is the positions
        return torch.full((rows, n), 0.5)
    if name == "few-values":  # heavy ties, +0.0 and -0.0 among them
        return torch.tensor([-1.0, -0.0, 0.0, 2.0, 3.0])[torch.randint(0, 5, (rows, n), generator=g)]
    if name == "sawtooth":  # ascending runs restarting every 37 keys, rising slowly
        return (pos % 37) + pos / 1024
    if name == "specials":  # random with NaN, +-inf and signed zeros sprinkled in
        x = torch.randn(rows, n, generator=g)
        pick = torch.randint(0, 8, (rows, n), generator=g)
        x = torch.where(pick == 0, float("nan"), x)
        x = torch.where(pick == 1, float("inf"), x)
        x = torch.where(pick == 2, float("-inf"), x)
        return torch.where(pick == 3, -0.0, x)
    if name == "all-neg-inf":
        return torch.full((rows, n), float("-inf"))
    return torch.randn(rows, n, generator=g)


PATTERNS = ["ascending", "descending", "equal", "few-values", "sawtooth", "specials", "all-neg-inf", "random"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN in the interpreter
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("k_top,chunk_k", [(5, 48), (16, 1000), (40, 96)])
def test_merge_orders_ties_and_flushes(pattern, k_top, chunk_k):
    """Buffers of 16 or 64 keys (flushed after 12 or 48), many flushes a chunk, chunks not a
    multiple of the scan block, random windows (empty, short, past the row's end), several rows
    a program; the candidate scratch starts as garbage."""
    rows, n = 24, 300
    g = torch.Generator().manual_seed(len(pattern) + k_top)
    logits = _pattern(pattern, rows, n, g).to(DEVICE)
    ks, ke = W.random_windows(rows, n, g, DEVICE, empty_fraction=0.15, overhang=20)
    ks[0], ke[0] = 0, n  # the whole row
    ks[1], ke[1] = 3, 3 + k_top - 1  # one key fewer than topk
    idx, val = merge_chunks(logits, ks, ke, k_top, chunk_k)
    ref_idx, ref_val = R.topk_of_logits(logits, R.window_mask(ks, ke, n), k_top)
    assert torch.equal(idx, ref_idx)
    assert _equal(val, ref_val)


def _pass_launches(rows: int, n_keys: int, k_top: int) -> int:
    """The launches of the passes across programs at the defaults: the digit passes (two over
    group maxima, three over the keys) and the compaction."""
    return kern.pass_levels(topk._across_segments(rows, n_keys, k_top)[1]) + 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN in the interpreter
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    "k_top,segments,rows_a_program,maxima",
    [(k, s, r, 0) for k, s in [(5, 2), (130, 5), (130, 8)] for r in ["interpreter", "gpu"]]
    # over maxima: 130 / 5 programs holds fewer than 2 W groups (5 x 64 columns), so keys again;
    # 130 / 12 programs hold more maxima (12 x 64) than a row has keys, so none are kept
    + [(5, 2, "gpu", 1), (130, 5, "gpu", 1), (130, 8, "gpu", 1), (130, 8, "interpreter", 1), (130, 12, "gpu", 1)],
)
def test_rows_across_programs(pattern, k_top, segments, rows_a_program, maxima, monkeypatch, record_launches):
    """The radix select across a row's programs: random windows (empty, shorter than topk, past
    the row's end), every tie pattern, blocks of 64 keys dealt over the programs; index for
    index and value for value with the reference. The digit passes over every key (the last
    step's select starts from their three digits) or over group maxima where the row's
    programs hold at least 2 W groups (topk 130: 8 programs of 64 columns, not 5; the select
    from the top; the maxima kept between the passes where the row's keys outnumber them, not
    at 12 programs); with the GPU's rows a program and digit widths too (narrower digits at
    topk 5: a select from the top)."""
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 64)
    monkeypatch.setattr(topk, "_ACROSS_GROUP_MAXIMA", maxima)
    passes = record_launches(kern, "topk_rows_pass_kernel")
    last_steps, real_merge = [], topk._merge
    monkeypatch.setattr(topk, "_merge", lambda *a, **kw: last_steps.append(kw["maxima"]) or real_merge(*a, **kw))
    if rows_a_program == "gpu":
        monkeypatch.setattr(topk, "_INTERPRETER_KEYS_PER_PROGRAM", 0)
    rows, n = 6, 700
    g = torch.Generator().manual_seed(len(pattern) + 7 * k_top)
    logits = _pattern(pattern, rows, n, g).to(DEVICE)
    ks, ke = W.random_windows(rows, n, g, DEVICE, empty_fraction=0.15, overhang=20)
    ks[0], ke[0] = 0, n
    ks[1], ke[1] = 3, 3 + k_top - 1  # one key fewer than topk
    idx, val = topk._topk_rows_across_programs(logits, ks, ke, k_top, segments=segments, values=True)
    ref_idx, ref_val = R.topk_of_logits(logits, R.window_mask(ks, ke, n), k_top)
    assert torch.equal(idx, ref_idx)
    assert _equal(val, ref_val)
    on = bool(maxima) and segments * 64 >= 2 * topk.state_width(k_top)
    assert last_steps == [on]
    assert len(passes) == (kern.RADIX_LEVELS if on else kern.RADIX_LEVELS + 1)  # two digits over maxima
    kept = topk._across_segments(rows, n, k_top, segments)[2]
    assert kept == (on and segments != 12)  # (the case of 12 programs reads its keys again)


def test_rows_across_programs_over_ties_past_their_buffer(monkeypatch):
    """The last step after the passes: a row whose candidates outnumber its 2 W slots (every
    key tied with its topk-th), a row of random keys, one shorter than topk, an empty one; the
    kept counts and histograms zero afterwards."""
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 64)
    monkeypatch.setattr(topk, "_kept_histograms", {})
    n, k_top = 700, 130  # W 256: 512 slots a row
    g = torch.Generator().manual_seed(81)
    logits = torch.cat([_pattern("equal", 1, n, g), _pattern("random", 3, n, g)]).to(DEVICE)
    ks = torch.tensor([0, 0, 5, 9], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([n, n, 5 + k_top - 7, 9], dtype=torch.int32, device=DEVICE)
    idx, val = topk._topk_rows_across_programs(logits, ks, ke, k_top, segments=3, values=True)
    ref_idx, ref_val = R.topk_of_logits(logits, R.window_mask(ks, ke, n), k_top)
    assert torch.equal(idx, ref_idx)
    assert _equal(val, ref_val)
    (kept,) = topk._kept_histograms.values()
    assert not kept.hist.any() and not kept.counts.any()


def test_rows_across_programs_past_their_buffer_whatever_the_order(monkeypatch):
    """More candidates than the buffer's 2 W slots after the passes (every key shares the
    topk-th key's top 24 bits), the largest 128 keys in the blocks appended past slot 2 W (the
    third program's, which the interpreter runs last): the last step counts from memory, not
    from the first 2 W slots alone (whose compaction then kept more than W keys). A second row
    of one value throughout: the positions decide."""
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 64)
    monkeypatch.setattr(topk, "_INTERPRETER_KEYS_PER_PROGRAM", 0)
    n, k_top = 700, 130  # W 256: 512 slots a row; blocks 5 and 8 land in slots 572-699
    pos = torch.arange(n, dtype=torch.int32)
    late = ((pos >= 320) & (pos < 384)) | ((pos >= 512) & (pos < 576))
    base = torch.tensor([1.5], dtype=torch.float32).view(torch.int32)
    bits = torch.stack([base + torch.where(late, 200 + pos % 50, pos % 100), base.expand(n)])
    logits = bits.view(torch.float32).contiguous().to(DEVICE)
    ks = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([n, n - 3], dtype=torch.int32, device=DEVICE)
    idx, val = topk._topk_rows_across_programs(logits, ks, ke, k_top, segments=3, values=True)
    ref_idx, ref_val = R.topk_of_logits(logits, R.window_mask(ks, ke, n), k_top)
    assert torch.equal(idx, ref_idx)
    assert _equal(val, ref_val)


@pytest.mark.parametrize("ctx_2d", [False, True])
def test_rows_across_programs_decode_windows(ctx_2d, monkeypatch):
    """The same over decode lengths (1-D causal rows of next_n 3, or 2-D), bf16 logits with ties."""
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 32)
    b, next_n, n, k_top = 5, 3, 300, 24
    g = torch.Generator().manual_seed(40 + ctx_2d)
    lens = torch.tensor([300, 0, 2, 130, 77], dtype=torch.int32)
    ctx = (lens[:, None] * torch.rand(b, next_n, generator=g)).to(torch.int32) if ctx_2d else lens
    ctx = ctx.to(DEVICE)
    logits = torch.cat([_pattern("random", 6, n, g), _pattern("few-values", 9, n, g)]).to(torch.bfloat16).to(DEVICE)
    mode = kern.WIN_DECODE_2D if ctx_2d else kern.WIN_DECODE_1D
    idx, val = topk._topk_rows_across_programs(logits, ctx, ctx, k_top, mode=mode, next_n=next_n,
                                               ctx_stride=ctx.stride(0) if ctx_2d else 1, segments=4, values=True)
    ref_idx, ref_val = R.topk_of_logits(logits, R.paged_valid_mask(ctx, next_n, n), k_top)
    assert torch.equal(idx, ref_idx)
    assert _equal(val, ref_val)


@pytest.mark.parametrize("ctx_2d", [False, True])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_merge_decode_windows(ctx_2d, logits_dtype):
    """Decode windows (1-D causal rows of next_n 3, or 2-D lengths), ascending and tied logits."""
    b, next_n, n, k_top = 5, 3, 200, 24
    g = torch.Generator().manual_seed(30 + ctx_2d)
    lens = torch.tensor([200, 0, 2, 130, 77], dtype=torch.int32)
    ctx = (lens[:, None] * torch.rand(b, next_n, generator=g)).to(torch.int32) if ctx_2d else lens
    ctx = ctx.to(DEVICE)
    logits = torch.cat([_pattern("ascending", 6, n, g), _pattern("few-values", 9, n, g)]).to(logits_dtype).to(DEVICE)
    mode = kern.WIN_DECODE_2D if ctx_2d else kern.WIN_DECODE_1D
    idx, val = merge_chunks(logits, ctx, ctx, k_top, 64, mode=mode, next_n=next_n)
    ref_idx, ref_val = R.topk_of_logits(logits, R.paged_valid_mask(ctx, next_n, n), k_top)
    assert torch.equal(idx, ref_idx)
    assert _equal(val, ref_val)


@pytest.mark.parametrize("piece_keys", [None, 16])
def test_merge_long_rows_wide_state(piece_keys, monkeypatch):
    """topk 128 (a buffer of 256, scan blocks of 64) over 2000 keys in one and in four chunks:
    random, ascending and descending rows, the three in one program; the selects reading the
    buffer whole, or 16 keys a row at a time (16 pieces: each pass's histogram summed over
    them, the compaction moving keys down piece by piece)."""
    if piece_keys is not None:
        monkeypatch.setattr(topk, "_SELECT_PIECE_KEYS", piece_keys)
    rows, n, k_top = 3, 2000, 128
    g = torch.Generator().manual_seed(31)
    logits = torch.cat([_pattern(p, 1, n, g) for p in ("random", "ascending", "descending")]).to(DEVICE)
    ks, ke = W.full(rows, n, DEVICE)
    ref_idx, ref_val = R.topk_of_logits(logits, R.window_mask(ks, ke, n), k_top)
    for chunk_k in (n, 512):
        idx, val = merge_chunks(logits, ks, ke, k_top, chunk_k)
        assert torch.equal(idx, ref_idx) and _equal(val, ref_val)


@triton.jit
def _select_rows_kernel(cand_ptr, count_ptr, bar_ptr, stride, TOPK: tl.constexpr, ROWS: tl.constexpr,
                        CAP: tl.constexpr, PIECE: tl.constexpr):
    """``_select`` alone on ROWS rows a program: the rows' counts and bars written back."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    count = tl.load(count_ptr + row)
    bar = tl.load(bar_ptr + row)
    count, bar = kern._select(cand_ptr + row[:, None] * stride, count, bar, bar, count, TOPK, ROWS, CAP, PIECE, 0,
                              False)
    tl.store(count_ptr + row, count)
    tl.store(bar_ptr + row, bar)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_order_keys_sort_as_the_contract(pattern):
    """``reference.order_keys`` sorted descending gives the contract's order (the reference
    top-k over all positions): NaN, both zeros and infinities included."""
    g = torch.Generator().manual_seed(len(pattern))
    logits = _pattern(pattern, 3, 200, g)
    ref_idx, _ = R.topk_of_logits(logits, torch.ones_like(logits, dtype=torch.bool), 200)
    assert torch.equal(R.order_keys(logits).sort(dim=1, descending=True).indices.to(torch.int32), ref_idx)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN in the interpreter
@pytest.mark.parametrize("pattern", ["random", "equal", "few-values", "specials", "all-neg-inf", "sawtooth"])
@pytest.mark.parametrize("cap,rows", [(64, 2), (8192, 1)])
def test_select_keeps_exactly_the_topk_largest(pattern, cap, rows):
    """The select itself, on buffers held in registers (64 keys, two rows a program) and counted
    from memory (8192 keys: topk above 2048): exactly the TOPK largest keys at the buffer's start
    (in some order), the count TOPK and the bar the smallest of them; rows holding TOPK or fewer
    untouched. Keys shuffled, so the largest sit anywhere in the buffer."""
    top = 20 if cap == 64 else 2100
    g = torch.Generator().manual_seed(cap + len(pattern))
    counts = torch.tensor([cap, cap - 5, top, top - 3][: 2 * rows], dtype=torch.int32)
    n_rows = counts.shape[0]
    keys = R.order_keys(_pattern(pattern, n_rows, cap, g))
    keys = keys[:, torch.randperm(cap, generator=g)]
    cand = keys.clone().to(DEVICE)
    bars = torch.full((n_rows,), -(2**63), dtype=torch.int64, device=DEVICE)
    cnt = counts.clone().to(DEVICE)
    piece = min(cap, max(16, 1024 // rows))
    _select_rows_kernel[(n_rows // rows,)](cand, cnt, bars, cand.stride(0), top, rows, cap, piece)
    cand, cnt, bars = cand.cpu(), cnt.cpu(), bars.cpu()
    for r in range(n_rows):
        held = int(counts[r])
        if held <= top:
            assert int(cnt[r]) == held and torch.equal(cand[r], keys[r])
            continue
        want = keys[r, :held].sort(descending=True).values[:top]
        assert int(cnt[r]) == top
        assert torch.equal(cand[r, :top].sort(descending=True).values, want)
        assert int(bars[r]) == int(want[-1])


@pytest.mark.parametrize("pattern", ["random", "ascending", "few-values"])
def test_merge_topk_past_the_held_buffer(pattern, monkeypatch):
    """topk 2100 (W 4096: a buffer of 8192 keys, more than a select holds in registers, so its
    passes count from memory a piece at a time) over 13000 keys in one chunk and in chunks of
    5000, the GPU's one row a program; ties (few values) search the positions from memory too."""
    monkeypatch.setattr(topk, "_INTERPRETER_KEYS_PER_PROGRAM", 0)
    rows, n, k_top = 2, 13000, 2100
    g = torch.Generator().manual_seed(61)
    logits = _pattern(pattern, rows, n, g).to(DEVICE)
    ks = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([n, n - 100], dtype=torch.int32, device=DEVICE)
    ref_idx, ref_val = R.topk_of_logits(logits, R.window_mask(ks, ke, n), k_top)
    for chunk_k in (n, 5000):
        idx, val = merge_chunks(logits, ks, ke, k_top, chunk_k)
        assert torch.equal(idx, ref_idx) and _equal(val, ref_val), chunk_k


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN in the interpreter
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("groups_bar", [0, 1])
def test_merge_one_row_a_program(pattern, groups_bar, monkeypatch):
    """One row a launch, so one program a row and the widest select digits: 1000 keys, topk 40,
    a whole row and random windows, in one chunk and in chunks of 300; the first chunk's scan
    from its group maxima's bar and from an empty bar."""
    monkeypatch.setattr(topk, "_FIRST_CHUNK_BAR", groups_bar)
    n, k_top = 1000, 40
    g = torch.Generator().manual_seed(50 + len(pattern))
    logits = _pattern(pattern, 3, n, g).to(DEVICE)
    ks, ke = W.random_windows(3, n, g, DEVICE, overhang=10)
    ks[0], ke[0] = 0, n
    for r in range(3):
        one = slice(r, r + 1)
        ref_idx, ref_val = R.topk_of_logits(logits[one], R.window_mask(ks[one], ke[one], n), k_top)
        for chunk_k in (n, 300):
            idx, val = merge_chunks(logits[one], ks[one], ke[one], k_top, chunk_k)
            assert torch.equal(idx, ref_idx) and _equal(val, ref_val), (r, chunk_k)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN in the interpreter
@pytest.mark.parametrize("pattern", ["random", "specials", "equal", "all-neg-inf"])
def test_first_chunk_bar_from_group_maxima(pattern, monkeypatch):
    """After a first chunk (not the last) of 8 W keys a row, each row's bar is at most its
    topk-th key; on random logits it is the topk-th largest of the chunk's 2 W group maxima
    (groups of four columns 2 W apart; near the 84th percentile, so no select follows); rows
    with fewer than topk groups holding a key (a window of topk - 1 keys) keep the empty bar."""
    monkeypatch.setattr(topk, "_FIRST_CHUNK_BAR", 1)
    rows, n, k_top = 4, 512, 40  # W 64: 128 groups of four columns
    g = torch.Generator().manual_seed(90 + len(pattern))
    logits = _pattern(pattern, rows, n, g).to(DEVICE)
    ks = torch.tensor([0, 0, 0, 100], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([n, n, n, 100 + k_top - 1], dtype=torch.int32, device=DEVICE)
    bars, candidates, counts = topk._workspace(rows, k_top, 2, DEVICE)
    out = torch.empty((rows, k_top), dtype=torch.int32, device=DEVICE)
    topk._merge(logits, bars, candidates, counts, 0, n, ks, ke, n, n, 1, 1, 0, out, None, k_top, kern.WIN_PREFILL,
                first=True, final=False)
    tilefuse.check_errors()
    keys = R.order_keys(logits.cpu())
    for r in range(rows):
        bar = int(bars[r])
        row_keys = keys[r, int(ks[r]):int(ke[r])]
        if r == 3:
            assert bar == -(2**63)  # 39 keys: fewer than topk groups
            continue
        kth = int(row_keys.sort(descending=True).values[k_top - 1])
        assert bar <= kth, r  # (a select in the scan makes it the topk-th key so far)
        if pattern == "random":  # no select in the scan (fewer keys above the bar than 3 W / 2)
            maxima = (keys[r] >> 32).view(n // 128, 128).max(dim=0).values
            kth_max, next_max = maxima.sort(descending=True).values[k_top - 1:k_top + 1].tolist()
            t = (bar + 1) >> 32  # the search may stop anywhere above the next maximum
            assert (bar + 1) % (1 << 32) == 0 and next_max < t <= kth_max, r
            assert int((row_keys > bar).sum()) <= 96, r


def test_first_chunk_bar_only_where_its_words_are_held(monkeypatch):
    """The group maxima are held in registers as a select holds its buffer: the bar is asked for
    at topk 2048 (one row a program) and at the interpreter's row blocks, not above topk 2048,
    and the bytes moved follow (no second read of the first chunk there)."""
    assert topk._groups_bar(2048, 1) and topk._groups_bar(16, 2) and topk._groups_bar(64, 32)
    assert not topk._groups_bar(4096, 1) and not topk._groups_bar(64, 64)
    wide = topk.topk_bytes_moved(64, 131072, 2100, 65536)
    assert wide["chunked_total"] == wide["unfused"] + 64 * 12 * 2 * 1
    monkeypatch.setattr(topk, "_FIRST_CHUNK_BAR", 0)
    assert not topk._groups_bar(2048, 1)


# ---------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------
def prefill_inputs(s_q, s_k, h, d, fmt, seed, weights_dtype=torch.float32, distinct_keys=None):
    """Quantised op inputs; with ``distinct_keys`` only that many different key rows (repeated:
    many rows of exactly equal logits)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(s_k, d, generator=g).to(torch.bfloat16)
    if distinct_keys:
        k = k[torch.arange(s_k) % distinct_keys]
    w = torch.randn(s_q, h, generator=g).to(weights_dtype)
    qq = tuple(None if t is None else t.to(DEVICE) for t in F.quantize_q(q, fmt))
    kk = tuple(t.to(DEVICE) for t in F.quantize_k(k, fmt))
    return qq, kk, w.to(DEVICE)


def expected_prefill(qq, kk, w, ks, ke, k_top, logits_dtype=torch.float32):
    """The unfused pair: the logits op, then the reference's ranking over the windows."""
    logits = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, clean_logits=True, logits_dtype=logits_dtype)
    return R.topk_of_logits(logits, R.window_mask(ks, ke, kk[0].shape[0]), k_top)


def check_prefill(qq, kk, w, ks, ke, k_top, chunk_k, logits_dtype=torch.float32):
    ref_idx, ref_val = expected_prefill(qq, kk, w, ks, ke, k_top, logits_dtype)
    out = torch.full((ks.shape[0], k_top), 12345, dtype=torch.int32, device=DEVICE)  # poisoned
    idx, val = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top, logits_dtype, return_values=True, out=out,
                                         chunk_k=chunk_k)
    tilefuse.check_errors()
    assert idx is out
    assert torch.equal(idx, ref_idx), "indices differ from the unfused logits' top-k"
    assert _equal(val, ref_val), "values differ from the unfused logits"
    return idx


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_prefill_formats_windows_and_chunks(fmt):
    """Random windows (empty rows, ke past S_k) cutting across 256-key chunks."""
    s_q, s_k = shapes((16, 600), (512, 20000))
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 64, fmt, seed=len(fmt))
    g = torch.Generator().manual_seed(3)
    ks, ke = W.random_windows(s_q, s_k, g, DEVICE, empty_fraction=0.2, overhang=40)
    ks[0], ke[0] = 0, s_k + 40  # the whole row, ke past S_k
    ks[1], ke[1] = 255, 257  # two keys on both sides of a chunk boundary
    idx = check_prefill(qq, kk, w, ks, ke, 16, chunk_k=256)
    assert (idx[ks == ke] == -1).all()


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_prefill_ties_from_repeated_keys(logits_dtype):
    """Seven distinct key rows: every logit value repeats ~100 times in a row; the order among
    equal logits is by position, across chunks."""
    s_q, s_k = shapes((8, 768), (256, 16384))
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=5, distinct_keys=7)
    ks, ke = W.causal_tail(s_q, s_k, DEVICE)
    idx = check_prefill(qq, kk, w, ks, ke, 64, chunk_k=256, logits_dtype=logits_dtype)
    if logits_dtype == torch.float32:  # (bf16 may round two key rows to one value)
        # All 64 ranks hold the best key row's positions (>= 108 in every window), ascending.
        assert (idx.diff(dim=1) == 7).all()


def test_prefill_all_zero_inputs_and_negative_weights():
    """All logits 0 (+0.0 and -0.0 from negative weights): the order is the window's positions."""
    s_q, s_k = 8, 300
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=6)
    qq = (torch.zeros_like(qq[0]), None)
    w = -w.abs()
    ks, ke = W.random_windows(s_q, s_k, torch.Generator().manual_seed(6), DEVICE)
    idx = check_prefill(qq, kk, w, ks, ke, 32, chunk_k=256)
    for i in range(s_q):
        n = min(32, int(ke[i] - ks[i]))
        assert idx[i, :n].tolist() == list(range(int(ks[i]), int(ks[i]) + n))


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_prefill_monotone_logits(order):
    """Logits monotone in the key position (per-key FP8 scales): ascending, every key beats the
    running bar and the candidate buffer fills at every block; descending, none after the first."""
    s_q, s_k, h, d = 8, 700, 4, 32
    qq = F.quantize_q(torch.ones(s_q, h, d, device=DEVICE).to(torch.bfloat16), "fp8")
    k, scale = F.quantize_k(torch.ones(s_k, d).to(torch.bfloat16), "fp8")
    ramp = 1 + torch.arange(s_k, dtype=torch.float32) / 1024
    kk = (k.to(DEVICE), (scale * (ramp if order == "ascending" else ramp.flip(0))).to(DEVICE))
    w = torch.rand(s_q, h, generator=torch.Generator().manual_seed(22)).to(DEVICE) + 0.5
    ks, ke = W.causal_tail(s_q, s_k, DEVICE)
    idx = check_prefill(qq, kk, w, ks, ke, 16, chunk_k=256)
    ends = ke.long()[:, None]
    first = ends - 1 - torch.arange(16, device=DEVICE) if order == "ascending" else torch.arange(16, device=DEVICE)
    assert torch.equal(idx.long(), first.expand(s_q, 16))


def test_prefill_topk_larger_than_every_window():
    s_q, s_k = 16, 520
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=7)
    ks = torch.randint(0, 480, (s_q,), generator=torch.Generator().manual_seed(7), dtype=torch.int32).to(DEVICE)
    ke = (ks + torch.arange(s_q, device=DEVICE) * 3).to(torch.int32)  # 0 to 45 keys
    idx = check_prefill(qq, kk, w, ks, ke, 64, chunk_k=256)
    lengths = (ke.clamp(max=s_k) - ks).long()
    assert torch.equal((idx >= 0).sum(dim=1), lengths)
    assert torch.equal(idx >= 0, torch.arange(64, device=DEVICE)[None, :] < lengths[:, None])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf * 0 in the interpreter
def test_prefill_inf_and_nan_logits():
    """Infinite weights: +inf, -inf and NaN (inf * relu(s) with s <= 0) logits in the windows."""
    s_q, s_k = 8, 400
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=8)
    w[0, 0] = float("inf")
    w[1, 0] = float("-inf")
    w[2, :2] = torch.tensor([float("inf"), float("-inf")])
    ks, ke = W.full(s_q, s_k, DEVICE)
    logits = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke)
    assert logits[:3].isnan().any() and logits[:2].isinf().any()
    idx = check_prefill(qq, kk, w, ks, ke, 256, chunk_k=256)
    # Row 0 holds +inf and NaN only: the +inf first, then the NaN, each by position.
    n_inf = int(logits[0].isposinf().sum())
    assert 0 < n_inf < 256 and int(logits[0].isnan().sum()) == s_k - n_inf
    assert torch.equal(idx[0, :n_inf], logits[0].isposinf().nonzero().flatten().to(torch.int32))
    assert torch.equal(idx[0, n_inf:], logits[0].isnan().nonzero().flatten()[: 256 - n_inf].to(torch.int32))


def test_prefill_bitwise_reruns_and_chunk_sizes():
    """One chunk (the default size) and 256: the same bits; no keys: all -1; no rows: empty."""
    s_q, s_k = 8, 600
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=9)
    ks, ke = W.causal_tail(s_q, s_k, DEVICE)
    first = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, 24, chunk_k=256)
    for chunk_k in (256, None):
        assert torch.equal(tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, 24, chunk_k=chunk_k), first)
    assert torch.equal(first, expected_prefill(qq, kk, w, ks, ke, 24)[0])
    none = tilefuse.fp8_fp4_mqa_topk(qq, (kk[0][:0], kk[1][:0]), w, ks, ke, 8)
    assert torch.equal(none, torch.full((s_q, 8), -1, dtype=torch.int32, device=DEVICE))
    tilefuse.check_errors()
    empty = tilefuse.fp8_fp4_mqa_topk((qq[0][:0], None), kk, w[:0], ks[:0], ke[:0], 8)
    assert empty.shape == (0, 8)


def test_prefill_many_rows_use_the_row_tile(record_launches):
    """64 query rows (the 64-row tile, not heads_on_n): still the unfused op's ranking; one merge
    launch per chunk, 64 rows a program at topk 8 through the interpreter, 2 on a GPU (32 keys)."""
    s_q, s_k = 64, 512
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=10, weights_dtype=torch.bfloat16)
    launched = record_launches(kern, "topk_merge_chunk_kernel")
    ks, ke = W.zigzag(s_q, s_k, DEVICE)
    check_prefill(qq, kk, w, ks, ke, 8, chunk_k=256)
    programs = (1,) if DEVICE == "cpu" else (32,)
    assert launched == [programs, programs]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_prefill_row_blocks(fmt, record_launches):
    """Row blocks of 128: the last block of 12 rows keeps the 140-row launch configuration
    (not the few-rows one, unless the whole call's size class takes it: on Hopper a 140 x 300
    FP8 call does, and MXFP4's in one launch), so the bits stay the
    unfused op's; error rows count from row 0."""
    from tilefuse.indexer import _dispatch, prefill

    s_q, s_k = 140, 300
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 64, fmt, seed=20)
    whole = prefill.resolve_config(fmt, 4, 64, s_q, None, torch.float32,
                                   _dispatch.capability_major(torch.device(DEVICE)), s_k)
    few_row_launches = record_launches(prefill_kernel, "prefill_heads_on_n_kernel")
    few_row_launches_mx = record_launches(prefill_kernel, "prefill_mx_few_rows_kernel")
    ks, ke = W.random_windows(s_q, s_k, torch.Generator().manual_seed(20), DEVICE, empty_fraction=0.1, overhang=9)
    ref_idx, ref_val = expected_prefill(qq, kk, w, ks, ke, 8)
    idx, val = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, 8, return_values=True, chunk_k=256, chunk_q=128)
    tilefuse.check_errors()
    assert torch.equal(idx, ref_idx) and _equal(val, ref_val)
    # every block, or none (MX few-row calls on Hopper: the one-launch kernel)
    assert bool(few_row_launches or few_row_launches_mx) == whole.heads_on_n
    ks[133] = ke[133] + 1
    tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, 8, chunk_k=256, chunk_q=128)
    with pytest.raises(tilefuse.DeviceValueError, match="row 133"):
        tilefuse.check_errors()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_prefill_plan_over_changing_sizes(fmt, monkeypatch):
    """Eager one-step calls of one argument layout with new S_q and S_k (one size class), new
    windows (empty, past the end) and fresh random inputs each: the first call is checked and
    makes the layout's plan, the others reuse it without the checks, each bit for bit the
    unfused pair's (FP8: the first call's launches replayed). Windows and an output off 16-byte
    alignment make a plan of their own. A bad window found by the kernels still surfaces at the
    next call; a wrong argument of the same layout but other sizes (weights rows), checked mode,
    another output layout and a call of two chunks each take the checked path."""
    monkeypatch.setattr(topk, "_prefill_plans", {})
    checked_calls = []
    real_checks = topk._check_topk_args
    monkeypatch.setattr(topk, "_check_topk_args", lambda *a: (checked_calls.append(a), real_checks(*a)))
    k_top = 24
    for i, (s_q, s_k) in enumerate(((40, 300), (33, 260), (48, 511))):
        qq, kk, w = prefill_inputs(s_q, s_k, 4, 64, fmt, seed=90 + i)
        ks, ke = W.random_windows(s_q, s_k, torch.Generator().manual_seed(90 + i), DEVICE, empty_fraction=0.1,
                                  overhang=7)
        ref_idx, ref_val = expected_prefill(qq, kk, w, ks, ke, k_top)
        out = torch.full((s_q, k_top), 12345, dtype=torch.int32, device=DEVICE)
        idx, val = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top, return_values=True, out=out)
        tilefuse.check_errors()
        assert idx is out and torch.equal(idx, ref_idx) and _equal(val, ref_val), (s_q, s_k)
    assert len(topk._prefill_plans) == 1 and len(checked_calls) == 1
    # FP8: the first call's launches recorded, the next two replayed at their own sizes
    (plan,) = topk._prefill_plans.values()
    assert callable(plan.replay) if fmt == "fp8" else plan.replay == _jit.NOT_REPLAYABLE
    # windows and an output 4 bytes past 16-byte alignment (slices of larger buffers): a plan of
    # their own (the merge's replayed launch was compiled for aligned pointers)
    ks_off, ke_off = (torch.cat([t[:1], t])[1:] for t in (ks, ke))
    out_off = torch.full((s_q * k_top + 1,), 12345, dtype=torch.int32, device=DEVICE)[1:].view(s_q, k_top)
    idx, val = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks_off, ke_off, k_top, return_values=True, out=out_off)
    assert idx is out_off and torch.equal(idx, ref_idx) and _equal(val, ref_val)
    assert len(topk._prefill_plans) == 2 and len(checked_calls) == 2
    checked_calls.clear()
    topk._prefill_plans.clear()
    tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top, return_values=True, out=out)
    bad_ks = ks.clone()
    bad_ks[5] = ke[5] + 1
    tilefuse.fp8_fp4_mqa_topk(qq, kk, w, bad_ks, ke, k_top, return_values=True, out=out)
    assert len(checked_calls) == 1
    with pytest.raises(tilefuse.DeviceValueError, match="row 5"):
        tilefuse.check_errors()
    with pytest.raises(ValueError, match="weights"):
        tilefuse.fp8_fp4_mqa_topk(qq, kk, w[:-1], ks, ke, k_top, return_values=True, out=out)
    assert len(checked_calls) == 2
    with tilefuse.checked_mode():
        assert torch.equal(tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top, return_values=True)[0], ref_idx)
    assert len(checked_calls) == 3
    assert torch.equal(tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top), ref_idx)  # no out=, no values
    assert len(topk._prefill_plans) == 2 and len(checked_calls) == 4
    monkeypatch.setattr(topk, "default_chunk_k", lambda *a: 256)  # two chunks: no plan
    assert torch.equal(tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top), ref_idx)
    assert len(topk._prefill_plans) == 2 and len(checked_calls) == 5


class _LoggedStream:
    """A stand-in for a CUDA stream that logs what is asked of it (the interpreter has none)."""

    def __init__(self, name, log):
        self.name, self.log, self.events = name, log, 0

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait event", self.name, event))

    def record_event(self):
        self.events += 1
        self.log.append(("record", self.name, self.events))
        return self.events

    def __enter__(self):
        self.log.append(("enter", self.name))

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))


def _log_side_stream(monkeypatch, logits_op: str):
    """The side-stream path under logged stand-ins: the caller's and the side stream, and the
    logits op ``tilefuse.<logits_op>`` logging each call and its ``out`` buffer. Returns
    ``(log, outs, real_op)``; the caller puts ``real_op`` back before computing references."""
    log, outs = [], []
    main, side = _LoggedStream("main", log), _LoggedStream("side", log)
    monkeypatch.setattr(topk, "_merge_stream", lambda device, steps, enabled: side if enabled and steps > 1 else None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: stream)
    real_op = getattr(tilefuse, logits_op)

    def logged(*args, **kwargs):
        log.append(("logits",))
        outs.append(kwargs["out"])
        return real_op(*args, **kwargs)

    monkeypatch.setattr(tilefuse, logits_op, logged)
    return log, outs, real_op


def _check_side_stream_log(log, outs, steps: int) -> None:
    """Each merge on the side stream after it waited for the caller's, each step's logits after
    the caller waited for the merge two steps before, the caller joined to the side stream at
    the end; two logits buffers taken in turn."""
    expected = [("wait", "side", "main")]
    for i in range(steps):
        if i >= 2:
            expected.append(("wait event", "main", i - 1))  # the merge of step i - 2
        expected += [("logits",), ("wait", "side", "main"), ("enter", "side"), ("exit", "side"),
                     ("record", "side", i + 1)]
    assert log == expected + [("wait", "main", "side")]
    bases = [t.untyped_storage().data_ptr() for t in outs]
    assert len(set(bases)) == 2 and all(bases[i] == bases[i % 2] for i in range(steps))


def test_prefill_merges_beside_logits_order(monkeypatch, record_launches):
    """The side-stream path's order, with logged stand-ins for the streams: three row blocks by
    three chunks, each merge on the side stream after it waited for the caller's stream, each
    step's logits (into one of two buffers) after the caller waited for the merge two steps
    before, the caller joined to the side stream at the end; the result the unfused pair's."""
    log, logits_out, real_logits = _log_side_stream(monkeypatch, "fp8_fp4_mqa_logits")
    merges = record_launches(kern, "topk_merge_chunk_kernel")
    s_q, s_k, k_top = 300, 700, 24
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 64, "fp8", seed=75)
    ks, ke = W.random_windows(s_q, s_k, torch.Generator().manual_seed(75), DEVICE, empty_fraction=0.1)
    idx, val = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top, return_values=True, chunk_k=256, chunk_q=128)
    tilefuse.check_errors()
    monkeypatch.setattr(tilefuse, "fp8_fp4_mqa_logits", real_logits)
    ref_idx, ref_val = expected_prefill(qq, kk, w, ks, ke, k_top)
    assert torch.equal(idx, ref_idx) and _equal(val, ref_val)
    steps = 9
    assert len(merges) == steps and log[0] == ("wait", "side", "main") and log[-1] == ("wait", "main", "side")
    _check_side_stream_log(log, logits_out, steps)


def _eager_on_a_caller_stream_then_captured(call, check):
    """``call()`` eagerly on a stream of the caller's, then ``check()``; then ``call`` captured
    in a CUDA graph on that stream: the graph."""
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        call()
    torch.cuda.current_stream().wait_stream(caller)
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=caller):
        call()
    return graph


@pytest.mark.skipif(not ON_GPU, reason="streams and graphs: the GPU only")
@pytest.mark.parametrize("overlap", [0, 1])
def test_prefill_merges_beside_logits_in_a_graph(overlap, monkeypatch):
    """Three row blocks by three key chunks with the merges on the side stream (and without):
    eager on a stream of the caller's, captured in a CUDA graph and replayed over new inputs and
    windows; every result the unfused pair's, bit for bit, with poisoned outputs."""
    monkeypatch.setattr(topk, "_OVERLAP_MERGES", overlap)
    s_q, s_k, k_top = 300, 700, 24
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 64, "fp8", seed=70)
    ks, ke = W.random_windows(s_q, s_k, torch.Generator().manual_seed(70), DEVICE, empty_fraction=0.1)
    out = torch.full((s_q, k_top), 12345, dtype=torch.int32, device=DEVICE)
    vals = torch.full((s_q, k_top), 7.0, device=DEVICE)

    def call():
        idx, val = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k_top, return_values=True, chunk_k=256, chunk_q=128)
        out.copy_(idx)
        vals.copy_(val)

    def check():
        ref_idx, ref_val = expected_prefill(qq, kk, w, ks, ke, k_top)
        assert torch.equal(out, ref_idx) and _equal(vals, ref_val)

    graph = _eager_on_a_caller_stream_then_captured(call, check)
    for seed in (71, 72):
        qq_new, kk_new, w_new = prefill_inputs(s_q, s_k, 4, 64, "fp8", seed=seed)
        ks_new, ke_new = W.random_windows(s_q, s_k, torch.Generator().manual_seed(seed), DEVICE, empty_fraction=0.1)
        for dst, src in ((qq[0], qq_new[0]), (kk[0], kk_new[0]), (kk[1], kk_new[1]), (w, w_new), (ks, ks_new),
                         (ke, ke_new)):
            dst.copy_(src)
        out.fill_(12345)
        vals.fill_(7.0)
        graph.replay()
        tilefuse.check_errors()
        ref_idx, ref_val = expected_prefill(qq, kk, w, ks, ke, k_top)
        assert torch.equal(out, ref_idx) and _equal(vals, ref_val), seed


# ---------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------
class PagedCase:
    def __init__(self, fmt="fp8", lens=(70, 0, 129, 200), next_n=2, h=8, d=64, block_kv=32, ctx_2d=False,
                 seed=0, extra_cols=5, distinct_keys=None):
        g = torch.Generator().manual_seed(seed)
        lens = torch.tensor(lens, dtype=torch.int32)
        b, s = lens.shape[0], max(1, int(lens.max()))
        q = torch.randn(b, next_n, h, d, generator=g).to(torch.bfloat16)
        k = torch.randn(b, s, d, generator=g).to(torch.bfloat16)
        if distinct_keys:
            k = k[:, torch.arange(s) % distinct_keys]
        self.w = torch.randn(b * next_n, h, generator=g).to(DEVICE)
        if ctx_2d:
            ctx = (lens[:, None] * torch.rand(b, next_n, generator=g)).to(torch.int32)
            ctx[:, -1] = lens
        else:
            ctx = lens
        self.cache, self.table = paged.make_paged_kv_cache(k.to(DEVICE), lens.to(DEVICE), block_kv, fmt,
                                                           generator=g)
        self.qq = tuple(None if t is None else t.to(DEVICE) for t in F.quantize_q(q, fmt))
        self.ctx = ctx.to(DEVICE)
        self.next_n, self.block_kv = next_n, block_kv
        self.max_context_len = s + extra_cols
        self.meta = tilefuse.get_paged_mqa_logits_metadata(self.ctx, block_kv, NUM_SMS)

    def args(self):
        return (self.qq, self.cache, self.w, self.ctx, self.table, self.meta, self.max_context_len)

    def expected(self, k_top, logits_dtype=torch.float32):
        logits = tilefuse.fp8_fp4_paged_mqa_logits(*self.args(), True, logits_dtype)
        valid = R.paged_valid_mask(self.ctx, self.next_n, self.max_context_len)
        return R.topk_of_logits(logits, valid, k_top)

    def check(self, k_top, chunk_k, logits_dtype=torch.float32):
        ref_idx, ref_val = self.expected(k_top, logits_dtype)
        rows = self.w.shape[0]
        out = torch.full((rows, k_top), 12345, dtype=torch.int32, device=DEVICE)
        idx, val = tilefuse.fp8_fp4_paged_mqa_topk(*self.args(), k_top, logits_dtype, return_values=True, out=out,
                                                   chunk_k=chunk_k)
        tilefuse.check_errors()
        assert idx is out
        assert torch.equal(idx, ref_idx), "indices differ from the unfused logits' top-k"
        assert _equal(val, ref_val), "values differ from the unfused logits"
        return idx


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("ctx_2d", [False, True])
def test_decode_formats_and_length_modes(fmt, ctx_2d):
    """Lengths not a multiple of the page or the chunk, a zero-length request, chunks of two pages."""
    case = PagedCase(fmt, lens=shapes((70, 0, 129, 200), (5000, 0, 8193, 12000)), next_n=2, ctx_2d=ctx_2d,
                     seed=len(fmt) + 3 * ctx_2d)
    idx = case.check(16, chunk_k=shapes(64, 2048))
    assert (idx[2:4] == -1).all()  # request 1 is empty


def test_decode_ties_wide_output_and_topk_past_the_lengths():
    """Repeated keys (equal logits), max_context_len far past every length, topk > some lengths,
    next_n = 3 with 1-D lengths (causal rows)."""
    case = PagedCase("fp8", lens=(40, 97, 5), next_n=3, block_kv=16, seed=11, extra_cols=300, distinct_keys=5)
    idx = case.check(48, chunk_k=32)
    valid = R.paged_valid_mask(case.ctx, 3, case.max_context_len).sum(dim=1)
    assert torch.equal((idx >= 0).sum(dim=1), valid.clamp(max=48))


def test_decode_bf16_logits_and_rerun():
    case = PagedCase("mxfp4", lens=(150, 33), next_n=1, block_kv=64, seed=12)
    first = case.check(32, chunk_k=64, logits_dtype=torch.bfloat16)
    again = tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 32, torch.bfloat16, chunk_k=128)
    assert torch.equal(first, again)
    varlen = torch.arange(2, dtype=torch.int32, device=DEVICE)  # request id per token (next_n = 1)
    assert torch.equal(tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 32, torch.bfloat16, varlen, chunk_k=64), first)


@pytest.mark.parametrize("fmt,ctx_2d,logits_dtype", [("fp8", False, torch.float32), ("mxfp4", True, torch.bfloat16)])
def test_decode_whole_rows(fmt, ctx_2d, logits_dtype, record_launches, monkeypatch):
    """The default for few rows: one logits launch over whole rows, then the top-k across each
    row's programs (the passes: over group maxima, two digit histograms and the compaction;
    blocks of 64 keys dealt over 6 programs a row) and one final merge; ties (repeated keys), a
    zero-length request, lengths past topk and below it."""
    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", 0)  # the passes (a captured call's, or longer rows')
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 64)
    monkeypatch.setattr(topk, "_ACROSS_MIN_SEGMENT", 128)
    case = PagedCase(fmt, lens=(700, 0, 129, 33), next_n=2, ctx_2d=ctx_2d, seed=50 + len(fmt) + ctx_2d,
                     extra_cols=64, distinct_keys=40)
    rows = case.w.shape[0]
    assert topk.decode_whole_rows(rows, case.max_context_len, logits_dtype)
    passes = record_launches(kern, "topk_rows_pass_kernel")
    merges = record_launches(kern, "topk_merge_chunk_kernel")
    case.check(48, chunk_k=None, logits_dtype=logits_dtype)
    segments = topk.cdiv(case.max_context_len, 128)
    assert segments == 6 and passes == [(rows, segments)] * _pass_launches(rows, case.max_context_len, 48)
    assert len(merges) == 1
    idx = tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 48, logits_dtype, chunk_k=case.block_kv)
    assert torch.equal(idx, case.check(48, chunk_k=None, logits_dtype=logits_dtype))  # chunks agree


@pytest.mark.parametrize("fmt,ctx_2d,logits_dtype", [("fp8", False, torch.float32), ("mxfp4", True, torch.bfloat16)])
def test_decode_short_rows_one_merge_eagerly(fmt, ctx_2d, logits_dtype, record_launches, monkeypatch):
    """Eager calls over whole rows of at most ``_EAGER_ONE_MERGE_KEYS`` keys: the logits, then
    one merge a row over the whole row (no passes), through the checked path and the layout's
    plan alike; ties, a zero-length request, lengths past topk and below it; the bits the
    passes give. A call being captured keeps the passes; longer rows too."""
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 64)
    monkeypatch.setattr(topk, "_ACROSS_MIN_SEGMENT", 128)
    monkeypatch.setattr(topk, "_decode_plans", {})
    case = PagedCase(fmt, lens=(700, 0, 129, 33), next_n=2, ctx_2d=ctx_2d, seed=60 + len(fmt) + ctx_2d,
                     extra_cols=64, distinct_keys=40)
    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", 0)
    across = case.check(48, chunk_k=None, logits_dtype=logits_dtype)
    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", case.max_context_len)
    passes = record_launches(kern, "topk_rows_pass_kernel")
    merges = record_launches(kern, "topk_merge_chunk_kernel")
    for _ in range(2):  # the checked call, then the plan's
        out = torch.full_like(across, 12345)
        idx = tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 48, logits_dtype, out=out)
        tilefuse.check_errors()
        assert idx is out and torch.equal(idx, across)
    assert passes == [] and len(merges) == 2
    assert torch.equal(case.check(48, chunk_k=None, logits_dtype=logits_dtype), across)
    monkeypatch.setattr(topk.prefill, "_stream_and_capture", lambda index: (0, True))
    assert torch.equal(tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 48, logits_dtype), across)
    launches = _pass_launches(case.w.shape[0], case.max_context_len, 48)
    assert len(passes) == launches
    monkeypatch.setattr(topk.prefill, "_stream_and_capture", lambda index: (0, False))
    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", case.max_context_len - 1)
    assert torch.equal(tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 48, logits_dtype), across)
    assert len(passes) == 2 * launches


def test_decode_merges_beside_logits_order(monkeypatch, record_launches):
    """Decode chunks on the side-stream path (the setting on), with logged stand-ins for the
    streams: each merge on the side stream after it waited for the caller's, each chunk's
    logits into one of two buffers after the caller waited for the merge two chunks before, the
    caller joined to the side stream at the end; ties and an empty request, the result the
    unfused op's."""
    monkeypatch.setattr(topk, "_OVERLAP_DECODE_MERGES", 1)
    merges = record_launches(kern, "topk_merge_chunk_kernel")
    case = PagedCase("fp8", lens=(150, 0, 97), next_n=2, block_kv=16, seed=76, distinct_keys=40)
    ref_idx, ref_val = case.expected(24)
    log, logits_out, real_logits = _log_side_stream(monkeypatch, "fp8_fp4_paged_mqa_logits")
    idx, val = tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 24, return_values=True, chunk_k=32)
    monkeypatch.setattr(tilefuse, "fp8_fp4_paged_mqa_logits", real_logits)
    tilefuse.check_errors()
    assert torch.equal(idx, ref_idx) and _equal(val, ref_val)
    steps = topk.cdiv(case.max_context_len, 32)
    assert steps == 5 and len(merges) == steps
    _check_side_stream_log(log, logits_out, steps)


def _check_decode_in_a_graph(lens, block_kv: int, seeds, shorter, k_top: int, chunk_k: int | None = None,
                             whole_rows: bool = False) -> None:
    """A decode top-k call (FP8, next_n 2, requests of ``lens`` tokens) eager on a stream of the
    caller's, then captured in a CUDA graph and replayed over new queries and weights, first
    with the lengths ``shorter``, then with a new case's; every result the unfused op's, bit for
    bit, with poisoned outputs."""
    case = PagedCase("fp8", lens=lens, next_n=2, block_kv=block_kv, seed=seeds[0])
    rows = case.w.shape[0]
    assert topk.decode_whole_rows(rows, case.max_context_len, torch.float32) or not whole_rows
    out = torch.full((rows, k_top), 12345, dtype=torch.int32, device=DEVICE)
    vals = torch.full((rows, k_top), 7.0, device=DEVICE)

    def call():
        idx, val = tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), k_top, return_values=True, chunk_k=chunk_k)
        out.copy_(idx)
        vals.copy_(val)

    def check():
        ref_idx, ref_val = case.expected(k_top)
        assert torch.equal(out, ref_idx) and _equal(vals, ref_val)

    graph = _eager_on_a_caller_stream_then_captured(call, check)
    for seed in seeds[1:]:
        new = PagedCase("fp8", lens=lens, next_n=2, block_kv=block_kv, seed=seed)
        case.qq[0].copy_(new.qq[0])
        case.w.copy_(new.w)
        case.ctx.copy_(torch.tensor(shorter, dtype=torch.int32, device=DEVICE) if seed == seeds[1] else new.ctx)
        out.fill_(12345)
        vals.fill_(7.0)
        graph.replay()
        tilefuse.check_errors()
        check()


@pytest.mark.skipif(not ON_GPU, reason="streams and graphs: the GPU only")
@pytest.mark.parametrize("overlap", [0, 1])
def test_decode_merges_beside_logits_in_a_graph(overlap, monkeypatch):
    """Decode in five key chunks with the merges on the side stream (and without), eager then
    in a replayed CUDA graph (:func:`_check_decode_in_a_graph`)."""
    monkeypatch.setattr(topk, "_OVERLAP_DECODE_MERGES", overlap)
    _check_decode_in_a_graph((150, 0, 97), 16, (77, 78, 79), (120, 0, 61), 24, chunk_k=32)


@pytest.mark.skipif(not ON_GPU, reason="streams and graphs: the GPU only")
def test_decode_whole_rows_in_a_graph(monkeypatch):
    """Whole rows by the passes and the last step, eager then in a replayed CUDA graph
    (:func:`_check_decode_in_a_graph`)."""
    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", 0)
    _check_decode_in_a_graph((3000, 0, 97, 2500), 64, (82, 83, 84), (2000, 0, 61, 2500), 256, whole_rows=True)


def test_decode_whole_rows_limit():
    """Whole rows while their logits and candidates fit the limit, chunks past it."""
    limit = topk._WHOLE_ROWS_BYTES
    assert topk.decode_whole_rows(1, 163840, torch.float32)
    assert topk.decode_whole_rows(limit // 12, 1, torch.float32)
    assert not topk.decode_whole_rows(limit // 12 + 1, 1, torch.float32)
    assert topk.decode_whole_rows(limit // 10, 1, torch.bfloat16)
    assert topk.decode_whole_rows(136, 163840, torch.float32)
    assert not topk.decode_whole_rows(137, 163840, torch.float32)


@pytest.mark.parametrize("fmt,ctx_2d", [("fp8", False), ("mxfp4", True)])
def test_decode_whole_rows_plan_over_changing_sizes(fmt, ctx_2d, monkeypatch):
    """Eager calls over whole rows of one argument layout (one cache, one block-table width)
    with a new batch size, new lengths (an empty request, one below topk) and a new
    max_context_len each, on fresh random inputs: the first call is checked and makes the
    layout's plan, the others reuse it without the checks (the logits op's plan launched
    directly, the passes and the merge as partial launches), each bit for bit the unfused op's
    top-k. Checked mode takes the checked path to the same result; another output layout makes
    a plan of its own."""
    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", 0)  # the passes (a captured call's, or longer rows')
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 32)
    monkeypatch.setattr(topk, "_ACROSS_MIN_SEGMENT", 64)
    monkeypatch.setattr(topk, "_decode_plans", {})
    checked_calls = []
    real_checks = topk._check_topk_args
    monkeypatch.setattr(topk, "_check_topk_args", lambda *a: (checked_calls.append(a), real_checks(*a)))
    next_n, h, d, block_kv, k_top, pages = 2, 8, 64, 32, 24, 10
    g = torch.Generator().manual_seed(80 + ctx_2d)
    for b in (3, 2, 5, 4):
        max_len = int(torch.randint(60, pages * block_kv + 1, (1,), generator=g))
        lens = torch.randint(0, max_len + 1, (b,), generator=g).int()
        lens[0], lens[1] = 0, 5
        keys = torch.randn(b, max_len, d, generator=g).to(torch.bfloat16)
        cache, table = paged.make_paged_kv_cache(keys.to(DEVICE), lens.to(DEVICE), block_kv, fmt,
                                                 num_blocks=6 * pages, generator=g)
        table = torch.nn.functional.pad(table, (0, pages - table.shape[1])).contiguous()
        if ctx_2d:
            ctx = (lens[:, None] * torch.rand(b, next_n, generator=g)).int()
            ctx[:, -1] = lens
        else:
            ctx = lens
        ctx = ctx.to(DEVICE)
        qq = tuple(None if t is None else t.to(DEVICE)
                   for t in F.quantize_q(torch.randn(b, next_n, h, d, generator=g).to(torch.bfloat16), fmt))
        w = torch.randn(b * next_n, h, generator=g).to(DEVICE)
        meta = tilefuse.get_paged_mqa_logits_metadata(ctx, block_kv, NUM_SMS)
        args = (qq, cache, w, ctx, table, meta, max_len)
        ref_idx, ref_val = R.topk_of_logits(tilefuse.fp8_fp4_paged_mqa_logits(*args, True),
                                            R.paged_valid_mask(ctx, next_n, max_len), k_top)
        out = torch.full((b * next_n, k_top), 12345, dtype=torch.int32, device=DEVICE)
        idx, val = tilefuse.fp8_fp4_paged_mqa_topk(*args, k_top, return_values=True, out=out)
        tilefuse.check_errors()
        assert idx is out and torch.equal(idx, ref_idx) and _equal(val, ref_val), (b, max_len)
    assert len(topk._decode_plans) == 1 and len(checked_calls) == 1
    (plan,) = topk._decode_plans.values()
    passes = {key for key in plan.partials if len(key[0]) == 5}  # (PASS, MODE, BLOCK, MAXIMA, KEEP)
    assert len(passes) == _pass_launches(b * next_n, max_len, k_top) and len(plan.partials) > len(passes)
    declined = []
    for key in plan.partials:  # partial launches that decline (a launch hook, another device): each step launches
        plan.partials[key] = lambda *values, key=key: declined.append(key) and False
    idx, val = tilefuse.fp8_fp4_paged_mqa_topk(*args, k_top, return_values=True, out=torch.empty_like(out))
    assert torch.equal(idx, ref_idx) and _equal(val, ref_val) and len(declined) == len(passes) + 1  # and the merge
    with tilefuse.checked_mode():
        assert torch.equal(tilefuse.fp8_fp4_paged_mqa_topk(*args, k_top), ref_idx)
    assert len(topk._decode_plans) == 1 and len(checked_calls) == 2
    assert torch.equal(tilefuse.fp8_fp4_paged_mqa_topk(*args, k_top), ref_idx)  # no out=, no values
    assert len(topk._decode_plans) == 2 and len(checked_calls) == 3


def _spied(real, before):
    """A stand-in for the Triton kernel ``real`` (through ``tilefuse._jit.redirected``) that
    calls ``before(kwargs)`` ahead of each launch, which then runs."""
    class Spy:
        def __getitem__(self, grid):
            def launch(**kwargs):
                before(kwargs)
                return real[grid](**kwargs)
            return launch

    return Spy()


@pytest.mark.parametrize("fmt,ctx_2d", [("fp8", False), ("mxfp4", True)])
def test_decode_whole_rows_leave_the_kept_histograms_zero(fmt, ctx_2d, monkeypatch):
    """The passes' histograms and counts come from a buffer kept per device and stream, which
    the last step (the final merge) zeroes for every row (an empty request,
    rows shorter than topk and longer): filled when it starts, zeros after each call, and the
    next call on it right. A call of more rows than the buffer holds takes a zeroed buffer of
    its own and leaves the kept one."""
    from tilefuse import _jit

    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", 0)  # the passes (a captured call's, or longer rows')
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 32)
    monkeypatch.setattr(topk, "_ACROSS_MIN_SEGMENT", 64)
    monkeypatch.setattr(topk, "_KEPT_ROWS", 8)
    monkeypatch.setattr(topk, "_kept_histograms", {})
    at_merge = []  # (histograms, counts) as the last step found them
    real = kern.topk_merge_chunk_kernel
    spy = _spied(real, lambda kw: at_merge.append((kw["hist_ptr"].clone(), kw["count_ptr"].clone())))
    with _jit.redirected(real, spy):
        kept = None
        for seed, lens in ((70, (150, 0, 9, 70)), (71, (3, 120, 0, 200))):  # 8 rows
            case = PagedCase(fmt, lens=lens, next_n=2, ctx_2d=ctx_2d, seed=seed + ctx_2d, extra_cols=30)
            case.check(48, chunk_k=None)
            (now,) = topk._kept_histograms.values()
            assert kept is None or now is kept  # the same buffer for both calls
            kept = now
            hist, counts = at_merge[-1]
            assert hist.any() and counts.any()  # the passes summed into it
            assert not kept.hist.any() and not kept.counts.any()
        wide = PagedCase(fmt, lens=(150, 0, 9, 70, 33), next_n=2, ctx_2d=ctx_2d, seed=72)  # 10 rows
        wide.check(48, chunk_k=None)
    assert at_merge[-1][0].shape[0] == 10 * topk._HIST_INTS  # a buffer of its own
    assert list(topk._kept_histograms.values()) == [kept] and not kept.hist.any() and not kept.counts.any()


@pytest.mark.parametrize("failing", ["pass", "merge"])
def test_decode_whole_rows_failure_between_launches(failing, monkeypatch):
    """A launch that raises after the passes have summed into the kept buffer (the third pass
    or the merge) leaves the buffer out: the next call takes a zeroed one and is
    right."""
    from tilefuse import _jit

    monkeypatch.setattr(topk, "_EAGER_ONE_MERGE_KEYS", 0)  # the passes (a captured call's, or longer rows')
    monkeypatch.setattr(topk, "_ACROSS_BLOCK", 64)
    monkeypatch.setattr(topk, "_kept_histograms", {})
    case = PagedCase("fp8", lens=(200, 0, 17), next_n=2, seed=73)
    case.check(48, chunk_k=None)
    (first,) = topk._kept_histograms.values()
    real = {"pass": kern.topk_rows_pass_kernel, "merge": kern.topk_merge_chunk_kernel}[failing]

    def fail(kw):
        if failing != "pass" or kw["PASS"] == 2:
            raise RuntimeError("launch failed")

    with _jit.redirected(real, _spied(real, fail)), pytest.raises(RuntimeError, match="launch failed"):
        tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 48)
    assert topk._kept_histograms == {}  # not put back
    assert first.hist.any()  # half used
    other = PagedCase("fp8", lens=(90, 130, 5), next_n=2, seed=74)
    other.check(48, chunk_k=None)
    (kept,) = topk._kept_histograms.values()
    assert kept.hist.data_ptr() != first.hist.data_ptr()
    assert not kept.hist.any() and not kept.counts.any()


def test_decode_empty_batch_and_zero_columns():
    case = PagedCase("fp8", lens=(0, 0), next_n=2, seed=13, extra_cols=0)
    out = tilefuse.fp8_fp4_paged_mqa_topk(*case.args()[:-1], 0, 8)
    assert torch.equal(out, torch.full((4, 8), -1, dtype=torch.int32, device=DEVICE))
    case = PagedCase("fp8", lens=(10,), next_n=1, seed=14)
    empty = tilefuse.fp8_fp4_paged_mqa_topk((case.qq[0][:0], None), case.cache, case.w[:0], case.ctx[:0],
                                            case.table[:0], case.meta, case.max_context_len, 8)
    assert empty.shape == (0, 8)


@pytest.mark.parametrize("i", range(4))
def test_gpu_sweep_sample(i):
    """Four cases of the GPU contract sweep (``tests/indexer/topk_gpu_sweep.py``) at up to 300 keys."""
    from . import topk_gpu_sweep as sweep

    case = random.Random(40).sample(sweep.contract_cases(), 4)[i]
    sweep.run_case(case, seed=41 + i, small_chunk=i % 2 == 0, max_keys=300)
    tilefuse.check_errors()


# ---------------------------------------------------------------------------------------
# Custom ops, bytes, bad input
# ---------------------------------------------------------------------------------------
def test_custom_ops_fake_and_torch_compile():
    s_q, s_k = 8, 300
    qq, kk, w = prefill_inputs(s_q, s_k, 4, 32, "fp8", seed=15)
    ks, ke = W.causal_tail(s_q, s_k, DEVICE)
    real = tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, 16, chunk_k=256)

    def select(qv, k, ks_, ke_, w_):
        return tilefuse.fp8_fp4_mqa_topk((qv, None), (k, kk[1]), w_, ks_, ke_, 16, chunk_k=256)

    compiled = torch.compile(select, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(qq[0], kk[0], ks, ke, w), real)

    case = PagedCase("fp8", lens=(40, 90), next_n=2, seed=16)
    real = tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 8, chunk_k=32)

    def decode(qv, cache, w_, ctx, table, meta):
        return tilefuse.fp8_fp4_paged_mqa_topk((qv, None), cache, w_, ctx, table, meta, case.max_context_len, 8,
                                               chunk_k=32)

    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(case.qq[0], case.cache, case.w, case.ctx, case.table, case.meta), real)

    def whole_rows(qv, cache, w_, ctx, table, meta):
        return tilefuse.fp8_fp4_paged_mqa_topk((qv, None), cache, w_, ctx, table, meta, case.max_context_len, 8)

    compiled = torch.compile(whole_rows, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(case.qq[0], case.cache, case.w, case.ctx, case.table, case.meta), real)


@pytest.mark.parametrize("groups_bar", [0, 1])
def test_bytes_moved_and_default_chunks(groups_bar, monkeypatch):
    monkeypatch.setattr(topk, "_FIRST_CHUNK_BAR", groups_bar)
    moved = topk.topk_bytes_moved(8192, 131072, 2048, 16384, chunk_q=512)
    assert moved["unfused"] == 2 * 8192 * 131072 * 4 + 8192 * 2048 * 4
    # a count and a bar a row between chunks; the first chunk read again for its bar
    assert moved["chunked_total"] == moved["unfused"] + 8192 * 12 * 2 * 7 + groups_bar * 8192 * 16384 * 4
    assert moved["chunked_workspace_bytes"] == 512 * (16384 * 4 + 2 * 2048 * 8 + 12)
    if groups_bar:  # groups of four: 1 - 0.5^(1/4) of the first chunk, then topk ln 8
        per_row = 16384 * (1 - 0.5**0.25) + 2048 * math.log(8)
        assert moved["candidates_random"] == round(8192 * per_row * 16)
        assert topk.topk_bytes_moved(1, 4096, 2048, 4096)["candidates_random"] == 2048 * 16  # single-key groups
    else:
        assert moved["candidates_random"] == round(8192 * 2048 * (1 + math.log(64)) * 16)
    assert topk.topk_bytes_moved(4, 100, 128, 256)["candidates_random"] == 4 * 100 * 16
    assert moved["chunked_hbm_if_l2_resident"] < moved["unfused"] / 4
    assert topk.topk_bytes_moved(4, 100, 8, 256)["chunked_hbm_if_l2_resident"] == 4 * 8 * 4
    assert topk.default_chunk_k(2048, 256) == 65536 and topk.default_chunk_k(8, 256) == 2048
    assert topk.default_chunk_k(64, 48) == 2064  # whole pages of 48 tokens
    assert topk.default_prefill_chunk_k(2048) == 65536 and topk.default_prefill_chunk_k(5) == 2048
    assert topk.default_chunk_q(65536, torch.float32) == 512 and topk.default_chunk_q(65536, torch.bfloat16) == 1024
    assert topk.default_chunk_q(131072, torch.float32) == 256
    assert topk.state_width(2048) == 2048 and topk.state_width(3) == 16


def test_workspace_of_one_chunk_allocates_its_candidates_alone():
    """One chunk's merge reads no bar or count (``merge_chunks`` poisons them): every such call
    on a device shares one pair of one-element stand-ins; more chunks get a bar and a count a row."""
    bars, candidates, counts = topk._workspace(3, 40, 1, torch.device(DEVICE))
    again = topk._workspace(5, 16, 1, torch.device(DEVICE))
    assert again[0] is bars and again[2] is counts and bars.numel() == counts.numel() == 1
    assert candidates.shape == (3, 128) and again[1].shape == (5, 32) and candidates.dtype == torch.int64
    bars, candidates, counts = topk._workspace(3, 40, 2, torch.device(DEVICE))
    assert bars.shape == (3,) and counts.shape == (3,) and (bars.dtype, counts.dtype) == (torch.int64, torch.int32)


def test_decode_chunk_follows_its_setting(monkeypatch):
    """The decode chunk reads its setting per call (a benchmark's A/B sets it after import)."""
    monkeypatch.setattr(topk, "_DECODE_CHUNK_STATES", 8)
    assert topk.default_chunk_k(2048, 256) == 16384


def _prefill_args():
    qq, kk, w = prefill_inputs(8, 300, 4, 32, "fp8", seed=17)
    ks, ke = W.causal_tail(8, 300, DEVICE)
    return dict(q=qq, kv=kk, weights=w, cu_seq_len_k_start=ks, cu_seq_len_k_end=ke, topk=8)


PREFILL_BAD = {
    "q-not-tuple": (TypeError, "q:", dict(q=lambda q: q[0])),
    "ks-dtype": (TypeError, "cu_seq_len_k_start", dict(cu_seq_len_k_start=lambda t: t.long())),
    "ke-rows": (ValueError, "cu_seq_len_k_end", dict(cu_seq_len_k_end=lambda t: t[:-1])),
    "weights-dtype": (TypeError, "weights", dict(weights=lambda w: w.half())),
    "topk-zero": (ValueError, "topk", dict(topk=lambda n: 0)),
    "topk-huge": (ValueError, "topk", dict(topk=lambda n: 1 << 20)),
    "topk-past-the-sortable": (ValueError, "topk", dict(topk=lambda n: (1 << 14) + 1)),
    "chunk-unaligned": (ValueError, "chunk_k", dict(chunk_k=lambda n: 300)),
    "rows-unaligned": (ValueError, "chunk_q", dict(chunk_q=lambda n: 100)),
    "out-dtype": (TypeError, "out", dict(out=lambda o: torch.zeros(8, 8, dtype=torch.int64, device=DEVICE))),
    "out-shape": (ValueError, "out", dict(out=lambda o: torch.zeros(8, 9, dtype=torch.int32, device=DEVICE))),
    "meta-dtype": (ValueError, "schedule_meta", dict(schedule_meta=lambda m: torch.zeros(2, 2, device=DEVICE))),
    "values-flag": (TypeError, "return_values", dict(return_values=lambda v: 1)),
}


@pytest.mark.parametrize("name", list(PREFILL_BAD))
def test_prefill_bad_inputs_raise(name):
    exc, text, changes = PREFILL_BAD[name]
    args = _prefill_args()
    for key, fn in changes.items():
        args[key] = fn(args.get(key))
    with pytest.raises(exc, match=text):
        tilefuse.fp8_fp4_mqa_topk(**args)


PAGED_BAD = {
    "ctx-dtype": (TypeError, "context_lens", dict(context_lens=lambda c: c.long())),
    "ctx-shape": (ValueError, "context_lens", dict(context_lens=lambda c: torch.stack([c, c, c], 1))),
    "meta-shape": (ValueError, "schedule_meta", dict(schedule_meta=lambda m: m[:1])),
    "max-context-len": (ValueError, "max_context_len", dict(max_context_len=lambda n: -1)),
    "chunk-not-pages": (ValueError, "chunk_k", dict(chunk_k=lambda n: 40)),
    "cache-width": (ValueError, "kv_cache", dict(kv_cache=lambda c: c[..., :-1])),
}


@pytest.mark.parametrize("name", list(PAGED_BAD))
def test_decode_bad_inputs_raise(name):
    case = PagedCase("fp8", lens=(60, 100), next_n=2, seed=18)
    exc, text, changes = PAGED_BAD[name]
    args = dict(zip(("q", "kv_cache", "weights", "context_lens", "block_table", "schedule_meta", "max_context_len"),
                    case.args()), topk=8)
    for key, fn in changes.items():
        args[key] = fn(args.get(key))
    with pytest.raises(exc, match=text):
        tilefuse.fp8_fp4_paged_mqa_topk(**args)


def test_bad_values_are_found_on_the_device():
    """Windows and lengths are checked by the merge kernel, without a host sync: the error is
    raised by check_errors (or the next call), and nothing is read out of bounds meanwhile."""
    args = _prefill_args()
    ke = args["cu_seq_len_k_end"].clone()
    ke[3] = -5  # ks > ke
    args["cu_seq_len_k_end"] = ke
    tilefuse.fp8_fp4_mqa_topk(**args)
    with pytest.raises(tilefuse.DeviceValueError, match="row 3"):
        tilefuse.check_errors()
    case = PagedCase("fp8", lens=(60, 100), next_n=2, seed=19)
    too_long = case.ctx.clone()
    too_long[1] = case.max_context_len + 7
    for chunk_k in (None, 32):  # whole rows (the logits op checks), chunks (the merge checks)
        tilefuse.fp8_fp4_paged_mqa_topk(case.qq, case.cache, case.w, too_long, case.table, case.meta,
                                        case.max_context_len, 8, chunk_k=chunk_k)
        with pytest.raises(tilefuse.DeviceValueError, match="max_context_len"):
            tilefuse.check_errors()
        tilefuse.fp8_fp4_paged_mqa_topk(*case.args(), 8, chunk_k=chunk_k)
        tilefuse.check_errors()


def test_bench_suite_rows_and_checks():
    """The suite's rows parse and build lazily; its checks fail on a wrong answer."""
    assert suite.parse_shapes(["2048x32768,64x2x8192"]) == ([(2048, 32768)], [(64, 2, 8192)])
    with pytest.raises(ValueError, match="--shapes"):
        suite.parse_shapes(["64x"])
    rows = suite.cases(on_gpu=True, device="cpu", shapes=([(2048, 32768)], [(64, 2, 8192)]))
    assert [c.params["api"] for c in rows] == ["prefill", "decode"]
    assert rows[0].params["chunk_k_used"] == 65536 and rows[0].params["bytes_moved"]["unfused"] > 0
    chunk_k, chunk_q = suite.parse_chunks("8192,16384", "chunk-k"), suite.parse_chunks("256", "chunk-q")
    sweep = suite.cases(on_gpu=True, device="cpu", shapes=([(2048, 32768)], []), chunk_k=chunk_k, chunk_q=chunk_q)
    assert [(c.params["chunk_k_used"], c.params["chunk_q_used"]) for c in sweep] == [(8192, 256), (16384, 256)]
    with pytest.raises(ValueError, match="--chunk-k"):
        suite.parse_chunks("8k", "chunk-k")
    logits = torch.randn(5, 300)
    logits[1, 7:9] = 9.0  # a tie at the top
    valid = torch.ones(5, 300, dtype=torch.bool)
    valid[3, 20:] = False
    check_fused, check_pair = suite.make_checks(logits, valid, 16, torch.arange(5), 5)
    good, _ = R.topk_of_logits(logits, valid, 16)
    assert check_fused(good)["passed"]
    swapped = good.clone()
    swapped[1, :2] = swapped[1, :2].flip(0)  # right set, wrong order among equal logits
    assert not check_fused(swapped)["passed"]
    masked = logits.masked_fill(~valid, float("-inf"))
    assert check_pair(torch.topk(masked, 16, dim=1))["passed"]
    assert not check_pair(torch.topk(-masked, 16, dim=1))["passed"]
    # checks of some rows of a larger output (as at GPU sizes): the rows' logits only
    rows = torch.tensor([1, 3])
    check_some, _ = suite.make_checks(logits[rows], valid[rows], 16, rows, 5)
    assert check_some(good)["passed"] and not check_some(swapped)["passed"]
    assert suite.check_shape(logits, (5, 300))["passed"] and not suite.check_shape(logits, (5, 299))["passed"]


_TRACED = [f"{kern.__name__}:topk_merge_chunk_kernel", f"{kern.__name__}:topk_rows_pass_kernel",
           "tilefuse.indexer._paged_kernel:paged_logits_kernel"] + [
    f"{prefill_kernel.__name__}:{name}" for name in ("prefill_logits_kernel", "prefill_heads_on_n_kernel",
                                                     "mx_rows_renormalise_kernel", "prefill_mx_few_rows_kernel")]


def _traced_keys(calls) -> set:
    """Triton's specialisation key of every merge and logits launch the calls make (not run)."""
    import importlib

    from tilefuse import _jit
    from tilefuse.kernelcheck.variants import tracing

    kernels = {p: getattr(importlib.import_module(p.partition(":")[0]), p.partition(":")[2]) for p in _TRACED}
    with tracing(*_TRACED) as launches:
        for call in calls:
            call()
    return {(launch.function, _jit.specialization_key(kernels[launch.function], launch.arguments, launch.options))
            for launch in launches}


@pytest.mark.skipif(ON_GPU, reason="CPU check of the keys; the GPU counts compiles (tests/indexer/test_warmup.py)")
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_specialisation_keys_after_warmup_cover_random_calls(fmt, monkeypatch):
    """Every merge and logits launch of fused calls at random sizes (prefill S_q, S_k, windows,
    chunk counts; decode batch, 1-D / 2-D lengths, max_context_len, table widths; decode rows
    taken whole by an eager call, one merge a row, and by a call being captured, the passes and
    their last step, with and without values) has the key of a launch the warm-up made: no
    compile after warm-up. (The GPU's one row a merge program.)"""
    from tilefuse.indexer import prefill
    from tilefuse.indexer import warmup as warmup_mod

    monkeypatch.setattr(topk, "_INTERPRETER_KEYS_PER_PROGRAM", 0)
    h, d, block_kv, k = 8, 64, 32, 16
    model = tilefuse.IndexerModel(fmt=fmt, num_heads=h, head_dim=d, block_kv=block_kv, topk=k)
    warm = warmup_mod.warmup_calls(model, "cpu")
    warmed = _traced_keys(warm["prefill_topk"] + warm["decode_topk"])
    g = torch.Generator().manual_seed(31)
    calls = []
    for s_q, s_k, chunk in ((1, 1, None), (5, 700, 256), (40, 3000, 512), (130, 9000, None), (3, 257, 256)):
        q, kv = prefill._zero_inputs(fmt, s_q, s_k, h, d, torch.device("cpu"))
        w = torch.randn(s_q, h + 3)[:, 1:1 + h]
        ks, ke = W.random_windows(s_q, s_k, generator=g)
        calls.append(lambda q=q, kv=kv, w=w, ks=ks, ke=ke, chunk=chunk:
                     topk.fp8_fp4_mqa_topk(q, kv, w, ks, ke, k, chunk_k=chunk))
    for batch, max_len, ctx_2d, chunk in ((1, 1, False, None), (3, 700, True, 64), (7, 3000, False, 128),
                                          (2, 95, True, 32)):
        pages = -(-max_len // block_kv) + 1
        cache = paged.new_paged_kv_cache(batch * pages, block_kv, d, fmt)
        table = torch.randperm(batch * pages, generator=g).int().view(batch, pages)
        lens = torch.randint(1, max_len + 1, (batch, 1) if ctx_2d else (batch,), generator=g).int()
        (vals, sf), _ = prefill._zero_inputs(fmt, batch, 1, h, d, torch.device("cpu"))
        q = (vals.view(batch, 1, *vals.shape[1:]), None if sf is None else sf.view(batch, 1, h))
        w = torch.randn(batch, h)
        meta = paged.get_paged_mqa_logits_metadata(lens, block_kv, 4)
        calls.append(lambda q=q, cache=cache, w=w, lens=lens, table=table, meta=meta, max_len=max_len, chunk=chunk:
                     topk.fp8_fp4_paged_mqa_topk(q, cache, w, lens, table, meta, max_len, k, chunk_k=chunk))
        if chunk is None:  # whole rows: the same call being captured into a CUDA graph, with values
            def captured(q=q, cache=cache, w=w, lens=lens, table=table, meta=meta, max_len=max_len):
                with monkeypatch.context() as m:
                    m.setattr(prefill, "_stream_and_capture", lambda index: (0, True))
                    topk.fp8_fp4_paged_mqa_topk(q, cache, w, lens, table, meta, max_len, k, return_values=True)
            calls.append(captured)
    seen = _traced_keys(calls)
    assert seen and seen <= warmed, seen - warmed


def test_last_step_warps_only_after_the_passes(monkeypatch):
    """``_ACROSS_LAST_STEP_WARPS`` reaches the last step after the passes across programs, not
    the chunk merges (their registry variants, traced with it at 16)."""
    from tilefuse.kernelcheck import variants

    monkeypatch.setattr(topk, "_ACROSS_LAST_STEP_WARPS", 16)
    names = [v.name for v in variants.topk_merge_variants()]
    assert [n for n in names if " w16" in n and "after-passes" not in n] == []
    assert any(" w16" in n for n in names)
