"""Configurations that fail a compile check today, with the most spill each may show.

``tilefuse kernels`` and the compile tests accept a report whose only failures are its spills
(and, in the SASS, the local-memory instructions that carry them) when an entry here matches it
and its spill stores are within the entry's budget. The tests also fail on an entry that no
longer matches a failure (fixed: delete the entry) or no configuration at all (renamed: update
it). So the list only shrinks, and a regression in a listed configuration still fails.

An entry: (kernel, target glob, configuration glob, spill budget in bytes stored, why, and
optionally the Triton versions it was seen with, a glob: ptxas's register targets differ
between the CPU pin and the GPU image's Triton). Entries for another Triton are ignored.
"""

from __future__ import annotations

import fnmatch
from typing import NamedTuple

from tilefuse.kernelcheck import checks
from tilefuse.kernelcheck.compile import KernelReport


class KnownSpill(NamedTuple):
    kernel: str
    target: str  # glob
    configuration: str  # glob
    budget: int  # bytes of spill stores allowed
    why: str
    triton: str = "*"  # glob on triton.__version__


_MERGE_SCAN = "scan and select held to 64 registers"
_MERGE_FINAL = "select and final sort held to 64 registers"
_MERGE_BAR = "scan, select and the first chunk's group maxima held to 64 registers"

_ENTRIES = [
    # Prefill, compressed layout: the store address ``row + (col - ks[row])`` and its mask are
    # computed per element, on top of the 64x128 fp32 accumulator.
    ("indexer.prefill", "*", "* compressed*", 1100,
     "compressed-layout epilogue: per-element offsets and masks beside the accumulator"),
    # Prefill MXFP8 on Hopper, bf16-upcast path: the dequantised operands and the scale bytes
    # push the 64x128 tile just past 255 registers.
    ("indexer.prefill", "sm_90a", "mxfp8 * full*", 128, "MXFP8 bf16-upcast tile at the register limit"),
    # Prefill MXFP4 at most 32 rows on Hopper (the one-launch few-row kernel, both operands
    # renormalised in registers) with triton 3.6: the query and key conversions live at once.
    ("indexer.prefill", "sm_90a", "mxfp4 D128 * 8x128 w8s3 heads_on_n=True mx_inline=1", 96,
     "both operands' in-register renormalisation at 255 registers", "3.6*"),
    # Prefill options (not the defaults).
    ("indexer.prefill", "sm_90a", "mxfp4 * head_unroll=2*", 64, "two heads' upcast operands live at once", "3.8*"),
    ("indexer.prefill", "sm_90a", "mxfp4 * head_unroll=2*", 96, "two heads' upcast operands live at once", "3.6*"),
    # (20 B since the kernel clamps and checks the windows itself, 16 before; none with 3.6.)
    ("indexer.prefill", "sm_100a", "fp8 * relu_via_abs=*", 24,
     "Triton loop on sm_100a with the linear term's operands beside the key tile (option, timed on Hopper only)",
     "3.8*"),
    # Top-k merge: the 8-warp launches (topk 2048) are held to 64 registers (``topk._MERGE_MAXNREG``,
    # four programs an SM: measured faster than two an SM unspilled, NOTES round (15)); the scan's
    # temporaries spill a few words there (more since the next block's loads are held across an
    # iteration: faster all the same, NOTES round (26)), the select's and the sort's a few hundred.
    ("indexer.topk_merge", "sm_90a", "k2048 W2048 rows1 * first w8", 136, _MERGE_BAR, "3.8*"),
    ("indexer.topk_merge", "sm_90a", "k2048 W2048 rows1 prefill middle w8", 40, _MERGE_SCAN, "3.8*"),
    ("indexer.topk_merge", "sm_90a", "k2048 W2048 rows1 * last w8*", 260, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_90a", "k2048 W2048 rows1 * only w8", 340, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_90a", "k2048 W2048 rows1 * after-passes w8*", 128, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_90a", "k2048 W2048 rows1 * after-passes w16*", 16, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_100a", "k2048 W2048 rows1 * first w8", 200, _MERGE_BAR, "3.8*"),
    ("indexer.topk_merge", "sm_100a", "k2048 W2048 rows1 prefill middle w8", 84, _MERGE_SCAN, "3.8*"),
    ("indexer.topk_merge", "sm_100a", "k2048 W2048 rows1 * last w8*", 296, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_100a", "k2048 W2048 rows1 * only w8", 440, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_100a", "k2048 W2048 rows1 * after-passes w8*", 244, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "sm_100a", "k2048 W2048 rows1 * after-passes w16*", 32, _MERGE_FINAL, "3.8*"),
    ("indexer.topk_merge", "*", "k2048 W2048 rows1 * first w8", 80, _MERGE_BAR, "3.6*"),
    ("indexer.topk_merge", "*", "k2048 W2048 rows1 * last w8*", 212, _MERGE_FINAL, "3.6*"),
    ("indexer.topk_merge", "*", "k2048 W2048 rows1 * only w8", 392, _MERGE_FINAL, "3.6*"),
    ("indexer.topk_merge", "*", "k2048 W2048 rows1 * after-passes w8*", 56, _MERGE_FINAL, "3.6*"),
    ("indexer.topk_merge", "*", "k2048 W2048 rows1 prefill middle w8", 8, _MERGE_SCAN, "3.6*"),
    ("indexer.topk_merge", "sm_90a", "k512 W512 rows1 prefill * w2 values", 36,
     "the last chunk's sort of 512 keys in two warps beside the scan's prefetched block"),
    # Persistent GEMM: the masked (unaligned) epilogue builds a pointer per element (on sm_90a
    # it no longer spills since the per-tile clock read went under TRACE); the reduce-scatter
    # epilogues hold the accumulator while loading every peer's partial.
    ("tp.gemm", "sm_100a", "gemm * unaligned*", 100, "masked epilogue of an unaligned chunk"),
    ("tp.gemm", "sm_90a", "gemm * unaligned*", 256, "masked epilogue of an unaligned chunk", "3.6*"),
    ("tp.gemm", "*", "gemm_rs*", 2600, "reduce-scatter epilogue: accumulator plus peer partials", "3.8*"),
    ("tp.gemm", "*", "gemm_rs*", 2700, "reduce-scatter epilogue: accumulator plus peer partials", "3.6*"),
]
KNOWN_SPILLS = [KnownSpill(*e) for e in _ENTRIES]


def _for_this_triton() -> list[KnownSpill]:
    import triton

    return [e for e in KNOWN_SPILLS if fnmatch.fnmatch(triton.__version__, e.triton)]


def entries(kernel: str, target: str) -> list[KnownSpill]:
    """The entries of ``kernel`` whose target glob matches ``target``, for this Triton."""
    return [e for e in _for_this_triton() if e.kernel == kernel and fnmatch.fnmatch(target, e.target)]


def matching(report: KernelReport) -> list[KnownSpill]:
    """The entries that name the configuration of ``report``."""
    return [e for e in entries(report.kernel, report.target) if fnmatch.fnmatch(report.variant, e.configuration)]


def _spill_only(report: KernelReport, fails: list[str]) -> bool:
    # Spilled values live in local memory: the SASS's LDL/STL are the same finding as the spill.
    return report.ok and bool(report.spill_stores or report.spill_loads) and all(
        f.startswith("spills") or f.endswith("local-memory instructions (LDL/STL) in the SASS") for f in fails)


def accepted_by(report: KernelReport) -> list[KnownSpill]:
    """The entries that accept the failures of ``report``: empty when it passes every check or
    fails one that no entry accepts (another failure, or more spill than the largest budget)."""
    fails = checks.failures(report)
    known = matching(report)
    if not fails or not known or not _spill_only(report, fails):
        return []
    return known if report.spill_stores <= max(e.budget for e in known) else []


def stale(reports: list[KernelReport]) -> list[KnownSpill]:
    """Entries that name one of the compiled configurations yet accepted none of them: the
    configuration no longer fails (tighten or delete the entry)."""
    used = {e for r in reports for e in accepted_by(r)}
    named = {e for r in reports for e in matching(r)}
    return [e for e in KNOWN_SPILLS if e in named and e not in used]

