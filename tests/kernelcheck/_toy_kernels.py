"""Small kernels with known compiled shapes, for the instruction counting and the checks."""

import triton
import triton.language as tl


@triton.jit
def toy_dot(a_desc, b_desc, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[BM, BN] = A[BM, K] @ B[BN, K]^T over a K loop: one dot, TMA loads, plain stores."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([0, k])
        b = b_desc.load([0, k])
        acc = tl.dot(a, b.T, acc)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    tl.store(c_ptr + rows[:, None] * BN + cols[None, :], acc)


@triton.jit
def toy_axpy(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    """y = alpha * x + y: no dot; one fused multiply-add per element."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, alpha * x + y, mask=mask)


@triton.jit
def toy_dot_scaled(a_desc, b_desc, a_sf_ptr, b_sf_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """MXFP8 C = (A * sa) @ (B * sb)^T with UE8M0 scales per 32 elements of K."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    sk = tl.arange(0, BK // 32)
    for k in range(0, K, BK):
        a = a_desc.load([0, k])
        b = b_desc.load([0, k])
        sa = tl.load(a_sf_ptr + rows[:, None] * (K // 32) + (k // 32 + sk)[None, :])
        sb = tl.load(b_sf_ptr + cols[:, None] * (K // 32) + (k // 32 + sk)[None, :])
        acc = tl.dot_scaled(a, sa, "e4m3", b.T, sb, "e4m3", acc)
    tl.store(c_ptr + rows[:, None] * BN + cols[None, :], acc)


@triton.jit
def toy_spill(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """A [BLOCK, BLOCK] fp32 tile per program and a row-dependent reduction: with one warp and
    BLOCK = 128, 512 values a thread, far over the register file."""
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r[:, None] * BLOCK + r[None, :])
    y = tl.cumsum(x * x, axis=1) + tl.cumsum(x, axis=0)
    tl.store(y_ptr + r[:, None] * BLOCK + r[None, :], y)
