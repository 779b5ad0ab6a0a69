"""Where a fused top-k call's GPU time goes: each kernel's time per call (torch.profiler over
``--calls`` eager calls after a warm-up), beside the call's time in a CUDA graph and the
tilefuse logits alone, at the suite's shapes (``tilefuse bench topk``'s ``RxN`` prefill,
``BxNEXT_NxCTX`` decode).

    python benchmarks/topk_kernel_times.py [--shapes 64x1x32768 8x1x65536] [--calls 20] [--output f.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilefuse.bench import env
from tilefuse.bench.suites import topk as suite
from tilefuse.bench.timing import measure


def kernel_times(fn, calls: int) -> dict[str, dict]:
    """GPU time per call of each kernel ``fn`` launches (summed over its launches in a call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us > 0:
            rows[ev.key] = {"us_per_call": us / calls, "launches_per_call": ev.count / calls}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us_per_call"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["64x1x32768", "128x1x16384", "8x1x65536", "2048x32768"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_kernel_times: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for case in suite.cases(on_gpu=True, device="cuda", shapes=suite.parse_shapes(args.shapes)):
        impls = {i.name: i for i in case.build()}
        fused, logits = impls["tilefuse"], impls["tilefuse logits"]
        graph = {n: s.median_us for n, s in measure({"fused": fused.fn, "logits": logits.fn},
                                                     samples=args.samples).items()}
        kernels = kernel_times(fused.fn, args.calls)
        results.append({"case": case.name, "params": case.params, "graph_us": graph, "kernels": kernels})
        print(f"{case.name}: fused {graph['fused']:.1f} us in a graph, logits alone {graph['logits']:.1f}; "
              f"eager kernels, us a call (launches):", flush=True)
        for name, k in kernels.items():
            print(f"    {k['us_per_call']:9.1f}  ({k['launches_per_call']:.0f})  {name[:90]}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "calls": args.calls, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
