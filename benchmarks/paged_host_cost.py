"""Per-call cost of the paged decode ops as a serving engine calls them (issue: host cost).

Eager, back to back, default settings: ``calls`` launches timed on the host wall clock and
divided, the best of three rounds (the GPU work of a B = 32, ctx 4096 call is a few
microseconds, so the host and launch path bounds it); the metadata op the same way, and its
GPU time inside a CUDA graph of ``calls`` replays; each again with the batch size and
max_context_len new every call (a decode loop past its captured graphs). DeepGEMM in the
same run when ``import deep_gemm`` works. Then the compiles seen over 12 random (B,
max_context_len) pairs after the warm-up calls.

    python benchmarks/paged_host_cost.py --output paged-host-cost.json

Without a GPU it runs a few calls through the interpreter (the numbers then say nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tilefuse  # noqa: E402
from tilefuse import formats as F  # noqa: E402
from tilefuse.indexer import _paged_kernel as kern  # noqa: E402
from tilefuse.indexer import paged  # noqa: E402

H, D, BLOCK_KV = 64, 128, 64


def inputs(fmt: str, batch: int, ctx: int, next_n: int, device: str):
    g = torch.Generator().manual_seed(0)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    keys = torch.randn(batch, ctx, D, generator=g).to(torch.bfloat16).to(device)
    cache, table = paged.make_paged_kv_cache(keys, lens.to(device), BLOCK_KV, fmt, generator=g)
    qq = tuple(None if t is None else t.to(device)
               for t in F.quantize_q(torch.randn(batch, next_n, H, D, generator=g), fmt))
    w = torch.randn(batch * next_n, H, generator=g).to(device)
    return qq, cache, w, lens.to(device), table


def host_setup():
    """``(gpu, device, sync, num_sms, deep_gemm module or None)`` of this machine, for the
    host-cost scripts (on CPU: the interpreter's device, no sync, 8 workers)."""
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 8
    try:
        import deep_gemm
    except ImportError:
        deep_gemm = None
    return gpu, "cuda" if gpu else "cpu", sync, num_sms, deep_gemm


def per_call_us(fn, calls: int, sync, rounds: int = 3) -> float:
    """Wall time per call of ``calls`` back-to-back calls after a sync, the best of ``rounds``."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def alternating(ours, theirs, calls: int, sync, rounds: int = 7) -> dict:
    """Host time per call of two calls timed in alternating rounds of ``calls`` back-to-back
    calls (the order swapped every round, a sync before each), so that the host's drift over
    the run reaches both alike: each one's best round and the median of the rounds' ratios
    ours / theirs (the figure that holds from host to host)."""
    ours(), theirs()
    best, ratios = [float("inf")] * 2, []
    for r in range(rounds):
        times = [0.0, 0.0]
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = (ours, theirs)[i]
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[i] = (time.perf_counter() - t0) / calls * 1e6
        best = [min(b, t) for b, t in zip(best, times)]
        ratios.append(times[0] / times[1])
    sync()
    return {"ours_us": best[0], "theirs_us": best[1], "ratio_median": statistics.median(ratios),
            "ratios": ratios}


def graph_gpu_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def compiled_count(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in getattr(kernel, "cache", {}).values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--calls", type=int, default=None)
    args = ap.parse_args(argv)
    gpu, device, sync, num_sms, deep_gemm = host_setup()
    calls = args.calls or (200 if gpu else 2)
    batch, ctx = (32, 4096) if gpu else (2, 96)
    rows = []

    def record(name, us, **extra):
        rows.append({"name": name, "us": us, **extra})
        print(f"{name:56s} {us:9.1f} us", flush=True)

    def against_peer(name, ours, theirs):
        if gpu:
            pair = alternating(ours, theirs, calls, sync)
            label = f"{name}: tilefuse / deep_gemm, alternating rounds (median)"
            rows.append({"name": label, "ratio": pair["ratio_median"], **pair})
            print(f"{label} {pair['ratio_median']:.2f}", flush=True)

    def measure(fmt: str):
        qq, cache, w, lens, table = inputs(fmt, batch, ctx, 1, device)
        lens = lens.reshape(batch, 1).contiguous()  # 2-D lengths: DeepGEMM's metadata takes only those
        meta = tilefuse.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms)
        out = torch.empty(batch, ctx, device=device)
        record(f"tilefuse {fmt} B{batch} ctx{ctx} eager", per_call_us(
            lambda: tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, lens, table, meta, ctx), calls, sync))
        record(f"tilefuse {fmt} B{batch} ctx{ctx} eager out=", per_call_us(
            lambda: tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, lens, table, meta, ctx, out=out), calls, sync))
        if fmt == "fp8" and deep_gemm is not None:
            dg_meta = deep_gemm.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms)
            record(f"deep_gemm {fmt} B{batch} ctx{ctx} eager", per_call_us(
                lambda: deep_gemm.fp8_paged_mqa_logits(qq[0], cache, w, lens, table, dg_meta, ctx, False), calls,
                sync))
            against_peer(f"{fmt} B{batch} ctx{ctx} eager",
                         lambda: tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, lens, table, meta, ctx),
                         lambda: deep_gemm.fp8_paged_mqa_logits(qq[0], cache, w, lens, table, dg_meta, ctx, False))
        # A decode loop past its captured batch sizes: B (within 8 of ``batch``, one of DeepGEMM's
        # 32-request metadata classes) and max_context_len new every call, views made beforehand.
        b_lo = max(1, batch - 7)
        views = {b: (tuple(None if t is None else t[:b] for t in qq), w[:b], lens[:b], table[:b],
                     tilefuse.get_paged_mqa_logits_metadata(lens[:b], BLOCK_KV, num_sms))
                 for b in range(b_lo, batch + 1)}
        steps = itertools.count()

        def ours():
            i = next(steps)
            q_, w_, lens_, table_, meta_ = views[b_lo + i % (batch - b_lo + 1)]
            tilefuse.fp8_fp4_paged_mqa_logits(q_, cache, w_, lens_, table_, meta_, ctx + i)

        name = f"B{b_lo}-{batch} ctx{ctx}, B and max_context_len new every call"
        record(f"tilefuse {fmt} {name}", per_call_us(ours, calls, sync))
        if fmt == "fp8" and deep_gemm is not None:
            dg_metas = {b: deep_gemm.get_paged_mqa_logits_metadata(v[2], BLOCK_KV, num_sms) for b, v in views.items()}
            dg_steps = itertools.count()

            def theirs():
                i = next(dg_steps)
                b = b_lo + i % (batch - b_lo + 1)
                q_, w_, lens_, table_, _ = views[b]
                deep_gemm.fp8_paged_mqa_logits(q_[0], cache, w_, lens_, table_, dg_metas[b], ctx + i, False)

            record(f"deep_gemm {fmt} {name}", per_call_us(theirs, calls, sync))
            against_peer(f"{fmt} {name}", ours, theirs)
        return lens, views

    for fmt in ("fp8", "mxfp8", "mxfp4"):
        lens, views = measure(fmt)
    record(f"tilefuse metadata B{batch} eager", per_call_us(
        lambda: tilefuse.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms), calls, sync))
    if deep_gemm is not None:
        record(f"deep_gemm metadata B{batch} eager", per_call_us(
            lambda: deep_gemm.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms), calls, sync))
    batches = [v[2] for v in views.values()]
    for name, fn in (("tilefuse", tilefuse.get_paged_mqa_logits_metadata),
                     ("deep_gemm", deep_gemm and deep_gemm.get_paged_mqa_logits_metadata)):
        if fn is not None:
            steps = itertools.count()
            record(f"{name} metadata B{min(views)}-{batch} eager, B new every call", per_call_us(
                lambda fn=fn, steps=steps: fn(batches[next(steps) % len(batches)], BLOCK_KV, num_sms), calls, sync))
    if gpu:
        record(f"tilefuse metadata B{batch} GPU time in a graph", graph_gpu_us(
            lambda: tilefuse.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms), 20))
        if deep_gemm is not None:
            record(f"deep_gemm metadata B{batch} GPU time in a graph", graph_gpu_us(
                lambda: deep_gemm.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms), 20))

    # Compiles after warm-up over random shapes (one model configuration).
    for call in paged.warmup_calls("fp8", H, D, BLOCK_KV, 1, torch.float32, torch.float32, False, device):
        call()
    before = compiled_count(kern.paged_logits_kernel) + compiled_count(kern.paged_schedule_kernel)
    g = random.Random(1)
    firsts = []
    for _ in range(12 if gpu else 2):
        b = g.choice((1, 2, 4, 8, 24, 64, 200, 512)) if gpu else g.choice((1, 2, 3))
        mcl = g.randint(64, 40000) if gpu else g.randint(64, 200)
        qq, cache, w, lens, table = inputs("fp8", b, min(mcl, 4096), 1, device)
        sync()
        t0 = time.perf_counter()
        meta = tilefuse.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms)
        tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, lens, table, meta, mcl)
        sync()
        firsts.append((time.perf_counter() - t0) * 1e3)
    after = compiled_count(kern.paged_logits_kernel) + compiled_count(kern.paged_schedule_kernel)
    print(f"compiles after warm-up over {len(firsts)} random shapes: {after - before}; first call "
          f"{min(firsts):.2f}-{max(firsts):.2f} ms", flush=True)
    from tilefuse.bench.env import environment

    result = {"environment": environment("eager"),
              "device": torch.cuda.get_device_name() if gpu else "cpu (interpreter: not performance numbers)",
              "calls": calls, "rows": rows, "compiles_after_warmup": after - before, "first_call_ms": firsts}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
