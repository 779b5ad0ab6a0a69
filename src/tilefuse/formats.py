"""FP8, MXFP8 and MXFP4 formats: the one source of truth for packing and scales.

Kernels, references, tests and users all prepare inputs through these functions.

* FP8 (per row): E4M3 values with one positive fp32 scale per row,
  ``scale = max(amax_row, 1e-4) / 448`` (not rounded).
* MXFP8 / MXFP4: one UE8M0 scale per 32 consecutive elements of the last dimension,
  ``sf = 2**ceil(log2(max(amax, 1e-4) / fmax))`` with fmax 448 (E4M3) or 6 (E2M1).
  Scales are packed four to an int32, little-endian: byte ``b`` scales elements
  ``[32b, 32b + 32)``; unused bytes (D < 128) hold 0x7f (1.0) and are never read.
* FP4 packing: element ``2k`` in the low nibble, ``2k + 1`` in the high nibble of byte ``k``,
  stored as ``torch.int8`` with last dim ``D / 2``. A nibble is ``s|e1 e0|m`` (E2M1).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
MX_BLOCK = 32
SCALES_PER_INT32 = 4
UE8M0_ONE = 0x7F
AMAX_FLOOR = 1e-4
# The code of each format in the kernels' ``FMT`` constexpr (kernels import their constants from here).
FORMAT_CODE = {"fp8": 0, "mxfp8": 1, "mxfp4": 2}

# Magnitudes of the eight E2M1 codes 0..7; code | 8 is the negative.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes. ``code = #(|x| > midpoint)`` rounds to nearest
# with ties going to the smaller magnitude, and saturates at 6.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_last_dim(x: torch.Tensor, name: str) -> int:
    d = x.shape[-1]
    if d % MX_BLOCK or d > MX_BLOCK * SCALES_PER_INT32:
        raise ValueError(f"{name}: last dim must be a multiple of 32 and at most 128, got {d}")
    return d // MX_BLOCK


# ---------------------------------------------------------------------------------------
# UE8M0 scales
# ---------------------------------------------------------------------------------------
def pack_ue8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Pack UE8M0 bytes ``[..., n]`` (n <= 4, any integer dtype) into int32 ``[...]``.

    Missing bytes are filled with 0x7f (a scale of 1.0).
    """
    n = exponents.shape[-1]
    if n > SCALES_PER_INT32:
        raise ValueError(f"at most {SCALES_PER_INT32} scales fit in an int32, got {n}")
    e = exponents.to(torch.int64) & 0xFF
    if n < SCALES_PER_INT32:
        pad = torch.full((*e.shape[:-1], SCALES_PER_INT32 - n), UE8M0_ONE, dtype=torch.int64, device=e.device)
        e = torch.cat([e, pad], dim=-1)
    shifts = torch.arange(SCALES_PER_INT32, device=e.device, dtype=torch.int64) * 8
    packed = (e << shifts).sum(dim=-1)
    # Reinterpret the low 32 bits as a signed int32 (a byte >= 0x80 in the top slot).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, num_blocks: int = SCALES_PER_INT32) -> torch.Tensor:
    """Unpack int32 ``[...]`` into UE8M0 bytes as int32 ``[..., num_blocks]``."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed scales must be int32, got {packed.dtype}")
    shifts = torch.arange(num_blocks, device=packed.device, dtype=torch.int32) * 8
    return (packed.unsqueeze(-1) >> shifts) & 0xFF


def ue8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes to fp32 powers of two, ``2 ** (e - 127)``."""
    return torch.exp2(exponents.to(torch.float32) - 127.0)


def _block_scale_exponents(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """Per-32 block UE8M0 exponents ``[..., D/32]`` for ``x [..., D]``."""
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    e = torch.ceil(torch.log2(amax / fmax)).to(torch.int32) + 127
    return e.clamp(0, 254)


# ---------------------------------------------------------------------------------------
# FP8 per row
# ---------------------------------------------------------------------------------------
def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` to E4M3 with one fp32 scale per row: ``(values, scale [...])``."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / E4M3_MAX
    values = (xf / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return values, scale


def dequantize_fp8_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale.float().unsqueeze(-1)


# ---------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------
def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` to MXFP8: ``(E4M3 values [..., D], packed int32 scales [...])``."""
    _check_last_dim(x, "x")
    e = _block_scale_exponents(x, E4M3_MAX)
    sf = ue8m0_to_float(e)
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK)) / sf.unsqueeze(-1)
    values = blocks.clamp(-E4M3_MAX, E4M3_MAX).flatten(-2).to(FP8_DTYPE)
    return values, pack_ue8m0(e)


def block_scales(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 scale of every element ``[..., dim]`` from packed int32 scales ``[...]``."""
    nb = dim // MX_BLOCK
    sf = ue8m0_to_float(unpack_ue8m0(packed, nb))
    return sf.repeat_interleave(MX_BLOCK, dim=-1)


def dequantize_mxfp8(values: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return values.float() * block_scales(packed, values.shape[-1])


# ---------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------
def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8 0..15): nearest, ties to the smaller magnitude,
    saturating at 6."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _E2M1_MIDPOINTS:
        code += (mag > t).to(torch.uint8)
    negative = (x < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer dtype, low 4 bits used) to fp32.

    Pure device arithmetic (no host-built table), so it also runs inside CUDA-graph capture.
    """
    c = code.to(torch.int32) & 0xF
    e = ((c >> 1) & 3).float()
    m = (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))
    return torch.where(c >= 8, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., D]`` into int8 ``[..., D/2]`` (element 2k in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.int32) & 0xF
    byte = c[..., 0::2] | (c[..., 1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int8 ``[..., D/2]`` into E2M1 codes uint8 ``[..., D]``."""
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    return codes.to(torch.uint8)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` to MXFP4: ``(packed int8 [..., D/2], packed int32 scales [...])``."""
    _check_last_dim(x, "x")
    e = _block_scale_exponents(x, E2M1_MAX)
    sf = ue8m0_to_float(e)
    scaled = (x.float().unflatten(-1, (-1, MX_BLOCK)) / sf.unsqueeze(-1)).flatten(-2)
    return pack_fp4(encode_e2m1(scaled)), pack_ue8m0(e)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = decode_e2m1(unpack_fp4(packed))
    return values * block_scales(scales, values.shape[-1])


# ---------------------------------------------------------------------------------------
# One entry point per format, used by tests, benchmarks and users preparing inputs.
# ---------------------------------------------------------------------------------------
FORMATS = ("fp8", "mxfp8", "mxfp4")


def quantize_q(q: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries ``[..., H, D]`` in the layout the ops take: ``(values, sf)``; sf is None for fp8.

    FP8 queries carry no scale, so values are a plain cast (saturating at 448).
    """
    if fmt == "fp8":
        return q.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), None
    if fmt == "mxfp8":
        return quantize_mxfp8(q)
    if fmt == "mxfp4":
        return quantize_mxfp4(q)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def quantize_k(k: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[..., D]`` as ``(values, scale)``: fp32 per-row scale for fp8, packed int32 for MX."""
    if fmt == "fp8":
        return quantize_fp8_rows(k)
    if fmt == "mxfp8":
        return quantize_mxfp8(k)
    if fmt == "mxfp4":
        return quantize_mxfp4(k)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def dequantize_q(values: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    """fp32 queries from ``(values, sf)`` in any format (format read from the dtypes)."""
    if sf is None:
        return values.float()
    if values.dtype == torch.int8:
        return dequantize_mxfp4(values, sf)
    return dequantize_mxfp8(values, sf)


def dequantize_k(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 keys from ``(values, scale)`` in any format (format read from the dtypes)."""
    if scale.dtype == torch.int32:
        if values.dtype == torch.int8:
            return dequantize_mxfp4(values, scale)
        return dequantize_mxfp8(values, scale)
    return dequantize_fp8_rows(values, scale)


def format_of(q_values: torch.Tensor, q_sf: torch.Tensor | None) -> str:
    """Name of the format selected by the query tensors (the rule of the prefill API)."""
    if q_sf is None:
        return "fp8"
    return "mxfp4" if q_values.dtype == torch.int8 else "mxfp8"
