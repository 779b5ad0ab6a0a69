"""The interpreter numerics patch still does what it says after a triton bump."""

import pytest
import torch
import triton
import triton.language as tl

from tilefuse._interpreter import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="checks the CPU interpreter only")


@triton.jit
def _mix_kernel(a_ptr, b_ptr, f_ptr, out_bf16_ptr, out_fp8_ptr, dot_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])  # bf16
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])  # bf16
    f = tl.load(f_ptr + r[:, None] * N + r[None, :])  # fp32
    tl.store(out_bf16_ptr + r[:, None] * N + r[None, :], (a * b + a).to(tl.float32).to(tl.bfloat16))
    tl.store(out_fp8_ptr + r[:, None] * N + r[None, :], f.to(tl.float8e4nv))
    tl.store(dot_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))


def test_bf16_arithmetic_fp8_casts_and_bf16_dot_match_torch():
    n = 16
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    f = torch.randn(n, n) * 200
    f[0, 0] = 1000.0  # saturates
    out_bf16 = torch.empty(n, n, dtype=torch.bfloat16)
    out_fp8 = torch.empty(n, n, dtype=torch.float8_e4m3fn)
    dot = torch.empty(n, n)
    _mix_kernel[(1,)](a, b, f, out_bf16, out_fp8, dot, N=n)
    expect = (a.float() * b.float()).to(torch.bfloat16).float() + a.float()
    torch.testing.assert_close(out_bf16.float(), expect.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    want_fp8 = f.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(out_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
    torch.testing.assert_close(dot, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


@triton.jit
def _flip_kernel(x_ptr, flip_ptr, xor_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(flip_ptr + offs, tl.flip(x, 1))
    tl.store(xor_ptr + tl.arange(0, ROWS), tl.xor_sum(x, axis=1))


def test_xor_reductions_and_flip_are_numpy_fast():
    """``tl.flip`` (a tree of xor reductions) on a [4, 256] int64 tile: numpy's reduction, so a
    fraction of a second instead of minutes, with the same result."""
    import time

    x = torch.randint(-(2**62), 2**62, (4, 256), dtype=torch.int64)
    flipped, xors = torch.empty_like(x), torch.empty(4, dtype=torch.int64)
    t0 = time.perf_counter()
    _flip_kernel[(1,)](x, flipped, xors, ROWS=4, COLS=256)
    assert time.perf_counter() - t0 < 5.0
    assert torch.equal(flipped, x.flip(1))
    want = x[:, 0].clone()
    for c in range(1, 256):
        want ^= x[:, c]
    assert torch.equal(xors, want)
