"""Indexer prefill logits against both references, with the contract's rules:
exact -inf masks, every element written (poisoned outputs), bitwise reruns, bad inputs raise.

On CPU the kernels run through Triton's interpreter at small shapes (with small tiles so
several programs and partial tiles are exercised); on a GPU the same checks run at full size.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import triton

import tilefuse
import tilefuse.compat.deep_gemm as deep_gemm
from tilefuse import _jit
from tilefuse import formats as F
from tilefuse import reference as R
from tilefuse.indexer import _prefill_kernel as kern
from tilefuse.indexer import prefill
from tilefuse.indexer import windows as W

from ..conftest import DEVICE, ON_GPU

# Small tiles on CPU: more programs, partial tiles and skipped tiles at interpreter-sized shapes.
SMALL = prefill.PrefillConfig(block_q=16, block_n=32)
VARIANTS = {  # name -> (format, config fields beyond the tile)
    "fp8": ("fp8", {}),
    "fp8-unroll2": ("fp8", dict(head_unroll=2)),
    "fp8-clean-pass": ("fp8", dict(clean_pass=True)),
    "fp8-heads-on-n": ("fp8", dict(heads_on_n=True)),
    "mxfp8": ("mxfp8", {}),
    "mxfp8-unroll2": ("mxfp8", dict(head_unroll=2)),
    "mxfp4": ("mxfp4", {}),
    "mxfp4-unroll2": ("mxfp4", dict(head_unroll=2)),
    "mxfp4-via-fp8": ("mxfp4", dict(fp4_via_fp8=True)),
    "mxfp4-via-fp8-clean-pass": ("mxfp4", dict(fp4_via_fp8=True, clean_pass=True)),
    "mxfp8-via-f16": ("mxfp8", dict(mxfp8_via_f16=True)),
    "fp8-abs2": ("fp8", dict(relu_via_abs=2)),
    "fp8-abs2-unroll2": ("fp8", dict(relu_via_abs=2, head_unroll=2)),
    "mxfp4-via-fp8-abs2": ("mxfp4", dict(fp4_via_fp8=True, relu_via_abs=2)),
    "mxfp4-inline": ("mxfp4", dict(fp4_via_fp8=True, heads_on_n=True, mx_inline=1)),
    "mxfp8-inline": ("mxfp8", dict(mxfp8_via_f16=True, heads_on_n=True, mx_inline=1)),
}
BF16_THRESHOLD = {"fp8": 1e-3, "mxfp8": 0.02, "mxfp4": 0.02}


def make_inputs(s_q, s_k, h, d, fmt, seed, weights_dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h, d, generator=g) * scale).to(torch.bfloat16)
    k = (torch.randn(s_k, d, generator=g) * scale).to(torch.bfloat16)
    w = torch.randn(s_q, h, generator=g).to(weights_dtype)
    qq = tuple(None if t is None else t.to(DEVICE) for t in F.quantize_q(q, fmt))
    kk = tuple(t.to(DEVICE) for t in F.quantize_k(k, fmt))
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), qq, kk


def _rows(t, idx):
    return None if t is None else t[idx]


def check_logits(out, qq, kk, q, k, w, ks, ke, fmt, clean=True, max_seqlen_k=0, logits_dtype=torch.float32,
                 against_unquantised=True):
    """The §5 rules: both references, exact -inf masks, every element written.

    Masks and unwritten elements are checked over the complete output. At GPU sizes the fp32
    references are computed on 256 rows spread over the output (first and last included).
    """
    s_q, s_k = q.shape[0], k.shape[0]
    cols = max_seqlen_k or s_k
    assert out.shape == (s_q, cols) and out.stride(1) == 1 and out.dtype == logits_dtype
    out32 = out.float()
    if max_seqlen_k:
        length = (ke.clamp(max=s_k) - ks).clamp(min=0)
        inside_all = torch.arange(cols, device=out.device)[None, :] < length[:, None]
    else:
        inside_all = R.window_mask(ks, ke, s_k)
    if clean:
        assert torch.equal(torch.isneginf(out32), ~inside_all), "-inf mask differs from the reference"
        assert not out32.isnan().any(), "an element was not written"
    else:
        assert not out32[inside_all].isnan().any(), "an in-window element was not written"

    idx = torch.arange(s_q, device=out.device)
    if s_q * s_k > 1 << 26:
        idx = torch.linspace(0, s_q - 1, 256, device=out.device).round().long().unique()
    qq, ks, ke, w, q, out32 = (_rows(qq[0], idx), _rows(qq[1], idx)), ks[idx], ke[idx], w[idx], q[idx], out32[idx]
    ref = R.fp8_fp4_mqa_logits_ref(qq, kk, w, ks, ke, clean, max_seqlen_k, torch.float32)
    unquant = R.mqa_logits_ref(q, k, w, ks, ke)
    if max_seqlen_k:
        unquant = R.compress_logits(unquant, ks, ke, max_seqlen_k)
    inside = ~torch.isneginf(ref)
    out32 = torch.where(inside, out32, ref)
    bf16 = logits_dtype == torch.bfloat16 or w.dtype == torch.bfloat16
    tight = 3e-5 if bf16 else 5e-6
    diff = float(R.calc_diff(out32, ref))
    assert diff < tight, f"distance to the quantised reference {diff:.3g}, bar {tight:.3g}"
    # Against unquantised inputs the error is quantisation noise (FP8 sits near 7e-4 against a
    # 1e-3 bar): a statistic that needs a sample, so tiny cases check the tight bar only, and
    # the bar is also 1.1x the exact quantised reference's own distance (a draw of few keys may
    # put the reference itself past it).
    if against_unquantised and int(inside.sum()) * q.shape[1] >= 8192:
        bar = max(BF16_THRESHOLD[fmt], 1.1 * float(R.calc_diff(ref, unquant)))
        diff = float(R.calc_diff(out32, unquant))
        assert diff < bar, f"distance to the unquantised reference {diff:.3g}, bar {bar:.3g}"


def run(qq, kk, w, ks, ke, config=SMALL, **kw):
    return tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=config, **kw)


def shapes(cpu, gpu):
    return gpu if ON_GPU else cpu


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("windows", ["causal", "zigzag", "random", "overhang"])
def test_formats_and_windows(variant, windows, poisoned):
    fmt, fields = VARIANTS[variant]
    s_q, s_k = shapes((32, 256), (512, 8192))
    q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=hash((variant, windows)) % 1000)
    g = torch.Generator().manual_seed(7)
    if windows == "random":
        ks, ke = W.random_windows(s_q, s_k, generator=g, empty_fraction=0.25, device=DEVICE)
    elif windows == "overhang":  # ke > S_k is clamped
        ks, ke = W.random_windows(s_q, s_k, generator=g, overhang=s_k // 2, device=DEVICE)
    else:
        ks, ke = W.GENERATORS[windows](s_q, s_k, device=DEVICE)
    tile = dict(block_q=SMALL.block_q, block_n=SMALL.block_n) if not ON_GPU else {}
    cfg = prefill.PrefillConfig(**tile, **fields)
    out = run(qq, kk, w, ks, ke, config=cfg)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt)


@pytest.mark.parametrize("h", [4, 8, 32, 64])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4", "fp8-abs2", "mxfp8-inline", "mxfp4-inline"])
def test_heads_and_head_dims(h, d, fmt):
    fmt, fields = VARIANTS[fmt]
    if fmt == "mxfp4" and d == 32:
        pytest.skip("FP4 supports D in {64, 128}")
    if (fmt != "fp8" or fields) and h in (4, 32) and not ON_GPU:
        pytest.skip("interpreter time: MX and relu_via_abs covered at H in {8, 64}")
    s_q, s_k = shapes((16, 96), (256, 4096))
    q, k, w, qq, kk = make_inputs(s_q, s_k, h, d, fmt, seed=h * 1000 + d)
    ks, ke = W.causal_tail(s_q, s_k, device=DEVICE)
    check_logits(run(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, **fields)), qq, kk, q, k, w, ks, ke, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_weight_and_logit_dtypes(fmt, weights_dtype, logits_dtype, poisoned):
    s_q, s_k = shapes((16, 128), (256, 4096))
    q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=3, weights_dtype=weights_dtype)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(1), device=DEVICE)
    out = run(qq, kk, w, ks, ke, logits_dtype=logits_dtype)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt, logits_dtype=logits_dtype)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("clean", [True, False])
def test_compressed_layout(fmt, clean, poisoned):
    s_q, s_k = shapes((24, 200), (512, 8192))
    q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=11)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(5), empty_fraction=0.2,
                              overhang=16, device=DEVICE)
    longest = int((ke.clamp(max=s_k) - ks).max())
    out = run(qq, kk, w, ks, ke, clean_logits=clean, max_seqlen_k=longest + 3)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt, clean=clean, max_seqlen_k=longest + 3)


@pytest.mark.parametrize("h,d", [(4, 32), (12, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("layout", ["full+clean", "full", "compressed+clean", "compressed"])
def test_heads_on_n(h, d, layout, poisoned):
    """(query row, head) pairs on the MMA's N side: two rows per dot (one at H = 128), odd row
    counts, empty and overhanging windows, both layouts, bf16 weights and logits once."""
    s_q, s_k = shapes((21, 150), (77, 4096))  # two programs of 16 rows, the second partial
    q, k, w, qq, kk = make_inputs(s_q, s_k, h, d, "fp8", seed=h + d,
                                  weights_dtype=torch.bfloat16 if h == 12 else torch.float32)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(h), empty_fraction=0.2,
                              overhang=9, device=DEVICE)
    clean = layout.endswith("+clean")
    longest = int((ke.clamp(max=s_k) - ks).max()) + 2 if layout.startswith("compressed") else 0
    logits_dtype = torch.bfloat16 if h == 12 else torch.float32
    cfg = prefill.PrefillConfig(block_q=16, block_n=64, heads_on_n=True)
    out = run(qq, kk, w, ks, ke, config=cfg, clean_logits=clean, max_seqlen_k=longest, logits_dtype=logits_dtype)
    check_logits(out, qq, kk, q, k, w, ks, ke, "fp8", clean=clean, max_seqlen_k=longest,
                 logits_dtype=logits_dtype)
    again = run(qq, kk, w, ks, ke, config=cfg, clean_logits=clean, max_seqlen_k=longest, logits_dtype=logits_dtype)
    written = ~torch.isnan(out) if not clean else torch.ones_like(out, dtype=torch.bool)
    assert torch.equal(out[written].view(torch.int16 if logits_dtype == torch.bfloat16 else torch.int32),
                       again[written].view(torch.int16 if logits_dtype == torch.bfloat16 else torch.int32))
    _, _, w_mx, q_mx, k_mx = make_inputs(4, 64, 8, 64, "mxfp8", seed=1)
    ks_mx, ke_mx = W.causal_tail(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="heads_on_n"):
        run(q_mx, k_mx, w_mx, ks_mx, ke_mx, config=cfg)


# MX operands on the FP8 kernels' grid (E4M3 for MXFP4, f16 for MXFP8)
MX_VIA = {"mxfp4": dict(fp4_via_fp8=True), "mxfp8": dict(mxfp8_via_f16=True)}


def _wide_span_rows(q, k, fmt):
    """``(q, k, qq, kk)`` with query row 3's head 2 and key 17 past the exact block-exponent
    span (15 binades for MXFP8, 8 for MXFP4), quantised again."""
    q, k = q.float(), k.float()
    q[3, 2, :32] *= 1e6 if fmt == "mxfp8" else 1e4
    k[17, 32:64] *= 1e7 if fmt == "mxfp8" else 1e5
    qq, kk = F.quantize_q(q.cpu(), fmt), F.quantize_k(k.cpu(), fmt)
    return q, k, tuple(t.to(DEVICE) for t in qq), tuple(t.to(DEVICE) for t in kk)


def _mx_inline_case(s_q, s_k, fmt, seed, window_seed, compressed):
    """Inputs of the few-row MX tests (H 8, D 128): ``(q, k, w, qq, kk, ks, ke, max_seqlen_k)``,
    a fifth of the windows empty, the compressed width a little past the widest window."""
    q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 128, fmt, seed=seed)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(window_seed), empty_fraction=0.2,
                              device=DEVICE)
    return q, k, w, qq, kk, ks, ke, int((ke - ks).max()) + 5 if compressed else 0


def _check_wide_span_run(q, k, w, ks, ke, fmt, config, clean, max_seqlen_k):
    """``config`` on a query row and a key past the exact span (bf16 upcast) against the reference."""
    q, k, qq, kk = _wide_span_rows(q, k, fmt)
    got = run(qq, kk, w, ks, ke, config=config, clean_logits=clean, max_seqlen_k=max_seqlen_k)
    check_logits(got, qq, kk, q, k, w, ks, ke, fmt, clean=clean, max_seqlen_k=max_seqlen_k,
                 against_unquantised=False)


def _check_wide_span_prep(qq, kk, w, fmt, d, bad_q, bad_k):
    """The renormalise launch flags exactly the SMALL blocks of query row ``bad_q`` and key
    ``bad_k``, and every row of the other blocks times its scale is the dequantised row."""
    s_q, s_k = qq[0].shape[0], kk[0].shape[0]
    q_rows, w_rows, fix_q, k_rows, k_scale, fix_k = prefill._renormalise_rows(
        qq[0], qq[1], w, kk[0], kk[1], fmt, d, SMALL.block_q, SMALL.block_n)
    assert q_rows.dtype == k_rows.dtype == prefill._RENORM_DTYPE[fmt]
    assert fix_q.tolist() == [int(b == bad_q // SMALL.block_q) for b in range(-(-s_q // SMALL.block_q))]
    assert fix_k.tolist() == [int(b == bad_k // SMALL.block_n) for b in range(-(-s_k // SMALL.block_n))]
    q_ok = (torch.arange(s_q, device=w.device) // SMALL.block_q) != bad_q // SMALL.block_q
    k_ok = (torch.arange(s_k, device=w.device) // SMALL.block_n) != bad_k // SMALL.block_n
    q_scale = w_rows / w.float()  # a power of two: the division is exact
    assert torch.equal((q_rows.float() * q_scale[..., None])[q_ok], F.dequantize_q(*qq)[q_ok])
    assert torch.equal((k_rows.float() * k_scale[:, None])[k_ok], F.dequantize_k(*kk)[k_ok])


def test_mxfp4_via_fp8_is_exact_and_recomputes_rows_with_wide_scale_spans(poisoned):
    """Rows whose block exponents span more than 8 binades cannot be renormalised into E4M3;
    the second pass must recompute exactly their tiles (on queries and on keys)."""
    s_q, s_k, h, d = shapes((24, 160), (512, 8192)) + (8, 128)
    q, k, w, _, _ = make_inputs(s_q, s_k, h, d, "mxfp4", seed=21)
    q, k = q.float(), k.float()
    q[3, 2, :32] *= 1e4  # a 32-block 13+ binades above the row's others
    k[17, 32:64] *= 1e5
    q[5, 1, :32] *= 30  # a span of ~5 binades: exact on the FP8 path
    qq, kk = F.quantize_q(q.cpu(), "mxfp4"), F.quantize_k(k.cpu(), "mxfp4")
    qq, kk = tuple(t.to(DEVICE) for t in qq), tuple(t.to(DEVICE) for t in kk)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(3), device=DEVICE)
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, fp4_via_fp8=True))
    # The 1e5-scaled key block dominates every sum of squares, so the statistic against
    # unquantised inputs measures MXFP4 noise on that one column; the dequantised reference
    # (exact arithmetic on the same quantised values) is the check that matters here.
    check_logits(out, qq, kk, q, k, w, ks, ke, "mxfp4", against_unquantised=False)

    _check_wide_span_prep(qq, kk, w, "mxfp4", d, bad_q=3, bad_k=17)


def test_mxfp8_via_f16_is_exact_and_recomputes_rows_with_wide_scale_spans(poisoned):
    """As for MXFP4, with f16 rows: exact up to a 15-binade span of block exponents."""
    s_q, s_k, h, d = shapes((24, 160), (512, 8192)) + (8, 128)
    q, k, w, _, _ = make_inputs(s_q, s_k, h, d, "mxfp8", seed=23)
    q, k = q.float(), k.float()
    q[3, 2, :32] *= 1e6  # about 20 binades above the row's other blocks
    k[17, 32:64] *= 1e7
    q[5, 1, :32] *= 3e3  # about 12 binades: exact in f16
    qq, kk = F.quantize_q(q.cpu(), "mxfp8"), F.quantize_k(k.cpu(), "mxfp8")
    qq, kk = tuple(t.to(DEVICE) for t in qq), tuple(t.to(DEVICE) for t in kk)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(3), device=DEVICE)
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, mxfp8_via_f16=True))
    check_logits(out, qq, kk, q, k, w, ks, ke, "mxfp8", against_unquantised=False)

    _check_wide_span_prep(qq, kk, w, "mxfp8", d, bad_q=3, bad_k=17)


def _same_bits_on_cpu(got, ref):
    """The bits of ``ref`` on CPU; on the GPU, where two kernels' MMAs (operands from registers
    or from memory) may sum in different orders: the same -inf and values within 1e-5."""
    if DEVICE == "cpu":
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    else:
        assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(torch.isnan(got), torch.isnan(ref))
        fin = torch.isfinite(ref)
        assert ((got[fin] - ref[fin]).abs().max() <= 1e-5 * ref[fin].abs().max()).item()


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("clean,compressed", [(False, False), (True, False), (True, True)])
def test_mx_inline_is_one_launch_and_the_renormalised_passes_bits(fmt, clean, compressed, poisoned,
                                                                     record_launches):
    """``mx_inline``: one launch of the few-row MX kernel; with every row exact, the bits of the
    renormalise launch + the few-row FP8-grid pass (same tile); a query row and a key whose
    block exponents span too wide are computed with the bf16 upcast, against the reference."""
    from tilefuse.indexer import _prefill_kernel as kern

    passes = prefill.PrefillConfig(block_q=16, block_n=128, heads_on_n=True, **MX_VIA[fmt])
    inline = dataclasses.replace(passes, mx_inline=1)
    q, k, w, qq, kk, ks, ke, max_seqlen_k = _mx_inline_case(*shapes((20, 300), (200, 4096)), fmt, 31, 4, compressed)
    one = record_launches(kern, "prefill_mx_few_rows_kernel")
    renorm = record_launches(kern, "mx_rows_renormalise_kernel")
    got = run(qq, kk, w, ks, ke, config=inline, clean_logits=clean, max_seqlen_k=max_seqlen_k)
    assert len(one) == 1 and renorm == []
    check_logits(got, qq, kk, q, k, w, ks, ke, fmt, clean=clean, max_seqlen_k=max_seqlen_k)
    ref = run(qq, kk, w, ks, ke, config=passes, clean_logits=clean, max_seqlen_k=max_seqlen_k)
    written = ~torch.isnan(ref) & ~torch.isnan(got)
    _same_bits_on_cpu(got[written], ref[written])
    _check_wide_span_run(q, k, w, ks, ke, fmt, inline, clean, max_seqlen_k)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("weights_dtype,logits_dtype", [(torch.bfloat16, torch.float32),
                                                        (torch.float32, torch.bfloat16)])
def test_mx_inline_weight_and_logit_dtypes(fmt, weights_dtype, logits_dtype, poisoned):
    s_q, s_k = shapes((16, 128), (256, 4096))
    q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=5, weights_dtype=weights_dtype)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(2), device=DEVICE)
    via = MX_VIA[fmt]
    cfg = dataclasses.replace(SMALL, heads_on_n=True, mx_inline=1, **via)
    out = run(qq, kk, w, ks, ke, config=cfg, logits_dtype=logits_dtype)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt, logits_dtype=logits_dtype)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("clean,compressed", [(False, False), (True, True)])
@pytest.mark.parametrize("mode", [2, 3])
def test_mx_inline_with_query_rows_ready(fmt, clean, compressed, mode, poisoned, record_launches):
    """``mx_inline=2``: the query rows renormalised by a first launch (no key programs), the
    keys in the kernel; ``mx_inline=3``: the same rows by producer programs of the one launch.
    The bits of ``mx_inline=1`` where rows are exact; a block of rows with one that is not
    exact, and a wide-span key, computed with the bf16 upcast (reference). The tile counters
    of mode 3 are back at zero after every call."""
    from tilefuse.indexer import _prefill_kernel as kern

    one = prefill.PrefillConfig(block_q=4, block_n=128, heads_on_n=True, mx_inline=1, **MX_VIA[fmt])
    two = dataclasses.replace(one, mx_inline=mode)
    q, k, w, qq, kk, ks, ke, max_seqlen_k = _mx_inline_case(*shapes((20, 200), (200, 4096)), fmt, 41, 8, compressed)
    few = record_launches(kern, "prefill_mx_few_rows_kernel")
    renorm = record_launches(kern, "mx_rows_renormalise_kernel")
    got = run(qq, kk, w, ks, ke, config=two, clean_logits=clean, max_seqlen_k=max_seqlen_k)
    assert len(few) == 1 and len(renorm) == (1 if mode == 2 else 0)
    check_logits(got, qq, kk, q, k, w, ks, ke, fmt, clean=clean, max_seqlen_k=max_seqlen_k)
    ref = run(qq, kk, w, ks, ke, config=one, clean_logits=clean, max_seqlen_k=max_seqlen_k)
    _same_bits_on_cpu(got, ref)
    _check_wide_span_run(q, k, w, ks, ke, fmt, two, clean, max_seqlen_k)
    for i, (s_q, s_k) in enumerate(((9, 300), (23, 130), (5, 257))):  # new sizes: replayed launches, new scratch
        q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 128, fmt, seed=50 + i)
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(i), device=DEVICE)
        got = run(qq, kk, w, ks, ke, config=two, clean_logits=clean, max_seqlen_k=max_seqlen_k and s_k)
        check_logits(got, qq, kk, q, k, w, ks, ke, fmt, clean=clean, max_seqlen_k=max_seqlen_k and s_k)
    if ON_GPU:
        torch.cuda.synchronize()
    assert all(not c.any() for c in prefill._TILE_COUNTERS.values())


@pytest.mark.skipif(ON_GPU, reason="the spin bound is compiled in on a GPU (the interpreter reads it per call)")
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_inline_in_one_launch_when_the_rows_never_come(fmt, poisoned, monkeypatch):
    """``mx_inline=3``: a program whose query tile (its ready count, counter 2) is not counted
    ready within its reads of the counter computes the tile with the bf16 upcast (the reference
    holds), and the launch still leaves the counters at zero. (A stale count stands in for
    producers that never come.)"""
    from tilefuse.indexer import _prefill_kernel as kern

    monkeypatch.setattr(kern, "_MAX_SPINS", triton.language.constexpr(3))
    s_q, s_k, h, d = 20, 300, 8, 64
    cfg = prefill.PrefillConfig(block_q=8, block_n=128, heads_on_n=True, mx_inline=3, **MX_VIA[fmt])
    q, k, w, qq, kk = make_inputs(s_q, s_k, h, d, fmt, seed=12)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(12), device=DEVICE)
    run(qq, kk, w, ks, ke, config=cfg)  # (the stream's counters made)
    counters = prefill._tile_counters(torch.device(DEVICE), 0)
    counters[2] = -1000  # its producers' count never reaches theirs
    got = run(qq, kk, w, ks, ke, config=cfg)
    check_logits(got, qq, kk, q, k, w, ks, ke, fmt)
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_inline_in_one_launch_in_graphs_and_on_two_streams(fmt, record_launches):
    """``mx_inline=3`` (producer programs of the launch, counters reset by the launch): CUDA
    graphs (captured on a stream with eager calls before and after, and on a new one; each
    with counters of its own, zeroed by the graph) replayed over new inputs, and two calls in
    flight at once on two streams, each against the reference; the streams' counters are zero
    after them; no first launch (mx_inline=2's) anywhere."""
    from tilefuse.indexer import _prefill_kernel as kern

    s_q, s_k, h, d = 100, 4096, 64, 128
    cfg = prefill.PrefillConfig(block_q=16, block_n=128, num_warps=8, num_stages=3, heads_on_n=True, mx_inline=3,
                                **MX_VIA[fmt])
    q, k, w, qq, kk = make_inputs(s_q, s_k, h, d, fmt, seed=3)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(3), device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (compiled and recorded off the capture)
        for _ in range(3):
            run(qq, kk, w, ks, ke, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    renormalise = record_launches(kern, "mx_rows_renormalise_kernel")
    graph, fresh = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # (a stream with counters of its own)
        out = run(qq, kk, w, ks, ke, config=cfg)
    with torch.cuda.graph(fresh, stream=torch.cuda.Stream()):
        out_fresh = run(qq, kk, w, ks, ke, config=cfg)
    for seed in (4, 5, 6):
        q, k, w_new, qq_new, kk_new = make_inputs(s_q, s_k, h, d, fmt, seed=seed)
        for dst, src in ((qq[0], qq_new[0]), (qq[1], qq_new[1]), (kk[0], kk_new[0]), (kk[1], kk_new[1]),
                         (w, w_new.to(DEVICE))):
            dst.copy_(src)
        graph.replay()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (an eager call on the capture stream between replays)
            eager = run(qq, kk, w, ks, ke, config=cfg)
        torch.cuda.current_stream().wait_stream(side)
        fresh.replay()
        check_logits(out, qq, kk, q, k, w, ks, ke, fmt)
        check_logits(out_fresh, qq, kk, q, k, w, ks, ke, fmt)
        check_logits(eager, qq, kk, q, k, w, ks, ke, fmt)
    calls = [make_inputs(s_q, s_k, h, d, fmt, seed=seed) for seed in (7, 8)]
    streams = [torch.cuda.Stream() for _ in calls]
    outs = []
    for stream, (_, _, w_c, qq_c, kk_c) in zip(streams, calls):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append([run(qq_c, kk_c, w_c, ks, ke, config=cfg) for _ in range(4)])
    torch.cuda.synchronize()
    for (q, k, w_c, qq_c, kk_c), repeats in zip(calls, outs):
        for got in repeats:
            check_logits(got, qq_c, kk_c, q, k, w_c, ks, ke, fmt)
    assert all(not c.any() for c in prefill._TILE_COUNTERS.values())
    assert not renormalise


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_few_rows_block_q_below_16(fmt, poisoned):
    """The few-row kernels take block_q below 16 (more programs for a handful of rows): a step's
    math does not depend on it, so the bits are those of block_q 16."""
    s_q, s_k = shapes((7, 40), (300, 2048))
    q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=9)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(6), device=DEVICE)
    via = dict(MX_VIA[fmt], mx_inline=1) if fmt in MX_VIA else {}
    cfg = dataclasses.replace(SMALL, block_q=16, heads_on_n=True, **via)
    ref = run(qq, kk, w, ks, ke, config=cfg)
    for block_q in (2, 4):
        got = run(qq, kk, w, ks, ke, config=dataclasses.replace(cfg, block_q=block_q))
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    with pytest.raises(ValueError, match="block_q"):
        run(qq, kk, w, ks, ke, config=dataclasses.replace(cfg, block_q=1))


def test_mx_inline_rejects_what_it_cannot_run():
    _, _, w, qq, kk = make_inputs(16, 64, 4, 64, "mxfp4", seed=2)
    ks, ke = W.causal_tail(16, 64, device=DEVICE)
    for fmt_q, fmt_k, cfg in (((qq[0], qq[1]), kk, dataclasses.replace(SMALL, fp4_via_fp8=True, mx_inline=1)),):
        with pytest.raises(ValueError, match="mx_inline"):
            tilefuse.fp8_fp4_mqa_logits(fmt_q, fmt_k, w, ks, ke, config=cfg)
    _, _, w8, qq8, kk8 = make_inputs(16, 64, 4, 64, "fp8", seed=2)
    with pytest.raises(ValueError, match="mx_inline"):
        tilefuse.fp8_fp4_mqa_logits(qq8, kk8, w8, ks, ke, config=dataclasses.replace(SMALL, heads_on_n=True,
                                                                                       mx_inline=1))
    with pytest.raises(ValueError, match="mx_inline"):
        tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, fp4_via_fp8=True,
                                                                                 heads_on_n=True, mx_inline=5))


# ---------------------------------------------------------------------------------------
# MX on renormalised rows: the renormalise launch (rows, scales, fix-up flags) and the fix-up.
# ---------------------------------------------------------------------------------------
SPAN = {"mxfp4": 8, "mxfp8": 15}


def _mx_operands(fmt, s_q, s_k, h, d, seed, q_exps=(), k_exps=(), w_dtype=torch.float32, pads=(0, 0, 0)):
    """MX queries and keys of random codes with random block exponents inside the exact span,
    except the rows listed in ``q_exps`` (``((row, head), exponents)``) and ``k_exps``
    (``(key, exponents)``). ``pads``: extra elements per row of the query values, query scales
    and weights (which also start one element into their buffer)."""
    g = torch.Generator().manual_seed(seed)
    nb, dq = d // 32, d // 2 if fmt == "mxfp4" else d

    def codes(*shape):
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        if fmt == "mxfp4":
            return b.to(torch.uint8).view(torch.int8)
        return torch.where((b & 0x7F) == 0x7F, b & 0x70, b).to(torch.uint8).view(F.FP8_DTYPE)  # no NaN

    q, k = codes(s_q, h, dq), codes(s_k, dq)
    q_e = torch.randint(127 - SPAN[fmt] // 2, 128 + SPAN[fmt] // 2, (s_q, h, nb), generator=g)
    k_e = torch.randint(127 - SPAN[fmt] // 2, 128 + SPAN[fmt] // 2, (s_k, nb), generator=g)
    for idx, e in q_exps:
        q_e[idx] = torch.tensor(e[:nb])
    for idx, e in k_exps:
        k_e[idx] = torch.tensor(e[:nb])
    q_sf, k_sf = F.pack_ue8m0(q_e), F.pack_ue8m0(k_e)
    w = torch.randn(s_q, h, generator=g).to(w_dtype)
    pad_q, pad_sf, pad_w = pads
    if pad_q:
        q = torch.zeros(s_q, h * dq + pad_q, dtype=torch.uint8).view(q.dtype)[:, :h * dq].view(s_q, h, dq).copy_(q)
    if pad_sf:
        q_sf = torch.zeros(s_q, h + pad_sf, dtype=torch.int32)[:, :h].copy_(q_sf)
    if pad_w:
        w = torch.zeros(s_q, h + pad_w + 1, dtype=w_dtype)[:, 1:h + 1].copy_(w)
    return (q.to(DEVICE), q_sf.to(DEVICE)), (k.to(DEVICE), k_sf.to(DEVICE)), w.to(DEVICE)


def _renormalised_reference(values, sf, fmt, d):
    """Torch on the CPU: ``(rows [n, D] in E4M3 / f16, fp32 2^(e_max - 127) [n], exact [n])`` of
    MX rows ``[n, D or D/2]`` with packed scales ``[n]``: the rules of the renormalise launch."""
    values, sf = values.cpu(), sf.cpu()
    e = F.unpack_ue8m0(sf, d // 32)
    e_max, e_min = e.amax(dim=-1), e.amin(dim=-1)
    x = F.decode_e2m1(F.unpack_fp4(values)) if fmt == "mxfp4" else values.float()
    shift = (e - e_max[:, None]).clamp(min=-126).repeat_interleave(32, dim=-1)
    rows = (x * ((shift + 127) << 23).view(torch.float32)).to(prefill._RENORM_DTYPE[fmt])
    exact = (e_max - e_min <= SPAN[fmt]) & ((e_max - 127).abs() <= 100)
    return rows, torch.exp2(e_max.float() - 127.0), exact


def _block_any(flags, block):
    return [int(flags[i:i + block].any()) for i in range(0, flags.shape[0], block)]


def _same(a, b) -> bool:
    """Same dtype, shape and bytes (any dtype)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)))


# Exponents of special rows (four blocks; D < 128 takes the first D / 32): a span one past the
# exact range, the fold limit (exact) and one past it, the ends of UE8M0 (0: 2^-127, 255: inf).
def _special_exps(fmt):
    s = SPAN[fmt]
    return {"wide": [127, 126 - s, 127, 127], "fold": [227, 227 - s, 227, 227], "past_fold": [228, 228, 228, 228],
            "low_fold": [27, 27, 27 + s, 27], "zero": [0, 0, 0, 0], "top": [255, 250, 254, 255]}


RENORM_CASES = {  # name -> s_q, s_k, H, D (FP4: at least 64), block_q, block_n, weights dtype, pads, specials
    # Partial last blocks on both sides; one inexact (row, head) in a block of exact rows.
    "partial-blocks": (37, 100, 8, 128, 16, 32, torch.float32, (0, 0, 0),
                       [((20, 5), "wide"), ((3, 0), "fold"), ((33, 7), "past_fold"), ((10, 2), "low_fold"),
                        ((11, 1), "zero"), ((12, 3), "top")],
                       [(99, "wide"), (40, "fold"), (41, "low_fold"), (64, "zero"), (65, "top")]),
    "smaller-than-a-block": (5, 20, 4, 64, 64, 256, torch.bfloat16, (0, 0, 0), [((4, 3), "wide")], [(0, "wide")]),
    "padded-strides": (20, 70, 12, 128, 16, 64, torch.bfloat16, (32, 3, 5), [((17, 11), "past_fold")],
                       [(69, "past_fold")]),
    "all-exact": (3, 5, 4, 64, 16, 16, torch.float32, (0, 0, 0), [((1, 1), "fold")], [(4, "fold")]),
}


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("case", list(RENORM_CASES))
def test_mx_renormalise_launch_is_the_torch_reference(fmt, case):
    """Every output of the one renormalise launch, bitwise: the rows (exact or not), the key row
    scale, ``w_rows = weights * 2^(e_max - 127)`` and the fix-up flags per block_q query rows
    (any head) / block_n keys, partial last blocks included."""
    s_q, s_k, h, d, block_q, block_n, w_dtype, pads, q_sp, k_sp = RENORM_CASES[case]
    ex = _special_exps(fmt)
    qq, kk, w = _mx_operands(fmt, s_q, s_k, h, d, seed=len(case), q_exps=[(i, ex[n]) for i, n in q_sp],
                             k_exps=[(i, ex[n]) for i, n in k_sp], w_dtype=w_dtype, pads=pads)
    q_rows, w_rows, fix_q, k_rows, k_scale, fix_k = prefill._renormalise_rows(
        qq[0], qq[1], w, kk[0], kk[1], fmt, d, block_q, block_n)
    rows, scale, exact = _renormalised_reference(qq[0].reshape(s_q * h, -1), qq[1].reshape(-1), fmt, d)
    assert _same(q_rows, rows.view(s_q, h, d))
    assert _same(w_rows, w.cpu().float() * scale.view(s_q, h))
    assert fix_q.tolist() == _block_any(~exact.view(s_q, h).all(dim=1), block_q)
    rows, scale, exact = _renormalised_reference(kk[0], kk[1], fmt, d)
    assert _same(k_rows, rows) and _same(k_scale, scale)
    assert fix_k.tolist() == _block_any(~exact, block_n)
    if case == "all-exact":
        assert fix_q.tolist() == [0] and fix_k.tolist() == [0]
    if case == "partial-blocks":  # key block 1 holds only the fold limit's rows, exact
        assert fix_q.tolist() == [1, 1, 1] and fix_k.tolist() == [0, 0, 1, 1]


@pytest.mark.skipif(ON_GPU, reason="the bounds checker runs Triton's CPU interpreter")
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("speculate", [False, True])
def test_mx_renormalise_launch_stays_in_bounds(fmt, speculate):
    """Every load and store of the renormalise launch inside its tensors: one row or key, S_q
    and S_k below and past the flag blocks (block_n below and above the launch's 64 rows),
    H not a power of two, padded rows of query values, scales and weights."""
    from .bounds import checked_bounds

    shapes = ((1, 1, 4, 64, 16, 16, (0, 0, 0)), (3, 17, 12, 128, 16, 16, (16, 1, 2)),
              (37, 100, 8, 64, 64, 256, (0, 3, 0)), (70, 300, 4, 128, 128, 32, (32, 0, 5)))
    for s_q, s_k, h, d, block_q, block_n, pads in shapes:
        qq, kk, w = _mx_operands(fmt, s_q, s_k, h, d, seed=s_q, w_dtype=torch.bfloat16, pads=pads)
        with checked_bounds(speculate=speculate) as state:
            prefill._renormalise_rows(qq[0], qq[1], w, kk[0], kk[1], fmt, d, block_q, block_n)
        assert state.accesses > 0


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("tile", ["small", "default"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_mx_fixup_recomputes_the_flagged_tiles(fmt, tile, w_dtype, poisoned):
    """End to end, rows at the fold limit, and with small tiles one inexact (row, head) in the
    partial last query block, one inexact key in the partial last key block and a query row
    past the fold limit (with the default tile S_q and S_k are smaller than one block): every
    row against the dequantised reference, the flagged tiles bitwise the bf16 upcast's."""
    s_q, s_k, h, d = 37, 150, 8, 128
    ex = _special_exps(fmt)
    q_sp = [((3, 0), "fold"), ((4, 1), "low_fold")]
    k_sp = [(7, "low_fold")]
    if tile == "small":  # with the default tile these would flag the one tile: no exact pass left
        # Inexact rows whose renormalised pass differs from the upcast in the logits' bits: a
        # span one past the exact range (MXFP4), a row scale of 2^-127 (subnormal in fp32).
        q_sp += [((35, 5), "wide"), ((34, 6), "zero"), ((20, 2), "past_fold")]
        k_sp += [(149, "wide"), (148, "zero")]
    qq, kk, w = _mx_operands(fmt, s_q, s_k, h, d, seed=77, q_exps=[(i, ex[n]) for i, n in q_sp],
                             k_exps=[(i, ex[n]) for i, n in k_sp], w_dtype=w_dtype)
    via = MX_VIA[fmt]
    cfg = dataclasses.replace(SMALL if tile == "small" else prefill.default_config(fmt, h, d, s_q), **via)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(8), empty_fraction=0.1, overhang=5,
                              device=DEVICE)
    out = run(qq, kk, w, ks, ke, config=cfg)
    q, k = F.dequantize_q(*qq), F.dequantize_k(*kk)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt, against_unquantised=False)
    # Row by row: the rows scaled by 2^+-100 would dominate one statistic over all rows.
    ref = R.fp8_fp4_mqa_logits_ref(qq, kk, w, ks, ke, True, 0, torch.float32)
    tight = 3e-5 if w_dtype == torch.bfloat16 else 5e-6
    for i in range(s_q):
        if ke[i].clamp(max=s_k) > ks[i]:
            assert R.calc_diff(out[i].float(), ref[i]) < tight, i
    # The flagged tiles hold the bf16 upcast's bits: those of the op without the renormalised pass.
    _, _, q_exact = _renormalised_reference(qq[0].reshape(s_q * h, -1), qq[1].reshape(-1), fmt, d)
    _, _, k_exact = _renormalised_reference(kk[0], kk[1], fmt, d)
    fix_q = torch.tensor(_block_any(~q_exact.view(s_q, h).all(dim=1), cfg.block_q)).repeat_interleave(cfg.block_q)
    fix_k = torch.tensor(_block_any(~k_exact, cfg.block_n)).repeat_interleave(cfg.block_n)
    flagged = (fix_q[:s_q, None] | fix_k[None, :s_k]).bool().to(DEVICE)
    assert flagged.any() == (tile == "small") and not flagged.all()
    upcast = run(qq, kk, w, ks, ke, config=dataclasses.replace(cfg, fp4_via_fp8=False, mxfp8_via_f16=False))
    assert _same(out[flagged], upcast[flagged])


def test_unaligned_shape_129_by_4100(poisoned):
    """The contract's odd shape, with the default (large) tiles: partial tiles on both axes."""
    q, k, w, qq, kk = make_inputs(129, 4100, 4, 32, "fp8", seed=5)
    ks, ke = W.random_windows(129, 4100, generator=torch.Generator().manual_seed(2), empty_fraction=0.1,
                              overhang=50, device=DEVICE)
    out = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke)
    assert out.stride(0) % 16 == 0
    check_logits(out, qq, kk, q, k, w, ks, ke, "fp8")


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_one_query_row_and_all_empty_rows(fmt, poisoned):
    q, k, w, qq, kk = make_inputs(1, 200, 8, 64, fmt, seed=9)
    ks = torch.tensor([17], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([190], dtype=torch.int32, device=DEVICE)
    check_logits(run(qq, kk, w, ks, ke), qq, kk, q, k, w, ks, ke, fmt)
    # Every row empty (including ks == ke == S_k): all -inf.
    q, k, w, qq, kk = make_inputs(5, 200, 8, 64, fmt, seed=9)
    ks = torch.tensor([0, 50, 199, 200, 200], dtype=torch.int32, device=DEVICE)
    out = run(qq, kk, w, ks, ks.clone())
    assert torch.isneginf(out).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4", "fp8-abs2"])
def test_all_zero_inputs_with_unit_scales(fmt, poisoned):
    """Zeros everywhere: logits are exactly 0 inside the windows and -inf outside (with
    relu_via_abs too: the all-zero row takes the scale 1, not an infinite one)."""
    fmt, fields = VARIANTS[fmt]
    s_q, s_k, h, d = 16, 100, 8, 64
    if fmt == "fp8":
        qq = (torch.zeros(s_q, h, d, device=DEVICE).to(F.FP8_DTYPE), None)
        kk = (torch.zeros(s_k, d, device=DEVICE).to(F.FP8_DTYPE), torch.ones(s_k, device=DEVICE))
    else:
        one = F.pack_ue8m0(torch.full((1, d // 32), 127)).item()
        vals = torch.zeros if fmt == "mxfp8" else (lambda *s, **kw: torch.zeros(*s[:-1], s[-1] // 2, **kw))
        qv = vals(s_q, h, d, device=DEVICE)
        kv = vals(s_k, d, device=DEVICE)
        qv = qv.to(F.FP8_DTYPE) if fmt == "mxfp8" else qv.to(torch.int8)
        kv = kv.to(F.FP8_DTYPE) if fmt == "mxfp8" else kv.to(torch.int8)
        qq = (qv, torch.full((s_q, h), one, dtype=torch.int32, device=DEVICE))
        kk = (kv, torch.full((s_k,), one, dtype=torch.int32, device=DEVICE))
    w = torch.randn(s_q, h, device=DEVICE)
    ks, ke = W.causal_tail(s_q, s_k, device=DEVICE)
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, **fields))
    mask = R.window_mask(ks, ke, s_k)
    assert torch.equal(torch.isneginf(out), ~mask)
    assert (out[mask] == 0).all()


@pytest.mark.parametrize("scale", [1e-30, 1e36])
def test_relu_via_abs_at_extreme_weights(scale, poisoned):
    """The row scale c follows the combined row over fp32's range: weights of 1e-30 and 1e36
    (logits near 1e40 are out of fp32 range, so 1e36 with small inputs) stay within the bound."""
    q, k, w, qq, kk = make_inputs(24, 100, 8, 64, "fp8", seed=3, scale=0.05)
    ks, ke = W.causal_tail(24, 100, device=DEVICE)
    w = w * scale
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, relu_via_abs=2))
    check_logits(out, qq, kk, q, k, w, ks, ke, "fp8", against_unquantised=False)


def test_linear_term_parts_sum_to_the_weighted_query_row():
    """relu_via_abs's linear half: per row, c is a power of two putting max |sum_h w q| in
    [128, 256), the E4M3 parts sum to (sum_h w q) / c within 2^-4 per part of the row's
    largest value, w / c and c / 2 are exact; an all-zero row takes c = 1."""
    s_q, h, d = 37, 8, 64
    _, _, w, qq, _ = make_inputs(s_q, 8, h, d, "fp8", seed=12)
    q = qq[0].clone()
    q[3] = 0
    w = w * torch.logspace(-6, 6, s_q, device=DEVICE)[:, None]  # rows over twelve decades
    qc = (q.float() * w[:, :, None]).sum(1)
    for n in (1, 2):
        lin, w_scaled, half = prefill.linear_term_parts(q, w, n)
        c = 2 * half
        assert torch.equal(torch.frexp(c).mantissa, torch.full_like(c, 0.5)), "c is not a power of two"
        assert c[3] == 1 and torch.equal(w_scaled, w / c[:, None])
        biggest = (qc.abs().amax(1) / c)[torch.arange(s_q) != 3]
        assert ((biggest >= 128) & (biggest < 256)).all()
        parts = lin.view(s_q, n, d).float().sum(1)
        err = (parts - qc / c[:, None]).abs().amax(1)
        assert (err <= 256 * 2.0 ** (-4 * n)).all(), (n, err.max())


@pytest.mark.parametrize("variant", ["fp8", "fp8-unroll2", "mxfp8", "mxfp4", "fp8-abs2"])
def test_bitwise_reruns_and_schedule_meta(variant):
    fmt, fields = VARIANTS[variant]
    s_q, s_k = shapes((16, 64), (2048, 32768))
    _, _, w, qq, kk = make_inputs(s_q, s_k, 8 if not ON_GPU else 64, 64 if not ON_GPU else 128, fmt, seed=4)
    ks, ke = W.zigzag(s_q, s_k, device=DEVICE)
    cfg = prefill.PrefillConfig(**fields)
    meta = tilefuse.get_mqa_logits_metadata(ks, ke, s_k, qq[0].shape[1])
    first = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=cfg)
    reruns = 20 if ON_GPU else 3
    for i in range(reruns):
        again = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=cfg, schedule_meta=meta if i % 2 else None)
        assert torch.equal(first.view(torch.int32), again.view(torch.int32)), f"rerun {i} differs"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_clean_schedules_are_bitwise_identical(fmt):
    """-inf written inside the logits kernel or by the separate pass: the same bits."""
    s_q, s_k = shapes((24, 200), (1024, 16384))
    _, _, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=31)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(4), empty_fraction=0.2,
                              overhang=9, device=DEVICE)
    tile = dict(block_q=SMALL.block_q, block_n=SMALL.block_n) if not ON_GPU else {}
    inline = run(qq, kk, w, ks, ke, config=prefill.PrefillConfig(**tile))
    separate = run(qq, kk, w, ks, ke, config=prefill.PrefillConfig(**tile, clean_pass=True))
    assert torch.equal(inline.view(torch.int32), separate.view(torch.int32))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_split_over_keys_is_bitwise_identical_to_one_key_block(fmt):
    """Few query rows, many keys: the key range split over many programs (small key blocks, both
    head steps, with and without schedule metadata) gives the bits of one key block per
    row block. Integer-valued inputs make every dot exact, so the comparison sees the schedule
    (which keys a program visits, where it writes) and not the order in which the interpreter's
    matmul sums a tile, which depends on the tile's shape. The few-row kernel (``heads_on_n``,
    the default at this S_q) sums the heads in its own order, so it is compared with itself."""
    s_q, s_k, h, d = shapes((16, 3000, 8, 64), (16, 65536, 64, 128))
    g = torch.Generator().manual_seed(41)
    q = torch.randint(-6, 7, (s_q, h, d), generator=g).to(torch.bfloat16)
    k = torch.randint(-6, 7, (s_k, d), generator=g).to(torch.bfloat16)
    w = torch.randn(s_q, h, generator=g).to(DEVICE)
    qq = tuple(None if t is None else t.to(DEVICE) for t in F.quantize_q(q, fmt))
    kk = tuple(t.to(DEVICE) for t in F.quantize_k(k, fmt))
    ks, ke = W.causal_tail(s_q, s_k, device=DEVICE)
    ks[3], ke[5] = s_k // 2, ks[5]  # a half window and an empty row
    meta = tilefuse.get_mqa_logits_metadata(ks, ke, s_k, h)
    one_block = 4096 if not ON_GPU else 256  # on a GPU: the widest tile that fits
    unsplit = run(qq, kk, w, ks, ke, config=prefill.PrefillConfig(block_q=16, block_n=one_block), clean_logits=True)
    splits = [prefill.PrefillConfig(block_q=16, block_n=32), prefill.PrefillConfig(block_q=16, block_n=64,
              head_unroll=2)]
    for i, cfg in enumerate(splits):
        out = run(qq, kk, w, ks, ke, config=cfg, clean_logits=True, schedule_meta=meta if i % 2 else None)
        assert torch.equal(out.view(torch.int32), unsplit.view(torch.int32)), f"split config {cfg} differs"
    # The default: the few-row kernel (FP8, and MX's pass over renormalised rows) over few or
    # many key blocks, with and without metadata.
    assert prefill.default_config("fp8", h, d, s_q).heads_on_n
    # On a GPU the key tile is the MMA's M side, whose shape sets the order of the head sum:
    # there the split is over query-row groups at the default key tile.
    few = (prefill.PrefillConfig(block_q=16, block_n=128 if ON_GPU else one_block // 2, heads_on_n=True)
           if fmt == "fp8" else None)
    unsplit = run(qq, kk, w, ks, ke, config=few, clean_logits=True)
    if fmt == "fp8":
        splits = [dataclasses.replace(few, block_q=32) if ON_GPU else dataclasses.replace(few, block_n=32), None]
    else:
        splits = [None]
    for i, cfg in enumerate(splits):
        out = run(qq, kk, w, ks, ke, config=cfg, clean_logits=True, schedule_meta=None if i % 2 else meta)
        assert torch.equal(out.view(torch.int32), unsplit.view(torch.int32)), f"few-row config {cfg} differs"


def test_metadata_depends_only_on_arguments():
    ks, ke = W.zigzag(128, 1024, device=DEVICE)
    a = tilefuse.get_mqa_logits_metadata(ks, ke, 1024, 64)
    b = tilefuse.get_mqa_logits_metadata(ks.clone(), ke.clone(), 1024, 64)
    assert a.dtype == torch.int32 and a.shape == (1 + 2, 2) and torch.equal(a, b)
    # Query block 0 (rows 0..63) ends at key 128*... : [lo, hi) brackets every window.
    block_n = int(a[0, 1])
    for blk in range(2):
        lo, hi = (int(x) for x in a[1 + blk])
        rows = slice(blk * 64, (blk + 1) * 64)
        assert lo * block_n <= int(ks[rows].min()) and hi * block_n >= int(ke[rows].max())


def test_fp8_mqa_logits_matches_deepgemm_signature_and_compat_module():
    q, k, w, qq, kk = make_inputs(16, 64, 4, 32, "fp8", seed=1)
    ks, ke = W.causal_tail(16, 64, device=DEVICE)
    a = deep_gemm.fp8_mqa_logits(qq[0], kk, w, ks, ke)  # positional, DeepGEMM order and defaults
    b = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, True, 0, torch.float32, None)
    assert torch.equal(a, b)
    assert deep_gemm.fp8_fp4_mqa_logits is tilefuse.fp8_fp4_mqa_logits


def test_ops_run_the_triton_kernel(record_launches):
    """On CPU tensors the op goes through the Triton kernel (interpreter), not the reference."""
    launched = record_launches(kern, "prefill_logits_kernel")
    _, _, w, qq, kk = make_inputs(16, 64, 4, 32, "fp8", seed=1)
    ks, ke = W.causal_tail(16, 64, device=DEVICE)
    tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=SMALL)
    assert launched == [(2, 1)]


def test_fake_impl_traces_without_data():
    """The custom op's fake implementation gives the real output's shape, dtype and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, _, w, qq, kk = make_inputs(16, 100, 4, 32, "mxfp8", seed=1)
    ks, ke = W.causal_tail(16, 100, device=DEVICE)
    real = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, logits_dtype=torch.bfloat16, config=SMALL)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = [mode.from_tensor(t) for t in (qq[0], qq[1], kk[0], kk[1], w, ks, ke)]
        fake = torch.ops.tilefuse.mqa_logits(*args, True, 0, torch.bfloat16, prefill.config_key(SMALL))
        assert torch.ops.tilefuse.mqa_logits_out(*args, True, 0, prefill.config_key(SMALL),
                                                 mode.from_tensor(real)) is None
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype


# ---------------------------------------------------------------------------------------
# Bad inputs: a clear error naming the argument, never a wrong answer.
# ---------------------------------------------------------------------------------------
def _good():
    _, _, w, qq, kk = make_inputs(8, 64, 4, 64, "mxfp8", seed=0)
    ks, ke = W.causal_tail(8, 64, device=DEVICE)
    return dict(q=qq, kv=kk, weights=w, cu_seq_len_k_start=ks, cu_seq_len_k_end=ke)


def _with(**changes):
    args = _good()
    for key, fn in changes.items():
        args[key] = fn(args[key])
    return args


def _misaligned(t):
    """The same values at a base address 1 byte past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 16, dtype=torch.uint8, device=t.device)
    out = buf[1:1 + t.numel()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


BAD_INPUTS = {
    "q-not-tuple": (TypeError, "q:", dict(q=lambda q: q[0])),
    "q-dtype": (TypeError, "q:", dict(q=lambda q: (q[0].float(), q[1]))),
    "q-heads": (ValueError, "head count", dict(q=lambda q: (q[0][:, :3].contiguous(), q[1][:, :3].contiguous()))),
    "q-head-dim": (ValueError, "head dim", dict(q=lambda q: (q[0][..., :48].contiguous(), q[1]))),
    "q-strided": (ValueError, "q:", dict(q=lambda q: (q[0].transpose(0, 1).contiguous().transpose(0, 1), q[1]))),
    "q-sf-dtype": (TypeError, "q[1]", dict(q=lambda q: (q[0], q[1].float()))),
    "q-sf-shape": (ValueError, "q[1]", dict(q=lambda q: (q[0], q[1][:, :2].contiguous()))),
    "q-misaligned": (ValueError, "16-byte aligned", dict(q=lambda q: (_misaligned(q[0]), q[1]))),
    "k-misaligned": (ValueError, "16-byte aligned", dict(kv=lambda kv: (_misaligned(kv[0]), kv[1]))),
    "k-dtype": (TypeError, "kv[0]", dict(kv=lambda kv: (kv[0].view(torch.int8), kv[1]))),
    "k-dim": (ValueError, "kv[0]", dict(kv=lambda kv: (kv[0][:, :32].contiguous(), kv[1]))),
    "k-scale-dtype": (TypeError, "kv[1]", dict(kv=lambda kv: (kv[0], kv[1].float()))),
    "k-scale-shape": (ValueError, "kv[1]", dict(kv=lambda kv: (kv[0], kv[1][:10]))),
    "weights-dtype": (TypeError, "weights", dict(weights=lambda w: w.half())),
    "weights-shape": (ValueError, "weights", dict(weights=lambda w: w[:, :2])),
    "weights-stride": (ValueError, "weights", dict(weights=lambda w: w.t().contiguous().t())),
    "ks-dtype": (TypeError, "cu_seq_len_k_start", dict(cu_seq_len_k_start=lambda t: t.long())),
    "ke-shape": (ValueError, "cu_seq_len_k_end", dict(cu_seq_len_k_end=lambda t: t[:4])),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise(case):
    exc, text, changes = BAD_INPUTS[case]
    with pytest.raises(exc, match=text.replace("[", r"\[").replace("]", r"\]")):
        tilefuse.fp8_fp4_mqa_logits(**_with(**changes))


@pytest.fixture
def checks_cached(monkeypatch):
    """The validation cache as CUDA tensors use it (on CPU the tensors report device 0), empty
    at the start; yields a list counting the full checks run."""
    if not ON_GPU:
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(prefill, "_CHECKED", {})
    full = []
    real = prefill._check_inputs_full
    monkeypatch.setattr(prefill, "_check_inputs_full", lambda *a: full.append(1) or real(*a))
    return full


def test_checked_signatures_skip_the_checks_and_nothing_else(checks_cached):
    """A repeated valid call reads its result from the cache; every bad input after it (each a
    new signature) still raises, and the good call still hits."""
    good = _good()
    first = tilefuse.fp8_fp4_mqa_logits(**good)
    again = tilefuse.fp8_fp4_mqa_logits(**good)
    assert len(checks_cached) == 1 and torch.equal(first, again)
    for exc, text, changes in BAD_INPUTS.values():
        with pytest.raises(exc, match=text.replace("[", r"\[").replace("]", r"\]")):
            tilefuse.fp8_fp4_mqa_logits(**_with(**changes))
    with pytest.raises(ValueError, match="max_seqlen_k"):
        tilefuse.fp8_fp4_mqa_logits(**good, max_seqlen_k=-1)
    with pytest.raises(ValueError, match="max_seqlen_k"):  # True == 1, but not an int here
        tilefuse.fp8_fp4_mqa_logits(**good, max_seqlen_k=True)
    misaligned = torch.empty(good["kv"][0].numel() + 1, dtype=torch.uint8, device=DEVICE)[1:]
    k_off = misaligned.view(good["kv"][0].dtype).view(good["kv"][0].shape)
    with pytest.raises(ValueError, match="kv\\[0\\]: data pointer"):
        tilefuse.fp8_fp4_mqa_logits(**dict(good, kv=(k_off, good["kv"][1])))
    n = len(checks_cached)
    tilefuse.fp8_fp4_mqa_logits(**good)
    assert len(checks_cached) == n


def test_bad_scalars_and_modes_raise():
    args = _good()
    with pytest.raises(ValueError, match="max_seqlen_k"):
        tilefuse.fp8_fp4_mqa_logits(**args, max_seqlen_k=-1)
    with pytest.raises(TypeError, match="logits_dtype"):
        tilefuse.fp8_fp4_mqa_logits(**args, logits_dtype=torch.float16)
    with pytest.raises(ValueError, match="schedule_meta"):
        tilefuse.fp8_fp4_mqa_logits(**args, schedule_meta=torch.zeros(7, 2, dtype=torch.int32, device=DEVICE))
    q, kv = args["q"], args["kv"]
    with pytest.raises(TypeError, match=r"kv\[1\]"):  # FP8 queries with MX key scales
        tilefuse.fp8_fp4_mqa_logits((q[0], None), kv, *list(args.values())[2:])
    with pytest.raises(ValueError, match="unknown field"):
        tilefuse.set_config_override("prefill", block_z=3)


# ---------------------------------------------------------------------------------------
# Full-size checks on the GPU (the reference shapes of the contract).
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("s_q,s_k", [(2048, 32768), (4096, 8192), (128, 32768), (16, 65536)])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_reference_shapes_on_gpu(s_q, s_k, fmt, poisoned):
    q, k, w, qq, kk = make_inputs(s_q, s_k, 64, 128, fmt, seed=s_q)
    ks, ke = W.causal_tail(s_q, s_k, device=DEVICE)
    out = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_traces_under_torch_compile_without_graph_breaks(fmt):
    """fullgraph=True fails on any graph break: the op must be one opaque custom op."""
    _, _, w, qq, kk = make_inputs(16, 96, 4, 64, fmt, seed=8)
    ks, ke = W.causal_tail(16, 96, device=DEVICE)
    real = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, logits_dtype=torch.bfloat16, config=SMALL)

    def logits(qv, qs, k, kscale, w, ks, ke):
        return tilefuse.fp8_fp4_mqa_logits((qv, qs), (k, kscale), w, ks, ke, True, 0, torch.bfloat16,
                                           config=SMALL)

    compiled = torch.compile(logits, fullgraph=True, backend="aot_eager")
    got = compiled(qq[0], qq[1], kk[0], kk[1], w, ks, ke)
    assert torch.equal(got.view(torch.int16), real.view(torch.int16))


def test_custom_ops_take_a_config_key_and_declare_out_mutated():
    """The ops torch.compile sees carry the config as one int (not its fields), and the
    out variant declares its buffer mutated."""
    names = [a.name for a in torch.ops.tilefuse.mqa_logits.default._schema.arguments]
    assert names == ["q", "q_sf", "k", "k_scale", "weights", "ks", "ke", "clean_logits", "max_seqlen_k",
                     "logits_dtype", "config"]
    out_args = torch.ops.tilefuse.mqa_logits_out.default._schema.arguments
    assert [a.name for a in out_args][-1] == "out" and out_args[-1].alias_info.is_write
    assert prefill.config_of_key(prefill.config_key(SMALL)) == SMALL


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_traces_with_out_under_torch_compile(fmt):
    """out= under torch.compile goes through the mutating op: the same bits as eager, in place."""
    _, _, w, qq, kk = make_inputs(16, 96, 4, 64, fmt, seed=9)
    ks, ke = W.causal_tail(16, 96, device=DEVICE)
    real = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=SMALL)

    def logits(qv, qs, k, kscale, w, ks, ke, out):
        return tilefuse.fp8_fp4_mqa_logits((qv, qs), (k, kscale), w, ks, ke, config=SMALL, out=out) * 1

    buf = torch.full((16, 96), float("nan"), device=DEVICE)
    got = torch.compile(logits, fullgraph=True, backend="aot_eager")(qq[0], qq[1], kk[0], kk[1], w, ks, ke, buf)
    assert torch.equal(got.view(torch.int32), real.view(torch.int32))
    assert torch.equal(buf.view(torch.int32), real.view(torch.int32))


# ---------------------------------------------------------------------------------------
# out=: a caller-owned buffer, validated by shape and strides only, reused across calls.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["full+clean", "full", "compressed+clean"])
def test_out_buffer_is_written_and_reused(layout, poisoned):
    """A NaN-poisoned buffer with a padded row stride: every element the op defines is written,
    nothing past the columns is touched, the op returns the buffer itself, and a second call
    with other inputs into the same buffer gives that call's logits."""
    s_q, s_k = 24, 150
    clean = layout.endswith("+clean")
    max_seqlen_k = 160 if layout.startswith("compressed") else 0
    cols = max_seqlen_k or s_k
    # Row stride a multiple of 4 elements (16-byte rows), not of 16 for S_k = 150.
    storage = torch.full((s_q, cols + 16 - cols % 4), float("nan"), device=DEVICE)
    buf = storage[:, :cols]
    for seed in (1, 2):
        q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, "fp8", seed=seed)
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(seed), empty_fraction=0.2,
                                  device=DEVICE)
        got = run(qq, kk, w, ks, ke, clean_logits=clean, max_seqlen_k=max_seqlen_k, out=buf)
        assert got is buf
        check_logits(buf, qq, kk, q, k, w, ks, ke, "fp8", clean=clean, max_seqlen_k=max_seqlen_k)
        fresh = run(qq, kk, w, ks, ke, clean_logits=clean, max_seqlen_k=max_seqlen_k)
        written = ~torch.isnan(fresh)
        assert torch.equal(buf[written].view(torch.int32), fresh[written].view(torch.int32))
        assert storage[:, cols:].isnan().all(), "the op wrote past the buffer's columns"


@pytest.mark.parametrize("fmt,config", [
    ("fp8", SMALL), ("fp8", None), ("fp8", dataclasses.replace(SMALL, heads_on_n=True)),
    ("mxfp4", SMALL), ("mxfp4", dataclasses.replace(SMALL, fp4_via_fp8=True)),
    ("mxfp8", dataclasses.replace(SMALL, mxfp8_via_f16=True)), ("fp8", dataclasses.replace(SMALL, relu_via_abs=2)),
    ("mxfp8", dataclasses.replace(SMALL, mxfp8_via_f16=True, heads_on_n=True, mx_inline=2)),
    ("mxfp4", dataclasses.replace(SMALL, fp4_via_fp8=True, heads_on_n=True, mx_inline=2)),
    ("mxfp8", dataclasses.replace(SMALL, mxfp8_via_f16=True, heads_on_n=True, mx_inline=3)),
    ("mxfp4", dataclasses.replace(SMALL, fp4_via_fp8=True, heads_on_n=True, mx_inline=3))])
def test_one_layout_with_new_tensors_every_call(fmt, config, poisoned, monkeypatch):
    """Eager calls of one layout replay the launches of the first ones with their own tensors
    (new queries, keys, weights, windows and outputs every call, in any order) and new scratch
    buffers (the MX rows renormalised, the linear term of relu_via_abs)."""
    monkeypatch.setattr(prefill, "_REPLAYS", {})
    s_q, s_k = 24, 152
    buf = torch.full((s_q, s_k), float("nan"), device=DEVICE)
    inputs = []
    for seed in (1, 2, 3):
        q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=seed)
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(seed), empty_fraction=0.2,
                                  device=DEVICE)
        inputs.append((q, k, w, qq, kk, ks, ke))
    for step, i in enumerate((0, 1, 2, 0, 2, 1, 1)):
        q, k, w, qq, kk, ks, ke = inputs[i]
        own = step % 2 == 0
        got = run(qq, kk, w, ks, ke, config=config) if own else run(qq, kk, w, ks, ke, config=config, out=buf)
        check_logits(got, qq, kk, q, k, w, ks, ke, fmt)
    entries = list(prefill._REPLAYS.values())
    replayed = [v for v in entries if v.__class__ is tuple]
    assert len(entries) == 2 and len(replayed) == 2, entries


def test_sizes_changing_every_call(checks_cached, monkeypatch):
    """Chunked prefill: S_q and S_k change every call. The checks run once for the layout (the
    signature leaves the sizes out and compares them per call), the layout's launches are
    recorded at its second call and replayed at the sizes of every later one, and every call
    is right; a call whose per-row tensors disagree with q still raises."""
    monkeypatch.setattr(prefill, "_REPLAYS", {})
    for i, (s_q, s_k) in enumerate(((24, 152), (40, 100), (17, 300), (24, 168), (64, 64), (3, 2), (33, 80))):
        q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, "fp8", seed=70 + i)
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(i), empty_fraction=0.2,
                                  device=DEVICE)
        check_logits(run(qq, kk, w, ks, ke), qq, kk, q, k, w, ks, ke, "fp8")
    assert len(checks_cached) == 1
    entries = list(prefill._REPLAYS.values())  # the few-row and the 2-D tile layouts
    assert len(entries) == 2 and all(e.__class__ is tuple for e in entries), entries
    with pytest.raises(ValueError, match="weights: expected"):
        run(qq, kk, w[:-1], ks, ke)
    with pytest.raises(ValueError, match=r"kv\[1\]: expected"):
        run(qq, (kk[0], kk[1][:-1]), w, ks, ke)
    with pytest.raises(ValueError, match="cu_seq_len_k_end"):
        run(qq, kk, w, ks, ke[:-1])


@pytest.mark.parametrize("fmt,config", [
    ("fp8", None), ("mxfp4", None), ("mxfp8", None), ("fp8", dataclasses.replace(SMALL, relu_via_abs=2)),
    ("mxfp8", dataclasses.replace(SMALL, mxfp8_via_f16=True, heads_on_n=True)),
    ("mxfp4", dataclasses.replace(SMALL, fp4_via_fp8=True, heads_on_n=True, mx_inline=1))])
@pytest.mark.parametrize("clean,compressed", [(False, False), (True, False), (True, True)])
def test_replays_follow_the_sizes(fmt, config, clean, compressed, poisoned, monkeypatch):
    """A layout's replay at new sizes every call (every pass of the default paths: the MX rows
    renormalised into scratch buffers sized per call, the linear term of relu_via_abs, the
    -inf fill), new and caller-owned outputs, each call against the reference."""
    monkeypatch.setattr(prefill, "_REPLAYS", {})
    sizes = ((40, 150), (35, 64), (48, 300), (36, 33), (41, 151), (47, 290), (33, 17), (44, 100))
    storage = torch.full((48, 320), float("nan"), device=DEVICE)
    for i, (s_q, s_k) in enumerate(sizes):
        q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, fmt, seed=80 + i)
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(i), empty_fraction=0.2,
                                  device=DEVICE)
        max_seqlen_k = int((ke - ks).max()) + 3 if compressed else 0
        cols = max_seqlen_k or s_k
        out = storage[:s_q, :cols] if i % 2 else None
        got = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, clean, max_seqlen_k, config=config, out=out)
        check_logits(got, qq, kk, q, k, w, ks, ke, fmt, clean=clean, max_seqlen_k=max_seqlen_k)
    assert prefill._REPLAYS and all(e.__class__ is tuple for e in prefill._REPLAYS.values()), prefill._REPLAYS
    # The last call was a replay: the ordinary path gives the same bits.
    monkeypatch.setattr(prefill, "_REPLAYS", {})
    again = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, clean, max_seqlen_k, config=config)
    written = ~torch.isnan(again)
    assert torch.equal(got[written].view(torch.int32), again[written].view(torch.int32))


def test_a_launch_that_does_not_follow_the_sizes_is_not_replayed(monkeypatch):
    """Replays are keyed without the sizes: a layout with a launch that does not say how it
    follows them (here the linear term of relu_via_abs) takes the ordinary path every call."""
    monkeypatch.setattr(prefill, "_REPLAYS", {})
    monkeypatch.setattr(prefill, "_SIZED_ROWS", None)
    config = dataclasses.replace(SMALL, relu_via_abs=2)
    for i, (s_q, s_k) in enumerate(((40, 150), (35, 64), (48, 300), (36, 33))):
        q, k, w, qq, kk = make_inputs(s_q, s_k, 8, 64, "fp8", seed=90 + i)
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(i), device=DEVICE)
        check_logits(run(qq, kk, w, ks, ke, config=config), qq, kk, q, k, w, ks, ke, "fp8")
    assert list(prefill._REPLAYS.values()) == [_jit.NOT_REPLAYABLE]


def test_fp8_mqa_logits_takes_out():
    _, _, w, qq, kk = make_inputs(16, 64, 4, 32, "fp8", seed=1)
    ks, ke = W.causal_tail(16, 64, device=DEVICE)
    buf = torch.empty(16, 64, device=DEVICE)
    assert tilefuse.fp8_mqa_logits(qq[0], kk, w, ks, ke, out=buf) is buf
    assert torch.equal(buf, tilefuse.fp8_mqa_logits(qq[0], kk, w, ks, ke))


BAD_OUT = {
    "not-a-tensor": (TypeError, "out:", lambda b: b.tolist()),
    "dtype": (TypeError, "out:", lambda b: b.bfloat16()),
    "shape": (ValueError, "out:", lambda b: b[:, :60]),
    "rows": (ValueError, "out:", lambda b: b[:7]),
    "last-stride": (ValueError, "out:", lambda b: b.t().contiguous().t()),
    "row-stride": (ValueError, "out:", lambda b: torch.empty(8, 65, device=DEVICE)[:, :64]),
    "overlapping-rows": (ValueError, "out:", lambda b: b[:1].expand(8, 64)),
    "misaligned": (ValueError, "out: data pointer", lambda b: torch.empty(b.numel() + 4, device=DEVICE)[1:].view(-1)[
        :b.numel()].view(b.shape)),
}


@pytest.mark.parametrize("case", list(BAD_OUT))
def test_bad_out_raises(case):
    exc, text, make = BAD_OUT[case]
    args = _good()
    with pytest.raises(exc, match=text):
        tilefuse.fp8_fp4_mqa_logits(**args, out=make(torch.empty(8, 64, device=DEVICE)))


# ---------------------------------------------------------------------------------------
# Window values: found by the kernels (no host sync), raised at the next call or at
# check_errors(); in checked mode raised at once. Never an access out of bounds.
# ---------------------------------------------------------------------------------------
BAD_WINDOWS = {  # (argument named, ks, ke from the good causal windows of 8 rows over 64 keys, max_seqlen_k)
    "ks-negative": ("cu_seq_len_k_start", lambda ks, ke: (ks - 1000, ke), 0),
    "ks-after-ke": ("ks <= ke", lambda ks, ke: (ks + 1000, ke), 0),
    "longer-than-max-seqlen": ("max_seqlen_k", lambda ks, ke: (ks, ke), 3),  # windows are 57..64 keys long
    "compressed-ks-negative": ("cu_seq_len_k_start", lambda ks, ke: (ks - 1000, ke + 2000), 64),
}


def _bad_window_args(case):
    text, change, max_seqlen_k = BAD_WINDOWS[case]
    args = _good()
    args["cu_seq_len_k_start"], args["cu_seq_len_k_end"] = change(args["cu_seq_len_k_start"],
                                                                  args["cu_seq_len_k_end"])
    return text, dict(args, max_seqlen_k=max_seqlen_k)


@pytest.mark.parametrize("case", list(BAD_WINDOWS))
def test_window_errors_raise_at_the_next_call_or_check_errors(case):
    text, args = _bad_window_args(case)
    good = _good()
    tilefuse.check_errors()  # nothing pending from earlier tests
    # A poisoned margin around the output: the clamped windows keep every store inside it.
    cols = args["max_seqlen_k"] or 64
    storage = torch.full((10, cols + 32 + (-cols) % 4), float("nan"), device=DEVICE)
    out = storage[1:9, 16:16 + cols]
    tilefuse.fp8_fp4_mqa_logits(**args, out=out)  # no host sync: nothing raised yet
    assert storage[0].isnan().all() and storage[9].isnan().all()
    assert storage[:, :16].isnan().all() and storage[:, 16 + cols:].isnan().all(), "a store outside the buffer"
    with pytest.raises(tilefuse.DeviceValueError, match=text):
        tilefuse.fp8_fp4_mqa_logits(**good)  # the next call on the device raises it
    tilefuse.fp8_fp4_mqa_logits(**good)  # ... once
    tilefuse.fp8_fp4_mqa_logits(**args)
    with pytest.raises(ValueError, match=text):
        tilefuse.check_errors()
    tilefuse.check_errors()


@pytest.mark.parametrize("case", list(BAD_WINDOWS))
def test_window_errors_raise_at_once_in_checked_mode(case):
    text, args = _bad_window_args(case)
    with tilefuse.checked_mode():
        with pytest.raises(ValueError, match=text):
            tilefuse.fp8_fp4_mqa_logits(**args)
        tilefuse.check_errors()  # raised before any launch: nothing recorded
        tilefuse.fp8_fp4_mqa_logits(**_good())
    assert not tilefuse._errors.checked()


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    from tilefuse import _validate

    if ON_GPU:
        pytest.skip("CPU tensors on a GPU machine take the same branch")
    monkeypatch.setattr(_validate, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="q: tilefuse kernels need a CUDA tensor.*TRITON_INTERPRET"):
        tilefuse.fp8_fp4_mqa_logits(**_good())


# ---------------------------------------------------------------------------------------
# No compile after warm-up: the launch keys of any shape are those warm-up compiled.
# ---------------------------------------------------------------------------------------
_PREFILL_KERNELS = [f"{kern.__name__}:{name}" for name in (
    "prefill_logits_kernel", "prefill_heads_on_n_kernel", "fill_outside_windows_kernel",
    "mx_rows_renormalise_kernel", "linear_term_parts_kernel")] + [
    "tilefuse.indexer._prefill_kernel_gluon:prefill_logits_gluon_kernel",
    "tilefuse.indexer._prefill_kernel_sm100:prefill_logits_mx_kernel"]


def _launch_keys(calls) -> set:
    """Triton's specialisation key of every kernel launch the calls make (kernels not run)."""
    import importlib

    from tilefuse import _jit
    from tilefuse.kernelcheck.variants import tracing

    kernels = {path: getattr(importlib.import_module(path.partition(":")[0]), path.partition(":")[2])
               for path in _PREFILL_KERNELS}
    with tracing(*_PREFILL_KERNELS) as launches:
        for call in calls:
            call()
    return {(launch.function, _jit.specialization_key(kernels[launch.function], launch.arguments, launch.options))
            for launch in launches}


def _shape_calls(fmt, h, d, clean, compressed, w_dtype, g):
    """Calls over S_q, S_k, windows and strides chosen to move every specialisation: sizes of 1,
    multiples of 16 and odd ones, padded query/key/weight rows, sliced windows and key scales,
    in every size class (prefill.size_class)."""
    calls = []
    for s_q, s_k, pad, offset in ((1, 1, 0, 0), (16, 64, 16, 1), (33, 300, 32, 3), (64, 1024, 0, 2),
                                  (37, 17, 48, 0), (128, 160, 16, 5), (200, 4001, 0, 1), (97, 12000, 16, 2),
                                  (300, 7999, 0, 3)):
        _, _, w, qq, kk = make_inputs(s_q, s_k, h, d, fmt, seed=s_q)
        q_vals = torch.zeros(s_q, h * qq[0].shape[2] + pad, dtype=qq[0].dtype)[:, :h * qq[0].shape[2]]
        q_vals = q_vals.view(s_q, h, qq[0].shape[2])
        q_vals.copy_(qq[0])
        w_rows = torch.zeros(s_q, h + offset + 3).to(w_dtype)[:, offset:offset + h]
        scale_buf = torch.zeros(s_k + offset, dtype=kk[1].dtype)
        k_sf = scale_buf[offset:]
        k_sf.copy_(kk[1])
        win = torch.zeros(2 * s_q + 2 * offset, dtype=torch.int32)
        ks, ke = win[offset:offset + s_q], win[s_q + 2 * offset:]
        a, b = W.random_windows(s_q, s_k, generator=g)
        ks.copy_(a)
        ke.copy_(b)
        max_seqlen_k = s_k if compressed else 0
        calls.append(lambda q=(q_vals, qq[1]), kv=(kk[0], k_sf), w=w_rows, ks=ks, ke=ke, m=max_seqlen_k:
                     tilefuse.fp8_fp4_mqa_logits(q, kv, w, ks, ke, clean, m))
    return calls


def test_size_classes_and_their_defaults():
    """Hopper's FP8 default by call size: the few-row kernel up to 32 rows and for few-row calls,
    the plain Gluon loop (one launch) for small calls, the head sum through |s| above (fp32 and
    bf16 logits); elsewhere only the row count matters."""
    sc = prefill.size_class
    assert [sc(32, 10**9), sc(33, 4096), sc(128, 4096), sc(128, 4097), sc(256, 4096), sc(257, 4096), sc(512, 4096),
            sc(512, 4097), sc(128, 8193)] == [0, 1, 1, 2, 2, 3, 3, 4, 3]
    for logits in (torch.float32, torch.bfloat16):
        cfg = functools.partial(prefill.default_config, "fp8", 64, 128, logits_dtype=logits, arch=9)
        assert cfg(128, num_keys=4096).heads_on_n and cfg(16, num_keys=65536).heads_on_n
        small, big = cfg(512, num_keys=4096), cfg(2048, num_keys=32768)
        assert small.gluon and small.relu_via_abs == 0 and big.gluon and big.relu_via_abs == 2
        assert cfg(2048) == big  # no size given: the largest class
    for arch in (None, 10):
        assert prefill.default_config("fp8", 64, 128, 128, arch=arch, num_keys=4096) == prefill.default_config(
            "fp8", 64, 128, 128, arch=arch, num_keys=10**6)
    assert prefill.default_config("mxfp8", 64, 128, 512, arch=9, num_keys=4096) == prefill.default_config(
        "mxfp8", 64, 128, 512, arch=9, num_keys=10**6)
    # at most 32 rows: the few-row kernel over 4 rows a program (FP8), MX in one launch on Hopper
    assert prefill.default_config("fp8", 64, 128, 32, arch=9, num_keys=4096).block_q == 4
    for fmt in ("mxfp8", "mxfp4"):
        few = prefill.default_config(fmt, 64, 128, 32, arch=9, num_keys=4096)
        assert few.mx_inline and few.heads_on_n and few.block_q == 8
        assert not prefill.default_config(fmt, 64, 128, 32, arch=10, num_keys=4096).mx_inline
        # a few-row call up to MX_INLINE_CALL pairs: the query rows renormalised once, keys inline
        assert prefill.default_config(fmt, 64, 128, 33, arch=9, num_keys=4096).mx_inline == 3
        assert prefill.default_config(fmt, 64, 128, 128, arch=9, num_keys=4096).mx_inline == 3
        assert not prefill.default_config(fmt, 64, 128, 128, arch=9, num_keys=4097).mx_inline
        assert not prefill.default_config(fmt, 64, 128, 128, arch=10, num_keys=4096).mx_inline


@pytest.mark.parametrize("arch", [None, 9, 10])
@pytest.mark.parametrize("fmt,h,d,clean,compressed,w_dtype", [
    ("fp8", 8, 64, False, False, torch.float32),
    ("fp8", 64, 128, True, True, torch.bfloat16),
    ("mxfp8", 8, 64, True, False, torch.float32),
    ("mxfp4", 8, 128, False, True, torch.float32),
])
def test_no_shape_compiles_past_warmup(fmt, h, d, clean, compressed, w_dtype, arch, monkeypatch):
    """For a model configuration, the launch keys of every (S_q, S_k, windows, strides) are
    among those of ``warmup_calls``: after warm-up nothing compiles. Kernels are recorded, not
    run, so the GPU paths (``arch`` 9: the Gluon loop; 10: the block-scaled MX kernel) are
    checked here too; the keys are Triton's own, as its CUDA launcher computes them."""
    from tilefuse.indexer import _dispatch

    if ON_GPU:
        pytest.skip("CPU tensors traced as on the GPU: runs on CPU machines")
    monkeypatch.setattr(_dispatch, "capability_major", lambda device: arch)
    warm = _launch_keys(prefill.warmup_calls(fmt, h, d, w_dtype, torch.float32, clean, compressed, DEVICE))
    seen = _launch_keys(_shape_calls(fmt, h, d, clean, compressed, w_dtype, torch.Generator().manual_seed(3)))
    assert seen, "nothing launched"
    assert seen <= warm, f"keys outside warm-up: {sorted(seen - warm)}"


HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


def _gluon_case(fmt, layout, windows, seed):
    """A 1000 x 9000, H = 64 case with uneven windows, empty rows, partial tiles and (zig-zag)
    whole tiles no row sees, in one output layout: inputs, windows and the op's layout kwargs."""
    s_q, s_k = 1000, 9000
    q, k, w, qq, kk = make_inputs(s_q, s_k, 64, 128, fmt, seed=seed)
    if windows == "random":
        ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(5), empty_fraction=0.1,
                                  overhang=9, device=DEVICE)
    else:
        ks, ke = W.zigzag(s_q, s_k, device=DEVICE)
    kwargs = dict(clean_logits=layout != "raw", max_seqlen_k=4096 if layout == "compressed" else 0,
                  logits_dtype=torch.bfloat16 if layout == "bf16" else torch.float32)
    if layout == "compressed":
        ke = torch.minimum(ke, ks + 4096)
    return (q, k, w, qq, kk, ks, ke), kwargs


def _same_bits(a, b) -> bool:
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.skipif(not HOPPER, reason="the Gluon head loop runs on Hopper only")
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("layout", ["clean", "raw", "compressed", "bf16"])
@pytest.mark.parametrize("tile", [(4, 2), (8, 3), (4, 4), (4, 3)])
@pytest.mark.parametrize("windows", ["random", "zigzag"])
def test_gluon_head_loop_is_bitwise_the_triton_kernel(fmt, layout, tile, windows, poisoned):
    """Same tile, same head order, same MMA: the Gluon kernel (async wgmma) writes the Triton
    kernel's bits in every case of ``_gluon_case``."""
    (_, _, w, qq, kk, ks, ke), kwargs = _gluon_case(fmt, layout, windows, seed=51)
    num_warps, num_buf = tile
    base = prefill.PrefillConfig(block_q=64, block_n=128, num_warps=num_warps, num_stages=num_buf,
                                 fp4_via_fp8=fmt == "mxfp4", mxfp8_via_f16=fmt == "mxfp8")
    ref = run(qq, kk, w, ks, ke, config=base, **kwargs)
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(base, gluon=True), **kwargs)
    assert _same_bits(out, ref)


@pytest.mark.skipif(not HOPPER, reason="the Gluon head loop runs on Hopper only")
@pytest.mark.parametrize("h", [4, 8, 12])
@pytest.mark.parametrize("num_buf", [2, 3, 4])
@pytest.mark.parametrize("parts", [0, 2])
def test_gluon_head_loop_at_few_heads(h, num_buf, parts, poisoned):
    """The ends of the head loop, bitwise the Triton loop: H down to 4 (where the unrolled body
    runs once) and a ring as deep as H (no refills), with the plain and the |s| head sum."""
    _, _, w, qq, kk = make_inputs(300, 2000, h, 128, "fp8", seed=52)
    ks, ke = W.random_windows(300, 2000, generator=torch.Generator().manual_seed(6), empty_fraction=0.1,
                              overhang=9, device=DEVICE)
    base = prefill.PrefillConfig(block_q=64, block_n=128, num_warps=4, num_stages=num_buf, relu_via_abs=parts)
    ref = run(qq, kk, w, ks, ke, config=base)
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(base, gluon=True))
    assert _same_bits(out, ref)


@pytest.mark.skipif(not HOPPER, reason="the Gluon head loop runs on Hopper only")
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("layout", ["clean", "raw", "compressed", "bf16"])
@pytest.mark.parametrize("parts,refill", [(2, 1), (2, 2)])
@pytest.mark.parametrize("windows", ["random", "zigzag"])
def test_gluon_relu_via_abs_is_bitwise_the_triton_kernel(fmt, layout, parts, refill, windows, poisoned):
    """relu_via_abs in both head loops (the linear term's MMAs first, then |s| * w / c per head):
    the same bits, with the checks of the dequantised reference on top."""
    (q, k, w, qq, kk, ks, ke), kwargs = _gluon_case(fmt, layout, windows, seed=53)
    base = prefill.PrefillConfig(block_q=64, block_n=128, num_warps=4, num_stages=4, gluon_refill=refill,
                                 fp4_via_fp8=fmt == "mxfp4", relu_via_abs=parts)
    ref = run(qq, kk, w, ks, ke, config=base, **kwargs)
    out = run(qq, kk, w, ks, ke, config=dataclasses.replace(base, gluon=True), **kwargs)
    assert _same_bits(out, ref)
    check_logits(out, qq, kk, q, k, w, ks, ke, fmt, clean=kwargs["clean_logits"], max_seqlen_k=kwargs["max_seqlen_k"],
                 logits_dtype=kwargs["logits_dtype"])


def test_relu_via_abs_rejects_what_it_cannot_run():
    _, _, w, qq, kk = make_inputs(16, 64, 8, 64, "fp8", seed=1)
    ks, ke = W.causal_tail(16, 64, device=DEVICE)
    for cfg in (dataclasses.replace(SMALL, relu_via_abs=3), dataclasses.replace(SMALL, relu_via_abs=1),
                dataclasses.replace(SMALL, relu_via_abs=2, heads_on_n=True)):
        with pytest.raises(ValueError, match="relu_via_abs"):
            run(qq, kk, w, ks, ke, config=cfg)
    for fmt, fields in (("mxfp8", {}), ("mxfp4", {}), ("mxfp8", dict(mxfp8_via_f16=True))):
        _, _, w, qq, kk = make_inputs(16, 64, 8, 64, fmt, seed=1)
        with pytest.raises(ValueError, match="relu_via_abs"):
            run(qq, kk, w, ks, ke, config=dataclasses.replace(SMALL, relu_via_abs=2, **fields))


@pytest.mark.parametrize("h", [4, 12, 32, 128])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_default_config_at_head_counts_and_dims(h, d, poisoned):
    """FP8 with the configuration the op picks by itself (on Hopper: the Gluon loop with the |s|
    head sum; on CPU: the interpreter's Triton loop) against both references."""
    if not ON_GPU and (h == 128 or d == 32):
        pytest.skip("interpreter time: covered at the other H and D")
    s_q, s_k = shapes((40, 150), (700, 5000))
    q, k, w, qq, kk = make_inputs(s_q, s_k, h, d, "fp8", seed=h * 100 + d)
    ks, ke = W.random_windows(s_q, s_k, generator=torch.Generator().manual_seed(h + d), empty_fraction=0.1,
                              overhang=7, device=DEVICE)
    out = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke)
    check_logits(out, qq, kk, q, k, w, ks, ke, "fp8")


def test_gluon_rejects_tiles_it_cannot_run():
    _, _, w, qq, kk = make_inputs(16, 64, 8, 64, "fp8", seed=1)
    ks, ke = W.causal_tail(16, 64, device=DEVICE)
    for cfg in (prefill.PrefillConfig(block_q=32, num_warps=4, gluon=True),
                prefill.PrefillConfig(block_q=64, num_warps=4, num_stages=1, gluon=True),
                prefill.PrefillConfig(block_q=16, heads_on_n=True, gluon=True)):
        with pytest.raises(ValueError, match="gluon"):
            tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=cfg)
    if not HOPPER:
        with pytest.raises(ValueError, match="Hopper"):
            tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, config=prefill.PrefillConfig(gluon=True))


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the whole sweep (python -m tests.indexer.prefill_gpu_sweep)")
@pytest.mark.parametrize("i", range(4))
def test_gpu_sweep_sample(i):
    """Four cases of the GPU contract sweep (``tests/indexer/prefill_gpu_sweep.py``) at
    interpreter sizes (at most 100 rows and 32 heads, 160-200 keys), and its large-offset
    cases shrunk."""
    import random

    from . import prefill_gpu_sweep as sweep

    small = [c for c in sweep.contract_cases() if c.rows <= 100 and c.heads <= 32]
    case = random.Random(60).sample(small, 4)[i]
    sweep.run_case(case, seed=61 + i, s_k=160 + 13 * i)
    tilefuse.check_errors()
    if i == 0:
        sweep.run_large_keys(min_bytes=1 << 16, device=DEVICE, rows=4, span=200)
        sweep.run_large_logits(min_elements=1 << 13, device=DEVICE, s_k=1024 + 64)
