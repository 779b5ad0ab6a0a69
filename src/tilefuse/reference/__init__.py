"""Torch oracles for every tilefuse op (what the kernels are tested against)."""

from tilefuse.reference.comm_gemm import (
    ag_gemm_emulated,
    ag_gemm_ref,
    gemm_rs_emulated,
    gemm_rs_ref,
)
from tilefuse.reference.indexer import (
    calc_diff,
    compress_logits,
    fp8_fp4_mqa_logits_ref,
    mqa_logits_ref,
    window_mask,
)
from tilefuse.reference.paged import (
    fp8_fp4_paged_mqa_logits_ref,
    gather_paged_keys,
    paged_key_extent,
    paged_mqa_logits_ref,
    paged_row_ends,
    paged_valid_mask,
)
from tilefuse.reference.topk import fp8_fp4_mqa_topk_ref, fp8_fp4_paged_mqa_topk_ref, order_keys, topk_of_logits

__all__ = [
    "ag_gemm_emulated",
    "ag_gemm_ref",
    "gemm_rs_emulated",
    "gemm_rs_ref",
    "calc_diff",
    "compress_logits",
    "fp8_fp4_mqa_logits_ref",
    "fp8_fp4_mqa_topk_ref",
    "fp8_fp4_paged_mqa_logits_ref",
    "fp8_fp4_paged_mqa_topk_ref",
    "gather_paged_keys",
    "mqa_logits_ref",
    "order_keys",
    "paged_key_extent",
    "paged_mqa_logits_ref",
    "paged_row_ends",
    "paged_valid_mask",
    "topk_of_logits",
    "window_mask",
]
