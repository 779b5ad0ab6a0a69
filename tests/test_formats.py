"""Formats exactly as the contract's §2: UE8M0 packing, FP4 nibble order, quantiser rules."""

import pytest
import torch

from tilefuse import formats as F


def test_ue8m0_packing_is_little_endian_with_0x7f_padding():
    packed = F.pack_ue8m0(torch.tensor([[0x80, 0x7E]]))
    assert packed.dtype == torch.int32
    assert packed.item() & 0xFFFFFFFF == 0x7F7F7E80
    assert F.unpack_ue8m0(packed, 2).tolist() == [[0x80, 0x7E]]
    assert F.ue8m0_to_float(torch.tensor([127, 128, 120])).tolist() == [1.0, 2.0, 2.0**-7]


def test_fp4_low_nibble_holds_the_even_element():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (1, 2)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0xF3]]
    assert torch.equal(F.unpack_fp4(packed), codes)


def test_e2m1_rounds_to_nearest_ties_to_smaller_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.75, 2.5, 3.5, 5.0, 5.01, 100.0, -0.1, -2.9])
    got = F.decode_e2m1(F.encode_e2m1(x))
    assert got.tolist() == [0.0, 0.5, 0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, 0.0, -3.0]


@pytest.mark.parametrize("fmt,fmax", [("mxfp8", 448.0), ("mxfp4", 6.0)])
def test_mx_block_scale_is_the_power_of_two_above_amax_over_fmax(fmt, fmax):
    x = torch.randn(8, 128) * torch.logspace(-3, 3, 8)[:, None]
    values, sf = F.quantize_q(x, fmt)
    blocks = x.unflatten(-1, (4, 32)).abs().amax(-1).clamp_min(1e-4)
    expect = torch.exp2(torch.ceil(torch.log2(blocks / fmax)))
    assert torch.equal(F.ue8m0_to_float(F.unpack_ue8m0(sf, 4)), expect)
    deq = F.dequantize_q(values, sf)
    # Rounding error at most half the widest gap of the grid (E2M1: 4 -> 6, E4M3: 416 -> 448).
    half_gap = 1.0 if fmt == "mxfp4" else 16.0
    assert ((deq - x).abs() <= expect.repeat_interleave(32, -1) * half_gap).all()
    rel = (deq - x).norm() / x.norm()
    assert rel < (0.15 if fmt == "mxfp4" else 0.04)


def test_mx_d64_pads_the_unused_scale_bytes_with_0x7f():
    _, sf = F.quantize_k(torch.randn(3, 64), "mxfp8")
    assert ((sf >> 16) & 0xFFFF).eq(0x7F7F).all()


def test_fp8_rows_scale_is_amax_over_448_unrounded():
    k = torch.randn(5, 128) * 7
    values, scale = F.quantize_fp8_rows(k)
    assert values.dtype == F.FP8_DTYPE
    torch.testing.assert_close(scale, k.abs().amax(-1) / 448)
    assert values.float().abs().amax(-1).le(448).all()


def test_unknown_format_and_bad_dims_raise():
    with pytest.raises(ValueError, match="unknown format"):
        F.quantize_q(torch.randn(2, 4, 64), "fp6")
    with pytest.raises(ValueError, match="multiple of 32"):
        F.quantize_mxfp8(torch.randn(2, 48))
