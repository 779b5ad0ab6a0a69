"""Triton building blocks shared by the fused TP kernels: clocks, bounded waits, signals, traces.

Every cross-GPU wait here is bounded. On a timeout the waiting program claims the error
record once (rank, op, role, chunk, index, observed and expected flag values), raises the
workspace's abort word so every other wait of every kernel returns at once, and carries on
without the data; the host turns the record into ``CommTimeoutError``. Nothing traps, so the
CUDA context survives a stalled peer.

Every branch a wait takes is the same for all threads of a program: Triton broadcasts a scalar
atomic's result through shared memory behind a CTA barrier, so a program whose threads took
different sides of a branch (one thread's timer past the limit, another's not; one thread's
load of the abort word before a peer program's store, another's after) would meet different
barriers and hang. Words that change under a program are read with ``read_word`` (one load,
broadcast), and the timer's verdict goes through ``cta_any`` (a CTA-wide OR).

Layout of the control words at the start of each workspace (int32 indices); ``symm.py``
builds the workspaces, the kernels only see these offsets.
"""

from __future__ import annotations

import triton
import triton.language as tl

# int32 word indices of the control region (first 64 bytes of a workspace). Globals read by
# kernels must be constexpr objects; host code reads ``.value``.
CTL_ABORT = tl.constexpr(0)  # sticky: a wait timed out; every later wait returns at once
CTL_CLAIM = tl.constexpr(1)  # the first timed-out program claims the error record
CTL_GO_GEMM = tl.constexpr(2)  # set by the start barrier: the GEMM may read flags / push
CTL_GO_COMM = tl.constexpr(3)  # same, for the communication kernel of the call
CTL_DONE_GEMM = tl.constexpr(4)  # GEMM programs that finished (the last one resets flags)
CTL_DONE_COMM = tl.constexpr(5)  # communication programs that finished
CTL_WORDS = 16
SIG_OFFSET = tl.constexpr(64)  # bytes: W int32 barrier slots, written by peers
FLAGS_OFFSET = 128  # bytes: per-chunk / per-tile flags

# Error record (int32[8], host-visible): code, rank, op, role, chunk, index, observed, expected.
ERR_WORDS = 8
OP_CODES = {"gemm": 0, "ag_gemm": 1, "gemm_rs": 2}
ROLE_BARRIER = tl.constexpr(1)
ROLE_GEMM = tl.constexpr(2)  # a GEMM tile waiting for its rows (ag_gemm) or peer partials (gemm_rs)
ROLE_GO = tl.constexpr(3)  # a kernel waiting for the start barrier of its call
ROLE_PUSH = tl.constexpr(4)  # the ag_gemm push kernel waiting for the start barrier
ROLE_NAMES = {1: "barrier", 2: "gemm", 3: "go", 4: "push"}
# Spins between two looks at the clock and the abort word: each look costs two CTA barriers
# and an L2 round trip that would otherwise delay noticing the flag.
EXPIRY_EVERY = tl.constexpr(4)
TRACE_FIELDS = tl.constexpr(5)  # per event: start ns, split ns, end ns, wait ns, info


@triton.jit
def now_ns(USE_TIMER: tl.constexpr):
    """%globaltimer in ns on a GPU; 0 in the interpreter (which has no inline asm)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def fence_proxy_async(USE_TIMER: tl.constexpr):
    """Order generic-proxy acquires before the TMA (async-proxy) reads that follow them."""
    if USE_TIMER:  # a real GPU; the interpreter has no proxies and no inline asm
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def read_word(ptr):
    """``*ptr`` (relaxed, gpu scope), one value for every thread of the program (see the module
    note: a volatile load is made by each thread and may differ between them)."""
    return tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def cta_any(pred, USE_TIMER: tl.constexpr):
    """1 if ``pred`` holds in any thread of the program, else 0 (``bar.red.or``; every thread
    must reach it). In the interpreter a program is one thread: ``pred`` itself."""
    if USE_TIMER:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r", [pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )
    else:
        r = pred.to(tl.int32)
    return r


@triton.jit
def _record_timeout(ctl_ptr, err_ptr, rank, op, role, chunk, index, observed, expected):
    claimed = tl.atomic_cas(ctl_ptr + CTL_CLAIM, 0, 1, sem="acq_rel", scope="gpu")
    if claimed == 0:
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, op)
        tl.store(err_ptr + 3, role)
        tl.store(err_ptr + 4, chunk)
        tl.store(err_ptr + 5, index)
        tl.store(err_ptr + 6, observed)
        tl.store(err_ptr + 7, expected)
        tl.store(err_ptr + 0, 1)
    tl.atomic_xchg(ctl_ptr + CTL_ABORT, 1, sem="release", scope="gpu")


@triton.jit
def _expired(t0, spins, timeout, ctl_ptr, USE_TIMER: tl.constexpr):
    """(the wait is over, the abort word), both uniform over the program's threads."""
    if USE_TIMER:
        late = cta_any(now_ns(USE_TIMER) - t0 > timeout, USE_TIMER)
    else:
        late = (spins > timeout).to(tl.int32)
    aborted = read_word(ctl_ptr + CTL_ABORT)
    return (late != 0) | (aborted != 0), aborted


@triton.jit
def wait_geq(ptr, target, ctl_ptr, err_ptr, timeout, rank, op, role, chunk, index, USE_TIMER: tl.constexpr):
    """Spin until ``*ptr >= target`` (acquire, system scope), bounded by ``timeout``
    (ns on a GPU, spins in the interpreter) and by the workspace's abort word."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    if v < target:
        t0 = now_ns(USE_TIMER)
        spins = t0 - t0
        while v < target:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
            spins += 1
            if (v < target) & (spins % EXPIRY_EVERY == 0):
                expired, aborted = _expired(t0, spins, timeout, ctl_ptr, USE_TIMER)
                if expired:
                    if aborted == 0:
                        _record_timeout(ctl_ptr, err_ptr, rank, op, role, chunk, index, v, target)
                    v = v * 0 + target


@triton.jit
def cas_bounded(ptr, cmp, val, ctl_ptr, err_ptr, timeout, rank, op, role, chunk, USE_TIMER: tl.constexpr):
    """Spin until ``*ptr`` goes ``cmp -> val`` (acq_rel, system scope), bounded as ``wait_geq``."""
    old = tl.atomic_cas(ptr, cmp, val, sem="acq_rel", scope="sys")
    if old != cmp:
        t0 = now_ns(USE_TIMER)
        spins = t0 - t0
        while old != cmp:
            old = tl.atomic_cas(ptr, cmp, val, sem="acq_rel", scope="sys")
            spins += 1
            if (old != cmp) & (spins % EXPIRY_EVERY == 0):
                expired, aborted = _expired(t0, spins, timeout, ctl_ptr, USE_TIMER)
                if expired:
                    if aborted == 0:
                        _record_timeout(ctl_ptr, err_ptr, rank, op, role, chunk, -1, old, cmp)
                    old = old * 0 + cmp


@triton.jit
def as_ptr(addr, DTYPE: tl.constexpr):
    """int64 address -> pointer. Workspace regions are 16-byte aligned; the cast drops what the
    compiler knows about alignment, so restate it: tile loads/stores then use 16-byte vectors."""
    return tl.multiple_of(addr.to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def peer_ptr(bases_ptr, peer, byte_offset, DTYPE: tl.constexpr):
    """Pointer to ``byte_offset`` (16-byte aligned) inside rank ``peer``'s workspace."""
    return as_ptr(tl.load(bases_ptr + peer) + byte_offset, DTYPE)


@triton.jit
def barrier_all(bases_ptr, ctl_ptr, err_ptr, timeout, rank, op, W: tl.constexpr, USE_TIMER: tl.constexpr):
    """All ranks of the workspace meet (one program). Each rank raises its slot in every peer's
    signal array (0 -> 1, waiting while the peer has not consumed the last one), then consumes
    the slot each peer raised in its own array (1 -> 0). Self-resetting, so back-to-back
    barriers and CUDA-graph replays need no host work."""
    sig_local = peer_ptr(bases_ptr, rank, SIG_OFFSET, tl.int32)
    for s in tl.static_range(1, W):
        peer = (rank + s) % W
        remote = peer_ptr(bases_ptr, peer, SIG_OFFSET, tl.int32)
        cas_bounded(remote + rank, 0, 1, ctl_ptr, err_ptr, timeout, rank, op, ROLE_BARRIER, peer, USE_TIMER)
    for s in tl.static_range(1, W):
        peer = (rank + s) % W
        cas_bounded(sig_local + peer, 1, 0, ctl_ptr, err_ptr, timeout, rank, op, ROLE_BARRIER, peer, USE_TIMER)


@triton.jit
def bulk_stores_done(USE_TIMER: tl.constexpr):
    """Wait until this program's TMA stores have been written (not only read out of shared
    memory, which is all a descriptor store waits for) and order them before the generic-proxy
    flag that follows. The thread that issued them waits; the others pass."""
    if USE_TIMER:  # a real GPU; the interpreter's stores are done when they return
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1,
        )


@triton.jit
def set_flag(ptr, value):
    """Publish the calling program's earlier writes, then set a flag (release, system scope).
    The CTA barrier makes every thread's stores part of what thread 0's release covers."""
    tl.debug_barrier()
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def add_flag(ptr, value):
    """As ``set_flag`` but adds: a band written by several programs counts their pieces."""
    tl.debug_barrier()
    tl.atomic_add(ptr, value, sem="release", scope="sys")


@triton.jit
def finish_program(ctl_ptr, done_idx, go_idx, num_programs, flags_ptr, n_flags, ZERO_BLOCK: tl.constexpr):
    """Count finished programs; the last one resets the flags this kernel consumed, its go word
    and the counter, so the next call (stream-ordered after this kernel) starts clean."""
    tl.debug_barrier()
    prev = tl.atomic_add(ctl_ptr + done_idx, 1, sem="acq_rel", scope="gpu")
    if prev == num_programs - 1:
        offs = tl.arange(0, ZERO_BLOCK)
        for start in range(0, n_flags, ZERO_BLOCK):
            tl.store(flags_ptr + start + offs, tl.zeros([ZERO_BLOCK], tl.int32), mask=start + offs < n_flags)
        tl.atomic_xchg(ctl_ptr + go_idx, 0, sem="release", scope="gpu")
        tl.atomic_xchg(ctl_ptr + done_idx, 0, sem="release", scope="gpu")


@triton.jit
def trace_event(trace_ptr, pid, idx, MAX_EVENTS: tl.constexpr, t_start, t_split, t_end, wait_ns, info):
    """Record one event of program ``pid``: start, split (a GEMM tile: its main loop done, the
    epilogue next; a copied item: its waits done, the copy next) and end ns, ns spent waiting,
    info. Events past ``MAX_EVENTS`` in a program are dropped."""
    if idx < MAX_EVENTS:
        base = trace_ptr + (pid * MAX_EVENTS + idx) * TRACE_FIELDS
        tl.store(base + 0, t_start)
        tl.store(base + 1, t_split)
        tl.store(base + 2, t_end)
        tl.store(base + 3, wait_ns.to(tl.int64))
        tl.store(base + 4, info.to(tl.int64))


def use_timer(device_type: str) -> bool:
    """Kernels read %globaltimer on a GPU; the interpreter counts spins instead."""
    return device_type == "cuda"


def timeout_units(timeout_s: float, device_type: str, interpreter_spins: int = 2000) -> int:
    """The ``timeout`` argument of the waits: ns on a GPU, a spin count in the interpreter."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    return int(timeout_s * 1e9) if use_timer(device_type) else interpreter_spins
