"""The eager prefill top-k call's host time taken apart, beside the unfused pair's pieces.

One row block and one key chunk (128 x 4096 FP8, H64 D128, topk 2048: the op's plan path).
Each part is called alone, 200 times back to back a round, five rounds alternating over the
parts in one process (host speed drifts from process to process): the host time to enqueue a
round (no sync inside) and its wall time with the sync, medians per call. Where the GPU time
is the larger, the wall time reads it.

    python benchmarks/topk_prefill_host_parts.py [--rounds 5] [--output parts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import tilefuse
from tilefuse.bench import env
from tilefuse.indexer import _topk_kernel as kern
from tilefuse.indexer import topk as T

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from prefill_host_cost import time_calls  # noqa: E402
from topk_host_cost import prefill_inputs  # noqa: E402


def parts(s_q: int, s_k: int, k: int) -> dict:
    qq, kk, w, ks, ke = prefill_inputs(s_q, s_k, "cuda")
    for _ in range(3):  # the plan made, its launches recorded
        tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k)
    plan = next(p for p in T._prefill_plans.values() if p.device.type == "cuda")
    logits = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, clean_logits=False)
    out = torch.empty(s_q, k, dtype=torch.int32, device="cuda")
    candidates = torch.empty((s_q, 2 * T.state_width(k)), dtype=torch.int64, device="cuda")
    args = (qq[0], qq[1], kk[0], kk[1], w, ks, ke)

    def merge():
        T._merge(logits, plan.bars, candidates, plan.counts, 0, s_k, ks, ke, s_k, s_k, 1, 0, 0, out, None, k,
                 kern.WIN_PREFILL, first=True, final=True, partials=plan.partials)

    return {
        "fused": lambda: tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k),
        "fused out=": lambda: tilefuse.fp8_fp4_mqa_topk(qq, kk, w, ks, ke, k, out=out),
        "plan key": lambda: T._prefill_plan_key(*args, k, torch.float32, False, None, None),
        "plan run": lambda: T._run_prefill_plan(plan, *args, torch.float32, k, out, None),
        "logits op (clean_logits=False)": lambda: tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, clean_logits=False),
        "merge alone": merge,
        "torch.empty candidates": lambda: torch.empty((s_q, 2 * T.state_width(k)), dtype=torch.int64,
                                                      device="cuda"),
        "torch.topk alone": lambda: torch.topk(logits, k, dim=1),
        "pair": lambda: torch.topk(tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, clean_logits=True), k, dim=1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (host time of real launches)")
        return 0
    calls = parts(128, 4096, 2048)
    samples = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            samples[name].append(time_calls(fn, 200, "cuda", rounds=1))
    rows = [{"part": name, "host_us": statistics.median(x["host_us"] for x in v),
             "wall_us": statistics.median(x["wall_us"] for x in v)} for name, v in samples.items()]
    for r in rows:
        print(f"{r['part']:32s} host {r['host_us']:7.1f} us  wall {r['wall_us']:7.1f} us")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("eager"), "case": "prefill fp8 H64 D128 128/4096 top2048",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
