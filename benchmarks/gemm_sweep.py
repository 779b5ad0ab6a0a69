"""Tile sweep of the persistent GEMM core of ``tilefuse.tp`` on one GPU, against cuBLAS
(``torch.matmul``) timed in the same run.

The fused ag_gemm / gemm_rs live on this kernel; #6 asks >= 0.95 of cuBLAS alone at every
shape they run. Shapes: the per-GPU GEMMs of both ops at W = 2 (seed and LLM families of
``tilefuse.bench.suites.tp``), bf16, B in [K, N]. Every config's output is checked against cuBLAS
(relative error) before it is timed. The outcome goes to ``benchmarks/NOTES.md`` and the
winners into ``tilefuse.tp._gemm_core.default_config``.

    python benchmarks/gemm_sweep.py --output gemm-sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import torch

from tilefuse.bench import env, timing
from tilefuse.bench.suites import tp as tp_bench
from tilefuse.tp._gemm_core import GemmConfig, default_config, gemm, num_sms

CONFIGS = [
    GemmConfig(128, 256, 64, 8, 3, 8), GemmConfig(128, 128, 64, 8, 4, 4), GemmConfig(128, 128, 64, 8, 5, 8),
    GemmConfig(64, 256, 64, 8, 4, 4), GemmConfig(128, 64, 64, 8, 5, 4), GemmConfig(256, 128, 64, 8, 3, 8),
    GemmConfig(128, 256, 128, 8, 2, 8),
]


def gemm_shapes(world: int = 2) -> list[tuple[int, int, int]]:
    """(M, N, K) each rank multiplies: ag_gemm all of M, gemm_rs all of M (its partials)."""
    out = []
    for op in ("ag_gemm", "gemm_rs"):
        for m, n, k, _ in tp_bench.shapes(op, "seed,llm"):
            out.append((m, n, k))
    return sorted(set(out))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="gemm-sweep.json")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--max-m", type=int, default=16384, help="skip larger M (time)")
    ap.add_argument("--shapes", default=None, help="only these MxNxK, comma-separated")
    ap.add_argument("--flatten", action="store_true",
                    help="the default tile, 128x256 / 3 stages and 128x128 / 5 stages, each with and without flatten")
    args = ap.parse_args(argv)
    only = None if not args.shapes else {tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")}
    configs = CONFIGS
    if args.flatten:
        configs = [c for base in (CONFIGS[0], CONFIGS[2]) for c in (base, dataclasses.replace(base, flatten=True))]
    dev = torch.device("cuda")
    sms = num_sms(dev)
    record = {"environment": env.environment("graph"), "rows": []}
    table = []
    for m, n, k in gemm_shapes():
        if m > args.max_m or (only is not None and (m, n, k) not in only):
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        b = (torch.randn(k, n, device=dev, generator=g) * k**-0.5).to(torch.bfloat16)
        ref = a @ b
        default = default_config(m, n, k, sms)
        fns = {"cublas": functools.partial(torch.matmul, a, b)}
        errs = {}
        for cfg in dict.fromkeys([default, *configs]):
            name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
            name += " flat" if cfg.flatten else ""
            name += " (default)" if cfg == default else ""
            fn = functools.partial(gemm, a, b, config=cfg)
            try:
                out = fn()
                errs[name] = float((out.float() - ref.float()).norm() / ref.float().norm())
                if errs[name] < 1e-2:
                    fns[name] = fn
            except Exception as e:  # a config that does not compile or fit is a row, not a crash
                errs[name] = f"{type(e).__name__}: {str(e)[:200]}"
        stats = timing.time_graph(fns, calls=5, samples=args.samples)
        cublas = stats["cublas"].median_us
        for name, st in stats.items():
            ratio = cublas / st.median_us
            record["rows"].append({"m": m, "n": n, "k": k, "config": name, "stats": st.to_dict(),
                                   "vs_cublas": ratio, "rel_err": errs.get(name)})
            table.append((f"{m}x{n}x{k}", name, st.median_us, ratio))
        for name, e in errs.items():
            if name not in stats:
                record["rows"].append({"m": m, "n": n, "k": k, "config": name, "error": e})
        torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{'shape':20s} {'config':32s} {'us':>9s} {'vs cuBLAS':>9s}")
    for shape, name, us, ratio in table:
        print(f"{shape:20s} {name:32s} {us:9.1f} {ratio:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
