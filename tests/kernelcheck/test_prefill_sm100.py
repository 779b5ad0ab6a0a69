"""The Blackwell MX prefill kernel (``tl.dot_scaled``) through Triton's interpreter, against the
dequantised reference, with the contract's rules (spec/indexer.md section 5): calc_diff below
5e-6 (3e-5 with bf16 weights or logits), the exact -inf mask, every element written, bitwise
reruns. Its compiled form for sm_100a is checked in test_kernels_compile.py."""

from __future__ import annotations

import pytest
import torch

from tilefuse import formats as F
from tilefuse import reference as R
from tilefuse._errors import error_record
from tilefuse.indexer import _prefill_kernel_sm100 as k100

pytestmark = pytest.mark.interpreter
S_Q, S_K, H = 37, 300, 8  # 3 query blocks of 16 (the last partial) x 3 key tiles of 128 (the last partial)


def _inputs(fmt, d, seed, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = F.quantize_q(torch.randn(S_Q, H, d, generator=g), fmt)
    k = F.quantize_k(torch.randn(S_K, d, generator=g), fmt)
    w = torch.randn(S_Q, H, generator=g).to(w_dtype)
    ks = torch.randint(0, 200, (S_Q,), generator=g, dtype=torch.int32)
    ke = ks + torch.randint(0, 160, (S_Q,), generator=g, dtype=torch.int32)  # some past S_K, some empty
    ks[3], ke[3] = 50, 50
    ks[0], ke[0] = 0, S_K + 20
    return q, k, w, ks, ke


def _run(q, k, w, ks, ke, clean, max_seqlen_k, out_dtype):
    cols = max_seqlen_k or S_K
    out = torch.empty_strided((S_Q, cols), (-(-cols // 16) * 16, 1), dtype=out_dtype).fill_(float("nan"))
    k100.launch(q[0], q[1], k[0], k[1], w, ks, ke, out, clean, max_seqlen_k > 0, error_record("cpu"))
    return out


@pytest.mark.parametrize("fmt,d", [("mxfp8", 32), ("mxfp8", 64), ("mxfp8", 128), ("mxfp4", 64), ("mxfp4", 128)])
@pytest.mark.parametrize("clean", [True, False])
def test_full_layout(fmt, d, clean):
    q, k, w, ks, ke = _inputs(fmt, d, seed=d)
    out = _run(q, k, w, ks, ke, clean, 0, torch.float32)
    ref = R.fp8_fp4_mqa_logits_ref(q, k, w, ks, ke)
    inside = R.window_mask(ks, ke, S_K)
    assert not out[inside].isnan().any()
    assert R.calc_diff(out.masked_fill(~inside, 0), ref) < 5e-6
    if clean:
        assert torch.equal(torch.isneginf(out), ~inside)
        assert not out.isnan().any()
    rerun = _run(q, k, w, ks, ke, clean, 0, torch.float32)
    assert torch.equal(rerun.nan_to_num(0.0), out.nan_to_num(0.0))


@pytest.mark.parametrize("fmt,d", [("mxfp8", 128), ("mxfp4", 64)])
def test_compressed_layout(fmt, d):
    q, k, w, ks, ke = _inputs(fmt, d, seed=7)
    max_len = int((ke.clamp(max=S_K) - ks).clamp(min=0).max())
    out = _run(q, k, w, ks, ke, True, max_len, torch.float32)
    ref = R.compress_logits(R.fp8_fp4_mqa_logits_ref(q, k, w, ks, ke), ks, ke, max_len)
    inside = ~torch.isneginf(ref)
    assert not out[inside].isnan().any()  # the columns past each row's length are the op's -inf fill
    assert R.calc_diff(out.masked_fill(~inside, 0), ref) < 5e-6


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_bf16_weights_and_logits(fmt):
    q, k, w, ks, ke = _inputs(fmt, 128, seed=3, w_dtype=torch.bfloat16)
    out = _run(q, k, w, ks, ke, True, 0, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref = R.fp8_fp4_mqa_logits_ref(q, k, w, ks, ke)
    assert torch.equal(torch.isneginf(out.float()), torch.isneginf(ref))
    assert R.calc_diff(out.float(), ref) < 3e-5


def test_scales_reach_the_dot():
    """Large per-block scale differences (UE8M0 exponents far from 127) are applied per block."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(S_Q, H, 128, generator=g)
    q[..., 32:64] *= 2.0**20
    k = torch.randn(S_K, 128, generator=g)
    k[:, 96:] *= 2.0**-20
    qq, kk = F.quantize_q(q, "mxfp8"), F.quantize_k(k, "mxfp8")
    w = torch.rand(S_Q, H, generator=g)
    ks = torch.zeros(S_Q, dtype=torch.int32)
    ke = torch.full((S_Q,), S_K, dtype=torch.int32)
    out = _run(qq, kk, w, ks, ke, True, 0, torch.float32)
    assert R.calc_diff(out, R.fp8_fp4_mqa_logits_ref(qq, kk, w, ks, ke)) < 5e-6


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("max_seqlen_k", [0, 160])
def test_the_op_dispatches_here_on_capability_10(monkeypatch, fmt, max_seqlen_k):
    """fp8_fp4_mqa_logits on a (simulated) 10.x device runs this kernel, tail fill included."""
    from tilefuse.indexer import _dispatch, prefill

    calls = []
    real = k100.launch
    monkeypatch.setattr(_dispatch, "capability_major", lambda device: 10)
    monkeypatch.setattr(k100, "launch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, w, ks, ke = _inputs(fmt, 128, seed=5)
    ke = torch.minimum(ke, ks + 150)
    out = prefill.fp8_fp4_mqa_logits(q, k, w, ks, ke, True, max_seqlen_k)
    assert calls == [1]
    ref = R.fp8_fp4_mqa_logits_ref(q, k, w, ks, ke, True, max_seqlen_k)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)) and not out.isnan().any()
    assert R.calc_diff(out, ref) < 5e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10,
                    reason="needs a Blackwell (10.x) GPU")
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_blackwell_gpu(fmt):
    from tilefuse.indexer import prefill

    g = torch.Generator().manual_seed(0)
    s_q, s_k, h, d = 2048, 8192, 64, 128
    q = tuple(None if t is None else t.cuda() for t in F.quantize_q(torch.randn(s_q, h, d, generator=g), fmt))
    k = tuple(t.cuda() for t in F.quantize_k(torch.randn(s_k, d, generator=g), fmt))
    w = torch.randn(s_q, h, generator=g).cuda()
    ks = torch.zeros(s_q, dtype=torch.int32, device="cuda")
    ke = torch.arange(s_q, dtype=torch.int32, device="cuda") + (s_k - s_q) + 1
    out = prefill.fp8_fp4_mqa_logits(q, k, w, ks, ke)
    ref = R.fp8_fp4_mqa_logits_ref(q, k, w, ks, ke)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    assert R.calc_diff(out, ref) < 5e-6
    assert torch.equal(prefill.fp8_fp4_mqa_logits(q, k, w, ks, ke), out)
