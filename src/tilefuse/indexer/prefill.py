"""Indexer prefill logits: ``logits[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])`` for ``ks[i] <= j < ke[i]``.

DeepGEMM-compatible names, argument order and defaults (``fp8_mqa_logits``,
``fp8_fp4_mqa_logits``, ``get_mqa_logits_metadata``), on FP8, MXFP8 and MXFP4 inputs, for any
head count that is a multiple of 4 up to 128 and head dims 32/64/128 (FP4: 64/128). The ops
are ``torch.library`` custom ops with fake implementations, so they trace under
``torch.compile`` without graph breaks.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tilefuse import _config, _errors, _jit, _validate
from tilefuse._config import apply_override, register_config
from tilefuse._errors import check_errors, error_record
from tilefuse._jit import Launcher, cdiv, host_descriptor, next_power_of_2
from tilefuse._validate import (
    check_aligned,
    check_kernel_device,
    check_same_device,
    check_tma_rows,
    expect,
    expect_tensor,
)
from tilefuse.formats import FORMAT_CODE, FP8_DTYPE, format_of
from tilefuse.indexer import _dispatch, _prefill_kernel_sm100
from tilefuse.indexer import _prefill_kernel as kern
from tilefuse.indexer._layout import new_logits

_LOGITS_DTYPES = (torch.float32, torch.bfloat16)


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Launch configuration: an explicit table, no autotuning at run time.
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tile shape, pipelining and kernel path of the prefill op (defaults: :func:`default_config`).

    ``block_q`` x ``block_n``: query rows x keys per program; ``num_warps``, ``num_stages``.
    ``head_unroll`` (1 or 2): heads per step of the Triton head loop.
    ``fp4_via_fp8`` (MXFP4) / ``mxfp8_via_f16`` (MXFP8): rows renormalised by their largest
    block scale into E4M3 / f16 (exact while the row's block exponents span <= 8 / 15
    binades and that scale is within 2^+-100; it is folded into the weights or the key scale)
    and run on FP8 / f16 tensor cores; a second pass recomputes with the bf16 upcast only the
    tiles holding a row that is not exact. Without either, MX operands are upcast to bf16 for
    the dot.
    ``clean_pass``: the ``-inf`` of the full layout written by a separate store-only pass
    instead of inside the logits kernel (same bits).
    ``heads_on_n`` (few query rows): (query row, head) pairs on the MMA's N side, the key
    tile loaded once per program; for MX with ``fp4_via_fp8`` / ``mxfp8_via_f16``, the pass
    over the renormalised rows runs so (the recompute keeps the 2-D tile). The choice is the
    config's, never the call's row count, so a slice of the rows gets the same bits.
    ``mx_inline`` (MX with ``heads_on_n``): 1, one launch instead of three, each operand row
    renormalised in the few-row kernel's registers, a step with a row that is not exact
    computed with the bf16 upcast (Hopper's default at most 32 rows); 2, the query rows
    renormalised once by a first launch, the keys in the kernel's registers (two launches); 3,
    as 2 in one launch: producer programs at the head of its grid renormalise the query rows,
    which the others wait for (per-stream counters, reset by the kernel itself).
    ``gluon`` (Hopper): the 2-D tile's head loop as the Gluon kernel (async wgmma); then
    ``num_stages`` (>= 2) is its ring of query buffers, ``block_q`` 64 or 128, and warps
    beyond one per 16 rows split the keys; ``gluon_refill`` 1 or 2 (needs ``num_stages`` >= 3)
    buffers refilled at a time.
    ``relu_via_abs`` (0 or 2; E4M3 operands with query rows on the MMA's M side): the head sum
    as ``(sum_h w_h s_h + sum_h w_h |s_h|) / 2``, the linear half one MMA per part of
    ``sum_h w_h q_h`` split into 2 E4M3 parts.

    Every field's measurements are in ``benchmarks/NOTES.md``.
    """

    block_q: int = 64  # query rows per program
    block_n: int = 128  # keys per program
    num_warps: int = 4  # as in Triton
    num_stages: int = 3  # as in Triton; Gluon: the ring of query buffers
    head_unroll: int = 1  # heads per step of the Triton head loop
    fp4_via_fp8: bool = False  # MXFP4 renormalised into E4M3
    clean_pass: bool = False  # the -inf written by a store-only pass
    mxfp8_via_f16: bool = False  # MXFP8 renormalised into f16
    heads_on_n: bool = False  # (query row, head) pairs on the MMA's N side
    gluon: bool = False  # the head loop as the Gluon kernel (Hopper)
    gluon_refill: int = 1  # Gluon query buffers refilled at a time
    relu_via_abs: int = 0  # 0, or 2: the head sum through |s| with a 2-part linear term
    mx_inline: int = 0  # MX rows renormalised inside the few-row kernel: 1 both, 2 / 3 the keys

    @functools.cached_property
    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


register_config("prefill", PrefillConfig)
# At most this many query rows take the few-row path (heads_on_n; for MX, in the pass over the
# renormalised rows). With the call sizes below, the only choices of the defaults that depend
# on the sizes (size_class), so a model's kernels are a fixed set (warmup_calls).
FEW_ROWS = 32
# FP8 on Hopper, measured per eager call and in GPU time (benchmarks/NOTES.md, round of
# 2026-12-03 (4)): up to FEW_CALL_ROWS rows and FEW_CALL (query row, key) pairs the few-row
# kernel is the fastest in GPU time too; up to SMALL_CALL pairs (an engine's short chunks) the
# plain Gluon head loop, one launch, against the head sum through |s|, whose linear term is a
# second launch, a scratch buffer and a third host descriptor.
FEW_CALL_ROWS = 256
FEW_CALL = 2**20
SMALL_CALL = 2**21
# MX on Hopper: up to this many pairs of a few-row call the query rows renormalised once and the
# keys in the few-row kernel (mx_inline=2 / 3) beat the three launches in GPU time as well
# (19-33 us against 38-39 at 64-128 rows of 4096 keys; 45-61 against 32-41 at 256 rows).
MX_INLINE_CALL = 2**19


def size_class(num_q_rows: int, num_keys: int) -> int:
    """All that the default configs read of a call's sizes: 0 at most FEW_ROWS rows; a few-row
    call (FEW_CALL_ROWS rows): 1 up to MX_INLINE_CALL pairs, 2 up to FEW_CALL; 3 a small call
    (SMALL_CALL), 4 the rest."""
    if num_q_rows <= FEW_ROWS:
        return 0
    pairs = num_q_rows * num_keys
    if num_q_rows <= FEW_CALL_ROWS and pairs <= FEW_CALL:
        return 1 if pairs <= MX_INLINE_CALL else 2
    return 3 if pairs <= SMALL_CALL else 4


def default_config(fmt: str, num_heads: int, head_dim: int, num_q_rows: int | None = None,
                   logits_dtype: torch.dtype = torch.float32, arch: int | None = None,
                   num_keys: int | None = None) -> PrefillConfig:
    """The launch configuration measured best on an H200 at H = 64, D = 128 for each format,
    by the number of query rows (at most 32: the few-row path), the call's size (with
    ``num_keys``: :func:`size_class`) and the logits dtype; ``arch`` is the GPU's
    compute-capability major (None: the CPU interpreter), 9 picks the Gluon head loop where it
    won. The sweeps behind every row are in ``benchmarks/NOTES.md``.
    """
    del num_heads, head_dim  # one tile per format fits every H and D measured so far
    hopper = arch == 9
    few = num_q_rows is not None and num_q_rows <= FEW_ROWS
    cls = 4 if num_q_rows is None or num_keys is None else size_class(num_q_rows, num_keys)
    if fmt == "fp8":
        if few or (hopper and cls in (1, 2)):
            # block_q 4 at most FEW_ROWS rows: 4x the programs, GPU time 6.4-7.7 µs against 9.6-12.2
            return PrefillConfig(block_q=4 if few else 16, block_n=128, num_warps=4, num_stages=3, heads_on_n=True)
        if hopper:
            return PrefillConfig(block_q=64, block_n=128, num_warps=4, num_stages=4, gluon=True, gluon_refill=1,
                                 relu_via_abs=0 if cls == 3 else 2)
        return PrefillConfig(block_q=64, block_n=128, num_warps=4, num_stages=3, head_unroll=2,
                             clean_pass=logits_dtype == torch.bfloat16)
    if hopper and few:
        # one launch renormalising in registers: 22-29 µs per eager call against 50-71 for the
        # three launches; in a graph 18-24 µs of GPU time against 15-17
        return PrefillConfig(block_q=8, block_n=128, num_warps=8, num_stages=3, heads_on_n=True, mx_inline=1,
                             fp4_via_fp8=fmt == "mxfp4", mxfp8_via_f16=fmt == "mxfp8")
    if hopper and cls == 1:
        # the query rows renormalised once (by producer programs of the launch), the keys in the
        # few-row kernel: half the three launches' GPU time, one launch
        return PrefillConfig(block_q=16, block_n=128, num_warps=8, num_stages=3, heads_on_n=True, mx_inline=3,
                             fp4_via_fp8=fmt == "mxfp4", mxfp8_via_f16=fmt == "mxfp8")
    if fmt == "mxfp8":
        if hopper and not few:
            return PrefillConfig(block_q=64, block_n=128, num_warps=4, num_stages=4, mxfp8_via_f16=True, gluon=True,
                                 gluon_refill=2)
        return PrefillConfig(block_q=64, block_n=128, num_warps=4, num_stages=2, head_unroll=2, mxfp8_via_f16=True,
                             heads_on_n=few)
    return PrefillConfig(block_q=64, block_n=256, num_warps=8, num_stages=3, fp4_via_fp8=True, heads_on_n=few)


def resolve_config(fmt: str, num_heads: int, head_dim: int, num_q_rows: int | None = None,
                   config: PrefillConfig | None = None, logits_dtype: torch.dtype = torch.float32,
                   arch: int | None = None, num_keys: int | None = None) -> PrefillConfig:
    """``config`` if given, else the default for ``arch``; then the fields set by
    ``tilefuse.set_config_override("prefill", ...)`` (or ``TILEFUSE_PREFILL_CONFIG`` at import)."""
    cfg = apply_override(config or default_config(fmt, num_heads, head_dim, num_q_rows, logits_dtype, arch,
                                                  num_keys), "prefill")
    # the few-row kernels' block_q is only the rows a program loops over (not an MMA side)
    min_q = 2 if cfg.heads_on_n else 16
    if cfg.block_q < min_q or cfg.block_n < 16 or cfg.block_q & (cfg.block_q - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"block_q and block_n must be powers of two >= 16 (block_q >= 2 with heads_on_n), got {cfg}")
    if cfg.head_unroll not in (1, 2):
        raise ValueError(f"head_unroll must be 1 or 2, got {cfg.head_unroll}")
    if cfg.heads_on_n and not (fmt == "fp8" or cfg.fp4_via_fp8 or cfg.mxfp8_via_f16):
        raise ValueError(f"heads_on_n runs FP8 operands (MX: with fp4_via_fp8 or mxfp8_via_f16), got {cfg} for {fmt}")
    if cfg.gluon and (cfg.heads_on_n or cfg.block_q not in (64, 128) or cfg.num_warps % (cfg.block_q // 16)
                      or cfg.num_stages < 2):
        raise ValueError("gluon runs the 2-D tile (not heads_on_n) with block_q 64 or 128, num_warps a multiple "
                         f"of block_q / 16 and num_stages >= 2, got {cfg}")
    if cfg.gluon_refill not in (1, 2) or (cfg.gluon_refill == 2 and cfg.num_stages < 3):
        raise ValueError(f"gluon_refill must be 1, or 2 with num_stages >= 3, got {cfg}")
    if cfg.mx_inline not in (0, 1, 2, 3):
        raise ValueError(f"mx_inline must be 0 to 3, got {cfg.mx_inline}")
    if cfg.mx_inline and (fmt == "fp8" or not cfg.heads_on_n):
        raise ValueError(f"mx_inline runs MX operands on the few-row kernel (heads_on_n), got {cfg} for {fmt}")
    # One part misses the accuracy bound; three add time and no accuracy that shows (NOTES).
    if cfg.relu_via_abs not in (0, 2) or (cfg.relu_via_abs and (
            cfg.heads_on_n or fmt == "mxfp8" or (fmt == "mxfp4" and not cfg.fp4_via_fp8))):
        raise ValueError("relu_via_abs (0 or 2 parts) runs E4M3 operands on the 2-D tile with query rows on the "
                         f"MMA's M side (FP8, or MXFP4 with fp4_via_fp8; not heads_on_n), got {cfg} for {fmt}")
    return cfg


# ---------------------------------------------------------------------------------------
# Validation: shapes, dtypes, strides and devices only (no device data, no host sync). The
# window values are checked in the kernels (tilefuse._errors) or, in checked mode, here.
# ---------------------------------------------------------------------------------------
def split_query(q) -> tuple:
    """``(values, sf)`` of an op's query pair (``sf`` is None for FP8)."""
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise TypeError("q: expected a tuple (values, sf); sf is None for FP8")
    values, sf = q
    return values, sf


def split_keys(kv) -> tuple:
    """``(k, k_sf)`` of a prefill op's key pair."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError("kv: expected a tuple (k, k_sf)")
    k, k_sf = kv
    return k, k_sf


def check_window_bound(t: torch.Tensor, name: str, s_q: int) -> None:
    """One side of the key windows (``cu_seq_len_k_start`` or ``cu_seq_len_k_end``): int32,
    contiguous ``[S_q]``."""
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != s_q or t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous [{s_q}] tensor, got shape {tuple(t.shape)}")


# Signatures of CUDA argument sets that passed _check_inputs (what it reads: dtypes, shapes
# but S_q and S_k, strides, devices, base alignment, the scalars), with the format, H and D:
# an engine's chunks change S_q and S_k every call, and the lookup costs a third of the checks.
_CHECKED: dict[tuple, tuple] = {}
_CHECKED_MAX = 4096


def _signature(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype) -> tuple:
    """What _check_inputs reads but the sizes S_q and S_k (each only as its class, 0, 1 or
    more; the call's sizes are compared by :func:`_sizes_agree`) and ``max_seqlen_k`` (as 0 or
    not); raises AttributeError or TypeError for non-tensors."""
    return (q.dtype, q.shape[1:], min(q.shape[0], 2), q.stride(), q.get_device(), q.data_ptr() & 15,
            None if q_sf is None else (q_sf.dtype, q_sf.shape[1:], q_sf.stride(), q_sf.get_device()),
            k.dtype, k.shape[1:], min(k.shape[0], 2), k.stride(), k.get_device(), k.data_ptr() & 15,
            k_scale.dtype, k_scale.shape[1:], k_scale.stride(), k_scale.get_device(),
            weights.dtype, weights.shape[1:], weights.stride(), weights.get_device(),
            ks.dtype, ks.shape[1:], ks.stride(), ks.get_device(), ke.dtype, ke.shape[1:], ke.stride(), ke.get_device(),
            max_seqlen_k.__class__, min(max_seqlen_k, 1), logits_dtype)


def _sizes_agree(q, q_sf, k, k_scale, weights, ks, ke) -> bool:
    """The sizes a signature leaves out agree: every per-row tensor has S_q rows, the key
    scales S_k."""
    s_q = q.shape[0]
    return (weights.shape[0] == s_q and ks.shape[0] == s_q and ke.shape[0] == s_q
            and k_scale.shape[0] == k.shape[0] and (q_sf is None or q_sf.shape[0] == s_q))


def _check_inputs(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype, sig=None):
    """Validate shapes, dtypes, strides and devices; return ``(fmt, S_q, H, D, S_k)``. ``sig``:
    the arguments' :func:`_signature` where the caller has it."""
    if sig is None:
        if torch.compiler.is_compiling():  # a traced tensor has no data pointer to sign
            return _check_inputs_full(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype)
        try:
            sig = _signature(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype)
        except (AttributeError, TypeError, RuntimeError, IndexError):  # not tensors, or no data pointer (tracing)
            return _check_inputs_full(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype)
    try:
        hit = _CHECKED.get(sig)
    except TypeError:  # unhashable
        return _check_inputs_full(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype)
    if hit is not None and _sizes_agree(q, q_sf, k, k_scale, weights, ks, ke):
        fmt, h, d = hit
        return fmt, q.shape[0], h, d, k.shape[0]
    result = _check_inputs_full(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype)
    # CUDA tensors only: whether others are valid depends on more than the signature (the
    # interpreter, the device type).
    if sig[4] >= 0:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        fmt, _, h, d, _ = result
        _CHECKED[sig] = (fmt, h, d)
    return result


def _check_inputs_full(q, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype):
    for name, t in (("q", q), ("kv[0]", k), ("kv[1]", k_scale), ("weights", weights),
                    ("cu_seq_len_k_start", ks), ("cu_seq_len_k_end", ke)):
        if not isinstance(t, torch.Tensor):
            expect_tensor(t, name)
    if q_sf is not None and not isinstance(q_sf, torch.Tensor):
        expect_tensor(q_sf, "q[1] (query scales)")
    check_kernel_device(q, "q")
    fmt = format_of(q, q_sf)

    if q.dim() != 3:
        raise ValueError(f"q: expected [S_q, H, D], got shape {tuple(q.shape)}")
    s_q, h, dq = q.shape
    if fmt == "mxfp4":
        if q.dtype != torch.int8:
            raise TypeError(f"q: MXFP4 values must be int8 (packed), got {q.dtype}")
        d = dq * 2
        if d not in (64, 128):
            raise ValueError(f"q: MXFP4 head dim must be 64 or 128 (packed last dim 32/64), got {d}")
    else:
        if q.dtype != FP8_DTYPE:
            raise TypeError(f"q: expected {FP8_DTYPE} values, got {q.dtype}")
        d = dq
        if d not in (32, 64, 128):
            raise ValueError(f"q: head dim must be 32, 64 or 128, got {d}")
    if h % 4 or not 4 <= h <= 128:
        raise ValueError(f"q: head count must be a multiple of 4 in [4, 128], got {h}")
    if q.stride(2) != 1 or q.stride(1) != dq:
        raise ValueError(f"q: heads and head dim must be contiguous, got strides {q.stride()}")
    check_tma_rows(q, "q")

    if k.dim() != 2:
        raise ValueError(f"kv[0]: expected [S_k, {dq}], got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"kv[0]: expected {q.dtype} like q, got {k.dtype}")
    if k.shape[1] != dq:
        raise ValueError(f"kv[0]: last dim must be {dq} like q, got {k.shape[1]}")
    check_tma_rows(k, "kv[0]")
    s_k = k.shape[0]

    scale_dtype = torch.float32 if fmt == "fp8" else torch.int32
    if k_scale.dtype != scale_dtype:
        raise TypeError(f"kv[1]: {fmt} keys need {scale_dtype} scales, got {k_scale.dtype}")
    if k_scale.dim() != 1 or k_scale.shape[0] != s_k or k_scale.stride(0) != 1:
        raise ValueError(f"kv[1]: expected a contiguous [{s_k}] tensor, got shape {tuple(k_scale.shape)}")
    if q_sf is not None:
        if q_sf.dtype != torch.int32:
            raise TypeError(f"q[1]: query scales must be int32 (packed UE8M0), got {q_sf.dtype}")
        if q_sf.dim() != 2 or q_sf.shape[0] != s_q or q_sf.shape[1] != h or q_sf.stride(1) != 1:
            raise ValueError(f"q[1]: expected [{s_q}, {h}] with unit last stride, got shape {tuple(q_sf.shape)}")

    if weights.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"weights: expected fp32 or bf16, got {weights.dtype}")
    if weights.dim() != 2 or weights.shape[0] != s_q or weights.shape[1] != h or weights.stride(1) != 1:
        raise ValueError(f"weights: expected [{s_q}, {h}] with unit last stride, got shape {tuple(weights.shape)} "
                         f"strides {weights.stride()}")
    for name, t in (("cu_seq_len_k_start", ks), ("cu_seq_len_k_end", ke)):
        check_window_bound(t, name, s_q)
    if not isinstance(max_seqlen_k, int) or isinstance(max_seqlen_k, bool) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k: expected an int >= 0, got {max_seqlen_k!r}")
    if logits_dtype not in _LOGITS_DTYPES:
        raise TypeError(f"logits_dtype: expected float32 or bfloat16, got {logits_dtype}")

    # get_device() is an int (-1: CPU): comparing torch.device objects costs ~1 us each.
    dev = q.get_device()
    if not (k.get_device() == dev and k_scale.get_device() == dev and weights.get_device() == dev
            and ks.get_device() == dev and ke.get_device() == dev and (q_sf is None or q_sf.get_device() == dev)):
        tensors = {"kv[0]": k, "kv[1]": k_scale, "weights": weights, "cu_seq_len_k_start": ks,
                   "cu_seq_len_k_end": ke, "q": q}
        if q_sf is not None:
            tensors["q[1]"] = q_sf
        check_same_device(tensors, "q")
    return fmt, s_q, h, d, s_k


def _check_out(out, s_q: int, cols: int, logits_dtype: torch.dtype, device: torch.device) -> None:
    """A caller-owned logits buffer: the op's dtype and shape, unit last stride, rows of at
    least ``cols`` elements starting 16-byte aligned (what the kernels' stores need)."""
    if not isinstance(out, torch.Tensor):
        expect_tensor(out, "out")
    if out.dtype != logits_dtype:
        raise TypeError(f"out: expected {logits_dtype} like logits_dtype, got {out.dtype}")
    if out.dim() != 2 or out.shape[0] != s_q or out.shape[1] != cols:
        raise ValueError(f"out: expected shape [{s_q}, {cols}], got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out: expected device {device} like q, got {out.device}")
    if s_q > 1 and out.stride(0) < cols:
        raise ValueError(f"out: rows overlap (row stride {out.stride(0)} < {cols} columns)")
    check_tma_rows(out, "out")


def _check_windows(ks: torch.Tensor, ke: torch.Tensor, s_k: int, max_seqlen_k: int) -> None:
    """Checked mode: the window values read on the host (one small reduction, one sync)."""
    if ks.numel() == 0:
        return
    longest = (ke.clamp(max=s_k) - ks).max()
    neg, inverted, longest = torch.stack([(ks < 0).any().int(), (ks > ke).any().int(), longest.int()]).tolist()
    if neg:
        raise ValueError("cu_seq_len_k_start: window starts must be >= 0")
    if inverted:
        raise ValueError("cu_seq_len_k_start/cu_seq_len_k_end: every window needs ks <= ke")
    if max_seqlen_k > 0 and longest > max_seqlen_k:
        raise ValueError(f"max_seqlen_k: {max_seqlen_k} is smaller than the longest window ({longest} keys)")


# ---------------------------------------------------------------------------------------
# Per-shape decisions, made once: the config (by format, H, D, few or many rows, logits
# dtype, GPU, override) and the GPU's architecture. The custom ops take the config as one
# small int: its index in the table of configs seen so far.
# ---------------------------------------------------------------------------------------
_CONFIGS: list[PrefillConfig] = []
_CONFIG_INDEX: dict[PrefillConfig, int] = {}
_RESOLVED: dict[tuple, int] = {}
_ARCH: dict[torch.device, int] = {}
_ERR_RECORDS: dict[torch.device, torch.Tensor] = {}


def _arch(device: torch.device) -> int | None:
    if device.type != "cuda":
        return _dispatch.capability_major(device)
    arch = _ARCH.get(device)
    if arch is None:
        arch = _ARCH[device] = _dispatch.capability_major(device)
    return arch


def config_key(cfg: PrefillConfig) -> int:
    """The small int the custom ops take for ``cfg`` (stable for the process's lifetime)."""
    key = _CONFIG_INDEX.get(cfg)
    if key is None:
        key = _CONFIG_INDEX[cfg] = len(_CONFIGS)
        _CONFIGS.append(cfg)
    return key


def config_of_key(key: int) -> PrefillConfig:
    return _CONFIGS[key]


def _resolved_key(fmt: str, h: int, d: int, s_q: int, s_k: int, config: PrefillConfig | None,
                  logits_dtype: torch.dtype, device: torch.device) -> int:
    override = _config._overrides.get("prefill")
    arch = _arch(device)
    cls = size_class(s_q, s_k)
    cache_key = (fmt, h, d, cls, config, logits_dtype, arch, tuple(sorted(override.items())) if override else ())
    key = _RESOLVED.get(cache_key)
    if key is None:
        # (sizes standing for the class: the defaults read nothing else of them)
        cfg = resolve_config(fmt, h, d, s_q, config, logits_dtype, arch, s_k)
        key = _RESOLVED[cache_key] = config_key(cfg)
    return key


# ---------------------------------------------------------------------------------------
# The implementation, and the custom ops torch.compile sees
# ---------------------------------------------------------------------------------------
def _run(q, q_sf, k, k_scale, weights, ks, ke, clean_logits: bool, max_seqlen_k: int, cfg: PrefillConfig,
         out: torch.Tensor) -> None:
    """Write the logits of validated inputs into ``out`` ([S_q, S_k or max_seqlen_k])."""
    fmt = format_of(q, q_sf)
    s_q, h, dq = q.shape
    d = dq * 2 if fmt == "mxfp4" else dq
    s_k = k.shape[0]
    if s_q == 0:
        return
    err = _ERR_RECORDS.get(q.device)
    if err is None:
        err = _ERR_RECORDS[q.device] = error_record(q.device)
    compressed = max_seqlen_k > 0
    if compressed and clean_logits:
        _fill_outside_windows(out, ks, ke, s_k, compressed=True)
    if s_k == 0:
        return
    # The -inf of the full layout: inside the logits kernel, or in a store-only pass after it.
    separate_clean = clean_logits and cfg.clean_pass and not compressed
    clean = clean_logits and not separate_clean
    # Blackwell (10.x): MX formats run the native block-scaled kernel with its own tile; the
    # table of which kernel runs where is _dispatch.PREFILL_KERNELS.
    if _dispatch.prefill_kernel_path(_arch(q.device), fmt) == _dispatch.SM100_MX_DOT_SCALED:
        _prefill_kernel_sm100.launch(q, q_sf, k, k_scale, weights, ks, ke, out, clean, compressed, err)
    elif cfg.mx_inline:
        _launch_mx_few_rows(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, d, clean, compressed, cfg, err)
    elif (fmt == "mxfp4" and cfg.fp4_via_fp8) or (fmt == "mxfp8" and cfg.mxfp8_via_f16):
        _mx_via_renormalised_rows(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, clean, compressed, d, cfg, err)
    else:
        _launch(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, d, clean, compressed, cfg, err)
    if separate_clean:
        _fill_outside_windows(out, ks, ke, s_k, compressed=False)


def _check_pointers(q, k, out=None) -> None:
    # Eager calls checked these in _check_inputs; under torch.compile data pointers exist only now.
    check_aligned(q, "q")
    check_aligned(k, "kv[0]")
    if out is not None:
        check_aligned(out, "out")


@torch.library.custom_op("tilefuse::mqa_logits", mutates_args=())
def _mqa_logits_op(q: torch.Tensor, q_sf: torch.Tensor | None, k: torch.Tensor, k_scale: torch.Tensor,
                   weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool, max_seqlen_k: int,
                   logits_dtype: torch.dtype, config: int) -> torch.Tensor:
    _check_pointers(q, k)
    out = new_logits(q.shape[0], max_seqlen_k or k.shape[0], logits_dtype, q.device)
    _run(q, q_sf, k, k_scale, weights, ks, ke, clean_logits, max_seqlen_k, config_of_key(config), out)
    return out


@_mqa_logits_op.register_fake
def _mqa_logits_fake(q, q_sf, k, k_scale, weights, ks, ke, clean_logits, max_seqlen_k, logits_dtype, config):
    return new_logits(q.shape[0], max_seqlen_k or k.shape[0], logits_dtype, q.device)


@torch.library.custom_op("tilefuse::mqa_logits_out", mutates_args=("out",))
def _mqa_logits_out_op(q: torch.Tensor, q_sf: torch.Tensor | None, k: torch.Tensor, k_scale: torch.Tensor,
                       weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool,
                       max_seqlen_k: int, config: int, out: torch.Tensor) -> None:
    _check_pointers(q, k, out)
    _run(q, q_sf, k, k_scale, weights, ks, ke, clean_logits, max_seqlen_k, config_of_key(config), out)


@_mqa_logits_out_op.register_fake
def _mqa_logits_out_fake(q, q_sf, k, k_scale, weights, ks, ke, clean_logits, max_seqlen_k, config, out):
    return None


# Kernel launches skip Triton's binder after a key's first launch (tilefuse._jit.Launcher).
# Every pointer these kernels specialise on alignment is checked aligned by the wrappers or
# allocated here, so a key is the constexprs, the launch options and the tensors' dtypes.
_heads_on_n = Launcher(kern.prefill_heads_on_n_kernel)
_logits = Launcher(kern.prefill_logits_kernel)
_linear_parts = Launcher(kern.linear_term_parts_kernel)
_fill = Launcher(kern.fill_outside_windows_kernel)


def _launch(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, d, clean, compressed, cfg: PrefillConfig, err,
            fix_q=None, fix_k=None) -> None:
    """One launch of the prefill kernel; ``fix_q``/``fix_k`` (int32 per query/key block) restrict
    it to the flagged tiles; ``err`` is the device's error record."""
    s_q, h, dq = q.shape
    s_k = k.shape[0]
    options = cfg.launch_options
    if cfg.heads_on_n and fmt == "fp8":
        heads_p = next_power_of_2(h)
        k_desc = host_descriptor(TensorDescriptor, k, [s_k, dq], [k.stride(0), 1], [cfg.block_n, dq])
        consts = (h, heads_p, d, max(1, 128 // heads_p), clean, compressed, cfg.block_q, cfg.block_n, cfg.num_stages)
        grid = (cdiv(s_k, cfg.block_n), cdiv(s_q, cfg.block_q))
        _heads_on_n((consts, cfg.num_warps, q.dtype, weights.dtype, out.dtype), grid,
                    (q, q.stride(0), q.stride(1), k_desc, k_scale, weights, weights.stride(0), ks, ke, out,
                     out.stride(0), s_q, s_k, out.shape[1], err, *consts), options,
                    sized=_sized_tile(cfg.block_q, cfg.block_n, (10, 11, 12, 13), (3,), (1,)))
        return
    lin_parts = half_scale = None
    if cfg.relu_via_abs and fmt == "fp8" and q.dtype == FP8_DTYPE and fix_q is None:
        lin_parts, weights, half_scale = linear_term_parts(q, weights, cfg.relu_via_abs)
    if cfg.gluon and fmt == "fp8" and fix_q is None:
        if _arch(q.device) != 9:
            raise ValueError("gluon: the Gluon prefill kernel runs on Hopper (sm_90) GPUs only")
        from tilefuse.indexer import _prefill_kernel_gluon

        _prefill_kernel_gluon.launch(q, k, k_scale, weights, ks, ke, out, clean, compressed, err, cfg.block_q,
                                     cfg.block_n, cfg.num_warps, cfg.num_stages, refill_every=cfg.gluon_refill,
                                     lin_parts=lin_parts, half_scale=half_scale)
        return
    q_desc = host_descriptor(TensorDescriptor, q, [s_q, h * dq], [q.stride(0), 1], [cfg.block_q, dq])
    k_desc = host_descriptor(TensorDescriptor, k, [s_k, dq], [k.stride(0), 1], [cfg.block_n, dq])
    lin_desc = None if lin_parts is None else host_descriptor(
        TensorDescriptor, lin_parts, [s_q, lin_parts.shape[1]], [lin_parts.stride(0), 1], [cfg.block_q, dq])
    fixup = fix_q is not None
    lin = 0 if lin_parts is None else cfg.relu_via_abs
    key = (fmt, d, h, clean, compressed, fixup, lin, cfg.block_q, cfg.block_n, cfg.head_unroll, cfg.num_warps,
           cfg.num_stages, q.dtype, weights.dtype, out.dtype, k_scale.dtype)
    _logits(key, (cdiv(s_k, cfg.block_n), cdiv(s_q, cfg.block_q)), (
        q_desc, q_sf if q_sf is not None else ks, q_sf.stride(0) if q_sf is not None else 0,  # q_sf unused for FP8
        k_desc, k_scale,
        weights, weights.stride(0),
        ks, ke,
        out, out.stride(0),
        s_q, s_k, out.shape[1], err,
        h, d, FORMAT_CODE[fmt], clean, compressed, cfg.block_q, cfg.block_n, cfg.head_unroll,
        fix_q, fix_k, fixup, lin_desc, half_scale, lin,
    ), options, sized=_sized_tile(cfg.block_q, cfg.block_n, (10, 11, 12, 13), *(
        ((0, 3), (0, 1)) if lin_desc is None else ((0, 3, 26), (0, 1, 0)))))


_mx_few_rows = Launcher(kern.prefill_mx_few_rows_kernel)


def _launch_mx_few_rows(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, d, clean, compressed, cfg: PrefillConfig,
                        err) -> None:
    """MX logits on the few-row kernel, the rows renormalised in its registers (``mx_inline`` 1; with 2
    the query rows by a launch before it, with 3 by producer programs of the same launch)."""
    s_q, h, _ = q.shape
    heads_p = next_power_of_2(h)
    prepared = cfg.mx_inline - 1
    counters = err  # (not read unless prepared is 2: the error record keeps the key)
    if prepared == 2:
        q_tiles = cdiv(s_q, cfg.block_q)
        if q_tiles > _COUNTER_TILES:
            prepared = 1  # (more tiles than counters): the query rows by a first launch
        else:
            counters = _tile_counters(q.device, q_tiles)
    if prepared == 1:  # (fix_q per program: one flag block is one program's rows)
        q_rows, w_rows, fix_q = _renormalise_rows(q, q_sf, weights, k, k_scale, fmt, d, cfg.block_q, cfg.block_n,
                                                  keys=False)[:3]
    elif prepared == 2:
        q_rows = _jit.scratch(s_q, h, d, dtype=_RENORM_DTYPE[fmt], device=q.device, sized=lambda s_q, *_: (s_q, h, d))
        w_rows = _jit.scratch(s_q, h, dtype=torch.float32, device=q.device, sized=lambda s_q, *_: (s_q, h))
        fix_q = err
    else:  # not read: the error record keeps the compile key (its alignment does not vary)
        q_rows = w_rows = fix_q = err
    consts = (h, heads_p, d, FORMAT_CODE[fmt], max(1, 128 // heads_p), clean, compressed, cfg.block_q, cfg.block_n,
              cfg.num_stages, _SPAN_EXACT[fmt], _FOLD_EXP_LIMIT, prepared)
    if prepared == 2:
        sized = _sized_producers_and_tiles(cfg.block_q, cfg.block_n, cdiv(cfg.block_q * h, _PRODUCER_PAIRS))
    else:
        sized = _sized_tile(cfg.block_q, cfg.block_n, (13, 17, 18, 19), (), ())
    _mx_few_rows((consts, cfg.num_warps, q.dtype, weights.dtype, out.dtype),
                 sized[0](s_q, k.shape[0], out.shape[1], out.stride(0))[0],
                 (q, q.stride(0), q.stride(1), q_sf, q_sf.stride(0), k, k.stride(0), k_scale, weights,
                  weights.stride(0), ks, ke, out, out.stride(0), q_rows, w_rows, fix_q, s_q, k.shape[0], out.shape[1],
                  err, counters, *consts),
                 cfg.launch_options, sized=sized)


# mx_inline 3: query (row, head) pairs per producer program, and the query tiles one call may have
# (counters per device and stream: 2 int32 a tile).
_PRODUCER_PAIRS = kern._PRODUCER_PAIRS.value
_COUNTER_TILES = 4096
_TILE_COUNTERS: dict = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The tile counters of an ``mx_inline`` 3 launch of ``tiles`` tiles on the current
    stream of ``device``: zero when no launch runs (each launch leaves them so), one buffer per
    stream so that calls on two streams never share one (a call replayed on another stream takes
    the ordinary path: the stream is in the op's replay key). A call captured into a CUDA graph
    gets a buffer of the graph's own, zeroed by a node of the graph before each replay's launch
    (the graph may be replayed on any stream, beside the calls on this one; capture is in the
    replay key too). (A buffer a stream, 32 KiB, kept for the process: an engine's streams are
    few.)"""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(2 * tiles, dtype=torch.int32, device=device)
    key = (device, _current_stream(device))
    counters = _TILE_COUNTERS.get(key)
    if counters is None:
        counters = _TILE_COUNTERS[key] = torch.zeros(2 * _COUNTER_TILES, dtype=torch.int32, device=device)
    return counters


def _current_stream(device: torch.device) -> int:
    return _stream_of(device.index if device.type == "cuda" else -1)


def _stream_of(device_index: int) -> int:
    """The current stream of a CUDA device by index (-1: a CPU tensor, 0)."""
    return torch._C._cuda_getCurrentRawStream(device_index) if device_index >= 0 else 0


def _stream_and_capture(device_index: int) -> tuple:
    """The current stream of a CUDA device by index and whether it is capturing a graph."""
    return _stream_of(device_index), device_index >= 0 and torch._C._cuda_isCurrentStreamCapturing()


@functools.cache
def _sized_producers_and_tiles(block_q: int, block_n: int, parts: int):
    """The 1-D grid of ``mx_inline`` 3: ``parts`` producers per query tile, then the (key tile,
    query tile) programs; sizes at the same positions as :func:`_sized_tile`'s."""
    def sized(s_q, s_k, n_cols, stride_out):
        q_tiles, k_tiles = -(-s_q // block_q), -(-s_k // block_n)
        return (q_tiles * (parts + k_tiles),), (stride_out, s_q, s_k, n_cols), ()

    return sized, (13, 17, 18, 19), ()


# A launch's ``sized`` (tilefuse._jit.replay): the grid, the size arguments and the rows of its
# host descriptors for a call of sizes ``(S_q, S_k, n_cols, out row stride)``.
@functools.cache
def _sized_tile(block_q: int, block_n: int, int_positions: tuple, desc_positions: tuple, desc_rows: tuple):
    """A (key block, query block) grid; the size arguments ``(out row stride, S_q, S_k,
    n_cols)`` at ``int_positions``; descriptors whose rows are S_q (0) or S_k (1)."""
    def sized(s_q, s_k, n_cols, stride_out):
        sizes = (s_q, s_k)
        return ((-(-s_k // block_n), -(-s_q // block_q)), (stride_out, s_q, s_k, n_cols),
                tuple(sizes[r] for r in desc_rows))

    return sized, int_positions, desc_positions


def _rows_grid(s_q, s_k, n_cols, stride_out):
    return (s_q,), (), ()


_SIZED_ROWS = (_rows_grid, (), ())


def linear_term_parts(q: torch.Tensor, weights: torch.Tensor, parts: int):
    """For ``relu_via_abs``: (E4M3 parts ``[S_q, parts * D]`` of ``sum_h w_h q_h / c``, fp32
    ``w / c`` ``[S_q, H]``, fp32 ``c / 2`` ``[S_q]``) with ``c`` a power of two per row."""
    s_q, h, d = q.shape
    lin = _jit.scratch(s_q, parts * d, dtype=FP8_DTYPE, device=q.device, sized=lambda s_q, *_: (s_q, parts * d))
    w_scaled = _jit.scratch(s_q, h, dtype=torch.float32, device=q.device, sized=lambda s_q, *_: (s_q, h))
    half_scale = _jit.scratch(s_q, dtype=torch.float32, device=q.device, sized=lambda s_q, *_: (s_q,))
    if s_q:
        consts = (h, next_power_of_2(h), d, parts)
        _linear_parts((consts, weights.dtype), (s_q,), (q, q.stride(0), weights, weights.stride(0), lin, w_scaled,
                                                        half_scale, *consts), sized=_SIZED_ROWS)
    return lin, w_scaled, half_scale


# How many binades a row's block exponents may span and still convert exactly (MXFP4 into
# E4M3: E2M1 times 2^-8 is on the E4M3 grid; MXFP8 into f16: E4M3 times 2^-15 keeps its bits);
# the folded row scale must also keep fp32 weights finite.
_SPAN_EXACT = {"mxfp4": 8, "mxfp8": 15}
_RENORM_DTYPE = {"mxfp4": FP8_DTYPE, "mxfp8": torch.float16}
_FOLD_EXP_LIMIT = 100
_RENORM_ROWS = 64  # rows (query: (row, head) pairs) per program of the renormalise launch
_renormalise = Launcher(kern.mx_rows_renormalise_kernel)


def _renormalise_rows(q, q_sf, weights, k, k_scale, fmt: str, d: int, fix_q_rows: int, fix_k_rows: int,
                      keys: bool = True):
    """Both MX operands in one launch: ``(q_rows [S_q, H, D], w_rows [S_q, H] fp32, fix_q,
    k_rows [S_k, D], k_row_scale [S_k] fp32, fix_k)``. Rows are E4M3 (MXFP4) or f16 (MXFP8)
    renormalised by their largest block scale ``2^(e_max - 127)``: the keys' is the row scale,
    the queries' is folded into ``w_rows = weights * scale``. ``fix_q`` / ``fix_k`` (int32, one
    per ``fix_q_rows`` query rows / ``fix_k_rows`` keys, the last block partial) are 1 where a
    row of the block is not exact. S_q (and S_k with ``keys``) must be > 0; without ``keys``
    only the queries are renormalised (the key outputs returned are the query's)."""
    s_q, h, _ = q.shape
    s_k = k.shape[0] if keys else 0
    dev = q.device
    dtype = _RENORM_DTYPE[fmt]
    n_fix_q = cdiv(s_q, fix_q_rows)
    n_fix_k = cdiv(s_k, fix_k_rows)
    # Separate tensors: on the host one torch.empty costs about what carving a typed view out
    # of a shared workspace does (benchmarks/NOTES.md); a replayed call (tilefuse._jit.replay)
    # allocates them as one buffer. Sizes as varargs parse faster than a tuple.
    q_rows = _jit.scratch(s_q, h, d, dtype=dtype, device=dev, sized=lambda s_q, *_: (s_q, h, d))
    w_rows = _jit.scratch(s_q, h, dtype=torch.float32, device=dev, sized=lambda s_q, *_: (s_q, h))
    fix_q = _jit.scratch(n_fix_q, dtype=torch.int32, device=dev, sized=lambda s_q, *_: (cdiv(s_q, fix_q_rows),))
    if keys:
        k_rows = _jit.scratch(s_k, d, dtype=dtype, device=dev, sized=lambda s_q, s_k, *_: (s_k, d))
        k_row_scale = _jit.scratch(s_k, dtype=torch.float32, device=dev, sized=lambda s_q, s_k, *_: (s_k,))
        fix_k = _jit.scratch(n_fix_k, dtype=torch.int32, device=dev,
                             sized=lambda s_q, s_k, *_: (cdiv(s_k, fix_k_rows),))
    else:  # no key programs: the query outputs stand in (same dtypes), never written as keys
        k_rows, k_row_scale, fix_k = q_rows, w_rows, fix_q

    def sized(s_q, s_k, *_):
        s_k = s_k if keys else 0
        grid = (max(cdiv(s_q * h, _RENORM_ROWS), cdiv(s_q, fix_q_rows))
                + max(cdiv(s_k, _RENORM_ROWS), cdiv(s_k, fix_k_rows)),)
        return grid, (s_q, s_k), ()

    consts = (h, next_power_of_2(h), d, FORMAT_CODE[fmt], _SPAN_EXACT[fmt], _FOLD_EXP_LIMIT, _RENORM_ROWS, fix_q_rows,
              fix_k_rows)
    _renormalise((consts, q.dtype, weights.dtype), sized(s_q, s_k)[0], (
        q, q.stride(0), q_sf, q_sf.stride(0), weights, weights.stride(0), k, k.stride(0), k_scale,
        q_rows, w_rows, fix_q, k_rows, k_row_scale, fix_k, s_q, s_k, *consts), sized=(sized, (15, 16), ()))
    return q_rows, w_rows, fix_q, k_rows, k_row_scale, fix_k


_FP8_PASS_CONFIGS: dict[tuple, PrefillConfig] = {}


def _fp8_pass_config(cfg: PrefillConfig, h: int, d: int) -> PrefillConfig:
    """The config of the pass over renormalised rows: ``cfg`` on the Gluon loop, else the FP8
    default off Hopper, few-row (``cfg.heads_on_n``, 16 rows a program) or 2-D tile, with ``cfg``'s head sum. Never
    from the call's row count: the top-k runs row blocks under the whole call's config."""
    if cfg.gluon:
        return cfg
    key = (cfg, h, d)
    fp8_cfg = _FP8_PASS_CONFIGS.get(key)
    if fp8_cfg is None:
        fp8_cfg = default_config("fp8", h, d, FEW_ROWS if cfg.heads_on_n else None)
        if cfg.heads_on_n:  # 16 rows a program, the tile this pass was measured at (not the FP8 few-row default's 4)
            fp8_cfg = dataclasses.replace(fp8_cfg, block_q=16)
        fp8_cfg = _FP8_PASS_CONFIGS[key] = dataclasses.replace(fp8_cfg, relu_via_abs=cfg.relu_via_abs)
    return fp8_cfg


def _mx_via_renormalised_rows(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, clean, compressed, d,
                              cfg: PrefillConfig, err) -> None:
    """MX logits on the FP8 kernel's head loop: rows renormalised into E4M3 (MXFP4, FP8 MMA) or
    f16 (MXFP8, f16 MMA) by one launch that also flags the config's query / key blocks holding a
    row that was not exact; then the bf16 upcast recomputes only the flagged tiles."""
    # relu(c * x) = c * relu(x) for c > 0: the query row scale is folded into w_rows.
    q_rows, w_rows, fix_q, k_rows, k_row_scale, fix_k = _renormalise_rows(
        q, q_sf, weights, k, k_scale, fmt, d, cfg.block_q, cfg.block_n)
    _launch(q_rows, None, k_rows, k_row_scale, w_rows, ks, ke, out, "fp8", d, clean, compressed,
            _fp8_pass_config(cfg, q.shape[1], d), err)
    _launch(q, q_sf, k, k_scale, weights, ks, ke, out, fmt, d, clean, compressed, cfg, err, fix_q, fix_k)


def _fill_outside_windows(out, ks, ke, s_k, compressed: bool, block_q: int = 32, block_c: int = 128) -> None:
    n_cols = out.shape[1]
    _fill((compressed, block_q, block_c, out.dtype), (cdiv(n_cols, block_c), cdiv(out.shape[0], block_q)),
          (out, out.stride(0), ks, ke, out.shape[0], s_k, n_cols, compressed, block_q, block_c),
          sized=_sized_fill(block_q, block_c))


@functools.cache
def _sized_fill(block_q: int, block_c: int):
    def sized(s_q, s_k, n_cols, stride_out):
        return (-(-n_cols // block_c), -(-s_q // block_q)), (stride_out, s_q, s_k, n_cols), ()

    return sized, (1, 4, 5, 6), ()


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------
def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
    schedule_meta: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer logits over FP8, MXFP8 or MXFP4 queries and keys.

    Args:
        q: ``(values, sf)``. FP8: e4m3 ``[S_q, H, D]`` and ``None``. MXFP8: e4m3 ``[S_q, H, D]``
            and int32 ``[S_q, H]`` packed UE8M0. MXFP4: int8 ``[S_q, H, D/2]`` (packed nibbles)
            and int32 ``[S_q, H]``. Passing query scales selects MX mode.
        kv: ``(k, k_sf)``: keys ``[S_k, D]`` (``[S_k, D/2]`` int8 for MXFP4) with fp32 ``[S_k]``
            per-row scales (FP8) or int32 ``[S_k]`` packed UE8M0 (MX).
        weights: fp32 or bf16 ``[S_q, H]``, last stride 1 (row stride may be padded).
        cu_seq_len_k_start, cu_seq_len_k_end: int32 ``[S_q]``, the window ``[ks, ke)`` of each
            row; ``ke > S_k`` is clamped.
        clean_logits: write ``-inf`` to every column outside the window (in compressed mode:
            past each row's length; DeepGEMM rejects that combination, tilefuse supports it).
        max_seqlen_k: 0 for the full ``[S_q, S_k]`` layout; ``> 0`` for the compressed layout
            ``[S_q, max_seqlen_k]`` where column ``c`` holds key ``ks[i] + c``.
        logits_dtype: torch.float32 or torch.bfloat16.
        schedule_meta: from :func:`get_mqa_logits_metadata`, checked by shape only; the output
            is bitwise identical with or without it.
        config: launch configuration override (see :class:`PrefillConfig`).
        out: a caller-owned logits buffer to write (and return) instead of a new one:
            ``logits_dtype``, shape ``[S_q, S_k]`` (or ``[S_q, max_seqlen_k]``), last stride 1,
            row stride >= its columns with rows starting 16-byte aligned. Reusable across calls.

    Returns:
        ``[S_q, S_k]`` (or ``[S_q, max_seqlen_k]``) logits, last stride 1; a new tensor has its
        row stride padded to a multiple of 16 elements (read ``logits.stride(0)``).

    Raises:
        TypeError: a non-tensor argument, or a wrong dtype (q, kv[0], kv[1], q[1], weights,
            windows, logits_dtype, out).
        ValueError: a wrong shape; H not a multiple of 4 in [4, 128]; D not in {32, 64, 128}
            (FP4: {64, 128}); non-contiguous heads/head dim, a row stride or base not 16-byte
            aligned; tensors on different devices, or on the CPU without Triton's interpreter;
            schedule_meta or out of the wrong dtype, shape, strides or device; ``max_seqlen_k``
            negative.
        tilefuse.DeviceValueError (a ValueError): window values, found by the kernels and raised
            at the next call on the device or at :func:`tilefuse.check_errors` (in checked mode,
            :func:`tilefuse.set_checked`, a ValueError at once): ``ks < 0``, ``ks > ke``,
            ``max_seqlen_k`` smaller than a window. Whatever the values, nothing is read or
            written out of bounds (windows are clamped into ``[0, S_k]``).
    """
    q_values, q_sf = split_query(q)
    k, k_scale = split_keys(kv)
    ks, ke = cu_seq_len_k_start, cu_seq_len_k_end
    compiling = torch.compiler.is_compiling()
    sig = replay_key = entry = None
    if not compiling:
        try:
            sig = _signature(q_values, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype)
            if not _errors.checked():
                overrides = _config._overrides.get("prefill")
                s_q, s_k = q_values.shape[0], k.shape[0]
                cols = max_seqlen_k if max_seqlen_k > 0 else s_k
                # What the call's host work depends on but its sizes (the config's size class
                # does): the launches of a layout's calls follow the sizes (tilefuse._jit.replay).
                replay_key = (sig, size_class(s_q, s_k), bool(clean_logits), config,
                              tuple(sorted(overrides.items())) if overrides else None,
                              None if out is None else (out.dim(), out.stride(), out.dtype, out.get_device(),
                                                        out.data_ptr() & 15),
                              None if schedule_meta is None else (schedule_meta.dim(), schedule_meta.shape[1:],
                                                                  schedule_meta.stride(), schedule_meta.dtype,
                                                                  schedule_meta.get_device()),
                              # on the CPU, whether it runs at all depends on the interpreter (and
                              # which kernels, on the architecture the tests pose as)
                              sig[4] >= 0 or (_validate.interpreter_enabled(), _arch(q_values.device)),
                              # (MX: mx_inline 3 binds the current stream's tile counters,
                              # a graph's call its own)
                              None if q_sf is None else _stream_and_capture(sig[4]))
                entry = _REPLAYS.get(replay_key)
                if entry.__class__ is tuple and not (
                        _sizes_agree(q_values, q_sf, k, k_scale, weights, ks, ke) and max(s_q, s_k, cols) < _MAX_SIZE
                        and (out is None or (out.shape[0] == s_q and out.shape[1] == cols
                                             and (s_q <= 1 or out.stride(0) >= cols)))
                        and (schedule_meta is None or schedule_meta.shape[0] == _metadata_rows(s_q))):
                    entry = _jit.NOT_REPLAYABLE  # this call takes the ordinary path: its checks say what is wrong
        except (AttributeError, TypeError, RuntimeError, IndexError):  # the checks below say what is wrong
            sig = replay_key = None
        if entry.__class__ is tuple:  # this call's launches are the entry's, with its own tensors and sizes
            run, device = entry
            _errors.raise_pending_fast(device)
            if out is None:
                out = new_logits(s_q, cols, logits_dtype, device)
            # (False: a launch hook, a redirect, another current device: the ordinary path)
            if run((s_q, s_k, cols, out.stride(0)), q_values, q_sf, k, k_scale, weights, ks, ke, out):
                return out
    fmt, s_q, h, d, s_k = _check_inputs(q_values, q_sf, k, k_scale, weights, ks, ke, max_seqlen_k, logits_dtype,
                                        sig)
    device = q_values.device
    _errors.raise_pending_fast(device)
    cols = max_seqlen_k if max_seqlen_k > 0 else s_k
    if schedule_meta is not None:
        _check_metadata(schedule_meta, s_q, device)
    if out is not None:
        _check_out(out, s_q, cols, logits_dtype, device)
    key = _resolved_key(fmt, h, d, s_q, s_k, config, logits_dtype, device)
    clean = bool(clean_logits)
    checked_now = _errors.checked() and _errors.host_reads_possible(device)
    if checked_now:
        _check_windows(ks, ke, s_k, max_seqlen_k)
    if compiling:
        if out is None:
            return torch.ops.tilefuse.mqa_logits(q_values, q_sf, k, k_scale, weights, ks, ke, clean, max_seqlen_k,
                                                 logits_dtype, key)
        torch.ops.tilefuse.mqa_logits_out(q_values, q_sf, k, k_scale, weights, ks, ke, clean, max_seqlen_k, key, out)
        return out
    # Eager: the implementation directly (the custom op's dispatch would cost more than the
    # rest of the host work together).
    if out is None:
        out = new_logits(s_q, cols, logits_dtype, device)
    if replay_key is None or entry is None or entry is _jit.NOT_REPLAYABLE or entry.__class__ is tuple:
        _run(q_values, q_sf, k, k_scale, weights, ks, ke, clean, max_seqlen_k, _CONFIGS[key], out)
        if entry is None and replay_key is not None:  # recorded at its second call
            _remember_replay(replay_key, 0)
    else:
        _run_recorded(replay_key, entry, (q_values, q_sf, k, k_scale, weights, ks, ke, out), clean, max_seqlen_k,
                      _CONFIGS[key])
    if checked_now:
        check_errors(device)
    return out


# Eager calls by everything their host work depends on but the sizes (the argument signature,
# the size class, clean, config, overrides, the layouts of out and schedule_meta): the
# launches a call made, replayed with a later call's tensors, sizes and new scratch buffers
# (tilefuse._jit.replay), so that a call of a known layout checks nothing and builds nothing
# but what its sizes change. A layout's first call only marks it (0); its next ones record, an
# int counting the tries while a launch is not yet direct (it is from a key's second launch on
# a GPU). A layout with a launch that cannot follow the sizes is not replayed.
_REPLAYS: dict[tuple, object] = {}
_REPLAYS_MAX = 4096
_MAX_SIZE = 2**31  # sizes passed as 32-bit ints (larger ones take the ordinary path)


def _run_recorded(replay_key, tries: int, inputs: tuple, clean: bool, max_seqlen_k: int, cfg: PrefillConfig) -> None:
    q = inputs[0]
    with _jit.recorded_launches() as recording:
        _run(*inputs[:7], clean, max_seqlen_k, cfg, inputs[7])
    if recording is None:  # another thread is recording: next time
        return
    replayed = _jit.replay_or_try_again(
        recording, inputs, (_ERR_RECORDS.get(q.device), _TILE_COUNTERS.get((q.device, _current_stream(q.device)))),
        tries)
    if callable(replayed):
        replayed = (replayed, q.device)
    _remember_replay(replay_key, replayed)


def _remember_replay(replay_key, entry) -> None:
    if len(_REPLAYS) >= _REPLAYS_MAX:
        _REPLAYS.clear()
    _REPLAYS[replay_key] = entry


def fp8_mqa_logits(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor, clean_logits: bool = True, max_seqlen_k: int = 0, *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 indexer logits with DeepGEMM's ``fp8_mqa_logits`` signature: ``q`` is a bare e4m3
    ``[S_q, H, D]`` tensor, ``kv = (k e4m3 [S_k, D], k_scale fp32 [S_k])``, fp32 logits.

    See :func:`fp8_fp4_mqa_logits` for the arguments (``out`` included) and the errors raised.
    """
    if not isinstance(q, torch.Tensor):
        expect_tensor(q, "q")
    return fp8_fp4_mqa_logits((q, None), kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                              clean_logits, max_seqlen_k, out=out)


# ---------------------------------------------------------------------------------------
# Schedule metadata
# ---------------------------------------------------------------------------------------
_META_HEADER_ROWS = 1


def get_mqa_logits_metadata(
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    num_kv_tokens: int,
    num_heads: int,
) -> torch.Tensor:
    """Schedule metadata for :func:`fp8_fp4_mqa_logits`, computed once and reusable by every layer.

    Layout (int32 ``[1 + num_q_blocks, 2]``): row 0 holds the tile ``(block_q, block_n)``; row
    ``1 + b`` holds the half-open range of key blocks ``[lo, hi)`` that query block ``b`` must
    compute (blocks outside it are only ``-inf`` fills). It depends only on its arguments.
    """
    expect_tensor(cu_seq_len_k_start, "cu_seq_len_k_start")
    expect_tensor(cu_seq_len_k_end, "cu_seq_len_k_end")
    expect(cu_seq_len_k_start.shape == cu_seq_len_k_end.shape and cu_seq_len_k_start.dim() == 1, ValueError,
            "cu_seq_len_k_start/cu_seq_len_k_end: expected two [S_q] tensors of one shape")
    expect(num_heads % 4 == 0 and 4 <= num_heads <= 128, ValueError,
            f"num_heads: expected a multiple of 4 in [4, 128], got {num_heads}")
    cfg = default_config("fp8", num_heads, 128)
    s_q = cu_seq_len_k_start.shape[0]
    nqb = cdiv(s_q, cfg.block_q)
    pad = nqb * cfg.block_q - s_q
    ks = torch.nn.functional.pad(cu_seq_len_k_start.long(), (0, pad), value=num_kv_tokens)
    ke = torch.nn.functional.pad(cu_seq_len_k_end.long().clamp(max=num_kv_tokens), (0, pad), value=0)
    nonempty = ke > ks
    lo = torch.where(nonempty, ks, num_kv_tokens).view(nqb, cfg.block_q).amin(dim=1)
    hi = torch.where(nonempty, ke, 0).view(nqb, cfg.block_q).amax(dim=1)
    lo_blk = torch.div(lo, cfg.block_n, rounding_mode="floor")
    hi_blk = torch.where(hi > lo, torch.div(hi + cfg.block_n - 1, cfg.block_n, rounding_mode="floor"), lo_blk)
    header = torch.tensor([[cfg.block_q, cfg.block_n]], dtype=torch.int64, device=lo.device)
    return torch.cat([header, torch.stack([lo_blk, hi_blk], dim=1)]).to(torch.int32)


_META_BLOCK_Q = default_config("fp8", 4, 128).block_q


def _metadata_rows(s_q: int) -> int:
    return _META_HEADER_ROWS + -(-s_q // _META_BLOCK_Q)


def _check_metadata(meta: torch.Tensor, s_q: int, device: torch.device) -> None:
    """By shape, dtype and device only: the kernels never read it, so it is never recomputed."""
    if not isinstance(meta, torch.Tensor):
        expect_tensor(meta, "schedule_meta")
    if meta.dtype != torch.int32 or meta.dim() != 2 or meta.shape[1] != 2:
        raise ValueError(f"schedule_meta: expected int32 [1 + num_q_blocks, 2] from get_mqa_logits_metadata, "
                         f"got {meta.dtype} {tuple(meta.shape)}")
    if meta.device != device:
        raise ValueError(f"schedule_meta: expected device {device}, got {meta.device}")
    if meta.shape[0] != _metadata_rows(s_q):
        raise ValueError(f"schedule_meta: made for another number of query rows ({meta.shape[0] - 1} blocks, "
                         f"S_q = {s_q})")


def warmup_calls(fmt: str, num_heads: int, head_dim: int, weights_dtype: torch.dtype = torch.float32,
                 logits_dtype: torch.dtype = torch.float32, clean_logits: bool = False, compressed: bool = False,
                 device: torch.device | str = "cuda") -> list:
    """One call per kernel variant that the op's heuristics can pick for this model
    configuration (a call of each size class whose config no smaller call has, with every pass
    each one launches), on small inputs. After running them, any S_q, S_k, windows and strides
    run without a compile. Returns the calls (each takes no arguments and returns nothing)."""
    device = torch.device(device)
    calls = []
    for s_q, s_k in warmup_sizes(fmt, num_heads, head_dim, logits_dtype, device):
        q, kv = _zero_inputs(fmt, s_q, s_k, num_heads, head_dim, device)
        weights = torch.zeros(s_q, num_heads, dtype=weights_dtype, device=device)
        ks = torch.zeros(s_q, dtype=torch.int32, device=device)
        ke = torch.arange(s_k - s_q + 1, s_k + 1, dtype=torch.int32, device=device)
        max_seqlen_k = s_k if compressed else 0

        def call(q=q, kv=kv, weights=weights, ks=ks, ke=ke, max_seqlen_k=max_seqlen_k) -> None:
            fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits, max_seqlen_k, logits_dtype)

        calls.append(call)
    return calls


def warmup_sizes(fmt: str, num_heads: int, head_dim: int, logits_dtype: torch.dtype,
                 device: torch.device) -> list[tuple[int, int]]:
    """``(S_q, S_k)``: the smallest call of each size class whose config no smaller call has
    (the first one at most FEW_ROWS rows)."""
    if fmt not in FORMAT_CODE:  # before the heuristics, whose errors would not name it
        raise ValueError(f"fmt: expected one of {sorted(FORMAT_CODE)}, got {fmt!r}")
    arch = _arch(device)
    rows = 3 * FEW_ROWS
    sizes, seen = [], set()
    for s_q, s_k in ((FEW_ROWS // 2, 256), (rows, 256), (rows, MX_INLINE_CALL // rows + 1),
                     (rows, FEW_CALL // rows + 1), (rows, SMALL_CALL // rows + 1)):
        cfg = resolve_config(fmt, num_heads, head_dim, s_q, None, logits_dtype, arch, s_k)
        if cfg not in seen:
            seen.add(cfg)
            sizes.append((s_q, s_k))
    return sizes


def _zero_inputs(fmt: str, s_q: int, s_k: int, h: int, d: int, device: torch.device):
    """Zero-valued operands of a format (unit scales), for warm-up launches."""
    if fmt == "fp8":
        values = torch.zeros(s_q, h, d, dtype=torch.uint8, device=device).view(FP8_DTYPE)
        keys = torch.zeros(s_k, d, dtype=torch.uint8, device=device).view(FP8_DTYPE)
        return (values, None), (keys, torch.ones(s_k, device=device))
    dq = d // 2 if fmt == "mxfp4" else d
    dtype = torch.int8 if fmt == "mxfp4" else FP8_DTYPE
    values = torch.zeros(s_q, h, dq, dtype=torch.uint8, device=device).view(dtype)
    keys = torch.zeros(s_k, dq, dtype=torch.uint8, device=device).view(dtype)
    one = 0x7F7F7F7F  # UE8M0 1.0 in every byte
    return ((values, torch.full((s_q, h), one, dtype=torch.int32, device=device)),
            (keys, torch.full((s_k,), one, dtype=torch.int32, device=device)))
