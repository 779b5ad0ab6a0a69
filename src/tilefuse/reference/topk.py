"""Torch oracle for the indexer top-k: a row's first ``topk`` valid positions of its logits,
ordered by (value descending, position ascending); ``-1`` (value ``-inf``) past the valid ones.

The order the fused ops promise, spelled out with stable sorts: positions ascending, then
values descending (``-0.0`` ties ``+0.0``), then NaN after every number, then invalid
positions last. The logits come from the unfused op or its reference
(:func:`fp8_fp4_mqa_logits_ref`, :func:`fp8_fp4_paged_mqa_logits_ref`).
"""

from __future__ import annotations

import torch

from tilefuse.reference.indexer import fp8_fp4_mqa_logits_ref, window_mask
from tilefuse.reference.paged import fp8_fp4_paged_mqa_logits_ref, paged_valid_mask


def topk_of_logits(logits: torch.Tensor, valid: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices int32 [R, topk], values [R, topk] in the logits' dtype)`` of ``logits [R, N]``
    over the positions where ``valid [R, N]`` holds."""
    rows, n = logits.shape
    values = logits.float() + 0.0  # -0.0 + 0.0 = +0.0: the two zeros tie
    nan = values.isnan()
    # Stable sorts from position order, least significant key first: value descending, then
    # NaN after numbers, then invalid positions last.
    order = torch.sort(values.masked_fill(nan, 0.0), dim=1, descending=True, stable=True).indices
    rank = nan.to(torch.int8) + 2 * (~valid).to(torch.int8)
    by_class = torch.sort(torch.gather(rank, 1, order), dim=1, stable=True).indices
    order = torch.gather(order, 1, by_class)
    width = min(topk, n)
    top = order[:, :width]
    kept = torch.gather(valid, 1, top)
    indices = torch.full((rows, topk), -1, dtype=torch.int32, device=logits.device)
    out_values = torch.full((rows, topk), float("-inf"), dtype=logits.dtype, device=logits.device)
    indices[:, :width] = torch.where(kept, top, -1).to(torch.int32)
    out_values[:, :width] = torch.where(kept, torch.gather(logits, 1, top), float("-inf")).to(logits.dtype)
    return indices, out_values


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """The top-k kernels' int64 key of each ``values [R, N]`` entry at positions 0..N-1 (their
    ``_order_keys``): the value's fp32 bits mapped to an order-preserving int32 in the high word
    (``-0.0`` as ``+0.0``, NaN below ``-inf``), ``0x7FFFFFFF - position`` in the low word, so
    that keys compare as the contract orders (value descending, position ascending)."""
    bits = (values.float() + 0.0).view(torch.int32).to(torch.int64)  # -0.0 + 0.0 = +0.0
    hi = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    hi = torch.where(values.isnan(), -(2**31), hi)
    pos = torch.arange(values.shape[1], dtype=torch.int64, device=values.device)
    return (hi << 32) | (0x7FFFFFFF - pos)


def fp8_fp4_mqa_topk_ref(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, topk: int = 2048,
                         logits_dtype: torch.dtype = torch.float32):
    """Prefill top-k of the dequantised logits reference: ``(indices, values)``."""
    logits = fp8_fp4_mqa_logits_ref(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                                    logits_dtype=logits_dtype)
    valid = window_mask(cu_seq_len_k_start, cu_seq_len_k_end, logits.shape[1])
    return topk_of_logits(logits, valid, topk)


def fp8_fp4_paged_mqa_topk_ref(q, kv_cache, weights, context_lens, block_table, max_context_len: int,
                               topk: int = 2048, logits_dtype: torch.dtype = torch.float32):
    """Decode top-k of the dequantised paged logits reference: ``(indices, values)``."""
    logits = fp8_fp4_paged_mqa_logits_ref(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                          logits_dtype=logits_dtype)
    valid = paged_valid_mask(context_lens, q[0].shape[1], max_context_len)
    return topk_of_logits(logits, valid, topk)
