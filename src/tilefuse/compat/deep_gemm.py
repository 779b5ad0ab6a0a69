"""DeepGEMM's indexer API backed by tilefuse: ``import tilefuse.compat.deep_gemm as deep_gemm``.

Names, argument order and defaults follow DeepGEMM; tilefuse adds MX formats on Hopper,
any head count that is a multiple of 4 up to 128, and clean logits in every mode.
"""

import tilefuse

fp8_mqa_logits = tilefuse.fp8_mqa_logits
fp8_fp4_mqa_logits = tilefuse.fp8_fp4_mqa_logits
get_mqa_logits_metadata = tilefuse.get_mqa_logits_metadata
fp8_paged_mqa_logits = tilefuse.fp8_paged_mqa_logits
fp8_fp4_paged_mqa_logits = tilefuse.fp8_fp4_paged_mqa_logits
get_paged_mqa_logits_metadata = tilefuse.get_paged_mqa_logits_metadata

__all__ = [
    "fp8_mqa_logits",
    "fp8_fp4_mqa_logits",
    "get_mqa_logits_metadata",
    "fp8_paged_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
]
