"""Configurations that fail a compile check today, with the most spill each may show.

The compile tests fail on any failure not listed here, on a listed configuration that spills
more than its budget or fails for another reason, and on an entry that no longer matches a
failure (fixed: delete the entry) or no configuration at all (renamed: update it). So the
list only shrinks, and a regression in a listed configuration still fails CI.

An entry: (kernel, target glob, configuration glob, spill budget in bytes stored, why).
"""

KNOWN_SPILLS = [
    # Prefill, compressed layout: the store address ``row + (col - ks[row])`` and its mask are
    # computed per element, on top of the 64x128 fp32 accumulator.
    ("indexer.prefill", "*", "* compressed*", 1100,
     "compressed-layout epilogue: per-element offsets and masks beside the accumulator"),
    # Prefill MXFP8 on Hopper, bf16-upcast path: the dequantised operands and the scale bytes
    # push the 64x128 tile just past 255 registers.
    ("indexer.prefill", "sm_90a", "mxfp8 * full*", 128, "MXFP8 bf16-upcast tile at the register limit"),
    # Prefill on Hopper, Gluon head loop with 4 warps refilling its query ring after every head
    # (an option; the default refills two at a time and has no spill): the head sum and two score
    # tiles (one under an MMA, one being applied), three 64x128 fp32 tiles, at the register limit.
    ("indexer.prefill_gluon", "sm_90a", "* w4 buf4*", 80, "three 64x128 fp32 tiles live in one warpgroup"),
    # Prefill options (not the defaults).
    ("indexer.prefill", "*", "* mx_split=True", 1300, "per-block FP8 path: four partial score tiles live"),
    ("indexer.prefill", "*", "* keys_major=True*", 320, "keys-major tile with the MX upcast / bf16 epilogue"),
    ("indexer.prefill", "sm_90a", "mxfp4 * head_unroll=2*", 64, "two heads' upcast operands live at once"),
    ("indexer.prefill", "sm_100a", "fp8 * relu_via_abs=*", 16,
     "Triton loop on sm_100a with the linear term's operands beside the key tile (option, timed on Hopper only)"),
    # Persistent GEMM: the masked (unaligned) epilogue builds a pointer per element (on sm_90a
    # it no longer spills since the per-tile clock read went under TRACE); the reduce-scatter
    # epilogues hold the accumulator while loading every peer's partial.
    ("tp.gemm", "sm_100a", "gemm * unaligned*", 100, "masked epilogue of an unaligned chunk"),
    ("tp.gemm", "*", "gemm_rs*", 2600, "reduce-scatter epilogue: accumulator plus peer partials"),
]
