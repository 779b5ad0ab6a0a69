"""Output layout of the indexer logits ops (private): rows padded so that every row starts
16-element (64-byte for fp32) aligned, as the kernels' vectorised stores and the consumers'
row-stride reads expect."""

from __future__ import annotations

import torch

ROW_ALIGN = 16


def padded_logits_layout(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(shape, stride)`` of a ``[rows, cols]`` logits tensor with its row stride padded to a
    multiple of ``ROW_ALIGN`` elements (at least one ``ROW_ALIGN``, also for ``cols = 0``)."""
    row = max(ROW_ALIGN, -(-cols // ROW_ALIGN) * ROW_ALIGN)
    return (rows, cols), (row, 1)


def new_logits(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised ``[rows, cols]`` logits tensor in :func:`padded_logits_layout`."""
    if cols % ROW_ALIGN == 0 and cols:  # already aligned rows: the plain allocation parses faster
        return torch.empty(rows, cols, dtype=dtype, device=device)
    shape, stride = padded_logits_layout(rows, cols)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)
