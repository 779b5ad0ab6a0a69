"""Indexer decode logits over a paged KV cache, DeepGEMM-compatible.

Public ops (names, argument order and defaults as DeepGEMM):

* :func:`get_paged_mqa_logits_metadata` — DeepGEMM's balanced split of the pages over
  ``num_sms`` workers, one small kernel (the logits op checks its shape only: the kernel
  schedules by request and chunk of keys, see ``_paged_kernel.py``, so the logits do not
  depend on it);
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

As a serving engine calls them: the host checks read shapes, dtypes, strides and devices only
(once per argument layout, then a dict lookup); value errors (lengths, page ids, request ids)
are found by the kernel and raised at the next call or by ``tilefuse.check_errors()``, with no
host sync and nothing read out of bounds (:func:`tilefuse.set_checked` checks them on the host
instead, with a sync); ``out=`` takes a caller-owned logits buffer; one compile per model
configuration serves every batch, length and table width (:func:`warmup_calls` runs them).

Under ``torch.compile`` the logits ops trace as the ``torch.library`` custom op
``tilefuse::paged_mqa_logits`` (it writes the ``out`` it is given), without graph breaks;
eager calls launch directly.
"""

from __future__ import annotations

import dataclasses

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tilefuse import _config, _errors, _validate, formats
from tilefuse._config import apply_override, register_config
from tilefuse._device import capability_major, sm_count
from tilefuse._errors import error_record, raise_pending_fast
from tilefuse._jit import Launcher, cdiv, host_descriptor, next_power_of_2
from tilefuse._validate import expect, expect_int, expect_tensor
from tilefuse.formats import FP8_DTYPE, format_of
from tilefuse.indexer import _paged_kernel as kern
from tilefuse.indexer._layout import new_logits
from tilefuse.indexer.prefill import split_query

_LOGITS_DTYPES = (torch.float32, torch.bfloat16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_SCALE_BYTES = 4
# The smallest tl.dot side: the (row, head) columns are padded up to it.
_MIN_DOT = 16


# ---------------------------------------------------------------------------------------
# Launch configuration: explicit values from one heuristic, no autotuning at run time.
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Tile shape, schedule and pipelining of the decode kernel.

    ``rows``: ``ceil(next_n / rows)`` programs share each key tile. ``chunk`` = 0 picks the
    keys per program per call from the batch (a runtime value: no compile per batch).
    ``head_sum_mma``: the weighted head sum as a second (tf32) dot on the tensor cores instead
    of a CUDA-core reduction (see ``_paged_kernel.py``). ``tma``: the key values by TMA (a
    tensor descriptor over the cache's value rows, one box per page a tile covers) instead of
    the per-element gather; where the cache's layout does not allow it (a page stride that is
    not a multiple of the value bytes per token, tiles that do not split into boxes of >= 64
    keys inside pages, an offset that is not a multiple of 16 bytes) the gather runs, with the
    same results. ``gluon``: FP8 on an sm_90 GPU, the Gluon kernel (``_paged_kernel_gluon.py``:
    each tile's MMA runs under the previous tile's epilogue; TMA key loads whatever ``tma``
    says, ``num_stages`` key buffers (at least 2), 4 warps, or 8 where ``num_warps`` >= 8 and
    ``rows`` is even) where it applies: 64-key tiles, at most 128 dot columns (``rows`` x padded
    heads), a cache whose value rows the TMA view reads (pages of a multiple of 64 tokens, or
    of 8, 16 or 32: one box per page); elsewhere the Triton kernel runs. ``persistent``: FP8
    on an sm_90 GPU, the persistent warp-specialised kernel (``_paged_kernel_ws.py``:
    ``ctas_per_sm`` programs an SM, 0 for the default, walk the batch's 64-key tiles, a
    producer warp loading and a consumer warpgroup scoring; ``num_stages`` key buffers, at least
    2) where it applies: H a power of two, ``next_pow2(next_n) * H`` in [16, 256], queries whose rows are
    evenly strided and 16-byte aligned, a cache the TMA views read with pages of at least 32
    tokens (``split_columns``, next_n > 1: each tile's MMA in two halves of the query rows, each
    half's MMA in flight under the other's epilogue); ``block_n``, ``rows``,
    ``chunk`` and ``num_warps`` do not apply to it. Elsewhere the kernel the other fields pick.
    """

    block_n: int = 128  # keys per tile: a power of two >= 16, independent of the page size
    rows: int = 1  # query rows (of next_n) per program, scored in one dot of rows * heads columns
    chunk: int = 0  # keys per program: a multiple of block_n, a power-of-two number of pages
    num_warps: int = 4  # as in Triton
    num_stages: int = 3  # as in Triton: the key-tile loads' pipeline
    block_fill: int = 1024  # columns per store of the -inf tail when cleaning
    head_sum_mma: bool = False  # the head sum as a tf32 dot
    tma: bool = False  # the key values by TMA
    gluon: bool = False  # the Gluon kernel (sm_90, FP8) where it applies
    persistent: bool = False  # the persistent warp-specialised kernel (sm_90, FP8) where it applies
    ctas_per_sm: int = 0  # its programs an SM, at most (and for 0) 3 up to 64 dot columns, 2 up to 128, else 1
    split_columns: bool = False  # its MMA in two halves of the query rows, one under the other's epilogue


register_config("paged", PagedConfig)

# Programs the per-call chunk aims for: about 16 per SM on a 132-SM H200, so that programs
# starting their pipeline overlap others streaming (benchmarks/NOTES.md, paged rounds).
_TARGET_PROGRAMS = 2048
# Chunk sizes the per-call choice moves between, in keys (down to one tile where a batch is
# too small to fill the GPU: see chunk_pages_for).
_MIN_CHUNK, _MAX_CHUNK = 512, 2048
# Programs per SM up to which a batch of two or more requests takes chunks below 512 keys, down
# to _FEW_CHUNK (``chunk_pages_for``'s ``few``): a batch that gives about one program an SM at 512
# keys is a program's latency, and shorter chunks spread it (benchmarks/NOTES.md, round (31)).
_FEW_PER_SM = 4
_FEW_CHUNK = 128
# Programs per SM that every default configuration holds resident at once (4-5 at 64-key
# tiles, 3-4 at 128): a batch with fewer programs than this many per SM runs in one wave.
_RESIDENT_PER_SM = 2
# Dot columns (query rows x padded heads) one program takes at most (a request's further rows go
# to further programs; one row at least), and from which size it runs on 8 warps (two
# warpgroups share the accumulator).
_MAX_DOT_COLUMNS = 128
_WIDE_DOT = 256


def default_paged_config(fmt: str, next_n: int, num_heads: int, head_dim: int, block_kv: int) -> PagedConfig:
    """The defaults for one model configuration (measured on the H200 unless said:
    ``benchmarks/NOTES.md``, paged rounds; the rules are stated here, the numbers live there).

    * ``rows``: a request's query rows in one program while ``rows * next_pow2(H)`` fits
      ``_MAX_DOT_COLUMNS`` (128) dot columns, so next_n 1 and 2 at H = 64 read each key tile
      once; past that, programs of 128 columns, each reading the tile (next_n 4 at H = 64 as
      two programs of two rows: 10-15% less time than one program of four on 8 warps, on an
      H100). 8 warps from 256 columns (one row at H >= 256).
    * FP8 with <= 32 dot columns: 128-key tiles, 3 stages; otherwise 64-key tiles, 4 stages
      (3 at 256 columns). At 64 columns (H 64, next_n 1) the 64-key tile streams 2-16% faster
      at B >= 8 and loses ~0.3 us at B 1 (two same-run sweeps beside DeepGEMM).
    * ``chunk`` = 0: chosen per call by :func:`chunk_pages_for` (a runtime value).
    * ``tma`` for FP8 (where the cache's layout allows it; the gather elsewhere); MX formats
      keep the gather until their TMA path is timed.
    """
    del head_dim, block_kv
    heads_p = next_power_of_2(num_heads)
    rows = min(next_power_of_2(next_n), max(1, _MAX_DOT_COLUMNS // heads_p))
    columns = rows * heads_p
    # 128-key tiles where the accumulator stays small (<= 32 dot columns) and the keys need no
    # bf16 dequantisation in registers; otherwise 64 (128 spills for MX, on sm_100a too).
    block_n = 128 if columns <= 32 and fmt == "fp8" else 64
    wide = columns >= _WIDE_DOT
    return PagedConfig(block_n=block_n, rows=rows, chunk=0, num_warps=8 if wide else 4,
                       num_stages=3 if block_n == 128 or wide else 4, block_fill=1024, head_sum_mma=False,
                       tma=fmt == "fp8")


def _pages_for(keys: int, block_kv: int, block_n: int) -> int:
    """Pages in a chunk of about ``keys`` keys: a power of two of them, whole ``block_n`` tiles."""
    pages = next_power_of_2(max(1, keys // block_kv))
    while (pages * block_kv) % block_n:
        pages *= 2
    return pages


def chunk_pages_for(batch: int, max_context_len: int, block_kv: int, block_n: int, wave: int = 0,
                    groups: int = 1, few: int = 0) -> int:
    """Pages per program for this call (whole pages, a power of two of them): the largest chunk
    in [512, 2048] keys that still gives about ``_TARGET_PROGRAMS`` programs over the batch
    (row groups counted);
    below 512 keys, down to one tile, the smallest chunk that gives at most ``wave`` programs
    (the GPU's resident programs, ``_RESIDENT_PER_SM`` an SM): every program of such a batch
    runs at once, and its time is one program's tiles one after another. ``groups``: programs
    per (request, chunk), the query rows' groups. ``few`` (the launch passes ``_FEW_PER_SM`` an
    SM; 0: off): before that, a batch of two or more requests halves down to ``_FEW_CHUNK``
    keys while the halved chunk gives at most ``few`` programs. (One request keeps the wave's
    rule: halved further it measured slower, benchmarks/NOTES.md round (31).)"""
    work = max(1, batch) * max(1, max_context_len) * groups  # programs at a chunk of one key
    target = _MIN_CHUNK
    if batch > 1:
        while target > max(block_n, _FEW_CHUNK) and work // (target // 2) <= few:
            target //= 2
    while target > block_n and work // (target // 2) <= wave:
        target //= 2
    while target < _MAX_CHUNK and work // (2 * target) >= _TARGET_PROGRAMS:
        target *= 2
    key = (target, block_kv, block_n)  # (a few values of each: per call a lookup)
    pages = _CHUNK_PAGES.get(key)
    if pages is None:
        pages = _CHUNK_PAGES[key] = _pages_for(target, block_kv, block_n)
    return pages


_CHUNK_PAGES: dict[tuple, int] = {}


def resolve_paged_config(fmt: str, next_n: int, num_heads: int, head_dim: int, block_kv: int,
                         config: PagedConfig | None = None) -> PagedConfig:
    """``config`` if given, else the default; then the fields set by
    ``tilefuse.set_config_override("paged", ...)`` (or ``TILEFUSE_PAGED_CONFIG`` at import)."""
    cfg = config or default_paged_config(fmt, next_n, num_heads, head_dim, block_kv)
    cfg = apply_override(cfg, "paged")
    for name in ("block_n", "rows", "block_fill"):
        v = getattr(cfg, name)
        expect(v >= 1 and v & (v - 1) == 0, ValueError, f"PagedConfig.{name} must be a power of two, got {v}")
    expect(cfg.block_n >= _MIN_DOT, ValueError, f"PagedConfig.block_n must be >= {_MIN_DOT}, got {cfg.block_n}")
    expect(cfg.num_warps >= 1 and cfg.num_stages >= 1, ValueError,
           f"PagedConfig: num_warps and num_stages must be >= 1, got {cfg}")
    pages = cfg.chunk // block_kv
    expect(cfg.chunk == 0 or (cfg.chunk > 0 and cfg.chunk % cfg.block_n == 0 and cfg.chunk % block_kv == 0
                              and pages & (pages - 1) == 0),
           ValueError, f"PagedConfig.chunk must be 0 (per call) or a multiple of block_n = {cfg.block_n} and a "
           f"power-of-two number of {block_kv}-token pages, got {cfg.chunk}")
    return cfg


# TMA limits: at most 256 rows per box; row coordinates are int32.
_TMA_MAX_BOX, _TMA_MAX_ROWS = 256, 2**31


def _tma_view(kv_cache: torch.Tensor, value_bytes: int, block_n: int, split_boxes: bool = False
              ) -> tuple[int, int] | None:
    """``(rows, box)`` of the TMA key loads on this cache, or None where the gather must run
    (decided from shapes, strides and the storage offset only).

    The values are read through a ``[rows, value_bytes]`` view of the cache (row stride
    ``value_bytes``; page ``p``'s values are rows ``p * page_stride // value_bytes`` on, the
    last page's values end the view); a tile of ``block_n`` keys is one box of
    ``min(block_n, block_kv)`` rows per page it covers. Needs a page stride that is a multiple
    of ``value_bytes``, tiles that split into whole boxes inside pages, boxes of at least 64
    rows where they are smaller than the tile (a smaller dot does not run on wgmma), a 16-byte
    aligned start and int32 row coordinates. ``split_boxes`` (the Gluon kernel: a tile's boxes
    land in one buffer and make one MMA): boxes smaller than the tile down to 8 rows, so that
    each starts on a whole swizzle pattern of the buffer.
    """
    nb, block_kv = kv_cache.shape[:2]
    page_stride = kv_cache.stride(0)
    box = min(block_n, block_kv)
    rows = ((nb - 1) * page_stride + block_kv * value_bytes) // value_bytes
    ok = (page_stride % value_bytes == 0 and (block_kv % block_n == 0 or block_n % block_kv == 0)
          and (box == block_n or box >= (8 if split_boxes else 64)) and box <= _TMA_MAX_BOX
          and kv_cache.storage_offset() % 16 == 0 and rows < _TMA_MAX_ROWS)
    return (rows, box) if ok else None


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


# Tokens quantised and written per step of make_paged_kv_cache (bf16 D 128: 256 MiB of keys).
_FILL_CHUNK_TOKENS = 1 << 20


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
        # Tokens written a slice at a time: the gathered keys and the quantiser's fp32 temporaries
        # of a whole long batch (B256 x 128K keys: ~8 GB of bf16 keys) would not fit beside them.
        for lo in range(0, req.numel(), _FILL_CHUNK_TOKENS):
            part = slice(lo, lo + _FILL_CHUNK_TOKENS)
            write_paged_kv_cache(cache, keys[req[part].to(keys.device), tok[part].to(keys.device)],
                                 slots[part].to(keys.device), fmt)
    return cache, table.to(keys.device)


# ---------------------------------------------------------------------------------------
# Schedule metadata
# ---------------------------------------------------------------------------------------
# Workers per program and lengths per step of the metadata kernel.
_META_BLOCK_W, _META_BLOCK_B = 32, 256


def _key_extent(context_lens: torch.Tensor) -> torch.Tensor:
    """Keys each request reads: its length (1-D) or its longest row (2-D), at least 0 (int64)."""
    lens = context_lens.long()
    if lens.dim() == 2:
        lens = lens.amax(dim=1) if lens.shape[1] else torch.zeros(lens.shape[0], dtype=torch.long, device=lens.device)
    return lens.clamp(min=0)


def _schedule(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """The split in torch ops (what ``paged_schedule_kernel`` computes): traced under
    torch.compile, and the checked mode's reference for stale metadata."""
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
    # Runs on every metadata call: the messages are formatted only on failure.
    if not isinstance(context_lens, torch.Tensor):
        expect_tensor(context_lens, name)
    if context_lens.dtype != torch.int32:
        raise TypeError(f"{name}: expected int32, got {context_lens.dtype}")
    if context_lens.dim() not in (1, 2):
        raise ValueError(f"{name}: expected [B] or [B, next_n], got shape {tuple(context_lens.shape)}")
    if context_lens.stride(-1) != 1 and context_lens.shape[-1] > 1:
        raise ValueError(f"{name}: last dim must be contiguous, got strides {context_lens.stride()}")


def _check_indices(indices, n: int, next_n: int, device) -> None:
    expect_tensor(indices, "indices")
    expect(indices.dtype == torch.int32, TypeError, f"indices: expected int32, got {indices.dtype}")
    expect(tuple(indices.shape) == (n,) and (indices.stride(0) == 1 or n <= 1), ValueError,
           f"indices: expected a contiguous [{n}] (one request id per token), got shape {tuple(indices.shape)}")
    expect(next_n == 1, ValueError, f"indices: varlen batches need next_n == 1, got next_n = {next_n}")
    expect(indices.device == device, ValueError, f"indices: expected device {device}, got {indices.device}")


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM's work split of the paged decode over ``num_sms`` workers.

    :func:`fp8_fp4_paged_mqa_logits` checks its shape only and does not read it: its schedule
    is one program per (request, chunk of keys) (``_paged_kernel.py``), so the logits do not
    depend on it. It is computed for engines that hold it in a fixed buffer per step.

    The batch's pages (``ceil(len_b / block_kv)`` per request; the longest row with 2-D
    lengths) are laid end to end and cut into ``num_sms`` ranges of equal size (within one
    page). Row ``w`` is ``(request, page)`` where worker ``w`` starts; row ``num_sms`` is
    ``(B, 0)``. Zero-length requests get no pages; an all-zero batch gives empty ranges.
    One small kernel (no host sync, CUDA-graph safe); the logits do not depend on ``num_sms``
    (bitwise).

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
        ValueError: a bad shape, ``block_kv`` or ``num_sms`` < 1, ``indices`` with next_n > 1,
            a CPU tensor without Triton's interpreter.
    """
    compiling = torch.compiler.is_compiling()
    key = None
    if not compiling:
        try:  # what the checks read; on the CPU, whether it runs at all depends on the interpreter
            # (the batch only as its class: the launch takes it per call)
            b = context_lens.shape[0]
            key = (context_lens.shape[1:], min(b, 2), context_lens.stride(), context_lens.dtype,
                   context_lens.get_device(), context_lens.is_cuda or _validate.interpreter_enabled(),
                   block_kv.__class__, block_kv, num_sms.__class__, num_sms, None if indices is None else (
                       indices.dim(), indices.stride(), indices.dtype, indices.get_device()))
            hit = _schedule_launches.get(key)
            if hit is not None and indices is not None and indices.shape[0] != b:
                hit = None
        except (AttributeError, TypeError, IndexError):  # the checks say what is wrong
            key = hit = None
        if hit is not None:
            launch, device = hit
            meta = torch.empty(num_sms + 1, 2, dtype=torch.int32, device=device)
            if launch(context_lens, meta, b):
                return meta
    _check_context_lens(context_lens)
    expect_int(block_kv, "block_kv", 1)
    expect_int(num_sms, "num_sms", 1)
    if indices is not None:
        next_n = context_lens.shape[1] if context_lens.dim() == 2 else 1
        _check_indices(indices, context_lens.shape[0], next_n, context_lens.device)
    if compiling:
        return _schedule(context_lens, block_kv, num_sms)
    _validate.check_kernel_device(context_lens, "context_lens")
    meta = torch.empty((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)
    ctx_2d = context_lens.dim() == 2
    next_n = context_lens.shape[1] if ctx_2d else 1
    consts = (next_n, next_power_of_2(next_n), ctx_2d, block_kv, _META_BLOCK_B, _META_BLOCK_W)
    grid = (cdiv(num_sms + 1, _META_BLOCK_W),)
    args = (context_lens, meta, context_lens.shape[0], context_lens.stride(0), num_sms, *consts)
    _schedule_launch(consts, grid, args, _SCHEDULE_OPTIONS)
    if key is not None and hit is None:
        launch = _schedule_launch.partial(consts, grid, args, _SCHEDULE_OPTIONS, live=(0, 1, 2))
        if launch is not None:
            if len(_schedule_launches) >= _MAX_PLANS:
                _schedule_launches.clear()
            _schedule_launches[key] = (launch, meta.device)
    return meta


_schedule_launch = Launcher(kern.paged_schedule_kernel)
_SCHEDULE_OPTIONS = {"num_warps": 4}
# Metadata launches by argument layout (what the checks read but the batch size, the scalars):
# partial launches taking the call's lengths, batch size and new output (Launcher.partial).
_schedule_launches: dict[tuple, tuple] = {}


def _check_values(context_lens, block_table, schedule_meta, indices, num_blocks: int, block_kv: int,
                  max_context_len: int) -> None:
    """The checked mode's value checks: one small reduction and one host sync."""
    if context_lens.numel() == 0:
        return
    lens = context_lens.long()
    extent = _key_extent(context_lens)
    pages = (extent + block_kv - 1) // block_kv
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < pages[:, None]
    bad_page = used & ((block_table < 0) | (block_table >= num_blocks))
    expected_meta = _schedule(context_lens, block_kv, schedule_meta.shape[0] - 1)
    bad_index = ((indices < 0) | (indices >= lens.shape[0])).any() if indices is not None else lens.new_zeros(())
    flags = torch.stack([
        (lens < 0).any(), (extent > max_context_len).any(), (pages > block_table.shape[1]).any(),
        bad_page.any(), (expected_meta != schedule_meta).any(), bad_index,
    ]).tolist()
    negative, too_long, short_table, bad_ids, stale_meta, bad_request = flags
    expect(not negative, ValueError, "context_lens: lengths must be >= 0")
    expect(not too_long, ValueError, f"context_lens: a length exceeds max_context_len = {max_context_len}")
    expect(not short_table, ValueError,
           f"block_table: too short for a length ({block_table.shape[1]} pages of {block_kv} tokens per row)")
    expect(not bad_ids, ValueError, f"block_table: a page id used by a request lies outside [0, {num_blocks})")
    expect(not stale_meta, ValueError,
           "schedule_meta: does not match context_lens and the cache's block_kv; build it with "
           "get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)")
    expect(not bad_request, ValueError, f"indices: a request id lies outside [0, {lens.shape[0]})")


# ---------------------------------------------------------------------------------------
# Validation and the per-shape launch plan
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one argument layout launches: checked once, then reused for every call with it
    whatever its batch size and ``max_context_len`` (those are checked and passed per call)."""

    next_n: int
    block_kv: int
    cfg: PagedConfig
    chunk_pages: int  # pages per program fixed by ``cfg.chunk``; 0: picked per call (chunk_pages_for)
    wave: int  # programs the device holds at once (chunk_pages_for); 0 on the CPU
    few: int  # programs up to which a batch takes chunks below 512 keys (chunk_pages_for); 0 on the CPU
    groups: int
    page_unit: int
    q_unit: int
    consts: dict
    # With TMA: (view rows, value bytes per row, box rows, value dtype) of the key descriptor.
    tma: tuple | None
    # The kernel's constexpr arguments in signature order around the key descriptor (a runtime
    # argument among them), and the launch key (with the dtypes and the alignment of the two
    # specialised pointers added per call).
    consts_before_desc: tuple
    consts_after_desc: tuple
    launch_key: tuple
    options: dict
    # The kernel: the Gluon one (``_paged_kernel_gluon``) or the Triton one; its Launcher and
    # the key descriptor's constructor (``kv_descriptor(values, rows, value_bytes, box)``).
    gluon: bool
    launcher: Launcher
    kv_descriptor: object
    # The persistent kernel where the config asks for it and it applies (None elsewhere): a
    # call whose queries are not 16-byte aligned takes the kernel the fields above describe.
    persistent: _Persistent | None
    # Partial launches (Launcher.partial) by the alignment of the two specialised pointers:
    # what a call passes is its tensors, sizes and grid, everything else is this plan's.
    fast: dict = dataclasses.field(default_factory=dict, compare=False)


def _check_inputs(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                  logits_dtype, indices, out):
    """Shapes, dtypes, strides and devices (no data read); returns (fmt, B, next_n, H, D, block_kv)."""
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
    if out is not None:
        expect_tensor(out, "out")
        expect(out.dtype == logits_dtype, TypeError, f"out: expected {logits_dtype} like logits_dtype, got {out.dtype}")
        rows = b * next_n
        expect(out.dim() == 2 and tuple(out.shape) == (rows, max_context_len), ValueError,
               f"out: expected [B * next_n, max_context_len] = [{rows}, {max_context_len}], got {tuple(out.shape)}")
        expect((out.stride(1) == 1 or max_context_len <= 1) and (out.stride(0) >= max_context_len or rows <= 1),
               ValueError, f"out: expected unit last stride and a row stride >= {max_context_len}, got strides "
               f"{out.stride()}")

    tensors = {"kv_cache": kv_cache, "weights": weights, "context_lens": context_lens, "block_table": block_table,
               "schedule_meta": schedule_meta}
    if q_sf is not None:
        tensors["q[1]"] = q_sf
    if out is not None:
        tensors["out"] = out
    for name, t in tensors.items():
        expect(t.device == q.device, ValueError, f"{name}: expected device {q.device} like q, got {t.device}")
    _validate.check_kernel_device(q, "q")
    return fmt, b, next_n, h, d, block_kv


def _make_plan(fmt, next_n, h, d, block_kv, q, kv_cache, context_lens, indices, clean_logits, config) -> _Plan:
    cfg = resolve_paged_config(fmt, next_n, h, d, block_kv, config)
    chunk_pages = cfg.chunk // block_kv if cfg.chunk else 0
    # Constexpr size of the page-id vector: the largest chunk any call picks, so the per-call
    # choice never compiles.
    max_chunk_pages = max(chunk_pages, _pages_for(_MAX_CHUNK, block_kv, cfg.block_n))
    page_unit = 16 if kv_cache.stride(0) % 16 == 0 else _SCALE_BYTES
    # The query strides likewise, in units of 16 elements (bytes) when all three allow it.
    q_unit = 16 if all(s % 16 == 0 for s in q.stride()[:3]) else 1
    heads_p = max(next_power_of_2(h), _MIN_DOT // cfg.rows)
    groups = cdiv(next_n, cfg.rows)
    dq = _value_bytes(d, fmt)
    view = _gluon_view(cfg, fmt, q.device, cfg.rows * heads_p, kv_cache, dq)
    gluon = view is not None
    if not gluon:
        view = _tma_view(kv_cache, dq, cfg.block_n) if cfg.tma else None
    tma = None if view is None else (view[0], dq, view[1], torch.int8 if fmt == "mxfp4" else FP8_DTYPE)
    consts = dict(
        NEXT_N=next_n, NEXT_N_P=next_power_of_2(next_n), NUM_HEADS=h, HEADS_P=heads_p, D=d,
        BLOCK_KV=block_kv, FMT=formats.FORMAT_CODE[fmt], CTX_2D=context_lens.dim() == 2, CLEAN=bool(clean_logits),
        HAS_INDICES=indices is not None, ROWS=cfg.rows, BLOCK_N=cfg.block_n,
        MAX_CHUNK_PAGES=next_power_of_2(max_chunk_pages), PAGE_UNIT=page_unit, Q_UNIT=q_unit,
        BLOCK_FILL=cfg.block_fill,
        NUM_STAGES=cfg.num_stages, G=groups, HEAD_SUM_MMA=cfg.head_sum_mma, TMA=tma is not None,
    )
    if gluon:
        from tilefuse.indexer import _paged_kernel_gluon as gk

        # The ring holds num_stages tiles (at least 2); 4 or 8 warps (a parameter of the kernel).
        consts.update(NUM_BUF=max(2, cfg.num_stages), num_warps=gk.num_warps_for(cfg.rows, cfg.rows * heads_p,
                                                                                  cfg.num_warps))
        names, launcher, kv_descriptor, options = gk.arg_names, gk.launcher, gk.kv_descriptor, {}
    else:
        names, launcher, kv_descriptor = _paged_launch.arg_names, _paged_launch, _triton_kv_descriptor
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    tail = names[_PAGED_RUNTIME_ARGS:]
    at = tail.index("kv_desc")
    before, after = tuple(consts[n] for n in tail[:at]), tuple(consts[n] for n in tail[at + 1:])
    launch_key = (gluon, before, after, cfg.num_warps, cfg.num_stages)
    sms = sm_count(q.device) or 0
    persistent = _persistent_plan(cfg, fmt, next_n, h, d, block_kv, q, kv_cache, context_lens, indices, clean_logits)
    return _Plan(next_n, block_kv, cfg, chunk_pages, sms * _RESIDENT_PER_SM, sms * _FEW_PER_SM, groups, page_unit,
                 q_unit, consts, tma, before, after, launch_key, options, gluon, launcher, kv_descriptor, persistent)


@dataclasses.dataclass(frozen=True)
class _Persistent:
    """What a plan launches with the persistent kernel (``_paged_kernel_ws``)."""

    columns: int  # next_pow2(next_n) * H: a request's query rows, one TMA box
    q_row_stride: int  # elements between the queries' (row, head) rows
    kv_rows: int  # rows of the key values' view
    box: int  # keys a TMA box of values (or scales) holds: min(64, block_kv)
    page_words: int  # the page stride, in 4-byte words
    data_words: int  # a page's values and scales, in 4-byte words
    programs_per_sm: int
    consts: tuple  # the kernel's constexpr arguments, in signature order
    options: dict
    launch_key: tuple
    fast: dict = dataclasses.field(default_factory=dict, compare=False)


# Registers of an SM shared by the programs resident on it (the persistent kernel's register
# cap follows from its programs an SM). Triton launches a warp-specialised kernel in whole
# warpgroups: the producer warp is padded to one (.reqntid 256), and its warpgroup hands the
# consumer's all but 24-40 registers a thread (setmaxnreg).
_SM_REGISTERS, _WS_THREADS = 65536, 256
_SM_SHARED = 228 * 1024


def _ws_shared_bytes(num_buf: int, columns: int, d: int) -> int:
    """The persistent kernel's shared memory, a little over (the compiled sizes are within 1
    KiB below it): a ring of key tiles (values, scales, page flags) and two request slots
    (queries, weights, counts, row ends), its barriers."""
    return num_buf * 64 * (d + 8) + 2 * (columns * (d + 4) + 64) + 2048


def _persistent_plan(cfg: PagedConfig, fmt: str, next_n: int, h: int, d: int, block_kv: int, q: torch.Tensor,
                     kv_cache: torch.Tensor, context_lens: torch.Tensor, indices, clean_logits) -> _Persistent | None:
    """The persistent kernel's part of a plan where ``cfg`` asks for it and it applies, else None."""
    if not (cfg.persistent and fmt == "fp8" and _is_sm90(q.device)):
        return None
    from tilefuse.indexer import _paged_kernel_ws as ws

    columns = next_power_of_2(next_n) * h  # (rows past next_n: weights 0, not stored)
    if h & (h - 1) or not ws.MIN_DOT_COLUMNS <= columns <= ws.MAX_DOT_COLUMNS or d not in (32, 64, 128):
        return None
    # The queries as rows [B * next_n * H, D]: rows evenly strided, 16-byte aligned.
    s_b, s_t, s_h = q.stride()[:3]
    if s_h % 16 or (next_n > 1 and s_t != h * s_h) or (q.shape[0] > 1 and s_b != next_n * h * s_h):
        return None
    # (a page stride that is a multiple of D >= 32 bytes: the scales' view is 16-byte strided too)
    view = _tma_view(kv_cache, d, ws.KEYS_PER_TILE, split_boxes=True)
    # A tile's scale boxes land at part * box * 4 bytes of its buffer, and a TMA copy's shared
    # destination must be 128-byte aligned: pages of 8 or 16 tokens take the other kernels.
    if view is None or (view[1] < ws.KEYS_PER_TILE and view[1] * 4 % 128):
        return None
    # At most as many programs an SM as their registers allow (at 80 registers a program, 3 an
    # SM, 128 columns ask ptxas for more than it has, and 256 take 255: sm_90a, triton 3.6) and
    # as their shared memory does (each program also has 1 KiB reserved).
    num_buf = max(2, cfg.num_stages)
    most = min(3 if columns <= 64 else 2 if columns <= 128 else 1,
               max(1, _SM_SHARED // (_ws_shared_bytes(num_buf, columns, d) + 1024)))
    ctas = min(cfg.ctas_per_sm or most, most)
    maxnreg = min(255, _SM_REGISTERS // (ctas * _WS_THREADS) // 8 * 8)
    split = cfg.split_columns and next_n > 1  # (halves of whole query rows)
    consts = (next_n, next_power_of_2(next_n), h, d, block_kv, context_lens.dim() == 2, bool(clean_logits),
              indices is not None, num_buf, cfg.block_fill, split, 4)
    options = {"maxnreg": maxnreg}
    return _Persistent(columns, s_h, view[0], view[1], kv_cache.stride(0) // 4, block_kv * (d + 4) // 4, ctas,
                       consts, options, ("ws", consts, maxnreg))


def _launch_persistent(p: _Persistent, q, kv_cache, weights, context_lens, block_table, indices, out,
                       max_context_len: int) -> None:
    """One launch of the persistent kernel into ``out`` (already checked; ``q`` 16-byte aligned)."""
    from tilefuse.indexer import _paged_kernel_gluon as gk
    from tilefuse.indexer import _paged_kernel_ws as ws

    b = q.shape[0]
    programs = max(1, min(p.programs_per_sm * (sm_count(q.device) or 1), b * cdiv(max_context_len, ws.KEYS_PER_TILE)))
    rows = b * q.shape[1] * q.shape[2]  # the queries' (row, head) rows
    idx = indices if indices is not None else context_lens
    fast = p.fast.get(None)
    if fast is not None and fast(q, kv_cache, weights, context_lens, block_table, idx, out, b, max_context_len,
                                 out.stride(0), programs, rows):
        return
    q_desc = ws.q_descriptor(q, rows, q.shape[3], p.q_row_stride, p.columns)
    kv_desc = gk.kv_descriptor(kv_cache.view(FP8_DTYPE), p.kv_rows, q.shape[3], p.box)
    sf_desc = ws.sf_descriptor(kv_cache.view(torch.float32), kv_cache.shape[0], p.page_words, p.data_words, p.box)
    args = (q_desc, kv_desc, sf_desc, weights, context_lens, block_table, idx, out, error_record(q.device),
            b, max_context_len, block_table.shape[1], kv_cache.shape[0], kv_cache.stride(0) // q.shape[3],
            weights.stride(0), context_lens.stride(0), block_table.stride(0), out.stride(0), *p.consts)
    key = (p.launch_key, weights.dtype, out.dtype)
    ws.launcher(key, (programs,), args, p.options)
    if fast is None and max_context_len < _MAX_RUNTIME_INT:
        # The tensors (the cache as both descriptors' base), the sizes and the grid change per
        # call; the query descriptor's rows follow the batch.
        fast = ws.launcher.partial(key, (programs,), args, p.options, live=(0, (1, 2), 3, 4, 5, 6, 7, 9, 10, 17),
                                   live_grid=(10,), live_rows={0: 11})
        if fast is not None:
            p.fast[None] = fast


# The Gluon kernel's tile (``_paged_kernel_gluon``): 64 keys, at most 128 (row, head) columns.
_GLUON_BLOCK_N, _GLUON_MAX_COLUMNS = 64, 128


def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and capability_major(device) == 9


def _gluon_view(cfg: PagedConfig, fmt: str, device, columns: int, kv_cache: torch.Tensor,
                value_bytes: int) -> tuple[int, int] | None:
    """The TMA view (``_tma_view``, a tile's boxes in one buffer) of the Gluon kernel where
    ``cfg`` asks for it and it runs: FP8, 64-key tiles, at most 128 dot columns, an sm_90 GPU;
    else None (the Triton kernel runs)."""
    if not (cfg.gluon and fmt == "fp8" and cfg.block_n == _GLUON_BLOCK_N and columns <= _GLUON_MAX_COLUMNS):
        return None
    if not _is_sm90(device):
        return None
    return _tma_view(kv_cache, value_bytes, cfg.block_n, split_boxes=True)


def _triton_kv_descriptor(values: torch.Tensor, rows: int, value_bytes: int, box: int):
    return host_descriptor(TensorDescriptor, values, [rows, value_bytes], [value_bytes, 1], [box, value_bytes])


# Launch plans by argument layout (shapes but the batch and ``max_context_len``, strides,
# dtypes, devices, scalars, overrides): the checks and the heuristics run once per layout, a
# dict lookup and a few integer compares afterwards. Sizes that change step to step (the batch,
# ``max_context_len``) are in the key only as their class (0, 1, more: size-1 dims relax the
# stride checks), so a decode loop past its captured batch sizes makes no plan per step.
_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def inputs_layout_key(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, indices) -> tuple:
    """What the checks read of a decode call's inputs, spelled out (a call per tensor costs more
    than the lookup): shapes but the batch size (its class: 0, 1, more), strides, dtypes,
    devices. AttributeError, TypeError or IndexError where an argument is not what the op
    takes (the checks then say what is wrong)."""
    # (on the CPU, whether it runs at all depends on the interpreter)
    return (q.shape[1:], min(q.shape[0], 2), q.stride(), q.dtype, q.get_device(),
            q.is_cuda or _validate.interpreter_enabled(),
            None if q_sf is None else (q_sf.shape[1:], q_sf.stride(), q_sf.dtype, q_sf.get_device()),
            # modulo 16: the scale words need 4, the TMA path 16
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.get_device(), kv_cache.storage_offset() % 16,
            weights.shape[1:], weights.stride(), weights.dtype, weights.get_device(),
            context_lens.shape[1:], context_lens.stride(), context_lens.dtype, context_lens.get_device(),
            block_table.shape[1:], block_table.stride(), block_table.dtype, block_table.get_device(),
            schedule_meta.shape, schedule_meta.stride(), schedule_meta.dtype, schedule_meta.get_device(),
            None if indices is None else (indices.stride(), indices.dtype, indices.get_device()))


def batch_dims_agree(b: int, rows: int, q_sf, weights, context_lens, block_table, indices) -> bool:
    """Whether the inputs' batch dims are a call's of ``b`` requests and ``rows`` query rows (the
    one part of a decode call's shapes that ``inputs_layout_key`` leaves out)."""
    return (weights.shape[0] == rows and context_lens.shape[0] == b and block_table.shape[0] == b
            and (q_sf is None or q_sf.shape[0] == b) and (indices is None or indices.shape[0] == b))


def _plan_for(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits,
              logits_dtype, indices, out, config, compiling: bool = False) -> _Plan:
    key = None
    if not compiling:
        overrides = _config._overrides.get("paged")
        try:
            b = q.shape[0]
            key = (*inputs_layout_key(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, indices),
                   None if out is None else (out.dim(), out.stride(), out.dtype, out.get_device()),
                   max_context_len.__class__, min(max_context_len, 2), bool(clean_logits), logits_dtype, config,
                   tuple(sorted(overrides.items())) if overrides else None)
            plan = _plans.get(key)
            if plan is not None:
                # The batch dims and the output's size against q's batch and max_context_len:
                # anything else makes the full checks below say what is wrong.
                rows = b * plan.next_n
                if (batch_dims_agree(b, rows, q_sf, weights, context_lens, block_table, indices)
                        and max_context_len < _MAX_RUNTIME_INT
                        and (out is None or (out.shape[0] == rows and out.shape[1] == max_context_len
                                             and (out.stride(0) >= max_context_len or rows <= 1)))):
                    return plan
                plan = None
        except (AttributeError, TypeError, IndexError):  # not tensors, or unhashable: the checks say which
            key = plan = None
    fmt, _, next_n, h, d, block_kv = _check_inputs(q, q_sf, kv_cache, weights, context_lens, block_table,
                                                   schedule_meta, max_context_len, logits_dtype, indices, out)
    plan = _make_plan(fmt, next_n, h, d, block_kv, q, kv_cache, context_lens, indices, clean_logits, config)
    if key is not None and max_context_len < _MAX_RUNTIME_INT:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


# Sizes passed to the kernels as 32-bit ints (Triton compiles a 64-bit variant past this; the
# ordinary launch path, not a plan's partial launch, takes such a call).
_MAX_RUNTIME_INT = 2**31


# ---------------------------------------------------------------------------------------
# The launch and the custom op
# ---------------------------------------------------------------------------------------
_paged_launch = Launcher(kern.paged_logits_kernel)
# The arguments before the first constexpr (kv_desc, a runtime one, comes among the constexprs):
# the Gluon kernel's first ones are the same.
_PAGED_RUNTIME_ARGS = _paged_launch.arg_names.index("NEXT_N")


def _launch(plan: _Plan, q, q_sf, kv_cache, weights, context_lens, block_table, indices, out,
            max_context_len: int) -> None:
    """One kernel launch into ``out`` (already checked)."""
    if out.numel() == 0:
        return
    if plan.persistent is not None and q.data_ptr() % 16 == 0:
        _launch_persistent(plan.persistent, q, kv_cache, weights, context_lens, block_table, indices, out,
                           max_context_len)
        return
    b = q.shape[0]
    chunk_pages = plan.chunk_pages or chunk_pages_for(b, max_context_len, plan.block_kv, plan.cfg.block_n,
                                                      plan.wave, plan.groups, plan.few)
    chunks_per_request = cdiv(max_context_len, chunk_pages * plan.block_kv)
    programs = plan.groups * b * chunks_per_request
    # Besides the plan: what Triton specialises on that the plan's layout key leaves open.
    aligned = (q.data_ptr() % 16 == 0, kv_cache.data_ptr() % 16 == 0)
    sf = q_sf if q_sf is not None else context_lens  # (an unused pointer argument)
    idx = indices if indices is not None else context_lens
    fast = plan.fast.get(aligned)
    if fast is not None and fast(q, sf, kv_cache, weights, context_lens, block_table, idx, out, b, max_context_len,
                                 chunk_pages, chunks_per_request, out.stride(0), programs):
        return
    kv_desc = None
    if plan.tma is not None:
        rows, dq, box, dtype = plan.tma
        kv_desc = plan.kv_descriptor(kv_cache.view(dtype), rows, dq, box)
    key = (plan.launch_key, q.dtype, weights.dtype, out.dtype, *aligned)
    args = (q, sf, kv_cache, weights, context_lens, block_table, idx, out, error_record(q.device),
            b, max_context_len, block_table.shape[1], kv_cache.shape[0], chunk_pages, chunks_per_request,
            q.stride(0) // plan.q_unit, q.stride(1) // plan.q_unit, q.stride(2) // plan.q_unit,
            q_sf.stride(0) if q_sf is not None else 0, q_sf.stride(1) if q_sf is not None else 0,
            weights.stride(0), context_lens.stride(0), block_table.stride(0),
            kv_cache.stride(0) // plan.page_unit, out.stride(0), *plan.consts_before_desc, kv_desc,
            *plan.consts_after_desc)
    plan.launcher(key, (programs,), args, plan.options)
    if fast is None and max_context_len < _MAX_RUNTIME_INT:
        # the tensors, the sizes and the grid change per call (the cache also as the key
        # descriptor's base); the rest is the plan's
        cache_at = (2,) if kv_desc is None else (2, _PAGED_RUNTIME_ARGS + len(plan.consts_before_desc))
        fast = plan.launcher.partial(key, (programs,), args, plan.options,
                                     live=(0, 1, cache_at, 3, 4, 5, 6, 7, 9, 10, 13, 14, 24), live_grid=(13,))
        if fast is not None:
            plan.fast[aligned] = fast


_BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(PagedConfig) if f.type in ("bool", bool))


def _config_from_ints(values: list[int]) -> PagedConfig:
    """The config the custom op carries as ints (``dataclasses.astuple``), flags back as bools."""
    fields = dataclasses.fields(PagedConfig)
    return PagedConfig(**{f.name: bool(v) if f.name in _BOOL_FIELDS else v for f, v in zip(fields, values)})


@torch.library.custom_op("tilefuse::paged_mqa_logits", mutates_args=("out",))
def _paged_mqa_logits(
    q: torch.Tensor,
    q_sf: torch.Tensor | None,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    indices: torch.Tensor | None,
    out: torch.Tensor,
    max_context_len: int,
    clean_logits: bool,
    config: list[int],
) -> None:
    cfg = _config_from_ints(config)
    plan = _plan_for(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                     clean_logits, out.dtype, indices, out, cfg)
    _launch(plan, q, q_sf, kv_cache, weights, context_lens, block_table, indices, out, max_context_len)


@_paged_mqa_logits.register_fake
def _paged_mqa_logits_fake(q, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, indices, out,
                           max_context_len, clean_logits, config):
    return None


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
    out: torch.Tensor | None = None,
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
        schedule_meta: ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)``,
            checked by shape (its values are not read: the result is bitwise identical for
            every ``num_sms``).
        max_context_len: columns of the output.
        clean_logits: write ``-inf`` to every column outside each row's window (both length
            modes; DeepGEMM supports 1-D only). Without it those columns are unspecified.
        logits_dtype: torch.float32 or torch.bfloat16.
        indices: int32 ``[B]``, request id of each token of a varlen batch (next_n = 1).
            Each token still reads its keys through its own block-table row and length, so
            the result does not depend on it; accepted for DeepGEMM compatibility.
        out: a caller-owned ``[B * next_n, max_context_len]`` buffer of ``logits_dtype`` with
            unit last stride (any row stride >= the width) to write into and return, reused
            across calls; checked by shape and strides only.
        config: launch configuration override (see :class:`PagedConfig`).

    Returns:
        ``[B * next_n, max_context_len]`` logits, last stride 1 (``out`` if given; else a new
        tensor whose row stride is padded to a multiple of 16 elements: read ``stride(0)``).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype (q, q[1], kv_cache, weights,
            context_lens, block_table, indices, out, logits_dtype).
        ValueError: a wrong shape (a cache width for another D or format, 2-D lengths or
            weights that do not match next_n, ``out`` of another shape), an unsupported H, D
            or next_n, non-contiguous last dims, a bad page stride, mixed devices, CPU tensors
            without Triton's interpreter.
        tilefuse.DeviceValueError: raised by this or a later call on the device (or by
            ``tilefuse.check_errors()``) when the kernel found bad values: a negative length,
            a length over ``max_context_len`` or past the block table's width, a page id
            outside the cache, a request id in ``indices`` outside the batch. The rows it
            names are not valid; nothing is read or written out of bounds (keys without a
            page score NaN). With :func:`tilefuse.set_checked` these (and ``schedule_meta`` made
            for other lengths) are checked on the host before the launch and raised as
            ``ValueError`` at once, at the cost of a host sync.
    """
    q_values, q_sf = split_query(q)
    if isinstance(q_values, torch.Tensor):
        raise_pending_fast(q_values.device)
    compiling = torch.compiler.is_compiling()
    plan = _plan_for(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                     clean_logits, logits_dtype, indices, out, config, compiling)
    if _errors.checked() and _errors.host_reads_possible(q_values.device):
        _check_values(context_lens, block_table, schedule_meta, indices, kv_cache.shape[0], plan.block_kv,
                      max_context_len)
    if out is None:
        out = new_logits(q_values.shape[0] * plan.next_n, max_context_len, logits_dtype, q_values.device)
    if compiling:
        _paged_mqa_logits(q_values, q_sf, kv_cache, weights, context_lens, block_table, schedule_meta, indices, out,
                          max_context_len, bool(clean_logits), [int(v) for v in dataclasses.astuple(plan.cfg)])
    else:  # eager: the launch without the dispatcher's cost
        _launch(plan, q_values, q_sf, kv_cache, weights, context_lens, block_table, indices, out, max_context_len)
    return out


def fp8_paged_mqa_logits(
    q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
    block_table: torch.Tensor, schedule_meta: torch.Tensor, max_context_len: int, clean_logits: bool = False,
    indices: torch.Tensor | None = None, *, out: torch.Tensor | None = None, config: PagedConfig | None = None,
) -> torch.Tensor:
    """FP8 decode logits with DeepGEMM's ``fp8_paged_mqa_logits`` signature: ``q`` is a bare
    e4m3 ``[B, next_n, H, D]`` tensor, the cache holds fp32 scales, logits are fp32.

    See :func:`fp8_fp4_paged_mqa_logits` for the arguments and the errors raised.
    """
    expect_tensor(q, "q")
    return fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens, block_table, schedule_meta,
                                    max_context_len, clean_logits, torch.float32, indices, out=out, config=config)


# ---------------------------------------------------------------------------------------
# Warm-up
# ---------------------------------------------------------------------------------------
def warmup_calls(fmt: str, num_heads: int, head_dim: int, block_kv: int, next_n: int,
                 weights_dtype: torch.dtype, logits_dtype: torch.dtype, clean_logits: bool,
                 device) -> list:
    """Callables that each run the decode op (or its metadata) once at a tiny shape, for every
    kernel variant the launch can pick for this model configuration: 1-D and 2-D lengths (and
    ``indices`` when next_n == 1), and the metadata for both length modes. After they ran, any
    batch, lengths, ``max_context_len``, table width and strides compile nothing (the page
    stride compiles once more if a cache's is not a multiple of 16 bytes).

    Raises:
        ValueError / TypeError: a configuration the op does not support (as the op would).
    """
    paged_kv_cache_width(head_dim, fmt)
    expect_int(block_kv, "block_kv", 1)
    expect(weights_dtype in _WEIGHT_DTYPES, TypeError, f"weights_dtype: expected fp32 or bf16, got {weights_dtype}")
    expect(logits_dtype in _LOGITS_DTYPES, TypeError, f"logits_dtype: expected fp32 or bf16, got {logits_dtype}")
    device = torch.device(device)
    batch, length = 2, block_kv + 1

    def inputs():
        pages = cdiv(length, block_kv)
        cache = new_paged_kv_cache(batch * pages, block_kv, head_dim, fmt, device=device)
        table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        dq = head_dim // 2 if fmt == "mxfp4" else head_dim
        values = torch.zeros(batch, next_n, num_heads, dq, dtype=torch.int8 if fmt == "mxfp4" else FP8_DTYPE,
                             device=device)
        sf = None if fmt == "fp8" else torch.zeros(batch, next_n, num_heads, dtype=torch.int32, device=device)
        w = torch.zeros(batch * next_n, num_heads, dtype=weights_dtype, device=device)
        return (values, sf), cache, w, table

    def one(ctx_2d: bool, with_indices: bool):
        def run():
            qq, cache, w, table = inputs()
            lens = torch.full((batch, next_n) if ctx_2d else (batch,), length, dtype=torch.int32, device=device)
            idx = torch.arange(batch, dtype=torch.int32, device=device) if with_indices else None
            meta = get_paged_mqa_logits_metadata(lens, block_kv, 1, idx)
            fp8_fp4_paged_mqa_logits(qq, cache, w, lens, table, meta, length, clean_logits, logits_dtype, idx)
        return run

    calls = [one(False, False), one(True, False)]
    if next_n == 1:
        calls.append(one(False, True))
    return calls
