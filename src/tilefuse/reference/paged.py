"""Torch oracles for the indexer decode logits over a paged KV cache.

Two references, as the accuracy rules ask:
* ``paged_mqa_logits_ref`` on unquantised per-request keys (bf16 or fp32), loose thresholds;
* ``fp8_fp4_paged_mqa_logits_ref`` with the op's own arguments: it gathers each request's
  pages through the block table, dequantises them (``tilefuse.formats``) and runs the same
  fp32 math, tight thresholds.
Both write ``-inf`` at every invalid column (the op does so only with ``clean_logits``).
"""

from __future__ import annotations

import torch

from tilefuse import formats


def paged_row_ends(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """The key end of every row ``[B, next_n]``: 2-D lengths as they are; 1-D lengths (causal
    multi-token prediction, row ``t`` sees ``j <= ctx[b] - next_n + t``) as the int32 ends they
    mean, at least 0 (the 2-D form DeepGEMM 2.6.1 takes on SM90)."""
    if context_lens.dim() == 2:
        return context_lens
    t = torch.arange(next_n, dtype=torch.int32, device=context_lens.device)
    return (context_lens.to(torch.int32)[:, None] - next_n + 1 + t).clamp(min=0).contiguous()


def paged_valid_mask(context_lens: torch.Tensor, next_n: int, max_context_len: int) -> torch.Tensor:
    """Bool ``[B * next_n, max_context_len]``: True where row ``(b, t)`` sees key ``j``.

    1-D lengths: ``j <= ctx[b] - next_n + t`` (causal multi-token prediction);
    2-D ``[B, next_n]``: ``j < ctx[b, t]``.
    """
    ends = paged_row_ends(context_lens, next_n).long()
    j = torch.arange(max_context_len, device=context_lens.device)
    return j[None, :] < ends.reshape(-1, 1)


def paged_key_extent(context_lens: torch.Tensor) -> torch.Tensor:
    """Keys request ``b`` reads: its length (1-D) or its longest row (2-D), at least 0."""
    lens = context_lens.long()
    if lens.dim() == 2:
        lens = lens.amax(dim=1)
    return lens.clamp(min=0)


def paged_mqa_logits_ref(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
) -> torch.Tensor:
    """fp32 logits ``[B * next_n, max_context_len]`` of real-valued inputs.

    ``q [B, next_n, H, D]``; ``k [B, S, D]`` with key ``j`` of request ``b`` at ``k[b, j]``
    (``S`` >= every request's key extent); ``weights [B * next_n, H]``. Invalid columns are
    ``-inf``.
    """
    b, next_n, _, _ = q.shape
    out = torch.zeros((b * next_n, max_context_len), dtype=torch.float32, device=q.device)
    extent = paged_key_extent(context_lens).clamp(max=max_context_len).tolist()
    w = weights.float().view(b, next_n, -1)
    for i, n in enumerate(extent):
        if n == 0:
            continue
        score = torch.einsum("thd,jd->thj", q[i].float(), k[i, :n].float()).relu_()
        out[i * next_n:(i + 1) * next_n, :n] = torch.einsum("thj,th->tj", score, w[i])
    return out.masked_fill_(~paged_valid_mask(context_lens, next_n, max_context_len), float("-inf"))


def gather_paged_keys(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, request: int, fmt: str, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` keys of ``request`` as stored: ``(values, scales)`` in the layout
    of :func:`tilefuse.formats.quantize_k` (E4M3 ``[n, D]`` or int8 ``[n, D/2]``; fp32 or int32 ``[n]``)."""
    nb, bkv, _, width = kv_cache.shape
    value_bytes = head_dim // 2 if fmt == "mxfp4" else head_dim
    npages = -(-num_tokens // bkv)
    # One row of bytes per page, read through the page stride.
    pages = kv_cache.as_strided((nb, bkv * width), (kv_cache.stride(0), 1), kv_cache.storage_offset())
    raw = pages[block_table[request, :npages].long()]
    values = raw[:, : bkv * value_bytes].reshape(npages * bkv, value_bytes)[:num_tokens]
    scales = raw[:, bkv * value_bytes:].contiguous().view(torch.float32 if fmt == "fp8" else torch.int32)
    scales = scales.reshape(npages * bkv)[:num_tokens]
    values = values.view(torch.int8) if fmt == "mxfp4" else values.view(formats.FP8_DTYPE)
    return values, scales


def fp8_fp4_paged_mqa_logits_ref(
    q: tuple[torch.Tensor, torch.Tensor | None], kv_cache: torch.Tensor, weights: torch.Tensor,
    context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int, clean_logits: bool = False,
    logits_dtype: torch.dtype = torch.float32, indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantised reference with the op's arguments: fp32 math, then a cast to ``logits_dtype``.

    ``indices`` (varlen request ids) do not change the result: every token reads its keys
    through its own block-table row.
    """
    del clean_logits, indices  # the oracle always writes -inf outside the windows
    values, sf = q
    fmt = formats.format_of(values, sf)
    b, next_n, h, dq = values.shape
    d = dq * 2 if fmt == "mxfp4" else dq
    q_deq = formats.dequantize_q(values, sf)
    extent = paged_key_extent(context_lens).clamp(max=max_context_len)
    longest = int(extent.max()) if b else 0
    k_deq = torch.zeros((b, longest, d), dtype=torch.float32, device=values.device)
    for i, n in enumerate(extent.tolist()):
        if n:
            k_deq[i, :n] = formats.dequantize_k(*gather_paged_keys(kv_cache, block_table, n, i, fmt, d))
    logits = paged_mqa_logits_ref(q_deq, k_deq, weights, context_lens, max_context_len)
    return logits.to(logits_dtype)
