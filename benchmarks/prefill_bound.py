"""What bounds the Hopper prefill head loop: the Gluon kernel timed whole and with one part of
its work removed at a time (``_prefill_kernel_gluon.ABLATIONS``), beside the Triton loop and the
FP8 matmul ceiling of the same run. Rates are the op's FLOPs (2 * valid pairs * H * D) over each
variant's time, so a variant that runs at the same rate as the whole kernel removed nothing
that bounds it. Outputs of the ablated variants are wrong by design and not checked; the
whole kernel is checked bit for bit against the Triton loop first.

    python benchmarks/prefill_bound.py --output prefill-bound.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

os.environ.setdefault("TILEFUSE_CHECK_WINDOWS", "0")

import prefill_sweep  # noqa: E402  (beside this script: the sweep's inputs)

import tilefuse  # noqa: E402
from tilefuse.bench import ceilings, env, timing  # noqa: E402
from tilefuse.indexer import _prefill_kernel_gluon as gk  # noqa: E402
from tilefuse.indexer import windows as W  # noqa: E402
from tilefuse.indexer.prefill import PrefillConfig  # noqa: E402

SHAPES = [(2048, 32768, 64), (2048, 32768, 32)]
TRITON_LOOP = PrefillConfig(64, 128, 4, 3, head_unroll=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="prefill-bound.json")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--num-buf", type=int, default=4)
    ap.add_argument("--refill-every", default="1", help="query-ring refill step(s) of the Gluon loop, e.g. 1,2")
    args = ap.parse_args(argv)
    refills = [int(x) for x in args.refill_every.split(",")]
    record = {"environment": env.environment("graph"), "ceilings": ceilings.measure_ceilings(), "rows": []}
    fp8_ceiling = ceilings.ceiling_value(record["ceilings"], "fp8_matmul")
    table = []
    for s_q, s_k, h in SHAPES:
        (q8, _), (k8, k_sf), w = prefill_sweep.make(s_q, s_k, h, 128, "fp8")
        ks, ke = W.causal_tail(s_q, s_k, device="cuda")
        flops = 2 * W.valid_pairs(ks, ke, s_k) * h * 128
        ref = tilefuse.fp8_fp4_mqa_logits((q8, None), (k8, k_sf), w, ks, ke, True, config=TRITON_LOOP)
        out = torch.empty_like(ref)
        compiled = {}
        fns = {"triton loop": functools.partial(tilefuse.fp8_fp4_mqa_logits, (q8, None), (k8, k_sf), w, ks, ke,
                                                True, config=TRITON_LOOP)}
        for refill in refills:
            for name, code in gk.ABLATIONS.items():
                if refill != 1 and code != 0:
                    continue  # ablations of the default loop only
                label = name if refill == 1 else f"{name} refill{refill}"
                run = functools.partial(gk.launch, q8, k8, k_sf, w, ks, ke, out, True, False, 64, 128, 4,
                                        args.num_buf, code, refill_every=refill)
                compiled[label] = run()
                if code == 0:
                    torch.cuda.synchronize()
                    assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), f"gluon {label} differs"
                fns[f"gluon {label}"] = run
        stats = timing.time_graph(fns, calls=5, samples=args.samples)
        for name, st in stats.items():
            tflops = flops / (st.median_us * 1e-6) / 1e12
            kern = compiled.get(name.removeprefix("gluon "))
            row = {"s_q": s_q, "s_k": s_k, "h": h, "variant": name, "stats": st.to_dict(), "tflops": tflops,
                   "ceiling_ratio": tflops / fp8_ceiling,
                   "registers": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None)}
            record["rows"].append(row)
            table.append((f"H{h} {s_q}/{s_k}", name, st.median_us, tflops, tflops / fp8_ceiling, row["registers"],
                          row["spills"]))
        del ref, out
        torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)
    print(f"fp8 ceiling {fp8_ceiling:.0f} TFLOP/s")
    print(f"{'shape':16s} {'variant':24s} {'us':>9s} {'TFLOP/s':>8s} {'ceil':>5s} {'regs':>5s} {'spill':>5s}")
    for label, name, us, tf, ratio, regs, spills in table:
        print(f"{label:16s} {name:24s} {us:9.1f} {tf:8.0f} {ratio:5.2f} {regs!s:>5s} {spills!s:>5s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
