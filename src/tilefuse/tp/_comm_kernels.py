"""Communication kernels of the fused TP GEMMs (run on a side stream beside the GEMM).

* ``_barrier_kernel``: one program; all ranks meet (``_primitives.barrier_all``), then the
  kernel raises the local go words that let this call's GEMM / communication kernel write into
  peers' buffers (the peers have finished reading them in the previous call).
* ``_ag_push_kernel``: ag_gemm, SM-driven gather. ``P`` programs copy the local shard, band by
  band and piece by piece, into the gathered buffer of every rank (own included unless
  ``LOCAL`` is off: then copy engines stage it) and add one to that band's flag on the
  destination; the destination's GEMM waits for ``pieces`` per band.
  Program 0 runs the start barrier first; programs wait for its go word before a remote store.

Each kernel's last program resets the flags it consumed and its go word (``finish_program``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tilefuse.tp import _primitives as P


@triton.jit
def _barrier_kernel(bases_ptr, ws_addr: tl.int64, err_addr: tl.int64, timeout, rank, W: tl.constexpr, OP: tl.constexpr,
                    SET_GO_GEMM: tl.constexpr, SET_GO_COMM: tl.constexpr, USE_TIMER: tl.constexpr):
    ctl_ptr = ws_addr.to(tl.pointer_type(tl.int32))
    err_ptr = err_addr.to(tl.pointer_type(tl.int32))
    P.barrier_all(bases_ptr, ctl_ptr, err_ptr, timeout, rank, OP, W, USE_TIMER)
    if SET_GO_GEMM:
        tl.atomic_xchg(ctl_ptr + P.CTL_GO_GEMM, 1, sem="release", scope="gpu")
    if SET_GO_COMM:
        tl.atomic_xchg(ctl_ptr + P.CTL_GO_COMM, 1, sem="release", scope="gpu")


@triton.jit
def _copy_block(src, src_row0, dst, dst_row0, rows, col0, cols, ld, BR: tl.constexpr, BC: tl.constexpr):
    """Copy ``rows x cols`` elements (row stride ``ld`` on both sides) in ``BR x BC`` blocks."""
    ri = tl.arange(0, BR)
    ci = tl.arange(0, BC)
    for r in range(0, rows, BR):
        for c in range(0, cols, BC):
            mask = ((r + ri)[:, None] < rows) & ((c + ci)[None, :] < cols)
            cc = (col0 + c + ci)[None, :]
            v = tl.load(src + (src_row0 + r + ri)[:, None].to(tl.int64) * ld + cc, mask=mask)
            tl.store(dst + (dst_row0 + r + ri)[:, None].to(tl.int64) * ld + cc, v, mask=mask)


@triton.jit(do_not_specialize=("Mc", "bands", "rank", "timeout"))  # no compile per M (as _persistent_gemm)
def _ag_push_kernel(
    a_ptr, ws_addr: tl.int64, bases_ptr, gath_off, flags_off, Mc, K, band_rows, bands, pieces, piece_cols, rank,
    err_addr: tl.int64, timeout, trace_ptr,
    W: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    BARRIER: tl.constexpr, TRACE: tl.constexpr, MAX_EVENTS: tl.constexpr, USE_TIMER: tl.constexpr,
    LOCAL: tl.constexpr = True,
):
    pid = tl.program_id(0)
    DTYPE = a_ptr.dtype.element_ty
    ctl_ptr = ws_addr.to(tl.pointer_type(tl.int32))
    err_ptr = err_addr.to(tl.pointer_type(tl.int32))
    if BARRIER:
        if pid == 0:
            P.barrier_all(bases_ptr, ctl_ptr, err_ptr, timeout, rank, 1, W, USE_TIMER)
            tl.atomic_xchg(ctl_ptr + P.CTL_GO_COMM, 1, sem="release", scope="gpu")
    go_ok = 0
    dead = 0  # the start barrier failed: no store into a peer's buffers (it may not exist any more)
    first = 0 if LOCAL else 1  # destinations rank + first, ..., rank + W - 1
    per_band = (W - first) * pieces
    n_items = bands * per_band
    ev = 0
    for it in range(pid, n_items, NUM_PROGRAMS):
        b = it // per_band
        s = first + (it % per_band) // pieces
        q = it % pieces
        dst_rank = (rank + s) % W
        t_start = P.now_ns(USE_TIMER)
        wait_ns = t_start - t_start
        if s != 0:
            if go_ok == 0:
                P.wait_geq(ctl_ptr + P.CTL_GO_COMM, 1, ctl_ptr, err_ptr, timeout, rank, 1, P.ROLE_PUSH, dst_rank,
                           -1, USE_TIMER)
                go_ok = 1
                dead = P.read_word(ctl_ptr + P.CTL_ABORT)  # the wait may have ended by abort
                wait_ns = P.now_ns(USE_TIMER) - t_start
        if (s == 0) | (dead == 0):
            dst = P.peer_ptr(bases_ptr, dst_rank, gath_off, DTYPE)
            row0 = b * band_rows
            rows = tl.minimum(band_rows, Mc - row0)
            col0 = q * piece_cols
            cols = tl.minimum(piece_cols, K - col0)
            _copy_block(a_ptr, row0, dst, rank * Mc + row0, rows, col0, cols, K, BR, BC)
            P.add_flag(P.peer_ptr(bases_ptr, dst_rank, flags_off, tl.int32) + rank * bands + b, 1)
        if TRACE:
            info = (dst_rank.to(tl.int64) << 40) | (b.to(tl.int64) << 20) | q
            P.trace_event(trace_ptr, pid, ev, MAX_EVENTS, t_start, t_start + wait_ns, P.now_ns(USE_TIMER), wait_ns,
                          info)
        ev += 1
    P.finish_program(ctl_ptr, P.CTL_DONE_COMM, P.CTL_GO_COMM, NUM_PROGRAMS,
                     P.as_ptr(ws_addr + flags_off, tl.int32), 0, 16)
