"""The assertions on a compiled kernel (what CI enforces for every registered variant).

For each :class:`~tilefuse.kernelcheck.compile.KernelReport`:

1. it compiled (TTIR through cubin);
2. no register spills and no other local memory (``ptxas``: 0 bytes spill stores/loads and
   no stack frame; SASS, when disassembled: no ``LDL``/``STL``);
3. shared memory within the target's per-block limit (227 KiB on sm_90 and sm_100), and
   on sm_100 tensor memory within its 512 columns;
4. if the kernel has a dot: every dot became the fast matrix instruction of the target —
   on sm_90a a ``warp_group_dot`` (PTX ``wgmma.mma_async``), on sm_100a a ``tc_gen5_mma``
   (PTX ``tcgen05.mma``) — with no ``tt.dot`` left for the ``mma.sync`` or FMA lowering, and
   no ``mma.sync`` in the PTX; a ``tl.dot_scaled`` on sm_100a must use the block-scaled
   ``tc_gen5_mma_scaled`` (not a dequantise-and-multiply fallback);
5. on sm_90a, when the SASS is disassembled: every PTX ``wgmma.mma_async`` is still there as a
   ``*GMMA`` instruction (ptxas deletes a wgmma whose result it believes unread, and the kernel
   then computes with whatever the registers held).
"""

from __future__ import annotations

from tilefuse.kernelcheck.compile import KernelReport

KIB = 1024
# Largest dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT = {"sm_90a": 227 * KIB, "sm_100a": 227 * KIB}
TMEM_COLUMNS = 512
# Per target: the TTGIR op of the fast MMA and the PTX instruction it lowers to.
FAST_MMA = {
    "sm_90a": (("ttng.warp_group_dot",), "wgmma"),
    "sm_100a": (("ttng.tc_gen5_mma", "ttng.tc_gen5_mma_scaled"), "tcgen05.mma"),
}


def has_dot(r: KernelReport) -> bool:
    return sum(r.dots.values()) > 0


def failures(r: KernelReport) -> list[str]:
    """What is wrong with one compiled variant (empty: all checks pass)."""
    if not r.ok:
        return [f"does not compile: {r.error}"]
    out = []
    if r.spill_stores or r.spill_loads:
        out.append(f"spills {r.spill_stores} B stored / {r.spill_loads} B loaded ({r.registers} registers)")
    if r.stack_frame and not (r.spill_stores or r.spill_loads):
        out.append(f"{r.stack_frame} B stack frame (local memory)")
    local = r.sass.get("LDL", 0) + r.sass.get("STL", 0)
    if local:
        out.append(f"{local} local-memory instructions (LDL/STL) in the SASS")
    limit = SHARED_LIMIT[r.target]
    if r.shared > limit:
        out.append(f"shared memory {r.shared} B exceeds the {limit} B limit of {r.target}")
    if r.target == "sm_100a" and (r.tmem_columns or 0) > TMEM_COLUMNS:
        out.append(f"tensor memory {r.tmem_columns} columns exceeds {TMEM_COLUMNS}")
    if has_dot(r):
        ops, ptx_name = FAST_MMA[r.target]
        left = r.lowered.get("tt.dot", 0) + r.lowered.get("tt.dot_scaled", 0)
        if left:
            out.append(f"{left} dot(s) not lowered to {' / '.join(ops)} (mma.sync or FMA fallback)")
        if not any(r.lowered.get(op, 0) for op in ops) or not r.ptx.get(ptx_name, 0):
            out.append(f"no {ptx_name} in the code of a kernel with {sum(r.dots.values())} dot(s)")
        if r.ptx.get("mma.sync", 0):
            out.append(f"{r.ptx['mma.sync']} mma.sync instruction(s): a dot fell off the {ptx_name} path")
        if r.target == "sm_100a" and r.dots.get("tt.dot_scaled", 0) and not r.lowered.get("ttng.tc_gen5_mma_scaled"):
            out.append("tl.dot_scaled did not become the block-scaled tcgen05 MMA (dequantised instead)")
        gmma = sum(n for op, n in r.sass_opcodes.items() if op.endswith("GMMA"))
        if r.target == "sm_90a" and r.sass_opcodes and gmma < r.ptx.get("wgmma", 0):
            out.append(f"ptxas dropped wgmma: {gmma} GMMA in the SASS for {r.ptx['wgmma']} wgmma in the PTX")
    return out
