"""Torch oracles for the indexer prefill logits.

Two references, as the accuracy rules ask:
* ``mqa_logits_ref`` on unquantised inputs (bf16 or fp32), loose thresholds;
* ``fp8_fp4_mqa_logits_ref`` on the quantised inputs the op takes, dequantised to fp32,
  tight thresholds.
Both work in query-row chunks so that a 32K x 64K case fits in memory.
"""

from __future__ import annotations

import torch

from tilefuse import formats

# Bytes of the [rows, H, S_k] fp32 score intermediate kept alive per chunk.
_CHUNK_BYTES = 1 << 30


def window_mask(ks: torch.Tensor, ke: torch.Tensor, num_k: int) -> torch.Tensor:
    """Bool ``[S_q, num_k]``: True where ``ks[i] <= j < ke[i]`` (ke clamped to num_k)."""
    j = torch.arange(num_k, device=ks.device)
    return (j[None, :] >= ks[:, None].long()) & (j[None, :] < ke[:, None].long())


def mqa_logits_ref(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
    clean_logits: bool = True,
) -> torch.Tensor:
    """fp32 logits ``[S_q, S_k]`` of real-valued ``q [S_q, H, D]``, ``k [S_k, D]``.

    ``logit[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])``; columns outside ``[ks, ke)`` are
    ``-inf`` (also when ``clean_logits`` is False: the op leaves them unspecified there).
    """
    del clean_logits  # the oracle always cleans; comparisons only read the window
    s_q, h, _ = q.shape
    s_k = k.shape[0]
    kf = k.float()
    out = torch.empty((s_q, s_k), dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_BYTES // max(1, h * s_k * 4))
    for r0 in range(0, s_q, rows):
        r1 = min(s_q, r0 + rows)
        score = torch.einsum("rhd,jd->rhj", q[r0:r1].float(), kf).relu_()
        out[r0:r1] = torch.einsum("rhj,rh->rj", score, weights[r0:r1].float())
        mask = window_mask(ks[r0:r1], ke[r0:r1], s_k)
        out[r0:r1].masked_fill_(~mask, float("-inf"))
    return out


def compress_logits(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    """Compressed layout: ``out[i, c] = logits[i, ks[i] + c]`` for ``c < ke[i] - ks[i]``, else -inf."""
    s_q, s_k = logits.shape
    c = torch.arange(max_seqlen_k, device=logits.device)
    src = ks[:, None].long() + c[None, :]
    valid = (src < ke[:, None].clamp(max=s_k).long()) & (src < s_k)
    gathered = torch.gather(logits, 1, src.clamp(max=max(s_k - 1, 0)))
    return torch.where(valid, gathered, torch.full_like(gathered, float("-inf")))


def fp8_fp4_mqa_logits_ref(
    q: tuple[torch.Tensor, torch.Tensor | None], kv: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: torch.Tensor, clean_logits: bool = True,
    max_seqlen_k: int = 0, logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantised reference with the op's arguments: fp32 math, then a cast to ``logits_dtype``."""
    q_deq = formats.dequantize_q(*q)
    k_deq = formats.dequantize_k(*kv)
    logits = mqa_logits_ref(q_deq, k_deq, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)
    if max_seqlen_k > 0:
        logits = compress_logits(logits, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k)
    return logits.to(logits_dtype)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2*sum(x*y) / sum(x*x + y*y)`` in float64, with the reference's (y's) -inf set to 0 in both."""
    x = x.double()
    y = y.double()
    ninf = torch.isneginf(y)
    x = x.masked_fill(ninf, 0.0)
    y = y.masked_fill(ninf, 0.0)
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1.0 - 2.0 * (x * y).sum() / denom)
