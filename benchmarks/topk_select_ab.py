"""The merge's two selects side by side: radix histograms against counts at a bisected bound.

``topk.SELECT_BY_COUNTS`` picks the select of the top-k merge kernel. This times, in one
process and one rotation per row (graph mode), the fused ops with each select beside the
unfused pair (tilefuse logits + ``torch.topk``), and the merge kernel's parts with each
(``topk_merge_parts.parts``). Outside the timed region the two selects' outputs must be
bitwise equal and pass the suite's check against the reference.

    python benchmarks/topk_select_ab.py [--prefill 2048x32768 ...] [--decode 64x1x32768 ...]
        [--samples 20] [--output select-ab.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import topk_merge_parts  # noqa: E402

from tilefuse.bench import env  # noqa: E402
from tilefuse.bench.suites import topk as suite  # noqa: E402
from tilefuse.bench.timing import measure  # noqa: E402
from tilefuse.indexer import topk as T  # noqa: E402

METHODS = {"radix": False, "counts": True}


def with_select(by_counts: bool, fn):
    def run():
        old = T.SELECT_BY_COUNTS
        T.SELECT_BY_COUNTS = by_counts
        try:
            return fn()
        finally:
            T.SELECT_BY_COUNTS = old
    return run


def time_case(case, samples: int) -> dict:
    impls = {i.name: i for i in case.build()}
    fused = impls["tilefuse"]
    fns = {m: with_select(on, fused.fn) for m, on in METHODS.items()}
    outs = {m: f() for m, f in fns.items()}
    checks = {m: fused.check(o) for m, o in outs.items()}
    same = torch.equal(outs["radix"], outs["counts"])
    del outs
    fns["tilefuse+torch.topk"] = impls["tilefuse+torch.topk"].fn
    stats = measure(fns, samples=samples)
    return {"case": case.name, "shape": case.x, "bitwise_equal": same,
            "checks_passed": {m: bool(c.get("passed")) for m, c in checks.items()},
            "us": {n: s.to_dict() for n, s in stats.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", nargs="*", default=["2048x32768", "2048x131072"])
    ap.add_argument("--decode", nargs="*", default=["64x1x32768", "256x1x8192", "1x1x32768", "8x1x131072"])
    ap.add_argument("--parts-rows", type=int, nargs="*", default=[512, 64])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_select_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    prefill, decode = suite.parse_shapes(args.prefill + args.decode)
    cases = suite.cases(on_gpu=True, device="cuda", shapes=(prefill, decode))
    rows = []
    for case in cases:
        r = time_case(case, args.samples)
        rows.append(r)
        us = {n: s["median_us"] for n, s in r["us"].items()}
        print(f"{r['shape']:>22}: radix {us['radix']:8.1f}  counts {us['counts']:8.1f}  pair "
              f"{us['tilefuse+torch.topk']:8.1f} us  counts/radix {us['counts'] / us['radix']:.2f}  "
              f"pair/counts {us['tilefuse+torch.topk'] / us['counts']:.2f}  equal {r['bitwise_equal']} "
              f"checks {r['checks_passed']}", flush=True)
    parts = []
    for n in args.parts_rows:
        for m, on in METHODS.items():
            old, T.SELECT_BY_COUNTS = T.SELECT_BY_COUNTS, on
            try:
                p = topk_merge_parts.parts(n, 16384, 2048, args.samples)
            finally:
                T.SELECT_BY_COUNTS = old
            p["select"] = m
            parts.append(p)
            row = "  ".join(f"{k} {s['median_us']:7.1f}" for k, s in p["us"].items())
            print(f"parts rows {n:4d} {m:>6}: {row} us", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "rows": rows, "parts": parts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
