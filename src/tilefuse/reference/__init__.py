"""Torch oracles for every tilefuse op (what the kernels are tested against)."""

from tilefuse.reference.indexer import (
    calc_diff,
    compress_logits,
    fp8_fp4_mqa_logits_ref,
    mqa_logits_ref,
    window_mask,
)

__all__ = [
    "calc_diff",
    "compress_logits",
    "fp8_fp4_mqa_logits_ref",
    "mqa_logits_ref",
    "window_mask",
]
