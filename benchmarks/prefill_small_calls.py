"""Small prefill calls (an engine's short chunks) under each launch configuration: host per
call, wall per call and GPU time, to place ``prefill.SMALL_CALL`` and the configs below it.

For each (format, S_q, S_k) and each candidate config (FP8: the Gluon head loop with the head
sum through |s|, which launches the linear-term pass first, the plain Gluon head loop, one
launch, and the few-row kernel; MX: the renormalised rows, three launches, the few-row MX
kernel renormalising in registers, one launch, and the same with the query rows renormalised
by a first launch), eager back-to-back calls with the same sizes (host and wall time, the best
of three rounds) and the GPU time of one call in a CUDA graph. The call's
cost to an engine is the larger of its host and GPU time. The default row says what
``fp8_fp4_mqa_logits`` picks without a config.

    python benchmarks/prefill_small_calls.py [--output small-calls.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from paged_host_cost import graph_gpu_us  # (sibling scripts: benchmarks/ is on sys.path)
from prefill_host_cost import _case, time_calls

import tilefuse
from tilefuse.indexer import prefill

C = prefill.PrefillConfig


def _few_row_mx(**via) -> dict:
    """The few-row MX kernel in each ``mx_inline`` mode (16x128, 8 warps): ``inline`` (1), ``inline2``, ``inline3``."""
    tile = C(block_q=16, block_n=128, num_warps=8, num_stages=3, heads_on_n=True, **via)
    return {("inline" if mode == 1 else f"inline{mode}"): dataclasses.replace(tile, mx_inline=mode)
            for mode in (1, 2, 3)}


CONFIGS = {
    "fp8": {"gluon abs2": C(block_q=64, block_n=128, num_warps=4, num_stages=4, gluon=True, relu_via_abs=2),
            "gluon plain": C(block_q=64, block_n=128, num_warps=4, num_stages=4, gluon=True),
            "heads_on_n": C(block_q=16, block_n=128, num_warps=4, num_stages=3, heads_on_n=True)},
    "mxfp8": {"via f16 gluon": C(block_q=64, block_n=128, num_warps=4, num_stages=4, mxfp8_via_f16=True,
                                 gluon=True, gluon_refill=2),
              **_few_row_mx(mxfp8_via_f16=True)},
    "mxfp4": {"via fp8": C(block_q=64, block_n=256, num_warps=8, num_stages=3, fp4_via_fp8=True),
              **_few_row_mx(fp4_via_fp8=True)},
}
SHAPES = {"fp8": [(64, 4096), (128, 4096), (256, 4096), (128, 8192), (512, 4096), (256, 16384), (1024, 8192)],
          "mxfp8": [(16, 4096), (128, 4096), (256, 4096), (512, 4096), (2048, 8192)],
          "mxfp4": [(16, 4096), (128, 4096), (256, 4096), (512, 4096), (2048, 8192)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=250, help="calls a round (3 rounds, the best kept)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--formats", default="fp8,mxfp8,mxfp4", help="comma-separated formats")
    ap.add_argument("--shapes", default=None, help="S_qxS_k,... for every format (default: SHAPES)")
    ap.add_argument("--block-q", default="", help="comma-separated block_q values: the few-row configs "
                    "(heads_on_n, inline) again at each")
    ap.add_argument("--block-n", default="", help="comma-separated block_n values: the same, for block_n")
    args = ap.parse_args(argv)
    block_qs = [int(b) for b in args.block_q.split(",") if b]
    block_ns = [int(b) for b in args.block_n.split(",") if b]
    shapes_arg = args.shapes and [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if not torch.cuda.is_available():
        print("prefill_small_calls: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for fmt, shapes in SHAPES.items():
        if fmt not in args.formats.split(","):
            continue
        configs = [("default", None), *CONFIGS[fmt].items()]
        for name, cfg in CONFIGS[fmt].items():
            if cfg.heads_on_n:
                for bq in block_qs or [cfg.block_q]:
                    for bn in block_ns or [cfg.block_n]:
                        if (bq, bn) != (cfg.block_q, cfg.block_n):
                            tag = (f" q{bq}" if bq != cfg.block_q else "") + (f" n{bn}" if bn != cfg.block_n else "")
                            configs.append((name + tag, dataclasses.replace(cfg, block_q=bq, block_n=bn)))
        for s_q, s_k in shapes_arg or shapes:
            q, kv, w, ks, ke = _case(fmt, s_q, s_k, 64, 128, "cuda")
            for name, cfg in configs:
                def fn(cfg=cfg, args=(q, kv, w, ks, ke)):
                    tilefuse.fp8_fp4_mqa_logits(*args, False, config=cfg)

                row = {"fmt": fmt, "s_q": s_q, "s_k": s_k, "config": name, **time_calls(fn, args.calls, "cuda"),
                       "gpu_us": graph_gpu_us(fn, 5)}
                if cfg is not None:
                    row["fields"] = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
                rows.append(row)
                print(f"{fmt:6} {s_q:5}/{s_k:<6} {name:14} host {row['host_us']:7.1f}  wall {row['wall_us']:7.1f}  "
                      f"gpu {row['gpu_us']:7.1f} us", flush=True)
    if args.output:
        from tilefuse.bench.env import environment

        with open(args.output, "w") as f:
            json.dump({"environment": environment("eager"), "small_call": prefill.SMALL_CALL, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
