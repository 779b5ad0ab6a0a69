"""Indexer decode logits over a paged KV cache, DeepGEMM-compatible.

Public ops (names, argument order and defaults as DeepGEMM):

* :func:`get_paged_mqa_logits_metadata` — DeepGEMM's balanced split of the pages over
  ``num_sms`` workers (checked against the lengths; the kernel schedules by request and chunk
  of keys, see ``_paged_kernel.py``, so the logits do not depend on it);
* :func:`fp8_paged_mqa_logits` — FP8 queries, fp32 logits;
* :func:`fp8_fp4_paged_mqa_logits` — FP8, MXFP8 or MXFP4 (format chosen by the query tuple),
  fp32 or bf16 logits.

For query row ``(b, t)`` (output row ``b * next_n + t``) and key ``j`` of request ``b``::

    logit = sum_h w[b * next_n + t, h] * relu(Qdeq[b, t, h] . Kdeq[b, j])

Context lengths are 1-D ``[B]`` (row ``t`` sees ``j <= ctx[b] - next_n + t``, causal
multi-token prediction) or 2-D ``[B, next_n]`` (row ``t`` sees ``j < ctx[b, t]``).

Cache helpers (how users, tests and benchmarks build caches in this layout):

* :func:`paged_kv_cache_width` — bytes per token of the cache's last dim;
* :func:`new_paged_kv_cache` — a zeroed cache ``uint8 [num_blocks, block_kv, 1, width]``,
  optionally with a padded page stride;
* :func:`write_paged_kv_cache` — quantise bf16/fp32 keys and write them at given slots;
* :func:`make_paged_kv_cache` — a cache and a (shuffled) block table holding a batch of keys.

Page layout (``block_kv`` tokens of head dim ``D``): the values of the page's tokens first,
row-major ``[block_kv, D]`` E4M3 (MXFP4: ``[block_kv, D/2]`` packed nibbles), then
``block_kv`` 4-byte scales (fp32 for FP8, packed UE8M0 int32 for MX). The page stride
(``kv_cache.stride(0)``, bytes) may be larger than ``block_kv * width``.

The logits ops are ``torch.library`` custom ops (``tilefuse::paged_mqa_logits``) with fake
implementations, so they trace under ``torch.compile`` without graph breaks.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from tilefuse import formats
from tilefuse._config import apply_override, register_config
from tilefuse._validate import expect, expect_int, expect_tensor
from tilefuse.formats import FP8_DTYPE, format_of
from tilefuse.indexer import _paged_kernel as kern
from tilefuse.indexer.prefill import _window_checks_enabled

_FORMAT_CODE = {"fp8": kern.FMT_FP8, "mxfp8": kern.FMT_MXFP8, "mxfp4": kern.FMT_MXFP4}
_LOGITS_DTYPES = (torch.float32, torch.bfloat16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_SCALE_BYTES = 4
# Output rows are padded to this many elements so every row starts 32-byte aligned or better.
_ROW_ALIGN = 16
# The smallest tl.dot side: the (row, head) columns are padded up to it.
_MIN_DOT = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---------------------------------------------------------------------------------------
# Launch configuration: explicit values from one heuristic, no autotuning at run time.
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Tile shape, schedule and pipelining of the decode kernel.

    block_n: keys per tile (a power of two >= 16; independent of the page size).
    rows: query rows (of ``next_n``) scored per program in one dot of ``rows * heads``
        columns (a power of two); ``ceil(next_n / rows)`` programs share each key tile.
    chunk: keys per program: one program per (request, chunk), the grid sized from
        ``max_context_len``; a multiple of ``block_n`` and a power-of-two number of pages.
    num_warps, num_stages: as in Triton; stages pipeline the key-tile loads.
    block_fill: columns per store of the ``-inf`` tail when cleaning.
    """

    block_n: int = 128
    rows: int = 1
    chunk: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    block_fill: int = 1024


register_config("paged", PagedConfig)

# Programs the chunk size aims for: about 16 per SM on a 132-SM H200, so that programs
# starting their pipeline overlap others streaming (measured: 512-key chunks at B = 64 / 8K,
# 1024 at B = 256 / 8K; NOTES.md).
_TARGET_PROGRAMS = 2048


def default_paged_config(fmt: str, next_n: int, num_heads: int, head_dim: int, block_kv: int,
                         batch: int = 64, max_context_len: int = 8192) -> PagedConfig:
    """The defaults, by shape, measured on the H200 (``benchmarks/NOTES.md``, paged rounds;
    ``TILEFUSE_PAGED_CONFIG`` overrides single fields for measurements).

    * ``rows``: as many query rows as fit 128 dot columns (``rows * next_pow2(H) <= 128``), so
      next_n = 2 at H = 64 reads each key tile once (rows = 1 there: 1.27-1.35x slower).
    * FP8 with <= 64 dot columns: 128-key tiles, 3 stages (two tiles in flight per program);
      otherwise 64-key tiles, 4 stages. Deeper pipelines were slower at every target row.
    * ``chunk``: the largest power of two in [512, 2048] that still gives about
      ``_TARGET_PROGRAMS`` programs over the batch, in whole pages (a power of two of them).
    """
    del head_dim
    heads_p = _next_pow2(num_heads)
    rows = min(_next_pow2(next_n), max(1, 128 // heads_p))
    # 128-key tiles where the accumulator stays small (<= 64 dot columns) and the keys need no
    # bf16 dequantisation in registers; otherwise 64 (128 spills there, on sm_100a too).
    block_n = 128 if rows * heads_p <= 64 and fmt == "fp8" else 64
    keys = max(1, batch) * max(1, max_context_len)
    target = 512
    while target < 2048 and keys // (2 * target) >= _TARGET_PROGRAMS:
        target *= 2
    # Whole pages, a power of two of them (any page size), and whole tiles.
    pages = _next_pow2(max(1, target // block_kv))
    while (pages * block_kv) % block_n:
        pages *= 2
    chunk = pages * block_kv
    return PagedConfig(block_n=block_n, rows=rows, chunk=chunk, num_warps=4, num_stages=3 if block_n == 128 else 4,
                       block_fill=1024)


def resolve_paged_config(fmt: str, next_n: int, num_heads: int, head_dim: int, block_kv: int,
                         config: PagedConfig | None = None, batch: int = 64,
                         max_context_len: int = 8192) -> PagedConfig:
    """``config`` if given, else the default; then the fields set by
    ``tilefuse.set_config_override("paged", ...)`` (or ``TILEFUSE_PAGED_CONFIG`` at import)."""
    cfg = config or default_paged_config(fmt, next_n, num_heads, head_dim, block_kv, batch, max_context_len)
    cfg = apply_override(cfg, "paged")
    for name in ("block_n", "rows", "block_fill"):
        v = getattr(cfg, name)
        expect(v >= 1 and v & (v - 1) == 0, ValueError, f"PagedConfig.{name} must be a power of two, got {v}")
    expect(cfg.block_n >= _MIN_DOT, ValueError, f"PagedConfig.block_n must be >= {_MIN_DOT}, got {cfg.block_n}")
    expect(cfg.num_warps >= 1 and cfg.num_stages >= 1, ValueError,
            f"PagedConfig: num_warps and num_stages must be >= 1, got {cfg}")
    pages = cfg.chunk // block_kv
    expect(cfg.chunk > 0 and cfg.chunk % cfg.block_n == 0 and cfg.chunk % block_kv == 0 and pages & (pages - 1) == 0,
            ValueError, f"PagedConfig.chunk must be a multiple of block_n = {cfg.block_n} and a power-of-two number "
            f"of {block_kv}-token pages, got {cfg.chunk}")
    return cfg


# ---------------------------------------------------------------------------------------
# Cache helpers
# ---------------------------------------------------------------------------------------
def _value_bytes(head_dim: int, fmt: str) -> int:
    return head_dim // 2 if fmt == "mxfp4" else head_dim


def paged_kv_cache_width(head_dim: int, fmt: str = "fp8") -> int:
    """Bytes per token in the cache's last dim: ``D + 4`` (FP8, MXFP8) or ``D/2 + 4`` (MXFP4)."""
    expect(fmt in formats.FORMATS, ValueError, f"fmt: unknown format {fmt!r}; expected one of {formats.FORMATS}")
    expect(head_dim in ((64, 128) if fmt == "mxfp4" else (32, 64, 128)), ValueError,
            f"head_dim: {fmt} supports 32, 64, 128 (MXFP4: 64, 128), got {head_dim}")
    return _value_bytes(head_dim, fmt) + _SCALE_BYTES


def new_paged_kv_cache(num_blocks: int, block_kv: int, head_dim: int, fmt: str = "fp8", *,
                       page_stride: int | None = None, device=None) -> torch.Tensor:
    """A zeroed paged cache: uint8 ``[num_blocks, block_kv, 1, width]`` as a view.

    Args:
        num_blocks: pages in the cache (>= 1).
        block_kv: tokens per page (>= 1).
        head_dim: D (32, 64, 128; MXFP4: 64, 128).
        fmt: "fp8", "mxfp8" or "mxfp4".
        page_stride: bytes from one page to the next (default ``block_kv * width``); larger
            values pad every page; must be a multiple of 4.
        device: where to allocate.

    Raises:
        ValueError: a bad count, format, head dim or page stride.
    """
    width = paged_kv_cache_width(head_dim, fmt)
    expect_int(num_blocks, "num_blocks", 1)
    expect_int(block_kv, "block_kv", 1)
    page_bytes = block_kv * width
    stride = page_bytes if page_stride is None else page_stride
    expect(isinstance(stride, int) and stride >= page_bytes and stride % _SCALE_BYTES == 0, ValueError,
            f"page_stride: expected a multiple of 4 that is >= block_kv * width = {page_bytes}, got {page_stride!r}")
    storage = torch.zeros(num_blocks * stride, dtype=torch.uint8, device=device)
    return storage.as_strided((num_blocks, block_kv, 1, width), (stride, width, width, 1))


def _check_cache(kv_cache: torch.Tensor, value_bytes: int, name: str = "kv_cache") -> None:
    expect_tensor(kv_cache, name)
    expect(kv_cache.dtype == torch.uint8, TypeError, f"{name}: expected uint8, got {kv_cache.dtype}")
    width = value_bytes + _SCALE_BYTES
    expect(kv_cache.dim() == 4 and kv_cache.shape[2] == 1, ValueError,
            f"{name}: expected [num_blocks, block_kv, 1, {width}], got shape {tuple(kv_cache.shape)}")
    expect(kv_cache.shape[3] == width, ValueError,
            f"{name}: last dim (bytes per token) must be {value_bytes} value bytes + 4 scale bytes = {width} "
            f"for this head dim and format, got {kv_cache.shape[3]}")
    nb, bkv = kv_cache.shape[:2]
    expect(nb >= 1 and bkv >= 1, ValueError,
            f"{name}: needs at least one page of one token, got {tuple(kv_cache.shape)}")
    expect(kv_cache.stride(3) == 1 and kv_cache.stride(1) == width, ValueError,
            f"{name}: expected the fused page view (strides (page_stride, {width}, *, 1)), got {kv_cache.stride()}")
    page_bytes = bkv * width
    expect(kv_cache.stride(0) >= page_bytes and kv_cache.stride(0) % _SCALE_BYTES == 0, ValueError,
            f"{name}: page stride must be a multiple of 4 and >= block_kv * {width} = {page_bytes}, "
            f"got {kv_cache.stride(0)}")
    # Scales are read as 4-byte words (storage_offset is not traceable: checked eagerly only).
    expect(torch.compiler.is_compiling() or kv_cache.storage_offset() % _SCALE_BYTES == 0, ValueError,
            f"{name}: storage offset must be a multiple of 4 bytes")


def _page_views(kv_cache: torch.Tensor, value_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache: values uint8 ``[num_blocks, block_kv, value_bytes]`` and scales as int32
    ``[num_blocks, block_kv]`` (fp32 scales are read through ``.view(torch.float32)``)."""
    nb, bkv = kv_cache.shape[:2]
    ps, off = kv_cache.stride(0), kv_cache.storage_offset()
    values = kv_cache.as_strided((nb, bkv, value_bytes), (ps, value_bytes, 1), off)
    scales = kv_cache.as_strided((nb, bkv * _SCALE_BYTES), (ps, 1), off + bkv * value_bytes).view(torch.int32)
    return values, scales


def write_paged_kv_cache(kv_cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor,
                         fmt: str = "fp8") -> None:
    """Quantise ``keys`` and write token ``i`` into slot ``slot_mapping[i]`` of ``kv_cache`` (in place).

    Args:
        kv_cache: uint8 ``[num_blocks, block_kv, 1, width]`` fused page view (see
            :func:`new_paged_kv_cache`).
        keys: real-valued ``[N, D]`` (bf16, fp16 or fp32), quantised with
            :func:`tilefuse.formats.quantize_k` (FP8: per-token fp32 scale; MX: per-32 UE8M0).
        slot_mapping: integer ``[N]``, slot ``page * block_kv + offset`` of each token.
        fmt: "fp8", "mxfp8" or "mxfp4"; must match the cache width.

    Raises:
        TypeError: non-tensor or wrong dtype arguments.
        ValueError: shapes that do not match, a cache width for another format or head dim,
            slots out of range.
    """
    expect_tensor(keys, "keys")
    expect_tensor(slot_mapping, "slot_mapping")
    expect(keys.dim() == 2, ValueError, f"keys: expected [N, D], got shape {tuple(keys.shape)}")
    expect(keys.is_floating_point() and keys.element_size() >= 2, TypeError,
            f"keys: expected real-valued bf16/fp16/fp32 keys, got {keys.dtype}")
    n, d = keys.shape
    paged_kv_cache_width(d, fmt)
    _check_cache(kv_cache, _value_bytes(d, fmt))
    expect(not slot_mapping.is_floating_point() and slot_mapping.dim() == 1 and slot_mapping.shape[0] == n,
            ValueError, f"slot_mapping: expected an integer [{n}] tensor, got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}")
    expect(keys.device == kv_cache.device and slot_mapping.device == kv_cache.device, ValueError,
            f"keys/slot_mapping: expected device {kv_cache.device}")
    if n == 0:
        return
    nb, bkv = kv_cache.shape[:2]
    slots = slot_mapping.long()
    lo, hi = torch.stack([slots.min(), slots.max()]).tolist()
    expect(lo >= 0 and hi < nb * bkv, ValueError, f"slot_mapping: slots must lie in [0, {nb * bkv}), got [{lo}, {hi}]")
    values, scales = formats.quantize_k(keys, fmt)
    vals_view, sf_view = _page_views(kv_cache, _value_bytes(d, fmt))
    page, off = slots // bkv, slots % bkv
    vals_view[page, off] = values.view(torch.uint8)
    sf_view[page, off] = scales.view(torch.int32)


def make_paged_kv_cache(keys: torch.Tensor, context_lens: torch.Tensor, block_kv: int, fmt: str = "fp8", *,
                        num_blocks: int | None = None, page_stride: int | None = None, shuffle: bool = True,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache and block table holding the first ``len_b`` keys of every request.

    Args:
        keys: real-valued ``[B, S, D]``; token ``j`` of request ``b`` is ``keys[b, j]``.
        context_lens: int ``[B]`` or ``[B, next_n]`` (the longest row counts), each <= S.
        block_kv: tokens per page.
        fmt: "fp8", "mxfp8" or "mxfp4".
        num_blocks: pages in the cache (default: exactly the pages needed, at least 1).
        page_stride: padded page stride in bytes (see :func:`new_paged_kv_cache`).
        shuffle: give requests random, non-contiguous pages (else pages in order).
        generator: CPU generator for the shuffle.

    Returns:
        ``(kv_cache, block_table)``: uint8 ``[num_blocks, block_kv, 1, width]`` and int32
        ``[B, max(1, max_pages)]``; entries past a request's pages are 0.

    Raises:
        ValueError: lengths negative or longer than ``S``, ``num_blocks`` too small, and the
            errors of :func:`new_paged_kv_cache`.
    """
    expect_tensor(keys, "keys")
    expect_tensor(context_lens, "context_lens")
    expect(keys.dim() == 3, ValueError, f"keys: expected [B, S, D], got shape {tuple(keys.shape)}")
    b, s, d = keys.shape
    expect(context_lens.dim() in (1, 2) and context_lens.shape[0] == b, ValueError,
            f"context_lens: expected [{b}] or [{b}, next_n], got shape {tuple(context_lens.shape)}")
    lens = context_lens.long() if context_lens.dim() == 1 else context_lens.long().amax(dim=1)
    lens = lens.cpu()
    expect(b == 0 or (int(lens.min()) >= 0 and int(lens.max()) <= s), ValueError,
            f"context_lens: lengths must lie in [0, {s}] (the keys given)")
    expect_int(block_kv, "block_kv", 1)
    pages = (lens + block_kv - 1) // block_kv
    total = int(pages.sum())
    nb = max(total, 1) if num_blocks is None else num_blocks
    expect(isinstance(nb, int) and nb >= max(total, 1), ValueError,
            f"num_blocks: the lengths need {total} pages, got {num_blocks!r}")
    cache = new_paged_kv_cache(nb, block_kv, d, fmt, page_stride=page_stride, device=keys.device)
    order = torch.randperm(nb, generator=generator) if shuffle else torch.arange(nb)
    max_pages = max(1, int(pages.max()) if b else 1)
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    starts = torch.cumsum(pages, 0) - pages
    for i in range(b):
        table[i, : int(pages[i])] = order[int(starts[i]): int(starts[i] + pages[i])].to(torch.int32)
    if total:
        req = torch.repeat_interleave(torch.arange(b), lens)
        tok = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        slots = table[req, tok // block_kv].long() * block_kv + tok % block_kv
        write_paged_kv_cache(cache, keys[req.to(keys.device), tok.to(keys.device)], slots.to(keys.device), fmt)
    return cache, table.to(keys.device)


# ---------------------------------------------------------------------------------------
# Schedule metadata
# ---------------------------------------------------------------------------------------
def _key_extent(context_lens: torch.Tensor) -> torch.Tensor:
    """Keys each request reads: its length (1-D) or its longest row (2-D), at least 0 (int64)."""
    lens = context_lens.long()
    if lens.dim() == 2:
        lens = lens.amax(dim=1) if lens.shape[1] else torch.zeros(lens.shape[0], dtype=torch.long, device=lens.device)
    return lens.clamp(min=0)


def _schedule(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """Worker ``w`` starts at page ``w * P // num_sms`` of the batch's ``P`` pages, as (request, page)."""
    pages = (_key_extent(context_lens) + block_kv - 1) // block_kv
    dev = context_lens.device
    if pages.numel() == 0:
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=dev)
    ends = torch.cumsum(pages, 0)
    targets = torch.arange(num_sms + 1, device=dev, dtype=torch.long) * ends[-1] // num_sms
    # The request holding page `target`: the first whose end exceeds it (empty requests are skipped).
    req = torch.searchsorted(ends, targets, right=True)
    starts = ends - pages
    page = targets - starts[req.clamp(max=pages.numel() - 1)]
    page = torch.where(req < pages.numel(), page, torch.zeros_like(page))
    return torch.stack([req, page], dim=1).to(torch.int32)


def _check_context_lens(context_lens, name: str = "context_lens") -> None:
    expect_tensor(context_lens, name)
    expect(context_lens.dtype == torch.int32, TypeError, f"{name}: expected int32, got {context_lens.dtype}")
    expect(context_lens.dim() in (1, 2), ValueError,
            f"{name}: expected [B] or [B, next_n], got shape {tuple(context_lens.shape)}")
    expect(context_lens.stride(-1) == 1 or context_lens.shape[-1] <= 1, ValueError,
            f"{name}: last dim must be contiguous, got strides {context_lens.stride()}")


def _check_indices(indices, n: int, next_n: int, device) -> None:
    expect_tensor(indices, "indices")
    expect(indices.dtype == torch.int32, TypeError, f"indices: expected int32, got {indices.dtype}")
    expect(tuple(indices.shape) == (n,), ValueError,
            f"indices: expected [{n}] (one request id per token), got shape {tuple(indices.shape)}")
    expect(next_n == 1, ValueError, f"indices: varlen batches need next_n == 1, got next_n = {next_n}")
    expect(indices.device == device, ValueError, f"indices: expected device {device}, got {indices.device}")


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM's work split of the paged decode over ``num_sms`` workers.

    :func:`fp8_fp4_paged_mqa_logits` checks that it matches the lengths; its default schedule,
    one program per (request, chunk of keys), measured 10-30% faster on the H200 than the first
    kernel's walk over these ranges (``benchmarks/NOTES.md``) and does not read it.

    The batch's pages (``ceil(len_b / block_kv)`` per request; the longest row with 2-D
    lengths) are laid end to end and cut into ``num_sms`` ranges of equal size (within one
    page). Row ``w`` is ``(request, page)`` where worker ``w`` starts; row ``num_sms`` is
    ``(B, 0)``. Zero-length requests get no pages; an all-zero batch gives empty ranges.
    Computed with device ops only (no host sync, CUDA-graph safe); the logits do not depend
    on ``num_sms`` (bitwise).

    Args:
        context_lens: int32 ``[B]`` or ``[B, next_n]``, as passed to the logits op.
        block_kv: tokens per page of the cache (>= 1).
        num_sms: number of workers (>= 1), normally the GPU's SM count.
        indices: int32 ``[B]`` request id per token in varlen batches (next_n == 1). The
            split is per token either way; accepted for DeepGEMM compatibility.

    Returns:
        int32 ``[num_sms + 1, 2]`` on the device of ``context_lens``.

    Raises:
        TypeError: a non-tensor or wrong dtype.
        ValueError: a bad shape, ``block_kv`` or ``num_sms`` < 1, ``indices`` with next_n > 1.
    """
    _check_context_lens(context_lens)
    expect_int(block_kv, "block_kv", 1)
    expect_int(num_sms, "num_sms", 1)
    if indices is not None:
        next_n = context_lens.shape[1] if context_lens.dim() == 2 else 1
        _check_indices(indices, context_lens.shape[0], next_n, context_lens.device)
    return _schedule(context_lens, block_kv, num_sms)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Problem:
    fmt: str
    batch: int
    next_n: int
    num_heads: int
    head_dim: int
    block_kv: int


def _check_inputs(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                  logits_dtype, indices) -> _Problem:
    """Shapes, dtypes, strides and devices (no data read)."""
    expect_tensor(q, "q")
    if q_sf is not None:
        expect_tensor(q_sf, "q[1] (query scales)")
    if q_sf is None:
        expect(q.dtype == FP8_DTYPE, TypeError,
                f"q: FP8 queries (no scales) must be {FP8_DTYPE}, got {q.dtype}"
                + ("; MXFP4 queries need their scales" if q.dtype == torch.int8 else ""))
    else:
        expect(q.dtype in (FP8_DTYPE, torch.int8), TypeError,
                f"q: MX queries must be {FP8_DTYPE} (MXFP8) or int8 packed (MXFP4), got {q.dtype}")
    fmt = format_of(q, q_sf)
    expect(q.dim() == 4, ValueError, f"q: expected [B, next_n, H, D], got shape {tuple(q.shape)}")
    b, next_n, h, dq = q.shape
    d = dq * 2 if fmt == "mxfp4" else dq
    if fmt == "mxfp4":
        expect(d in (64, 128), ValueError, f"q: MXFP4 head dim must be 64 or 128 (packed last dim 32/64), got {d}")
    else:
        expect(d in (32, 64, 128), ValueError, f"q: head dim must be 32, 64 or 128, got {d}")
    expect(h % 4 == 0 and 4 <= h <= 128, ValueError, f"q: head count must be a multiple of 4 in [4, 128], got {h}")
    expect(1 <= next_n <= 8, ValueError, f"q: next_n must be in [1, 8], got {next_n}")
    expect(q.stride(3) == 1, ValueError, f"q: head dim must be contiguous, got strides {q.stride()}")
    if q_sf is not None:
        expect(q_sf.dtype == torch.int32, TypeError,
                f"q[1]: query scales must be int32 (packed UE8M0), got {q_sf.dtype}")
        expect(tuple(q_sf.shape) == (b, next_n, h) and q_sf.stride(2) == 1, ValueError,
                f"q[1]: expected [{b}, {next_n}, {h}] with unit last stride, got shape {tuple(q_sf.shape)}")

    _check_cache(kv_cache, _value_bytes(d, fmt))
    block_kv = kv_cache.shape[1]

    expect_tensor(weights, "weights")
    expect(weights.dtype in _WEIGHT_DTYPES, TypeError, f"weights: expected fp32 or bf16, got {weights.dtype}")
    expect(tuple(weights.shape) == (b * next_n, h) and weights.stride(1) == 1, ValueError,
            f"weights: expected [B * next_n, H] = [{b * next_n}, {h}] with unit last stride, got shape "
            f"{tuple(weights.shape)} strides {weights.stride()}")

    _check_context_lens(context_lens)
    if context_lens.dim() == 1:
        expect(context_lens.shape[0] == b, ValueError,
                f"context_lens: expected [{b}], got {tuple(context_lens.shape)}")
    else:
        expect(tuple(context_lens.shape) == (b, next_n), ValueError,
                f"context_lens: 2-D lengths must be [B, next_n] = [{b}, {next_n}] (next_n of q), "
                f"got {tuple(context_lens.shape)}")

    expect_tensor(block_table, "block_table")
    expect(block_table.dtype == torch.int32, TypeError, f"block_table: expected int32, got {block_table.dtype}")
    expect(block_table.dim() == 2 and block_table.shape[0] == b, ValueError,
            f"block_table: expected [{b}, max_blocks], got shape {tuple(block_table.shape)}")
    expect(block_table.stride(1) == 1 or block_table.shape[1] <= 1, ValueError,
            f"block_table: last dim must be contiguous, got strides {block_table.stride()}")

    expect_tensor(schedule_meta, "schedule_meta")
    expect(schedule_meta.dtype == torch.int32 and schedule_meta.dim() == 2 and schedule_meta.shape[1] == 2
            and schedule_meta.shape[0] >= 2 and schedule_meta.is_contiguous(), ValueError,
            f"schedule_meta: expected contiguous int32 [num_sms + 1, 2] from get_paged_mqa_logits_metadata, "
            f"got {schedule_meta.dtype} {tuple(schedule_meta.shape)}")
    expect_int(max_context_len, "max_context_len", 0)
    expect(logits_dtype in _LOGITS_DTYPES, TypeError,
            f"logits_dtype: expected float32 or bfloat16, got {logits_dtype}")
    if indices is not None:
        _check_indices(indices, b, next_n, q.device)

    tensors = {"kv_cache": kv_cache, "weights": weights, "context_lens": context_lens, "block_table": block_table,
               "schedule_meta": schedule_meta}
    if q_sf is not None:
        tensors["q[1]"] = q_sf
    for name, t in tensors.items():
        expect(t.device == q.device, ValueError, f"{name}: expected device {q.device} like q, got {t.device}")
    return _Problem(fmt, b, next_n, h, d, block_kv)


def _check_values(context_lens, block_table, schedule_meta, num_blocks: int, block_kv: int,
                  max_context_len: int) -> None:
    """Checks that read the lengths and tables: one small reduction and one host sync.

    Skipped under CUDA-graph capture, torch.compile tracing and ``TILEFUSE_CHECK_WINDOWS=0``
    (then a key past the block table's width reads as NaN, never out of bounds).
    """
    if context_lens.numel() == 0 or not _window_checks_enabled():
        return
    lens = context_lens.long()
    extent = _key_extent(context_lens)
    pages = (extent + block_kv - 1) // block_kv
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < pages[:, None]
    bad_page = used & ((block_table < 0) | (block_table >= num_blocks))
    expected_meta = _schedule(context_lens, block_kv, schedule_meta.shape[0] - 1)
    flags = torch.stack([
        (lens < 0).any(), (extent > max_context_len).any(), (pages > block_table.shape[1]).any(),
        bad_page.any(), (expected_meta != schedule_meta).any(),
    ]).tolist()
    negative, too_long, short_table, bad_ids, stale_meta = flags
    expect(not negative, ValueError, "context_lens: lengths must be >= 0")
    expect(not too_long, ValueError, f"context_lens: a length exceeds max_context_len = {max_context_len}")
    expect(not short_table, ValueError,
            f"block_table: too short for a length ({block_table.shape[1]} pages of {block_kv} tokens per row)")
    expect(not bad_ids, ValueError, f"block_table: a page id used by a request lies outside [0, {num_blocks})")
    expect(not stale_meta, ValueError,
            "schedule_meta: does not match context_lens and the cache's block_kv; build it with "
            "get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)")


# ---------------------------------------------------------------------------------------
# The custom op
# ---------------------------------------------------------------------------------------
def _out_layout(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    stride = max(_ROW_ALIGN, triton.cdiv(cols, _ROW_ALIGN) * _ROW_ALIGN)
    return (rows, cols), (stride, 1)


def _launch_spec(q, q_sf, kv_cache, weights, context_lens, block_table, out, clean_logits: bool,
                 cfg: PagedConfig) -> tuple[tuple[int, int, int], tuple, dict]:
    """Grid, positional arguments and constexprs of one kernel launch (``out`` already allocated)."""
    fmt = format_of(q, q_sf)
    b, next_n, h, dq = q.shape
    # Byte views of one buffer: values as E4M3 (or packed FP4 bytes), scales as 4-byte words.
    kv_values = kv_cache.view(torch.int8 if fmt == "mxfp4" else FP8_DTYPE)
    kv_scales = kv_cache.view(torch.float32 if fmt == "fp8" else torch.int32)
    groups = triton.cdiv(next_n, cfg.rows)
    chunks_per_request = triton.cdiv(out.shape[1], cfg.chunk)
    grid = (groups * b * chunks_per_request,)
    args = (
        q, q_sf if q_sf is not None else context_lens, kv_values, kv_scales, weights, context_lens, block_table, out,
        out.shape[1], block_table.shape[1], chunks_per_request,
        q.stride(0), q.stride(1), q.stride(2),
        q_sf.stride(0) if q_sf is not None else 0, q_sf.stride(1) if q_sf is not None else 0,
        weights.stride(0), context_lens.stride(0), block_table.stride(0),
        kv_cache.stride(0), kv_cache.stride(0) // _SCALE_BYTES,
        out.stride(0),
    )
    # Dot columns per head group: the rows share the dot, which has at least _MIN_DOT columns.
    heads_p = max(_next_pow2(h), _MIN_DOT // cfg.rows)
    consts = dict(
        NEXT_N=next_n, NEXT_N_P=_next_pow2(next_n), NUM_HEADS=h, HEADS_P=heads_p,
        D=dq * 2 if fmt == "mxfp4" else dq, BLOCK_KV=kv_cache.shape[1], FMT=_FORMAT_CODE[fmt],
        CTX_2D=context_lens.dim() == 2, CLEAN=clean_logits, ROWS=cfg.rows, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk,
        BLOCK_FILL=cfg.block_fill, NUM_STAGES=cfg.num_stages, G=groups,
    )
    return grid, args, consts


@torch.library.custom_op("tilefuse::paged_mqa_logits", mutates_args=())
def _paged_mqa_logits(
    q: torch.Tensor,
    q_sf: torch.Tensor | None,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool,
    logits_dtype: torch.dtype,
    block_n: int,
    rows: int,
    chunk: int,
    num_warps: int,
    num_stages: int,
    block_fill: int,
) -> torch.Tensor:
    shape, stride = _out_layout(q.shape[0] * q.shape[1], max_context_len)
    out = torch.empty_strided(shape, stride, dtype=logits_dtype, device=q.device)
    if out.numel() == 0:
        return out
    cfg = PagedConfig(block_n, rows, chunk, num_warps, num_stages, block_fill)
    grid, args, consts = _launch_spec(q, q_sf, kv_cache, weights, context_lens, block_table, out, clean_logits, cfg)
    kern.paged_logits_kernel[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)
    return out


@_paged_mqa_logits.register_fake
def _paged_mqa_logits_fake(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                           clean_logits, logits_dtype, block_n, rows, chunk, num_warps, num_stages, block_fill):
    shape, stride = _out_layout(q.shape[0] * q.shape[1], max_context_len)
    return torch.empty_strided(shape, stride, dtype=logits_dtype, device=q.device)


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------
def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    logits_dtype: torch.dtype = torch.float32,
    indices: torch.Tensor | None = None,
    *,
    config: PagedConfig | None = None,
) -> torch.Tensor:
    """Indexer decode logits of ``next_n`` query rows per request against its paged keys.

    Args:
        q: ``(values, sf)``. FP8: e4m3 ``[B, next_n, H, D]`` and ``None``. MXFP8: e4m3
            ``[B, next_n, H, D]`` and int32 ``[B, next_n, H]`` packed UE8M0. MXFP4: int8
            ``[B, next_n, H, D/2]`` packed nibbles and int32 ``[B, next_n, H]``. Head dim
            contiguous; H a multiple of 4 up to 128; D in {32, 64, 128} (FP4: 64, 128);
            next_n in [1, 8].
        kv_cache: uint8 ``[num_blocks, block_kv, 1, width]`` fused page view, width = D + 4
            (FP4: D/2 + 4); FP8 caches hold fp32 scales, MX caches int32 UE8M0. Build it with
            :func:`make_paged_kv_cache` or :func:`write_paged_kv_cache`.
        weights: fp32 or bf16 ``[B * next_n, H]``, row ``b * next_n + t``, last stride 1.
        context_lens: int32 ``[B]`` (row ``t`` sees ``j <= ctx[b] - next_n + t``) or
            ``[B, next_n]`` (row ``t`` sees ``j < ctx[b, t]``); each length <= max_context_len.
        block_table: int32 ``[B, max_blocks]``: token ``j`` of request ``b`` is slot
            ``j % block_kv`` of page ``block_table[b, j // block_kv]``; entries past a
            request's length may be read but are never used as page ids.
        schedule_meta: ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)``
            for these lengths (checked); the result is bitwise identical for every
            ``num_sms``.
        max_context_len: columns of the output.
        clean_logits: write ``-inf`` to every column outside each row's window (both length
            modes; DeepGEMM supports 1-D only). Without it those columns are unspecified.
        logits_dtype: torch.float32 or torch.bfloat16.
        indices: int32 ``[B]``, request id of each token of a varlen batch (next_n = 1).
            Each token still reads its keys through its own block-table row and length, so
            the result does not depend on it; accepted for DeepGEMM compatibility.
        config: launch configuration override (see :class:`PagedConfig`).

    Returns:
        ``[B * next_n, max_context_len]`` logits, last stride 1, row stride padded to a
        multiple of 16 elements (read ``logits.stride(0)``).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype (q, q[1], kv_cache, weights,
            context_lens, block_table, indices, logits_dtype).
        ValueError: a wrong shape (a cache width for another D or format, 2-D lengths or
            weights that do not match next_n), an unsupported H, D or next_n, non-contiguous
            last dims, a bad page stride, mixed devices, negative lengths, a length over
            ``max_context_len``, a block table too short for a length or with page ids out of
            range, or ``schedule_meta`` built for other lengths or page size. The checks that
            read values cost one host sync; they are skipped under CUDA-graph capture,
            ``torch.compile`` and ``TILEFUSE_CHECK_WINDOWS=0``, where a key past the block
            table's width gives NaN logits instead (page ids must then be valid: they are
            read as given).
    """
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise TypeError("q: expected a tuple (values, sf); sf is None for FP8")
    q_values, q_sf = q
    p = _check_inputs(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                      max_context_len, logits_dtype, indices)
    cfg = resolve_paged_config(p.fmt, p.next_n, p.num_heads, p.head_dim, p.block_kv, config, p.batch,
                               max_context_len)
    _check_values(context_lens, block_table, schedule_meta, kv_cache.shape[0], p.block_kv, max_context_len)
    return _paged_mqa_logits(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, bool(clean_logits), logits_dtype,
                             *dataclasses.astuple(cfg))  # the op takes the config's fields in their order


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    indices: torch.Tensor | None = None,
    *,
    config: PagedConfig | None = None,
) -> torch.Tensor:
    """FP8 decode logits with DeepGEMM's ``fp8_paged_mqa_logits`` signature: ``q`` is a bare
    e4m3 ``[B, next_n, H, D]`` tensor, the cache holds fp32 scales, logits are fp32.

    See :func:`fp8_fp4_paged_mqa_logits` for the arguments and the errors raised.
    """
    expect_tensor(q, "q")
    return fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens, block_table, schedule_meta,
                                    max_context_len, clean_logits, torch.float32, indices, config=config)
