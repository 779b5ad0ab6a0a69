"""Blackwell (sm_100) kernel for the MXFP8/MXFP4 indexer prefill logits (private).

Same arguments, grid and semantics as ``prefill_logits_kernel`` in ``_prefill_kernel.py``:
a 2-D grid over (key block, query block), one program scores ``BLOCK_Q`` query rows against
``BLOCK_N`` keys, walks the H heads and accumulates ``relu(score) * w`` in fp32, then stores
the full or compressed layout (``-inf`` outside the window when ``CLEAN``).

The difference is the dot: Blackwell has a block-scaled tensor-core MMA (``tcgen05.mma``
with UE8M0 scale vectors), reached through ``tl.dot_scaled``, so the MX operands go to the
tensor cores as stored — E4M3 or packed E2M1 values and one scale byte per 32 elements —
with no dequantisation in registers and no per-block partial sums. The packed FP4 layout
(element ``2k`` in the low nibble of byte ``k``, packed along D) is the one ``tl.dot_scaled``
expects for an operand packed along K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tilefuse import _jit
from tilefuse._jit import host_descriptor
from tilefuse.formats import FORMAT_CODE
from tilefuse.indexer._prefill_kernel import (
    _DYNAMIC,
    _SLICEABLE,
    FMT_MXFP4,
    _store_logits,
    fill_skipped_tile,
    load_windows,
    tile_sees_no_keys,
)

# Launch tile (see the kernel for why): BLOCK_N is the MMA's M and must stay 128.
BLOCK_N = 128
BLOCK_Q = 16
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _scale_bytes(packed, NB: tl.constexpr):
    """Packed int32 UE8M0 scales ``[ROWS]`` -> uint8 ``[ROWS, NB]`` (byte ``b`` scales elements 32b..32b+31)."""
    b = tl.arange(0, NB)
    return ((packed[:, None] >> (b[None, :] * 8)) & 0xFF).to(tl.uint8)


@triton.jit(do_not_specialize=_DYNAMIC, do_not_specialize_on_alignment=_SLICEABLE + ["k_sf_ptr"])
def prefill_logits_mx_kernel(
    q_desc, q_sf_ptr, stride_qsf, k_desc, k_sf_ptr, w_ptr, stride_w, ks_ptr, ke_ptr, out_ptr, stride_out,
    S_q, S_k, n_cols, err_ptr,
    H: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, CLEAN: tl.constexpr, COMPRESSED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    q0 = pid_q * BLOCK_Q
    n0 = pid_n * BLOCK_N
    rows = q0 + tl.arange(0, BLOCK_Q)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < S_q
    ks, ke = load_windows(ks_ptr, ke_ptr, rows, row_ok, S_k, n_cols, err_ptr, pid_n == 0, COMPRESSED)
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out

    if tile_sees_no_keys(ks, ke, row_ok, n0, S_k, BLOCK_N):
        fill_skipped_tile(out_rows, cols, n0, row_ok, S_k, CLEAN, COMPRESSED, BLOCK_Q, BLOCK_N)
        return

    NB: tl.constexpr = D // 32
    DQ: tl.constexpr = D // 2 if FMT == FMT_MXFP4 else D  # two values a byte
    ELEM: tl.constexpr = "e2m1" if FMT == FMT_MXFP4 else "e4m3"
    # Keys are the M side of the MMA (M = BLOCK_N = 128: the block-scaled tcgen05 MMA needs
    # M = 128; with M = 64 Triton dequantises instead), query rows the N side. Keys and their
    # scales are loaded once for all heads. In the accumulator's TMEM layout a thread owns one
    # key and all BLOCK_Q query columns (4 warps), each needing its own weight per head, so
    # BLOCK_Q sets the register load: 16 compiles with no spills, 32 and 64 spill.
    k = k_desc.load([n0, 0])
    k_sf = _scale_bytes(tl.load(k_sf_ptr + cols, mask=cols < S_k, other=0), NB)
    w_rows = w_ptr + rows.to(tl.int64) * stride_w
    qsf_rows = q_sf_ptr + rows.to(tl.int64) * stride_qsf
    acc = tl.zeros((BLOCK_N, BLOCK_Q), dtype=tl.float32)
    s = tl.zeros((BLOCK_N, BLOCK_Q), dtype=tl.float32)
    for h in range(H):
        w = tl.load(w_rows + h, mask=row_ok, other=0.0).to(tl.float32)
        q_sf = _scale_bytes(tl.load(qsf_rows + h, mask=row_ok, other=0), NB)
        qt = tl.trans(q_desc.load([q0, h * DQ]))
        # Each head starts from a zero accumulator. Written as a reset under a run-time
        # condition (always true) rather than a constant zero: Triton 3.8 turns a constant-zero
        # accumulator into a constant use-accumulator=false flag, and its clean-up of unused
        # TMEM initial values then also strips the scales' TMEM copy (compile error). The
        # run-time flag keeps the accumulator in TMEM with no per-head zero fill.
        if h >= 0:
            s = tl.zeros((BLOCK_N, BLOCK_Q), dtype=tl.float32)
        s = tl.dot_scaled(k, k_sf, ELEM, qt, q_sf, ELEM, acc=s)
        acc += tl.maximum(s, 0.0) * w[None, :]
    acc = tl.trans(acc)  # to [query row, key] for row-contiguous stores

    valid = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None]) & row_ok[:, None]
    _store_logits(acc, out_rows, cols[None, :], ks[:, None], valid, row_ok[:, None], S_k, n0 + BLOCK_N <= S_k,
                  CLEAN, COMPRESSED)


def launch(q, q_sf, k, k_sf, weights, ks, ke, out, clean_logits: bool, compressed: bool, err, *,
           block_q: int = BLOCK_Q, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> None:
    """Run the kernel on validated MX inputs, writing ``out`` (as the Hopper launch does).

    ``q``: E4M3 ``[S_q, H, D]`` or packed-FP4 int8 ``[S_q, H, D/2]``; ``q_sf`` int32 ``[S_q, H]``;
    ``k``: ``[S_k, D]`` or ``[S_k, D/2]`` like ``q``; ``k_sf`` int32 ``[S_k]``; ``weights``
    ``[S_q, H]``; ``ks``/``ke`` int32 ``[S_q]``; ``out`` ``[S_q, S_k or max_seqlen_k]``; ``err``
    the device's error record (``tilefuse._errors.error_record``). The tile is
    fixed by the block-scaled MMA (128 keys) and the register budget (``block_q`` query rows).
    """
    fp4 = q.dtype == torch.int8
    s_q, h, dq = q.shape
    s_k = k.shape[0]
    if fp4:
        # tl.dot_scaled takes packed E2M1 as uint8; the bytes are the same.
        q, k = q.view(torch.uint8), k.view(torch.uint8)
    q_desc = host_descriptor(TensorDescriptor, q, [s_q, h * dq], [q.stride(0), 1], [block_q, dq])
    k_desc = host_descriptor(TensorDescriptor, k, [s_k, dq], [k.stride(0), 1], [BLOCK_N, dq])
    grid = (-(-s_k // BLOCK_N), -(-s_q // block_q))
    _jit.opaque_launch()  # (not through a Launcher: a recorded call of this path is not replayed)
    prefill_logits_mx_kernel[grid](
        q_desc, q_sf, q_sf.stride(0),
        k_desc, k_sf,
        weights, weights.stride(0),
        ks, ke,
        out, out.stride(0),
        s_q, s_k, out.shape[1], err,
        H=h, D=dq * 2 if fp4 else dq, FMT=FORMAT_CODE["mxfp4" if fp4 else "mxfp8"],
        CLEAN=clean_logits, COMPRESSED=compressed,
        BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
        num_warps=num_warps, num_stages=num_stages,
    )
