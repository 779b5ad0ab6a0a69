"""Which prefill kernel runs where: one table from (GPU capability major, format) to a kernel path.

    capability             fp8          mxfp8, mxfp4
    9.x  Hopper            hopper-fp8   hopper-mx-bf16
    10.x Blackwell sm_100  hopper-fp8   sm100-mx-dot-scaled
    anything else, CPU     as 9.x       as 9.x

* ``hopper-*``: ``prefill_logits_kernel`` (``_prefill_kernel.py``), written for Hopper; its
  ``tl.dot`` compiles to wgmma on sm_90 and to tcgen05 on sm_100, so FP8 keeps it on
  Blackwell. Hopper has no block-scaled MMA: MX operands are dequantised to bf16 for the dot,
  or renormalised into E4M3 / f16 rows first (``hopper-mx-bf16``; see ``PrefillConfig``).
* On 9.x the default config (``default_config(arch=9)``) runs the FP8 path's head loop, and
  MXFP8's f16-row pass, as the Gluon kernel (``_prefill_kernel_gluon.py``, async wgmma): same
  tile, same bits; ``PrefillConfig(gluon=False)`` keeps the Triton loop.
* ``sm100-mx-dot-scaled``: ``prefill_logits_mx_kernel`` (``_prefill_kernel_sm100.py``), the
  native block-scaled MMA through ``tl.dot_scaled``, with its own tile.

Other capabilities (Ampere, consumer Blackwell sm_120) and the CPU interpreter take the 9.x
row: the portable kernel, whatever MMA Triton finds for it. ``tilefuse kernels`` compiles each
kernel for the targets this table sends it to.
"""

from __future__ import annotations

from tilefuse._device import capability_major  # noqa: F401  (the ops call it from here)

HOPPER_FP8 = "hopper-fp8"
HOPPER_MX_BF16 = "hopper-mx-bf16"
SM100_MX_DOT_SCALED = "sm100-mx-dot-scaled"

# (capability major, format) -> kernel path. Majors not listed behave as 9.
PREFILL_KERNELS: dict[tuple[int, str], str] = {
    (9, "fp8"): HOPPER_FP8,
    (9, "mxfp8"): HOPPER_MX_BF16,
    (9, "mxfp4"): HOPPER_MX_BF16,
    (10, "fp8"): HOPPER_FP8,
    (10, "mxfp8"): SM100_MX_DOT_SCALED,
    (10, "mxfp4"): SM100_MX_DOT_SCALED,
}
_FALLBACK_MAJOR = 9
# Where each path's kernel lives (for the kernel checks and the docs).
KERNEL_OF_PATH = {
    HOPPER_FP8: "tilefuse.indexer._prefill_kernel:prefill_logits_kernel",
    HOPPER_MX_BF16: "tilefuse.indexer._prefill_kernel:prefill_logits_kernel",
    SM100_MX_DOT_SCALED: "tilefuse.indexer._prefill_kernel_sm100:prefill_logits_mx_kernel",
}


def prefill_kernel_path(major: int | None, fmt: str) -> str:
    """The kernel path for a capability major (None: CPU) and a format.

    Raises:
        ValueError: an unknown format.
    """
    key_major = major if (major, fmt) in PREFILL_KERNELS else _FALLBACK_MAJOR
    if (key_major, fmt) not in PREFILL_KERNELS:
        raise ValueError(f"fmt: expected one of fp8, mxfp8, mxfp4, got {fmt!r}")
    return PREFILL_KERNELS[(key_major, fmt)]
