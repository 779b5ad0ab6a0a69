"""Per-call cost of the fused top-k ops as an engine calls them eagerly, beside the unfused pairs.

Back to back, default settings, at sizes whose GPU work is a few microseconds (so the host and
launch path bounds a call): wall time per call over ``calls`` calls, the best of three rounds,
beside the GPU time of the same call in a CUDA graph (where the wall time is well above it, the
host's path is what a call costs). The pairs: tilefuse logits + ``torch.topk`` and, when ``import deep_gemm``
works, DeepGEMM's logits + ``torch.topk``. Then ``--profile``: the host functions that take
the fused decode and prefill calls' time (cProfile, by own time) and, on a GPU, the CUDA
runtime calls and kernels of 20 calls (torch.profiler).

    python benchmarks/topk_host_cost.py [--output f.json] [--profile] [--decode BxCTX ...]
        [--setting NAME --values V ...] [--no-prefill]

Without a GPU it runs a few calls through the interpreter (the numbers then say nothing).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys

import torch
from paged_host_cost import graph_gpu_us, host_setup, per_call_us  # (sibling scripts: benchmarks/ is on sys.path)

import tilefuse
from tilefuse import formats as F
from tilefuse.bench import env
from tilefuse.indexer import paged, topk

H, D, BLOCK_KV, TOPK = 64, 128, 64, 2048


def decode_inputs(batch: int, ctx: int, device: str):
    g = torch.Generator().manual_seed(batch + ctx)
    lens = torch.full((batch, 1), ctx, dtype=torch.int32)
    keys = torch.randn(batch, ctx, D, generator=g).to(torch.bfloat16).to(device)
    cache, table = paged.make_paged_kv_cache(keys, lens[:, 0].to(device), BLOCK_KV, "fp8", generator=g)
    qq = tuple(None if t is None else t.to(device) for t in F.quantize_q(torch.randn(batch, 1, H, D, generator=g),
                                                                         "fp8"))
    w = torch.randn(batch, H, generator=g).to(device)
    return qq, cache, w, lens.to(device), table


def prefill_inputs(s_q: int, s_k: int, device: str):
    g = torch.Generator().manual_seed(s_q + s_k)
    qq = tuple(None if t is None else t.to(device) for t in F.quantize_q(torch.randn(s_q, H, D, generator=g), "fp8"))
    kk = tuple(t.to(device) for t in F.quantize_k(torch.randn(s_k, D, generator=g), "fp8"))
    w = torch.randn(s_q, H, generator=g).to(device)
    ks = torch.zeros(s_q, dtype=torch.int32, device=device)
    ke = (torch.arange(s_q, dtype=torch.int32, device=device) + (s_k - s_q + 1)).clamp(max=s_k)
    return qq, kk, w, ks, ke


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--decode", nargs="+", default=None, metavar="BxCTX",
                    help="decode cases (default on a GPU: 1x4096 32x4096 1x32768)")
    ap.add_argument("--setting", default=None, help="a module-level int of tilefuse.indexer.topk: the fused "
                    "calls timed at each of --values in turn (a row each)")
    ap.add_argument("--values", type=int, nargs="+", default=[])
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args(argv)
    gpu, device, sync, num_sms, deep_gemm = host_setup()
    calls = args.calls or (200 if gpu else 1)
    rows = []

    def record(case, impl, fn):
        row = {"case": case, "impl": impl, "eager_us": per_call_us(fn, calls, sync)}
        if gpu:
            row["graph_gpu_us"] = graph_gpu_us(fn, 10)
        rows.append(row)
        print(f"{case:28s} {impl:28s} eager {row['eager_us']:8.1f} us   GPU in a graph "
              f"{row.get('graph_gpu_us', float('nan')):8.1f} us", flush=True)

    def profile(fn, case: str) -> None:
        """The host functions by own time (cProfile), then, on a GPU, the CUDA runtime calls and
        kernels a call makes (torch.profiler over 20 calls: launches, allocations, copies)."""
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print(f"{case}, fused, cProfile over {calls} calls:\n{text.getvalue()}", flush=True)
        if gpu:
            sync()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as tp:
                for _ in range(20):
                    fn()
                sync()
            print(f"{case}, fused, 20 calls:\n"
                  f"{tp.key_averages().table(sort_by='self_cpu_time_total', row_limit=25)}", flush=True)

    def record_fused(case, fn, result=None):
        """The fused call's row, or one a value of ``--setting`` (each value's first call
        outside the timing: a setting may make other kernels); ``result()``: the call's output,
        which must be the first value's bit for bit."""
        if not args.setting:
            record(case, "tilefuse fused", fn)
            return
        saved = getattr(topk, args.setting)
        first = None
        try:
            for value in args.values:
                setattr(topk, args.setting, value)
                fn()
                if result is not None:
                    sync()
                    now = result().clone()
                    first = now if first is None else first
                    if not torch.equal(now, first):
                        raise SystemExit(f"{case}: {args.setting}={value} differs from {args.values[0]}")
                record(case, f"tilefuse fused {args.setting}={value}", fn)
        finally:
            setattr(topk, args.setting, saved)

    def decode(batch: int, ctx: int) -> None:
        qq, cache, w, lens, table = decode_inputs(batch, ctx, device)
        meta = tilefuse.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms)
        k = min(TOPK, ctx)
        case = f"decode B{batch} ctx{ctx}"
        out = torch.empty(batch, k, dtype=torch.int32, device=device)

        def fused():
            tilefuse.fp8_fp4_paged_mqa_topk(qq, cache, w, lens, table, meta, ctx, k, out=out)

        record_fused(case, fused, lambda: out)
        record(case, "tilefuse + torch.topk", lambda: torch.topk(tilefuse.fp8_fp4_paged_mqa_logits(
            qq, cache, w, lens, table, meta, ctx), k, dim=1))
        if deep_gemm is not None:
            dg_meta = deep_gemm.get_paged_mqa_logits_metadata(lens, BLOCK_KV, num_sms)
            record(case, "deep_gemm + torch.topk", lambda: torch.topk(deep_gemm.fp8_paged_mqa_logits(
                qq[0], cache, w, lens, table, dg_meta, ctx, False), k, dim=1))
        if args.profile and batch == 1 and ctx == 4096:
            profile(fused, case)

    cases = [tuple(map(int, c.split("x"))) for c in args.decode] if args.decode else (
        ((1, 4096), (32, 4096), (1, 32768)) if gpu else ((1, 96),))
    for batch, ctx in cases:
        decode(batch, ctx)
    if args.no_prefill:
        return write(args.output, calls, rows)
    s_q, s_k = (128, 4096) if gpu else (4, 96)
    qq, kk, w, ks, ke = prefill_inputs(s_q, s_k, device)
    k = min(TOPK, s_k)
    case = f"prefill {s_q}/{s_k}"
    record_fused(case, lambda: tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k))
    if args.profile:
        profile(lambda: tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k), case)
    record(case, "tilefuse + torch.topk", lambda: torch.topk(tilefuse.fp8_fp4_mqa_logits(
        qq, kk, w, ks, ke, clean_logits=True), k, dim=1))
    if deep_gemm is not None:
        record(case, "deep_gemm + torch.topk", lambda: torch.topk(deep_gemm.fp8_mqa_logits(
            qq[0], kk, w, ks, ke, clean_logits=True), k, dim=1))
    return write(args.output, calls, rows)


def write(output, calls: int, rows: list) -> int:
    if output:
        with open(output, "w") as f:
            json.dump({"environment": env.environment("eager"), "calls": calls, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
