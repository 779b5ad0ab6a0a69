"""tilefuse: fused Triton kernels for large-model inference and training.

Public names resolve lazily, so ``import tilefuse`` stays cheap and works without CUDA:

* indexer (DeepGEMM-compatible): ``fp8_mqa_logits``, ``fp8_fp4_mqa_logits``,
  ``get_mqa_logits_metadata``, ``fp8_paged_mqa_logits``, ``fp8_fp4_paged_mqa_logits``,
  ``get_paged_mqa_logits_metadata``;
* tensor-parallel fused GEMMs: ``tilefuse.tp.ag_gemm``, ``tilefuse.tp.gemm_rs``;
* formats and references: ``tilefuse.formats``, ``tilefuse.reference``;
* ``check_errors()``: raise value errors that kernels found on the device (see ``tilefuse._errors``);
  ``set_checked()`` / ``checked_mode()``: validate device values synchronously, raising at once;
* ``warmup(IndexerModel(...))``: compile every indexer kernel a model configuration uses, at start-up.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # Kernels run through Triton's CPU interpreter, whose float casts and bf16 arithmetic are
    # wrong without this fix (MX formats would give garbage); see tilefuse._interpreter.
    from tilefuse._interpreter import patch_interpreter_numerics

    patch_interpreter_numerics()

_PUBLIC = {
    "fp8_mqa_logits": "tilefuse.indexer.prefill",
    "fp8_fp4_mqa_logits": "tilefuse.indexer.prefill",
    "get_mqa_logits_metadata": "tilefuse.indexer.prefill",
    "fp8_paged_mqa_logits": "tilefuse.indexer.paged",
    "fp8_fp4_paged_mqa_logits": "tilefuse.indexer.paged",
    "get_paged_mqa_logits_metadata": "tilefuse.indexer.paged",
    "fp8_fp4_mqa_topk": "tilefuse.indexer.topk",
    "fp8_fp4_paged_mqa_topk": "tilefuse.indexer.topk",
    "check_errors": "tilefuse._errors",
    "set_checked": "tilefuse._errors",
    "checked_mode": "tilefuse._errors",
    "warmup": "tilefuse.indexer.warmup",
    "IndexerModel": "tilefuse.indexer.warmup",
    "set_config_override": "tilefuse._config",
    "config_override": "tilefuse._config",
    "DeviceValueError": "tilefuse._errors",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tilefuse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
