"""Indexer decode logits over a paged KV cache, against both references, with the contract's
rules: exact -inf masks, every element written (poisoned outputs), bitwise reruns whatever the
metadata, balanced metadata, bad inputs raise.

On CPU the kernel runs through Triton's interpreter at small shapes (B <= 4, contexts of a few
hundred keys); on a GPU the same checks run at the contract's decode shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tilefuse
import tilefuse.compat.deep_gemm as deep_gemm
from tilefuse import _jit
from tilefuse import formats as F
from tilefuse import reference as R
from tilefuse.indexer import _paged_kernel as kern
from tilefuse.indexer import paged

from ..conftest import DEVICE, ON_GPU

BF16_THRESHOLD = {"fp8": 1e-3, "mxfp8": 0.02, "mxfp4": 0.02}
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 3

pytestmark = pytest.mark.usefixtures("no_pending_errors")


class Case:
    """A decode batch: unquantised inputs, quantised op inputs, a shuffled paged cache."""

    def __init__(self, fmt="fp8", lens=(70, 0, 129, 200), next_n=2, h=8, d=64, block_kv=32, ctx_2d=False,
                 seed=0, weights_dtype=torch.float32, page_stride=None, extra_cols=5, num_sms=NUM_SMS,
                 num_blocks=None, table_width=None):
        g = torch.Generator().manual_seed(seed)  # lengths and page shuffles
        gd = torch.Generator(device=DEVICE).manual_seed(seed)  # tensors, made where they are used
        lens = torch.tensor(lens, dtype=torch.int32)
        b = lens.shape[0]
        s = max(1, int(lens.max()))
        self.fmt, self.next_n, self.block_kv = fmt, next_n, block_kv
        self.q = torch.randn(b, next_n, h, d, generator=gd, device=DEVICE).to(torch.bfloat16)
        self.k = torch.randn(b, s, d, generator=gd, device=DEVICE).to(torch.bfloat16)
        self.w = torch.randn(b * next_n, h, generator=gd, device=DEVICE).to(weights_dtype)
        if ctx_2d:
            # Per-row lengths at most the request's, some rows empty.
            ctx = (lens[:, None] * torch.rand(b, next_n, generator=g)).to(torch.int32)
            ctx[:, -1] = lens
            self.ctx = ctx
        else:
            self.ctx = lens
        pages = int(((lens.long() + block_kv - 1) // block_kv).sum())
        cache, table = paged.make_paged_kv_cache(self.k, lens, block_kv, fmt, num_blocks=num_blocks or pages + 2,
                                                 page_stride=page_stride, generator=g)
        if table_width is not None:  # a wider table, as an engine's fixed one
            table = torch.nn.functional.pad(table, (0, table_width - table.shape[1]))
        # Poison a spare page (NaN values and scales) and point every unused table entry at it:
        # a read past a request's length would leak NaN into the logits.
        used = set(table[lens.to(DEVICE) > 0].flatten().tolist()) if pages else set()
        spare = next(i for i in range(pages + 2) if i not in used)
        raw = cache.as_strided((cache.shape[0], cache.shape[1] * cache.shape[3]), (cache.stride(0), 1),
                               cache.storage_offset())
        raw[spare] = 0xFF
        npages = ((lens.long() + block_kv - 1) // block_kv).to(DEVICE)
        cols = torch.arange(table.shape[1], device=DEVICE)
        self.table = torch.where(cols[None, :] < npages[:, None], table, spare).to(torch.int32)
        self.cache = cache
        self.qq = tuple(None if t is None else t.to(DEVICE) for t in F.quantize_q(self.q, fmt))
        self.ctx = self.ctx.to(DEVICE)
        self.max_context_len = s + extra_cols
        self.meta = tilefuse.get_paged_mqa_logits_metadata(self.ctx, block_kv, num_sms)

    def run(self, clean=False, logits_dtype=torch.float32, meta=None, **kw):
        return tilefuse.fp8_fp4_paged_mqa_logits(self.qq, self.cache, self.w, self.ctx, self.table,
                                                 self.meta if meta is None else meta, self.max_context_len,
                                                 clean, logits_dtype, **kw)

    def check(self, out, clean, logits_dtype=torch.float32, own_out=True):
        """The §5 rules: both references, exact -inf masks, every element written (``own_out``:
        the op allocated ``out``, with its padded row stride)."""
        rows = self.q.shape[0] * self.next_n
        ref = R.fp8_fp4_paged_mqa_logits_ref(self.qq, self.cache, self.w, self.ctx, self.table,
                                             self.max_context_len)
        assert out.shape == (rows, self.max_context_len) and out.stride(1) == 1 and out.dtype == logits_dtype
        assert out.stride(0) >= self.max_context_len and (out.stride(0) % 16 == 0 or not own_out)
        inside = ~torch.isneginf(ref)
        assert torch.equal(inside, R.paged_valid_mask(self.ctx, self.next_n, self.max_context_len)), \
            "the reference's -inf differ from the windows"
        out32 = out.float()
        if clean:
            assert torch.equal(torch.isneginf(out32), ~inside), "-inf mask differs from the reference"
            assert not out32.isnan().any(), "an element was not written"
        else:
            assert not out32[inside].isnan().any(), "an in-window element was not written"
            out32 = torch.where(inside, out32, ref)
        bf16 = logits_dtype == torch.bfloat16 or self.w.dtype == torch.bfloat16
        diff = R.calc_diff(out32, ref)
        assert diff < (3e-5 if bf16 else 5e-6), f"diff {float(diff):.3g} against the reference"
        # Against unquantised inputs the error is quantisation noise, a statistic that needs a
        # sample: small cases check the tight bar only. Over a few thousand elements the exact
        # quantised reference itself passes the format's bar in some draws only (FP8 1e-3: 1-15%
        # of the contract sweep's small cases on CPU), so the bar is also that reference's own
        # distance, with room for the logits' rounding.
        if int(inside.sum()) * self.q.shape[2] >= 4096:
            unquant = R.paged_mqa_logits_ref(self.q, self.k, self.w, self.ctx, self.max_context_len)
            bar = max(BF16_THRESHOLD[self.fmt], 1.1 * float(R.calc_diff(ref, unquant)))
            diff = R.calc_diff(out32, unquant)
            assert diff < bar, f"diff {float(diff):.3g} against unquantised inputs, bar {bar:.3g}"


def shapes(cpu, gpu):
    return gpu if ON_GPU else cpu


# ---------------------------------------------------------------------------------------
# Formats, length modes, clean on/off
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("ctx_2d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
def test_formats_length_modes_and_clean(fmt, ctx_2d, clean, poisoned):
    # Lengths: not a multiple of the page, a zero-length request in the middle, one key past a page.
    lens = shapes((70, 0, 129, 200), (5000, 0, 8193, 12000))
    case = Case(fmt, lens=lens, next_n=2 if ctx_2d else 3, h=8, d=64, block_kv=64, ctx_2d=ctx_2d,
                seed=len(fmt) * 4 + 2 * ctx_2d + clean)
    case.check(case.run(clean=clean), clean)


@pytest.mark.parametrize("clean", [True, False])
def test_output_much_wider_than_the_contexts(clean, poisoned):
    """max_context_len as serving engines pass it (the model's longest context): most chunk
    programs find no keys and only write -inf (clean) or nothing."""
    case = Case("fp8", lens=shapes((70, 0, 129), (5000, 0, 8193)), next_n=2, h=8, d=64, block_kv=32,
                extra_cols=shapes(1500, 150000), seed=29)
    for cfg in (None, paged.PagedConfig(block_n=64, chunk=128)):
        case.check(case.run(clean=clean, config=cfg), clean)


def test_table_entries_past_the_length_are_never_used(poisoned):
    """Serving engines leave garbage (-1, stale ids) past each request's pages; the kernel reads
    a chunk's table entries ahead of the length but must never use one as a page."""
    case = Case("fp8", lens=shapes((70, 0, 129, 5), (5000, 0, 8193, 5)), next_n=2, h=8, d=64, block_kv=32,
                seed=23)
    npages = (case.ctx.long() + 31) // 32  # 1-D lengths
    cols = torch.arange(case.table.shape[1], device=DEVICE)
    for junk in (-1, 2**31 - 1):
        case.table = torch.where(cols[None, :] < npages[:, None], case.table, junk).to(torch.int32)
        case.check(case.run(clean=True), True)


# (block_kv, next_n, H, D, fmt): every page size (also 16, 48, 96), next_n 1..8, H in {4, 8, 32, 64},
# D in {32, 64, 128}.
SHAPES = [
    (32, 1, 64, 128, "fp8"),
    (64, 2, 64, 128, "fp8"),
    (128, 1, 32, 128, "fp8"),
    (32, 4, 4, 32, "fp8"),
    (64, 5, 8, 64, "fp8"),
    (128, 8, 8, 32, "fp8"),
    (16, 3, 8, 64, "fp8"),
    (48, 2, 8, 64, "fp8"),  # a page size that is not a power of two
    (96, 1, 4, 64, "mxfp4"),
    (64, 1, 64, 128, "mxfp8"),
    (32, 6, 4, 32, "mxfp8"),
    (128, 2, 32, 64, "mxfp4"),
    (64, 7, 4, 128, "mxfp4"),
]


@pytest.mark.parametrize("block_kv,next_n,h,d,fmt", SHAPES)
def test_page_sizes_next_n_heads_and_head_dims(block_kv, next_n, h, d, fmt, poisoned):
    lens = shapes((block_kv + 1, 3 * block_kv, 1), (8 * block_kv + 1, 4096, 1))
    case = Case(fmt, lens=lens, next_n=next_n, h=h, d=d, block_kv=block_kv, seed=block_kv + next_n + h + d)
    case.check(case.run(clean=True), True)


@pytest.mark.parametrize("ctx_2d", [False, True])
def test_length_edge_cases(ctx_2d, poisoned):
    """Lengths below next_n (1-D rows wholly masked), exact page multiples, one past a page,
    max_context_len equal to the longest length, and a single request."""
    case = Case("fp8", lens=(1, 64, 65, 0), next_n=4, block_kv=64, ctx_2d=ctx_2d, extra_cols=0, seed=3)
    case.check(case.run(clean=True), True)
    one = Case("mxfp4", lens=(97,), next_n=1, block_kv=32, ctx_2d=ctx_2d, seed=4)
    one.check(one.run(clean=True), True)


@pytest.mark.parametrize("clean", [True, False])
def test_all_zero_lengths(clean, poisoned):
    case = Case("fp8", lens=(0, 0, 0), next_n=2, block_kv=32, seed=5)
    assert (case.meta == torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)).all()
    out = case.run(clean=clean)
    assert out.shape == (6, case.max_context_len)
    if clean:
        assert torch.isneginf(out).all()


def test_empty_batch_and_zero_columns():
    case = Case("fp8", lens=(50, 20), next_n=1, block_kv=32, seed=20)
    zero = torch.zeros_like(case.ctx)
    meta = tilefuse.get_paged_mqa_logits_metadata(zero, 32, 3)
    out = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, zero, case.table, meta, 0, True)
    assert out.shape == (2, 0)
    empty = tilefuse.get_paged_mqa_logits_metadata(case.ctx[:0], 32, 3)
    out = tilefuse.fp8_fp4_paged_mqa_logits((case.qq[0][:0], None), case.cache, case.w[:0], case.ctx[:0],
                                            case.table[:0], empty, 10, True)
    assert out.shape == (0, 10)


def test_padded_page_stride_and_offset_view(poisoned):
    """Pages padded to a larger stride, and a cache that is a view at an offset into a buffer."""
    case = Case("mxfp8", lens=(100, 33, 64), next_n=2, block_kv=32, page_stride=32 * 68 + 60, seed=6)
    case.check(case.run(clean=True), True)
    big = torch.full((case.cache.untyped_storage().nbytes() + 1024,), 0xFF, dtype=torch.uint8, device=DEVICE)
    c = case.cache
    inner = big.as_strided(c.shape, c.stride(), 512)
    inner.copy_(c)
    case.cache = inner
    case.check(case.run(clean=True), True)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_weight_and_logit_dtypes(fmt, weights_dtype, logits_dtype, poisoned):
    lens = shapes((150, 90), (9000, 7000))
    case = Case(fmt, lens=lens, next_n=2, h=32, d=64, block_kv=64, weights_dtype=weights_dtype, seed=7)
    case.check(case.run(clean=True, logits_dtype=logits_dtype), True, logits_dtype)


def test_varlen_indices(poisoned):
    """Varlen batch: one row per token (next_n = 1), tokens of one request sharing its pages."""
    base = Case("fp8", lens=(120, 0, 75), next_n=1, block_kv=32, seed=8)
    # Request 0 has 3 tokens, request 1 one, request 2 two: each token is a row with its own
    # length and a copy of its request's block-table row.
    req = torch.tensor([0, 0, 0, 1, 2, 2])
    lens = torch.tensor([118, 119, 120, 0, 74, 75], dtype=torch.int32, device=DEVICE)
    indices = req.to(torch.int32).to(DEVICE)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(6, 1, 8, 64, generator=g).to(torch.bfloat16)
    qq = tuple(None if t is None else t.to(DEVICE) for t in F.quantize_q(q, "fp8"))
    w = torch.randn(6, 8, generator=g).to(DEVICE)
    table = base.table[req.to(DEVICE)]
    meta = tilefuse.get_paged_mqa_logits_metadata(lens, 32, NUM_SMS, indices=indices)
    mcl = base.max_context_len
    out = tilefuse.fp8_paged_mqa_logits(qq[0], base.cache, w, lens, table, meta, mcl, True, indices)
    plain = tilefuse.fp8_paged_mqa_logits(qq[0], base.cache, w, lens, table, meta, mcl, True)
    assert torch.equal(out.view(torch.int32), plain.view(torch.int32))
    ref = R.fp8_fp4_paged_mqa_logits_ref(qq, base.cache, w, lens, table, mcl, indices=indices)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    assert R.calc_diff(out, ref) < 5e-6
    unquant = R.paged_mqa_logits_ref(q.to(DEVICE), base.k[req.to(DEVICE)], w, lens, mcl)
    assert R.calc_diff(out, unquant) < 1e-3


# ---------------------------------------------------------------------------------------
# Determinism and the schedule
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_bitwise_reruns_whatever_the_metadata(fmt):
    lens = shapes((200, 0, 33, 150), (30000, 0, 65, 60000, 8192, 1))
    case = Case(fmt, lens=lens, next_n=2, h=8 if not ON_GPU else 64, d=64 if not ON_GPU else 128, block_kv=32,
                seed=10)
    first = case.run(clean=True)
    counts = [1, 2, 5, 64] if not ON_GPU else [1, 7, NUM_SMS, 2 * NUM_SMS, 1000]
    configs = [None, paged.PagedConfig(rows=1), paged.PagedConfig(rows=1, block_n=64, chunk=64),
               paged.PagedConfig(rows=1, chunk=256, num_stages=2), paged.PagedConfig(rows=1, chunk=2048)]
    reruns = 20 if ON_GPU else 3
    for i in range(reruns):
        n = counts[i % len(counts)]
        meta = tilefuse.get_paged_mqa_logits_metadata(case.ctx, 32, n)
        again = case.run(clean=True, meta=meta)
        assert torch.equal(first.view(torch.int32), again.view(torch.int32)), f"rerun {i} (num_sms={n}) differs"
    # Neither do the chunk size and 64- or 128-key tiles (both wgmma on sm_90); rows changes the dot.
    base = case.run(clean=True, config=configs[1])
    for cfg in configs[2:]:
        assert torch.equal(base.view(torch.int32), case.run(clean=True, config=cfg).view(torch.int32)), cfg


@pytest.mark.parametrize("fmt,next_n,h,clean,ctx_2d", [("fp8", 1, 64, True, False), ("fp8", 3, 32, False, True),
                                                        ("mxfp4", 2, 8, True, True), ("mxfp8", 4, 16, True, False)])
def test_head_sum_on_the_tensor_cores(fmt, next_n, h, clean, ctx_2d, poisoned):
    """The option that runs the weighted head sum as a tf32 dot: same contract."""
    case = Case(fmt, lens=(70, 0, 129), next_n=next_n, h=h, d=64, block_kv=32, ctx_2d=ctx_2d, seed=40 + next_n)
    base = paged.resolve_paged_config(fmt, next_n, h, 64, 32)
    for cfg in (paged.PagedConfig(**{**base.__dict__, "head_sum_mma": True}),
                paged.PagedConfig(block_n=64, rows=1, chunk=64, head_sum_mma=True)):
        case.check(case.run(clean=clean, config=cfg), clean)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_query_strides_not_multiples_of_16(fmt):
    """Queries in a padded buffer (strides not multiples of 16) take the unit-stride query
    loads and give the contiguous queries' bits."""
    case = Case(fmt, lens=(70, 0, 129), next_n=2, h=8, d=64, block_kv=32, seed=52)
    want = case.run(clean=True)  # every element defined, so the two compare whole
    values, sf = case.qq
    padded = torch.zeros(*values.shape[:3], values.shape[3] + 4, dtype=values.dtype, device=values.device)
    padded[..., :values.shape[3]] = values
    strided = padded[..., :values.shape[3]]
    assert strided.stride(2) % 16
    got = tilefuse.fp8_fp4_paged_mqa_logits((strided, sf), case.cache, case.w, case.ctx, case.table, case.meta,
                                            case.max_context_len, True)
    case.check(got, True)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))


# ---------------------------------------------------------------------------------------
# TMA key loads (PagedConfig(tma=True)): the gather path's bits, or the gather itself
# ---------------------------------------------------------------------------------------
@pytest.fixture
def tma_launches(monkeypatch):
    """The ``TMA`` constant of every launch of the decode kernel (which still runs)."""
    seen = []
    real = kern.paged_logits_kernel
    at = real.arg_names.index("TMA")

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(args[at] if len(args) > at else kwargs["TMA"])
                return real[grid](*args, **kwargs)
            return launch

    with _jit.redirected(real, Spy()):  # the op launches through tilefuse._jit.Launcher
        yield seen


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _tma_and_gather(case, cfg, clean, logits_dtype=torch.float32, **kw):
    gather = case.run(clean=clean, logits_dtype=logits_dtype, config=dataclasses.replace(cfg, tma=False), **kw)
    tma = case.run(clean=clean, logits_dtype=logits_dtype, config=dataclasses.replace(cfg, tma=True), **kw)
    return gather, tma


# (fmt, block_kv, next_n, H, D, block_n (0: the default), chunk (0: per call), clean, 2-D lengths,
#  logits dtype, indices, page padding in bytes (a multiple of the value bytes: TMA still applies)).
# Every format, page size 32/64/128, next_n 1/2/4, H 16/64, D 64/128 and both flags appear;
# tiles of two pages (128 keys on 64-token pages), of one page and of half a page; chunks of
# several tiles starting past a request's first page.
F32, BF16 = torch.float32, torch.bfloat16
TMA_CASES = [
    ("fp8", 64, 1, 64, 128, 0, 0, False, False, F32, False, 0),
    ("fp8", 64, 2, 64, 128, 0, 128, True, True, F32, False, 0),
    ("fp8", 64, 1, 16, 64, 128, 256, True, False, BF16, True, 64),
    ("fp8", 128, 4, 16, 64, 64, 0, False, True, F32, False, 0),
    ("fp8", 128, 1, 16, 128, 128, 0, True, False, F32, False, 0),
    ("fp8", 32, 2, 16, 64, 32, 64, True, False, F32, False, 0),
    ("mxfp8", 64, 1, 16, 128, 0, 128, True, True, F32, False, 0),
    ("mxfp8", 128, 2, 64, 64, 0, 0, False, False, BF16, False, 128),
    ("mxfp8", 32, 4, 16, 128, 32, 0, True, True, F32, False, 0),
    ("mxfp4", 64, 2, 16, 128, 0, 0, True, False, F32, False, 0),
    ("mxfp4", 128, 1, 64, 64, 128, 0, False, True, BF16, False, 0),
    ("mxfp4", 32, 1, 16, 64, 32, 64, True, False, F32, True, 0),
]


@pytest.mark.parametrize("fmt,block_kv,next_n,h,d,block_n,chunk,clean,ctx_2d,logits_dtype,indices,pad", TMA_CASES)
def test_tma_key_loads_give_the_gather_bits(fmt, block_kv, next_n, h, d, block_n, chunk, clean, ctx_2d,
                                            logits_dtype, indices, pad, poisoned, tma_launches):
    """Every element of the poisoned output, written or not, has the gather path's bits."""
    lens = (2 * block_kv + 5, 0, block_kv - 3, 3 * block_kv + 1)
    width = paged.paged_kv_cache_width(d, fmt)
    case = Case(fmt, lens=lens, next_n=next_n, h=h, d=d, block_kv=block_kv, ctx_2d=ctx_2d,
                page_stride=block_kv * width + pad if pad else None, seed=block_kv + 7 * next_n + h + d,
                weights_dtype=BF16 if logits_dtype == BF16 else F32)
    base = paged.resolve_paged_config(fmt, next_n, h, d, block_kv)
    cfg = dataclasses.replace(base, block_n=block_n or base.block_n, chunk=chunk)
    idx = torch.arange(len(lens), dtype=torch.int32, device=DEVICE) if indices else None
    gather, tma = _tma_and_gather(case, cfg, clean, logits_dtype, indices=idx)
    assert tma_launches == [False, True]
    assert torch.equal(_bits(gather), _bits(tma))
    case.check(tma, clean, logits_dtype)


@pytest.mark.parametrize("why", ["page stride", "offset", "page size", "box past 256"])
def test_tma_falls_back_to_the_gather_where_the_layout_does_not_allow_it(why, poisoned, tma_launches):
    """A page stride that is not a multiple of the value bytes, a cache view at an offset that
    is not a multiple of 16 bytes, 32-token pages under 64-key tiles (boxes too small for a
    wgmma), 512-key tiles (a TMA box holds at most 256 rows): the gather runs, same bits."""
    block_kv, block_n = {"page size": (32, 64), "box past 256": (512, 512)}.get(why, (64, 64))
    width = paged.paged_kv_cache_width(64, "fp8")
    case = Case("fp8", lens=(block_kv + 9, 0, 2 * block_kv + 1), next_n=2, h=16, d=64, block_kv=block_kv,
                page_stride=block_kv * width + 16 if why == "page stride" else None, seed=61)
    if why == "offset":
        c = case.cache
        big = torch.full((c.untyped_storage().nbytes() + 64,), 0xFF, dtype=torch.uint8, device=DEVICE)
        inner = big.as_strided(c.shape, c.stride(), 4)
        inner.copy_(c)
        case.cache = inner
    cfg = paged.PagedConfig(block_n=block_n, rows=2, chunk=0)
    gather, tma = _tma_and_gather(case, cfg, True)
    assert tma_launches == [False, False]
    assert torch.equal(_bits(gather), _bits(tma))
    case.check(tma, True)


def test_tma_is_selectable_by_the_config_override(poisoned, tma_launches):
    case = Case("mxfp4", lens=(70, 0, 129), next_n=2, h=16, d=64, block_kv=64, seed=62)
    gather = case.run(clean=True)
    with tilefuse.config_override("paged", tma=True):
        tma = case.run(clean=True)
    assert tma_launches == [False, True]
    assert torch.equal(_bits(gather), _bits(tma))


def test_tma_bad_page_ids_read_nothing_and_score_nan():
    """As the gather path: NaN for the keys of bad pages (negative, huge, one past the cache),
    the same bits elsewhere, the error recorded."""
    case = Case("fp8", lens=(130, 200), next_n=1, h=16, d=64, block_kv=64, seed=63)
    table = case.table.clone()
    table[0, 1] = -5
    table[1, 0] = case.cache.shape[0]
    table[1, 2] = 2**31 - 1
    outs = []
    for tma in (False, True):
        outs.append(tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, case.ctx, table, case.meta,
                                                      case.max_context_len, True,
                                                      config=paged.PagedConfig(block_n=128, tma=tma)))
        with pytest.raises(tilefuse.DeviceValueError, match="block_table: page id .* is outside"):
            tilefuse.check_errors()
    gather, tma = outs
    assert torch.equal(_bits(gather), _bits(tma))
    assert tma[0, 64:128].isnan().all() and tma[1, :64].isnan().all() and tma[1, 128:192].isnan().all()
    assert not tma[0, :64].isnan().any() and not tma[1, 64:128].isnan().any() and not tma[1, 192:200].isnan().any()


def _worker_pages(meta: torch.Tensor, pages: torch.Tensor) -> list[int]:
    """Pages each worker covers, walking its [start, end) range in (request, page) order."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(pages, 0)])
    linear = [int(starts[b]) + int(p) if b < len(pages) else int(starts[-1]) for b, p in meta.tolist()]
    return [linear[w + 1] - linear[w] for w in range(len(linear) - 1)]


@pytest.mark.parametrize("ctx_2d", [False, True])
def test_metadata_balance_and_zero_lengths(ctx_2d):
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(0, 3000, (37,), generator=g).to(torch.int32)
    lens[[0, 5, 6, 36]] = 0
    ctx = torch.stack([lens // 2, lens], 1) if ctx_2d else lens
    for block_kv in (32, 64, 128):
        pages = (lens.long() + block_kv - 1) // block_kv
        for num_sms in (1, 7, 132, 2000):
            meta = tilefuse.get_paged_mqa_logits_metadata(ctx.to(DEVICE), block_kv, num_sms).cpu()
            assert meta.dtype == torch.int32 and meta.shape == (num_sms + 1, 2)
            # Empty requests hold no pages, so the first worker starts at request 1.
            assert meta[0].tolist() == [1, 0] and meta[-1].tolist() == [37, 0]
            work = _worker_pages(meta, pages)
            assert sum(work) == int(pages.sum())
            assert max(work) - min(work) <= 1, "unbalanced"
            for (b, p), n in zip(meta[:-1].tolist(), work):  # every busy worker starts on a real page
                assert n == 0 or (b < 37 and 0 <= p < int(pages[b]))


@pytest.mark.parametrize("ctx_2d", [False, True])
def test_metadata_batch_changing_every_call(ctx_2d):
    """One launch per layout serves every batch size: each call's split is the torch one's."""
    g = torch.Generator().manual_seed(12)
    for b in (5, 37, 1, 12, 37, 2, 0, 300, 5):  # (300: past one block of the kernel)
        lens = torch.randint(0, 900, (b,), generator=g).to(torch.int32)
        ctx = (torch.stack([lens // 3, lens], 1) if ctx_2d else lens).to(DEVICE)
        meta = tilefuse.get_paged_mqa_logits_metadata(ctx, 64, 7)
        assert torch.equal(meta.cpu(), paged._schedule(ctx, 64, 7).cpu()), b


def test_metadata_empty_and_all_zero_batches():
    assert tilefuse.get_paged_mqa_logits_metadata(torch.zeros(0, dtype=torch.int32, device=DEVICE), 64, 4).tolist() \
        == [[0, 0]] * 5
    for lens in (torch.zeros(5, dtype=torch.int32), torch.zeros(4, 3, dtype=torch.int32)):
        meta = tilefuse.get_paged_mqa_logits_metadata(lens.to(DEVICE), 64, 4)
        assert meta.tolist() == [[lens.shape[0], 0]] * 5
    # One request, more workers than pages: trailing workers get empty ranges.
    meta = tilefuse.get_paged_mqa_logits_metadata(torch.tensor([100], dtype=torch.int32, device=DEVICE), 64, 4)
    assert meta.tolist() == [[0, 0], [0, 0], [0, 1], [0, 1], [1, 0]]


def test_metadata_traces_and_depends_only_on_arguments():
    lens = torch.tensor([5, 300, 0, 77], dtype=torch.int32, device=DEVICE)
    a = tilefuse.get_paged_mqa_logits_metadata(lens, 32, 6)
    b = deep_gemm.get_paged_mqa_logits_metadata(lens.clone(), 32, 6)
    assert torch.equal(a, b)
    compiled = torch.compile(tilefuse.get_paged_mqa_logits_metadata, fullgraph=True, backend="eager")
    assert torch.equal(compiled(lens, 32, 6), a)


# ---------------------------------------------------------------------------------------
# Cache helpers
# ---------------------------------------------------------------------------------------
def test_fp8_cache_bytes_follow_the_fused_page_layout():
    """The page is [block_kv, D] E4M3 values, then block_kv fp32 scales (DeepGEMM's layout)."""
    g = torch.Generator().manual_seed(12)
    nb, bkv, d = 3, 32, 64
    keys = torch.randn(nb * bkv, d, generator=g).to(torch.bfloat16)
    cache = paged.new_paged_kv_cache(nb, bkv, d, "fp8")
    paged.write_paged_kv_cache(cache, keys, torch.arange(nb * bkv), "fp8")
    values, scale = F.quantize_fp8_rows(keys)
    expect = torch.cat([values.view(torch.uint8).view(nb, bkv * d), scale.view(torch.uint8).view(nb, bkv * 4)], 1)
    assert torch.equal(cache.reshape(nb, -1), expect)
    assert cache.shape == (nb, bkv, 1, d + 4) and cache.stride() == (bkv * (d + 4), d + 4, d + 4, 1)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_cache_bytes_and_scattered_slots(fmt):
    g = torch.Generator().manual_seed(13)
    nb, bkv, d = 4, 16, 128
    keys = torch.randn(10, d, generator=g)
    slots = torch.randperm(nb * bkv, generator=g)[:10]
    cache = paged.new_paged_kv_cache(nb, bkv, d, fmt, page_stride=bkv * paged.paged_kv_cache_width(d, fmt) + 16)
    paged.write_paged_kv_cache(cache, keys, slots, fmt)
    values, sf = F.quantize_k(keys, fmt)
    vb = d // 2 if fmt == "mxfp4" else d
    for i, slot in enumerate(slots.tolist()):
        page = cache.as_strided((cache.stride(0),), (1,), cache.storage_offset() + (slot // bkv) * cache.stride(0))
        off = slot % bkv
        assert torch.equal(page[off * vb:(off + 1) * vb], values[i].view(torch.uint8))
        at = bkv * vb + 4 * off
        assert torch.equal(page[at:at + 4], sf[i:i + 1].view(torch.uint8))
    got_v, got_s = R.gather_paged_keys(cache, torch.tensor([[0, 1, 2, 3]]), nb * bkv, 0, fmt, d)
    assert torch.equal(got_v[slots].view(torch.uint8), values.view(torch.uint8)) and torch.equal(got_s[slots], sf)


def test_cache_helpers_reject_bad_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        paged.new_paged_kv_cache(2, 32, 48)
    with pytest.raises(ValueError, match="page_stride"):
        paged.new_paged_kv_cache(2, 32, 64, page_stride=100)
    cache = paged.new_paged_kv_cache(2, 32, 64, "fp8")
    with pytest.raises(ValueError, match="kv_cache"):  # an FP8-width cache written as MXFP4
        paged.write_paged_kv_cache(cache, torch.randn(3, 64), torch.arange(3), "mxfp4")
    with pytest.raises(ValueError, match="slot_mapping"):
        paged.write_paged_kv_cache(cache, torch.randn(3, 64), torch.tensor([0, 1, 64]))
    with pytest.raises(ValueError, match="context_lens"):
        paged.make_paged_kv_cache(torch.randn(2, 10, 64), torch.tensor([3, 11]), 32)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_make_paged_kv_cache_writes_in_slices(monkeypatch, fmt):
    # Long batches are quantised a slice of tokens at a time: slices that split pages and requests
    # give the same bytes and table as one write.
    keys, lens = torch.randn(3, 50, 64), torch.tensor([50, 0, 37])
    whole = paged.make_paged_kv_cache(keys, lens, 16, fmt, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(paged, "_FILL_CHUNK_TOKENS", 7)
    sliced = paged.make_paged_kv_cache(keys, lens, 16, fmt, generator=torch.Generator().manual_seed(3))
    assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])
    assert whole[0].any()


# ---------------------------------------------------------------------------------------
# Plumbing: DeepGEMM names, the custom op, torch.compile, the kernel really runs
# ---------------------------------------------------------------------------------------
def test_fp8_paged_signature_and_compat_module():
    case = Case("fp8", lens=(40, 90), next_n=2, block_kv=32, seed=14)
    a = deep_gemm.fp8_paged_mqa_logits(case.qq[0], case.cache, case.w, case.ctx, case.table, case.meta,
                                       case.max_context_len, True)
    b = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, case.ctx, case.table, case.meta,
                                          case.max_context_len, True, torch.float32, None)
    assert torch.equal(a, b)
    assert deep_gemm.fp8_fp4_paged_mqa_logits is tilefuse.fp8_fp4_paged_mqa_logits


def test_ops_run_the_triton_kernel(record_launches):
    """On CPU tensors the op goes through the Triton kernel (interpreter), not the reference."""
    launched = record_launches(kern, "paged_logits_kernel")
    case = Case("fp8", lens=(40, 90), next_n=3, h=64, block_kv=32, seed=15, num_sms=5)
    case.run(config=paged.PagedConfig(rows=2, block_n=64, chunk=64))
    # row groups x requests x chunks of max_context_len
    assert launched == [(2 * 2 * ((case.max_context_len + 63) // 64),)]


def test_custom_op_fake_and_torch_compile():
    case = Case("mxfp4", lens=(40, 90), next_n=2, block_kv=32, seed=16)
    real = case.run(clean=True, logits_dtype=torch.bfloat16)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = [mode.from_tensor(t) for t in (case.qq[0], case.qq[1], case.cache, case.w, case.ctx, case.table,
                                              case.meta)]
        out = mode.from_tensor(torch.empty_like(real))
        assert torch.ops.tilefuse.paged_mqa_logits(*args, None, out, case.max_context_len, True,
                                                   [64, 1, 0, 4, 3, 1024, 0]) is None

    def decode(qv, qs, cache, w, ctx, table, out):
        meta = tilefuse.get_paged_mqa_logits_metadata(ctx, 32, 3)
        return tilefuse.fp8_fp4_paged_mqa_logits((qv, qs), cache, w, ctx, table, meta, case.max_context_len,
                                                 True, torch.bfloat16, out=out)

    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    for out in (None, torch.full_like(real, float("nan"))):
        got = compiled(case.qq[0], case.qq[1], case.cache, case.w, case.ctx, case.table, out)
        assert torch.equal(got.view(torch.int16), real.view(torch.int16))
        assert out is None or got.data_ptr() == out.data_ptr()


def test_custom_op_takes_the_config_as_its_fields_in_order():
    """Under torch.compile the op gets ``dataclasses.astuple(config)`` as its last argument."""
    import dataclasses

    case = Case("fp8", lens=(40, 90), next_n=2, block_kv=32, seed=30)
    cfg = paged.PagedConfig(block_n=64, rows=1, chunk=64, num_warps=4, num_stages=2, block_fill=16)
    want = case.run(clean=True, config=cfg)
    out = torch.full_like(want, float("nan"))
    torch.ops.tilefuse.paged_mqa_logits(case.qq[0], None, case.cache, case.w, case.ctx, case.table, case.meta, None,
                                        out, case.max_context_len, True, [int(v) for v in dataclasses.astuple(cfg)])
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert torch.ops.tilefuse.paged_mqa_logits.default._schema.arguments[-1].name == "config"


# ---------------------------------------------------------------------------------------
# Bad inputs: a clear error naming the argument, never a wrong answer.
# ---------------------------------------------------------------------------------------
def _args(case):
    return dict(q=case.qq, kv_cache=case.cache, weights=case.w, context_lens=case.ctx, block_table=case.table,
                schedule_meta=case.meta, max_context_len=case.max_context_len)


def _bad_cases():
    return {
        "q-not-tuple": (TypeError, "q:", dict(q=lambda q: q[0])),
        "q-dtype": (TypeError, "q:", dict(q=lambda q: (q[0].float(), q[1]))),
        "q-fp4-without-scales": (TypeError, "q:", dict(q=lambda q: (q[0].view(torch.int8), None))),
        "q-heads": (ValueError, "head count", dict(q=lambda q: (q[0][:, :, :3].contiguous(), q[1]))),
        "q-head-dim": (ValueError, "head dim", dict(q=lambda q: (q[0][..., :48].contiguous(), q[1]))),
        "q-3d": (ValueError, "q:", dict(q=lambda q: (q[0][:, 0], q[1]))),
        "cache-width": (ValueError, "kv_cache: last dim", dict(kv_cache=lambda c: c[..., :-1])),
        "cache-dtype": (TypeError, "kv_cache", dict(kv_cache=lambda c: c.view(torch.int8))),
        "cache-rank": (ValueError, "kv_cache", dict(kv_cache=lambda c: c[:, :, 0])),
        "weights-rows": (ValueError, "weights", dict(weights=lambda w: w[:-1])),
        "weights-dtype": (TypeError, "weights", dict(weights=lambda w: w.half())),
        "weights-stride": (ValueError, "weights", dict(weights=lambda w: w.t().contiguous().t())),
        "ctx-next-n": (ValueError, "next_n", dict(context_lens=lambda c: torch.stack([c, c, c], 1))),
        "ctx-dtype": (TypeError, "context_lens", dict(context_lens=lambda c: c.long())),
        "ctx-batch": (ValueError, "context_lens", dict(context_lens=lambda c: c[:1])),
        "table-dtype": (TypeError, "block_table", dict(block_table=lambda t: t.long())),
        "meta-shape": (ValueError, "schedule_meta", dict(schedule_meta=lambda m: m[:, :1])),
        "meta-dtype": (ValueError, "schedule_meta", dict(schedule_meta=lambda m: m.long())),
        "max-context-len": (ValueError, "max_context_len", dict(max_context_len=lambda n: -1)),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_inputs_raise(name):
    case = Case("fp8", lens=(60, 100), next_n=2, block_kv=32, seed=17)
    exc, text, changes = _bad_cases()[name]
    args = _args(case)
    for key, fn in changes.items():
        args[key] = fn(args[key])
    with pytest.raises(exc, match=text.replace("[", r"\[")):
        tilefuse.fp8_fp4_paged_mqa_logits(**args)


def test_bad_modes_raise():
    case = Case("mxfp8", lens=(60, 100), next_n=1, block_kv=32, seed=18)
    args = _args(case)
    with pytest.raises(TypeError, match="logits_dtype"):
        tilefuse.fp8_fp4_paged_mqa_logits(**args, logits_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"q\[1\]"):
        tilefuse.fp8_fp4_paged_mqa_logits(**{**args, "q": (case.qq[0], case.qq[1].float())})
    with pytest.raises(ValueError, match="indices"):
        tilefuse.fp8_fp4_paged_mqa_logits(**args, indices=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    two = Case("fp8", lens=(60, 100), next_n=2, block_kv=32, ctx_2d=True, seed=18)
    with pytest.raises(ValueError, match="next_n == 1"):
        tilefuse.get_paged_mqa_logits_metadata(two.ctx, 32, 4, indices=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_sms"):
        tilefuse.get_paged_mqa_logits_metadata(two.ctx, 32, 0)
    with pytest.raises(ValueError, match="unknown field"):
        tilefuse.set_config_override("paged", block_z=3)


# Bad values: found on the device (raised at the next call or by check_errors, no host sync), or
# on the host at once in the checked mode; never a read out of bounds.
BAD_VALUES = {
    "ctx-negative": ("context_lens: lengths must be >= 0", "context_lens: lengths must be >= 0 .request 0.",
                     dict(context_lens=lambda c: c - torch.tensor([100, 0], dtype=torch.int32, device=c.device))),
    "ctx-too-long": ("a length exceeds max_context_len", "max_context_len: smaller than the context of request",
                     dict(context_lens=lambda c: c + 50)),
    "table-too-short": ("block_table: too short", "longer than its block_table row holds",
                        dict(block_table=lambda t: t[:, :1])),
    "table-page-ids": ("block_table: a page id", "block_table: page id 1[0-9][0-9] is outside",
                       dict(block_table=lambda t: t + 100)),
    "table-huge-page-id": ("block_table: a page id", "block_table: page id 10000000",
                           dict(block_table=lambda t: torch.full_like(t, 10_000_000))),
    "meta-stale": ("schedule_meta: does not match", None, dict(schedule_meta=lambda m: m.flip(0))),
}


@pytest.fixture
def checked():
    with tilefuse.checked_mode():
        yield


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_values_raise_in_checked_mode(name, checked):
    case = Case("fp8", lens=(60, 100), next_n=2, block_kv=32, seed=17)
    text, _, changes = BAD_VALUES[name]
    args = _args(case)
    for key, fn in changes.items():
        args[key] = fn(args[key])
    with pytest.raises(ValueError, match=text):
        tilefuse.fp8_fp4_paged_mqa_logits(**args)


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_values_are_found_on_the_device(name):
    """Default mode: the call returns (no host sync); the error is raised by check_errors and,
    on CPU where the record is host memory, at the next call; in bounds whatever the values."""
    from .bounds import checked_bounds

    case = Case("fp8", lens=(60, 100), next_n=2, block_kv=32, seed=17)
    _, text, changes = BAD_VALUES[name]
    args = _args(case)
    for key, fn in changes.items():
        args[key] = fn(args[key])
    if ON_GPU:  # the bounds checker wraps the interpreter; on the GPU the sweep and the fault test cover bounds
        tilefuse.fp8_fp4_paged_mqa_logits(**args, clean_logits=True)
    else:
        with checked_bounds() as state:
            tilefuse.fp8_fp4_paged_mqa_logits(**args, clean_logits=True)
        assert state.accesses > 0
    if text is None:  # metadata is checked by shape only on this path
        tilefuse.check_errors()
        return
    if not ON_GPU:
        with pytest.raises(tilefuse.DeviceValueError, match=text):
            case.run()
        case.run()  # raised once, then cleared
    else:
        with pytest.raises(tilefuse.DeviceValueError, match=text):
            tilefuse.check_errors()
    tilefuse.check_errors()


def test_unchecked_missing_pages_read_as_nan():
    """A length past the block table gives NaN logits for the keys without a page and correct
    ones elsewhere (never an out-of-bounds read), and the error is reported."""
    case = Case("fp8", lens=(60, 100), next_n=1, block_kv=32, seed=19)
    short = case.table[:, :2].contiguous()
    out = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, case.ctx, short, case.meta,
                                            case.max_context_len, True)
    with pytest.raises(tilefuse.DeviceValueError, match="request 1 is longer than its block_table row"):
        tilefuse.check_errors()
    full = case.run(clean=True)
    assert out[1, 64:100].isnan().all()
    assert torch.equal(out[:, :64], full[:, :64]) and torch.equal(out[0], full[0])


def test_bad_page_ids_read_nothing_and_score_nan():
    """Page ids outside the cache (negative, huge) on some pages: those keys score NaN, the
    others are exact, and the error names a bad id."""
    case = Case("fp8", lens=(60, 100), next_n=1, block_kv=32, seed=21)
    good = case.run(clean=True)
    table = case.table.clone()
    table[0, 1] = -5
    table[1, 2] = 10_000_000
    out = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, case.ctx, table, case.meta,
                                            case.max_context_len, True)
    with pytest.raises(tilefuse.DeviceValueError, match="block_table: page id (-5|10000000) is outside"):
        tilefuse.check_errors()
    assert out[0, 32:60].isnan().all() and out[1, 64:96].isnan().all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, 32:64] = False
    keep[1, 64:96] = False
    assert torch.equal(out[keep].view(torch.int32), good[keep].view(torch.int32))


def test_bad_request_ids_in_indices():
    base = Case("fp8", lens=(120, 0, 75), next_n=1, block_kv=32, seed=8)
    indices = torch.tensor([0, 3, 1], dtype=torch.int32, device=DEVICE)
    tilefuse.fp8_fp4_paged_mqa_logits(base.qq, base.cache, base.w, base.ctx, base.table, base.meta,
                                      base.max_context_len, True, indices=indices)
    with pytest.raises(tilefuse.DeviceValueError, match="indices: request id 3 is outside the batch"):
        tilefuse.check_errors()
    with tilefuse.checked_mode(), pytest.raises(ValueError, match="indices: a request id"):
        tilefuse.fp8_fp4_paged_mqa_logits(base.qq, base.cache, base.w, base.ctx, base.table, base.meta,
                                          base.max_context_len, True, indices=indices)


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    case = Case("fp8", lens=(40, 90), next_n=1, block_kv=32, seed=22)
    if ON_GPU:
        pytest.skip("CPU tensors are checked where the tests run on CPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    paged._plans.clear()
    with pytest.raises(ValueError, match="q: tilefuse kernels need a CUDA tensor"):
        case.run()
    with pytest.raises(ValueError, match="context_lens: tilefuse kernels need a CUDA tensor"):
        tilefuse.get_paged_mqa_logits_metadata(case.ctx, 32, 3)


# ---------------------------------------------------------------------------------------
# out=: a caller-owned buffer
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_out_buffer_is_written_and_reused(logits_dtype):
    case = Case("fp8", lens=(70, 0, 129), next_n=2, block_kv=32, seed=24)
    rows = 3 * 2
    # A wider row stride than the op's own, poisoned, reused for two different batches' worth.
    buf = torch.full((rows, case.max_context_len + 40), float("nan"), dtype=logits_dtype, device=DEVICE)
    out = buf[:, 3:3 + case.max_context_len]
    for clean in (True, False):
        got = case.run(clean=clean, logits_dtype=logits_dtype, out=out)
        assert got is out
        case.check(got, clean, logits_dtype, own_out=False)
    assert buf[:, :3].isnan().all() and buf[:, 3 + case.max_context_len:].isnan().all(), "wrote outside out"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_one_layout_with_new_tensors_every_call(fmt):
    """Calls of one argument layout reuse its plan and, on a GPU, its partial launch: each
    call's own tensors (queries, cache, weights, lengths, table, output) are the ones read and
    written, in any order of calls."""
    cases = [Case(fmt, lens=(70, 0, 129), next_n=2, block_kv=32, seed=40 + i) for i in range(3)]
    outs = [torch.full((6, cases[0].max_context_len), float("nan"), device=DEVICE) for _ in range(2)]
    for step, i in enumerate((0, 1, 2, 0, 2, 1, 1, 0)):
        own = step % 3 == 0
        got = cases[i].run(clean=True) if own else cases[i].run(clean=True, out=outs[step % 2])
        cases[i].check(got, True, own_out=own)


def test_batch_size_and_width_changing_every_call():
    """A decode loop past its captured batch sizes: the batch and max_context_len change every
    call, the cache, table width and dtypes stay. One plan serves every batch of a size class
    (0, 1, more) and its partial launch takes the sizes and grid per call; every call is
    checked against the reference."""
    specs = [(70, 0, 129), (200, 31), (5, 64, 300, 1), (129,), (300, 299, 0, 12), (33, 1)]
    cases = [Case("fp8", lens=lens, next_n=1, block_kv=32, seed=60 + i, num_blocks=40, table_width=12,
                  extra_cols=7 * i) for i, lens in enumerate(specs)]
    before = set(paged._plans)
    for case in cases + cases[::-1]:
        case.check(case.run(clean=True), True)
    assert len(set(paged._plans) - before) <= 2, "a plan per batch size or width"
    # A plan in hand does not skip the checks of a batch that disagrees with q's.
    case = cases[0]
    with pytest.raises(ValueError, match="weights: expected"):
        tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w[:-1], case.ctx, case.table, case.meta,
                                          case.max_context_len)
    with pytest.raises(ValueError, match="block_table: expected"):
        tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, case.ctx, case.table[:-1], case.meta,
                                          case.max_context_len)
    with pytest.raises(ValueError, match="out: expected"):
        case.run(out=torch.empty(3, case.max_context_len + 1, device=DEVICE))


def test_chunk_per_call_fills_the_gpu_before_it_grows():
    """The per-call chunk: 512-2048 keys aiming at ``_TARGET_PROGRAMS`` programs, and smaller
    chunks, down to one tile, while they give at most the device's resident programs
    (``wave``), down to 128 keys while they give at most ``few``; whole pages, a power of two
    of them."""
    pages = paged.chunk_pages_for
    # Large batches: the rule aimed at _TARGET_PROGRAMS programs, whatever the wave.
    assert pages(256, 8192, 64, 64, wave=264) == pages(256, 8192, 64, 64) == 1024 // 64
    assert pages(64, 163840, 64, 64, wave=264) == 2048 // 64
    assert pages(8, 32768, 64, 64, wave=264) == 512 // 64
    # Small ones: shorter chunks until the wave is filled, never below one tile.
    assert pages(1, 8192, 64, 64, wave=264) == 1  # 64 keys: 128 programs
    assert pages(1, 65536, 64, 64, wave=264) == 256 // 64  # 256 programs of 256 keys
    assert pages(2, 65536, 64, 64, wave=264) == 512 // 64
    assert pages(1, 8192, 64, 128, wave=264) == 2  # one 128-key tile
    assert pages(1, 8192, 32, 64, wave=264) == 2  # one tile of two 32-token pages
    assert pages(1, 8192, 128, 64, wave=264) == 1  # one page is the smallest chunk
    # Row groups count as programs, on the way up as on the way down; no device (wave 0) keeps
    # 512 keys.
    assert pages(1, 65536, 64, 64, wave=264, groups=2) == 512 // 64
    assert pages(128, 8192, 64, 64, wave=264) == 512 // 64
    assert pages(128, 8192, 64, 64, wave=264, groups=2) == 1024 // 64
    assert pages(512, 8192, 64, 64, wave=264, groups=2) == pages(1024, 8192, 64, 64, wave=264) == 2048 // 64
    assert pages(1, 8192, 64, 64) == pages(1, 300, 64, 64) == 512 // 64
    # ``few`` (a batch of two or more): halving down to 128 keys while the halved chunk gives at
    # most that many programs, then the wave's rule; one request takes the wave's rule alone.
    assert pages(8, 10140, 64, 64, wave=264, few=528) == 256 // 64  # 317 programs of 256 keys
    assert pages(8, 10140, 64, 64, wave=264, few=792) == 128 // 64
    assert pages(32, 5300, 64, 64, wave=264, few=528) == 512 // 64  # 331 programs of 512 already
    assert pages(1, 8192, 64, 64, wave=264, few=792) == 1  # the wave's rule still goes to one tile
    assert pages(8, 10140, 64, 128, wave=264, few=10**6) == 128 // 64  # never below one tile
    assert pages(1, 65536, 64, 64, wave=264, few=10**6) == pages(1, 65536, 64, 64, wave=264) == 256 // 64


def test_default_rows_per_program_stop_at_128_dot_columns():
    """A request's query rows share a program up to 128 dot columns (rows x padded heads);
    more rows take more programs of that width; one row wider than that runs on 8 warps."""
    cfg = paged.default_paged_config
    assert (cfg("fp8", 2, 64, 128, 64).rows, cfg("fp8", 2, 64, 128, 64).num_warps) == (2, 4)
    assert (cfg("fp8", 4, 64, 128, 64).rows, cfg("fp8", 4, 64, 128, 64).num_warps) == (2, 4)
    assert cfg("fp8", 3, 64, 128, 64).rows == 2 and cfg("fp8", 8, 32, 128, 64).rows == 4
    assert cfg("fp8", 4, 16, 128, 64).rows == 4 and cfg("mxfp4", 4, 64, 128, 64).rows == 2
    wide = cfg("fp8", 1, 256, 128, 64)
    assert (wide.rows, wide.num_warps, wide.num_stages) == (1, 8, 3)


def test_out_buffer_bad_layouts_raise():
    case = Case("fp8", lens=(70, 129), next_n=1, block_kv=32, seed=25)
    good = torch.empty(2, case.max_context_len, device=DEVICE)
    for bad, exc, text in [
        (good.bfloat16(), TypeError, "out: expected torch.float32"),
        (good[:1], ValueError, "out: expected"),
        (torch.empty(case.max_context_len, 2, device=DEVICE).t(), ValueError, "out: expected unit last stride"),
        ("x", TypeError, "out: expected a torch.Tensor"),
    ]:
        with pytest.raises(exc, match=text):
            case.run(out=bad)


# ---------------------------------------------------------------------------------------
# Full-size checks on the GPU (the contract's decode shapes: block 64, lengths uniform in
# 0.7-1.3 of the mean).
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch,next_n,mean", [(64, 1, 8192), (256, 1, 8192), (64, 2, 32768), (1, 1, 65536)])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("ctx_2d", [False, True])
def test_decode_shapes_on_gpu(batch, next_n, mean, fmt, ctx_2d, poisoned):
    g = torch.Generator().manual_seed(batch + next_n)
    lens = torch.randint(int(0.7 * mean), int(1.3 * mean), (batch,), generator=g).tolist()
    case = Case(fmt, lens=lens, next_n=next_n, h=64, d=128, block_kv=64, ctx_2d=ctx_2d, seed=batch)
    case.check(case.run(clean=True), True)
    if not ctx_2d:
        case.check(case.run(clean=False), False)
