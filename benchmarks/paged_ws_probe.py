"""Probe for the next decode design: a warp-specialised Hopper key loop in Gluon.

The decode kernels spend ~1 us a key tile that is not the MMA (benchmarks/NOTES.md, "Decode:
how DeepGEMM's SM90 kernel is built"). DeepGEMM's kernel gives the TMA issue to producer
warps and keeps the math warps' loop free of CTA barriers. This probe is that loop alone, on
contiguous FP8 keys: a 1-warp worker partition issues the TMA of each 64-key tile into a ring
of ``NUM_BUF`` buffers (an empty and a ready mbarrier each), the 4-warp default partition
waits for a tile, runs its wgmma against the queries held in shared memory, frees the buffer,
and stores the ReLU'd, weighted head sums from registers. Without a GPU it compiles the probe
for sm_90a with the installed Triton and prints registers and spills; with one it also checks
the result against torch and times one program walking ``--tiles`` tiles, beside the same loop
without the worker partition (the math warps refilling the ring themselves, as the decode
kernels do): the time a tile of each is the figure to set beside the decode program's
~0.65-1 us (NOTES, third round of 2026-12-02).

    python benchmarks/paged_ws_probe.py [--tiles 2048] [--buffers 4]
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_N, D, COLS = 64, 128, 64  # keys a tile, head dim, (row, head) columns


@gluon.jit
def _issue(k_desc, k_bufs, ready, buf, tile):
    """The TMA of key tile ``tile`` into ring buffer ``buf``, completing on ``ready[buf]``."""
    mbarrier.expect(ready.index(buf), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [tile * k_desc.block_type.shape[0], 0], ready.index(buf),
                                    k_bufs.index(buf))


@gluon.jit
def _ring(k_desc, NUM_BUF: gl.constexpr):
    """``NUM_BUF`` key buffers and a barrier each that a fill completes."""
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_type.shape, k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
    return k_bufs, ready


@gluon.jit
def _staged_queries(q_ptr, dtype: gl.constexpr, NC: gl.constexpr, DK: gl.constexpr, num_warps: gl.constexpr):
    """The queries ([NC, DK], (row, head) pairs) in shared memory, once: the MMA's B operand."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    rows = gl.arange(0, NC, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, DK, layout=gl.SliceLayout(0, blocked))
    q = gl.load(q_ptr + rows[:, None] * DK + cols[None, :])
    q_smem = gl.allocate_shared_memory(dtype, [NC, DK], gl.NVMMASharedLayout.get_default_for([NC, DK], dtype), q)
    fence_async_shared()
    return q_smem


@gluon.constexpr_function
def _mma_layout(nc):
    """The scores' layout: one warpgroup's wgmma over ``nc`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nc, 32])


@gluon.jit
def _weights(w_ptr, NC: gl.constexpr):
    """The columns' weights, once, in the scores' column layout."""
    return gl.load(w_ptr + gl.arange(0, NC, layout=gl.SliceLayout(0, _mma_layout(NC))))


@gluon.jit
def _scores(k_buf, q_smem, BN: gl.constexpr, NC: gl.constexpr):
    """One tile's scores [BN keys, NC columns] (the wgmma, waited for)."""
    s = warpgroup_mma(k_buf, q_smem.permute((1, 0)), gl.zeros([BN, NC], gl.float32, _mma_layout(NC)), use_acc=False,
                      is_async=True)
    return warpgroup_mma_wait(0, deps=[s])


@gluon.jit
def _store_head_sums(s, w, out_ptr, tile, BN: gl.constexpr):
    """The tile's ReLU'd, weighted sums over its columns, stored from the MMA layout."""
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s.type.layout))
    gl.store(out_ptr + tile * BN + keys, gl.sum(gl.maximum(s, 0.0) * w[None, :], axis=1))


@gluon.jit
def _load_partition(k_desc, k_bufs, ready, empty, n_tiles, NUM_BUF: gl.constexpr):
    for t in range(n_tiles):
        buf = t % NUM_BUF
        # A buffer's first fill waits for nothing (phase 1 of a fresh barrier has completed).
        mbarrier.wait(empty.index(buf), ((t // NUM_BUF) & 1) ^ 1)
        _issue(k_desc, k_bufs, ready, buf, t)


@gluon.jit
def _math_partition(q_smem, w_ptr, out_ptr, k_bufs, ready, empty, n_tiles, NUM_BUF: gl.constexpr,
                    BN: gl.constexpr, NC: gl.constexpr):
    w = _weights(w_ptr, NC)
    for t in range(n_tiles):
        buf = t % NUM_BUF
        mbarrier.wait(ready.index(buf), (t // NUM_BUF) & 1)
        s = _scores(k_bufs.index(buf), q_smem, BN, NC)
        mbarrier.arrive(empty.index(buf), count=1)
        _store_head_sums(s, w, out_ptr, t, BN)


@gluon.jit
def ws_probe_kernel(k_desc, q_ptr, w_ptr, out_ptr, n_tiles, NUM_BUF: gl.constexpr, NC: gl.constexpr,
                    num_warps: gl.constexpr):
    BN: gl.constexpr = k_desc.block_type.shape[0]
    k_bufs, ready = _ring(k_desc, NUM_BUF)
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(empty.index(i), count=1)
    q_smem = _staged_queries(q_ptr, k_desc.dtype, NC, k_desc.block_type.shape[1], num_warps)
    gl.warp_specialize([(_math_partition, (q_smem, w_ptr, out_ptr, k_bufs, ready, empty, n_tiles, NUM_BUF, BN, NC)),
                        (_load_partition, (k_desc, k_bufs, ready, empty, n_tiles, NUM_BUF))], [1], [24])


@gluon.jit
def one_partition_probe_kernel(k_desc, q_ptr, w_ptr, out_ptr, n_tiles, NUM_BUF: gl.constexpr, NC: gl.constexpr,
                               num_warps: gl.constexpr):
    """The same loop without the worker partition (the decode kernels' way): the math warps
    issue each refill themselves, ``NUM_BUF`` tiles ahead."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    k_bufs, ready = _ring(k_desc, NUM_BUF)
    q_smem = _staged_queries(q_ptr, k_desc.dtype, NC, k_desc.block_type.shape[1], num_warps)
    for i in gl.static_range(NUM_BUF):
        if i < n_tiles:
            _issue(k_desc, k_bufs, ready, i, i)
    w = _weights(w_ptr, NC)
    for t in range(n_tiles):
        buf = t % NUM_BUF
        mbarrier.wait(ready.index(buf), (t // NUM_BUF) & 1)
        s = _scores(k_bufs.index(buf), q_smem, BN, NC)
        if t + NUM_BUF < n_tiles:
            _issue(k_desc, k_bufs, ready, buf, t + NUM_BUF)
        _store_head_sums(s, w, out_ptr, t, BN)


KERNELS = {"warp-specialised": ws_probe_kernel, "one partition": one_partition_probe_kernel}


def launch(kernel, k: torch.Tensor, q: torch.Tensor, w: torch.Tensor, out: torch.Tensor, num_buf: int) -> None:
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float8e4nv)
    k_desc = TensorDescriptor.from_tensor(k, [BLOCK_N, D], layout)
    kernel[(1,)](k_desc, q, w, out, k.shape[0] // BLOCK_N, num_buf, COLS, num_warps=4)


def compile_report(name: str, num_buf: int) -> str:
    """Compile a probe for sm_90a on any machine (no launch): registers, spills, shared memory."""
    from tilefuse.kernelcheck.compile import compile_variant
    from tilefuse.kernelcheck.variants import Variant

    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float8e4nv)
    sig = {"k_desc": f"tensordesc<fp8e4nv[{BLOCK_N}, {D}],{layout!r}>", "q_ptr": "*fp8e4nv", "w_ptr": "*fp32",
           "out_ptr": "*fp32", "n_tiles": "i32"}
    variant = Variant("probe", f"{name} {num_buf} buffers", f"{__name__}:{KERNELS[name].fn.__name__}", sig,
                      {"NUM_BUF": num_buf, "NC": COLS, "num_warps": 4}, 4, 3, ("q_ptr", "w_ptr", "out_ptr"),
                      ("sm_90a",), "option")
    r = compile_variant(variant, "sm_90a", sass=False)
    if r.error:
        return f"{name}: does not compile for sm_90a: {r.error}"
    return (f"{name}: compiled for sm_90a, registers {r.registers}, spills {r.spill_stores} B stored, shared "
            f"{r.shared} B, wgmma {r.ptx.get('wgmma')}, {r.compile_seconds:.1f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=2048)
    ap.add_argument("--buffers", type=int, default=4)
    args = ap.parse_args(argv)
    for name in KERNELS:
        print(compile_report(name, args.buffers), flush=True)
    if not torch.cuda.is_available():
        return 0
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(args.tiles * BLOCK_N, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    q = torch.randn(COLS, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(COLS, device="cuda", generator=g)
    ref = (torch.relu(k.float() @ q.float().T) * w).sum(dim=1)
    failed = False
    for name, kernel in KERNELS.items():
        out = torch.full((k.shape[0],), float("nan"), device="cuda")
        launch(kernel, k, q, w, out, args.buffers)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        failed |= not err < 1e-3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            launch(kernel, k, q, w, out, args.buffers)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 100  # per launch, microseconds
        print(f"{name}: one program, {args.tiles} tiles of {BLOCK_N} keys: {us:.1f} us, "
              f"{us * 1e3 / args.tiles:.0f} ns a tile; max relative error {err:.1e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
