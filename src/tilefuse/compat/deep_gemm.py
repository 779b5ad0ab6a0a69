"""DeepGEMM's indexer API backed by tilefuse: ``import tilefuse.compat.deep_gemm as deep_gemm``.

Names, argument order and defaults follow DeepGEMM; tilefuse adds MX formats on Hopper,
any head count that is a multiple of 4 up to 128, and clean logits in every mode.
Names resolve on first use, like ``tilefuse`` itself.
"""

import tilefuse

_NAMES = (
    "fp8_mqa_logits",
    "fp8_fp4_mqa_logits",
    "get_mqa_logits_metadata",
    "fp8_paged_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
)
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'tilefuse.compat.deep_gemm' has no attribute {name!r}")
    return getattr(tilefuse, name)


def __dir__():
    return sorted(__all__)
