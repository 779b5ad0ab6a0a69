"""The fused top-k with its merge's select cutting the interval in 2, 3 or 4 parts a pass
(``topk._SELECT_WAYS``), side by side in one rotation with tilefuse logits + ``torch.topk``.

Each variant is captured in its own CUDA graph with the setting it names, every output checked
bitwise against the 2-way select's (and that one against the suite's reference rows).

    python benchmarks/topk_ways_ab.py [--ways 2 3 4] [--shapes 2048x32768 64x1x32768] [--output ab.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilefuse.bench import env
from tilefuse.bench.suites import topk as suite
from tilefuse.bench.timing import measure
from tilefuse.indexer import topk as T


def _with_ways(fn, ways: int):
    def run():
        T._SELECT_WAYS = ways
        return fn()
    return run


def ab(case, ways: list[int], samples: int) -> dict:
    impls = {i.name: i for i in case.build()}
    fused, pair = impls["tilefuse"], impls["tilefuse+torch.topk"]
    fns = {f"fused {w}-way": _with_ways(fused.fn, w) for w in ways}
    fns["tilefuse+torch.topk"] = pair.fn
    outs = {n: f() for n, f in fns.items() if n.startswith("fused")}
    torch.cuda.synchronize()
    base = outs[f"fused {ways[0]}-way"]
    checked = fused.check(base)
    same = {n: bool(torch.equal(o, base)) for n, o in outs.items()}
    stats = measure(fns, samples=samples)
    T._SELECT_WAYS = ways[0]
    us = {n: s.median_us for n, s in stats.items()}
    return {"case": case.name, "params": case.params, "us": us, "check": checked, "bitwise_equal_to_first": same,
            "stats": {n: s.to_dict() for n, s in stats.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--shapes", nargs="+", default=["2048x32768", "2048x131072", "64x1x32768", "256x1x8192"])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_ways_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = suite.cases(on_gpu=True, device="cuda", shapes=suite.parse_shapes(args.shapes))
    results = []
    for case in cases:
        r = ab(case, args.ways, args.samples)
        results.append(r)
        pair = r["us"]["tilefuse+torch.topk"]
        row = "  ".join(f"{n} {v:8.1f} ({pair / v:4.2f}x)" for n, v in r["us"].items() if n.startswith("fused"))
        print(f"{case.name}: {row}  pair {pair:8.1f}  "
              f"equal {all(r['bitwise_equal_to_first'].values())} checked {r['check']['passed']}",
              flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "ab": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
