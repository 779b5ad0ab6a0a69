"""Host cost of one Triton launch on this machine, by launch path (GPU only).

What the floor under an op's eager cost is made of: ``kernel[grid](...)`` (Triton's binder,
specialisation key, cache lookup, launcher), the compiled kernel's launcher called directly
(what is left once the key is known), each with and without host tensor descriptors, and a
CUDA-graph-free ``torch.empty`` for scale. Then the TP GEMM core's eager call at a small M
taken apart stage by stage (the whole call, the launch by key with its arguments built, the
partial launch given the call's three tensors, the direct C launch with its arguments
flattened, the flattening alone, Triton's own launcher for the same key) beside cuBLAS.
Back-to-back calls, host time per call without a sync (the GPU work is a few microseconds,
below the host time). At large M the GPU time is the larger and the launch queue fills part way
through a round: those rows are neither host time nor GPU time (``tilefuse.bench.suites.tp
host`` times that shape).

    python benchmarks/launch_cost.py [--calls 5000] [--tp-m 64] [--output launch-cost.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tilefuse.bench.env import environment


@triton.jit(do_not_specialize=["n", "m", "s0", "s1"])
def _ptr_kernel(a, b, c, d, n, m, s0, s1, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(a + offs, mask=mask, other=0.0) + tl.load(b + offs, mask=mask, other=0.0)
    tl.store(c + offs, x + m + s0 + s1, mask=mask)
    tl.store(d + offs, x, mask=mask)


@triton.jit(do_not_specialize=["n"])
def _desc_kernel(a_desc, b_desc, c, n, BLOCK: tl.constexpr, D: tl.constexpr):
    x = a_desc.load([tl.program_id(0) * BLOCK, 0]).to(tl.float32) + b_desc.load([0, 0]).to(tl.float32)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(c + rows[:, None] * D + tl.arange(0, D)[None, :], x, mask=rows[:, None] < n)


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def _direct(compiled, grid, args):
    """The compiled kernel's launcher with the bound arguments, as JITFunction.run ends."""
    launcher = compiled.run
    function, meta = compiled.function, compiled.packed_metadata
    get_stream = torch._C._cuda_getCurrentRawStream
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]

    def call():
        launcher(g0, g1, g2, get_stream(0), function, meta, None, None, None, *args)

    return call


def tp_gemm_rows(m: int, n: int, k: int, calls: int) -> dict:
    """Stages of one eager ``tilefuse.tp.gemm`` call at ``m x n x k`` (bf16), beside cuBLAS."""
    from tilefuse import _jit
    from tilefuse.tp import _gemm_core as core

    dev = "cuda"
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    b = torch.randn(k, n, device=dev).to(torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    launched = []
    real = core._gemm_launcher

    class Recording:  # the op's launcher, recording what it is asked to launch
        def __call__(self, key, grid, args, options):
            launched.append((key, grid, args, options))
            real(key, grid, args, options)

        def partial(self, key, grid, args, options=None, live=()):
            return real.partial(key, grid, args, options, live)

    core._gemm_launcher = Recording()
    try:
        for _ in range(3):  # compile, prove the direct call (the last call recorded), then a partial launch
            core.gemm(a, b, out)
    finally:
        core._gemm_launcher = real
    key, grid, args, options = launched[-1]
    tag = f"tp.gemm {m}x{n}x{k}"
    rows = {
        f"{tag}: whole call": _per_call_us(lambda: core.gemm(a, b, out), calls),
        f"{tag}: Launcher, arguments built": _per_call_us(lambda: real(key, grid, args, options), calls),
    }
    entry = real._compiled[key]
    run, function, meta = entry[3], entry[4], entry[5]
    partial = real.partial(key, grid, args, options, live=((0, 1), 2, (3, 4, 5)))
    if partial is not None:
        rows[f"{tag}: partial launch alone"] = _per_call_us(lambda: partial(a, b, out), calls)
    if isinstance(run, _jit._DirectLaunch):
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream = torch._C._cuda_getCurrentRawStream(0)
        flat = tuple(run.flatten(args))
        base = (g0, g1, g2, stream, function, run.coop, run.pdl, None, None, meta, None, None, None)
        rows[f"{tag}: C launcher, arguments flattened"] = _per_call_us(lambda: run.raw(*base, *flat), calls)
        rows[f"{tag}: flattening alone"] = _per_call_us(lambda: run.flatten(args), calls)
        rows[f"{tag}: Triton's launcher (no direct call)"] = _per_call_us(
            lambda: run.run(g0, g1, g2, stream, function, meta, None, None, None, *args), calls)
    rows[f"torch.matmul {m}x{n}x{k} (cuBLAS)"] = _per_call_us(lambda: torch.matmul(a, b, out=out), calls)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--tp-m", type=int, nargs="*", default=[64], help="M of the TP GEMM core rows (N 4096, K 1024)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    dev = "cuda"
    n, block, d = 4096, 128, 128
    x, y, z, w = (torch.randn(n, device=dev) for _ in range(4))
    grid = (triton.cdiv(n, block),)
    rows = {}

    ptr_args = (x, y, z, w, n, 3, 5, 7, block)
    ck = _ptr_kernel[grid](*ptr_args)
    rows["kernel[grid], 4 pointers + 4 ints"] = _per_call_us(lambda: _ptr_kernel[grid](*ptr_args), a.calls)
    rows["compiled launcher direct, same args"] = _per_call_us(_direct(ck, grid, ptr_args), a.calls)

    k8 = torch.randn(n, d, device=dev).to(torch.float8_e4m3fn)
    out = torch.empty(n, d, device=dev)

    def descs():
        return (TensorDescriptor(k8, [n, d], [d, 1], [block, d]), TensorDescriptor(k8, [n, d], [d, 1], [block, d]))

    a_desc, b_desc = descs()
    ck = _desc_kernel[grid](a_desc, b_desc, out, n, block, d)
    rows["kernel[grid], 2 host descriptors (reused)"] = _per_call_us(
        lambda: _desc_kernel[grid](a_desc, b_desc, out, n, block, d), a.calls)
    rows["kernel[grid], 2 host descriptors built per call"] = _per_call_us(
        lambda: _desc_kernel[grid](*descs(), out, n, block, d), a.calls)
    rows["compiled launcher direct, 2 host descriptors"] = _per_call_us(
        _direct(ck, grid, (a_desc, b_desc, out, n, block, d)), a.calls)
    rows["TensorDescriptor() x2"] = _per_call_us(descs, a.calls)
    rows["torch.empty(128, 4096)"] = _per_call_us(lambda: torch.empty(128, 4096, device=dev), a.calls)
    rows["current raw stream"] = _per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0), a.calls)
    for m in a.tp_m:
        rows.update(tp_gemm_rows(m, 4096, 1024, a.calls))

    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:7.2f} us")
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"environment": environment(), "host_us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
