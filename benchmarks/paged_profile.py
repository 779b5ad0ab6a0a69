"""One decode row's kernels, tilefuse's default and DeepGEMM's, launched a few times each for a
profiler (GPU only): ``ncu -k regex:paged ... python benchmarks/paged_profile.py 8x1x32768``.
The same inputs as ``paged_sweep.py`` (FP8, H64 D128, 64-token pages, 2-D lengths uniform in
0.7-1.3 of the mean); each output is checked against the other before the profiled calls.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from paged_sweep import deep_gemm_call, make_row, parse_row

import tilefuse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+", type=parse_row, help="BxNEXT_NxCTX[/H]")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args(argv)
    for b, next_n, mean, heads in args.rows:
        row = make_row(b, next_n, mean, heads=heads)
        ours = functools.partial(tilefuse.fp8_fp4_paged_mqa_logits, row["q"], row["cache"], row["w"], row["ctx"],
                                 row["table"], row["meta"], row["max_len"])
        peer = deep_gemm_call(row)
        out = ours()
        if peer is not None:
            theirs = peer()
            inside = torch.arange(row["max_len"], device="cuda")[None, :] < row["ctx"].reshape(-1, 1)
            diff = (out - theirs).abs()[inside].max().item()
            print(f"B{b} n{next_n} ctx{mean}: max |ours - DeepGEMM| inside the windows {diff:.3g}", flush=True)
        for fn in (ours, peer):
            for _ in range(args.calls if fn is not None else 0):
                fn()
        torch.cuda.synchronize()
        del row
    return 0


if __name__ == "__main__":
    sys.exit(main())
