"""Warm-up at an engine's start: compile every indexer kernel a model configuration can use.

The kernels compile once per model configuration (format, H, D, dtypes, clean, compressed;
for decode also block_kv and next_n): sizes and strides that change every step are not
specialised, and the shape-dependent choices of the heuristics are a small fixed set. So one
call per variant, made here, is all the compiling a serving process does::

    report = tilefuse.warmup(tilefuse.IndexerModel(fmt="fp8", num_heads=64, head_dim=128))
    print(report.seconds, report.compiles)
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tilefuse import _jit


@dataclasses.dataclass(frozen=True)
class IndexerModel:
    """What a model fixes about its indexer calls. ``block_kv`` and ``next_n`` are for decode;
    ``topk`` > 0: the fused logits + top-k ops too, at that ``topk``."""

    fmt: str = "fp8"
    num_heads: int = 64
    head_dim: int = 128
    weights_dtype: torch.dtype = torch.float32
    logits_dtype: torch.dtype = torch.float32
    clean_logits: bool = False
    compressed: bool = False
    block_kv: int = 64
    next_n: int = 1
    topk: int = 0


@dataclasses.dataclass
class WarmupReport:
    """What :func:`warmup` ran: calls made per op, wall time, and the kernels compiled
    (``(kernel, key)`` per compile; empty under the CPU interpreter, which never compiles)."""

    calls: dict[str, int]
    seconds: float
    compiles: list[tuple[str, str]]

    @property
    def num_compiles(self) -> int:
        return len(self.compiles)


def warmup_calls(model: IndexerModel, device: torch.device | str, prefill: bool = True,
                 decode: bool = True) -> dict[str, list]:
    """The warm-up calls per op (``"prefill"``, ``"decode"``; with ``model.topk``, also
    ``"prefill_topk"``, ``"decode_topk"``) for one model configuration."""
    from tilefuse.indexer import paged, topk
    from tilefuse.indexer import prefill as prefill_op

    calls: dict[str, list] = {}
    if prefill:
        calls["prefill"] = prefill_op.warmup_calls(model.fmt, model.num_heads, model.head_dim, model.weights_dtype,
                                                   model.logits_dtype, model.clean_logits, model.compressed, device)
    if decode:
        calls["decode"] = paged.warmup_calls(model.fmt, model.num_heads, model.head_dim, model.block_kv, model.next_n,
                                             model.weights_dtype, model.logits_dtype, model.clean_logits, device)
    if model.topk:
        calls.update(topk.warmup_calls(model.fmt, model.num_heads, model.head_dim, model.topk, model.weights_dtype,
                                       model.logits_dtype, device, model.block_kv, model.next_n, prefill, decode))
    return calls


def warmup(*models: IndexerModel, device: torch.device | str | None = None, prefill: bool = True,
           decode: bool = True) -> WarmupReport:
    """Run every indexer kernel variant the given model configurations can pick, once, on
    ``device`` (default: the current CUDA device, else the CPU interpreter). Returns what was
    run, how long it took (synchronised) and what compiled.

    Raises:
        TypeError: a model that is not an :class:`IndexerModel`.
        ValueError: a configuration the ops reject (format, H, D, dtypes).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    for m in models:
        if not isinstance(m, IndexerModel):
            raise TypeError(f"models: expected IndexerModel, got {type(m).__name__}")
    counts: dict[str, int] = {}
    start = time.perf_counter()
    with _jit.count_compiles() as log:
        for m in models or (IndexerModel(),):
            for op, calls in warmup_calls(m, device, prefill, decode).items():
                for call in calls:
                    call()
                counts[op] = counts.get(op, 0) + len(calls)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return WarmupReport(counts, time.perf_counter() - start, list(log.compiles))
