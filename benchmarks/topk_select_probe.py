"""Probe of the top-k merge's select by counts: what one halving pass costs, and the rest.

The merge parts (``topk_merge_parts.py``) put a select of 3072 keys at ~52 us a 512-row block
on an H100, where ~12 passes of ~90 instructions a warp were counted at a few us. This times
the select's pieces alone, in the merge's launch shape (one program a row, 8 warps, 64
registers, 512 rows, graph mode), each kernel built from the merge kernel's own functions:

* ``load``: the high words of a 4096-key buffer into registers, and their min and max;
* ``passes P``: the same, then P counting passes at pivots that never stop early
  (``_count_at_least``, as ``_bisect_rank`` calls it), for P in ``--passes``: the slope over P
  is one pass's cost at this occupancy;
* ``compact``: the compaction of 3072 keys to 2048 (``_compact``, 3 pieces of 1024);
* ``select``: ``_select`` whole on buffers of 3072 random keys (normal values: ~13 passes);

    python benchmarks/topk_select_probe.py [--rows 512] [--passes 0 8 16 32] [--output probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from tilefuse.bench import env
from tilefuse.bench.timing import measure
from tilefuse.indexer import _topk_kernel as kern
from tilefuse.reference import order_keys

W, CAP, TOPK, PIECE = 2048, 4096, 2048, 1024
OPTIONS = {"num_warps": 8, "maxnreg": 64}


@triton.jit
def load_and_count_kernel(cand_ptr, count_ptr, out_ptr, passes, CAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    count = tl.load(count_ptr + row)
    slot = tl.arange(0, CAP)[None, :]
    valid = slot < count[:, None]
    pairs = (cand_ptr + row[:, None] * CAP).to(tl.pointer_type(tl.int32)) + 2 * slot
    hi_word = tl.load(pairs + 1, mask=valid, other=-(2**31))
    lo = tl.min(tl.where(valid, hi_word, 0x7FFFFFFF), axis=1).to(tl.int64)
    hi = tl.max(tl.where(valid, hi_word, -(2**31)), axis=1).to(tl.int64)
    acc = tl.zeros([1], tl.int32)
    for p in range(0, passes):
        # a pivot a pass that depends on the last count, so no pass can be hoisted
        mid = (lo + (hi - lo) // (p + 2) + (acc & 1)).to(tl.int32)
        acc += kern._count_at_least(hi_word, valid, mid)
    tl.store(out_ptr + row, acc + (lo + hi).to(tl.int32))


@triton.jit
def compact_kernel(cand_ptr, count_ptr, bar_ptr, thr_ptr, CAP: tl.constexpr, TOPK: tl.constexpr,
                   PIECE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    count = tl.load(count_ptr + row)
    thr = tl.load(thr_ptr + row)
    cand_rows = cand_ptr + row[:, None] * CAP
    n_pieces = tl.cdiv(tl.max(count, axis=0), PIECE)
    count, bar = kern._compact(cand_rows, count, tl.zeros([1], tl.int64), thr, n_pieces, TOPK, 1, PIECE)
    tl.store(bar_ptr + row, bar)


@triton.jit
def select_kernel(cand_ptr, count_ptr, bar_ptr, CAP: tl.constexpr, TOPK: tl.constexpr, PIECE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    count = tl.load(count_ptr + row)
    cand_rows = cand_ptr + row[:, None] * CAP
    count, bar = kern._select(cand_rows, count, tl.zeros([1], tl.int64), tl.zeros([1], tl.int64), count, TOPK, 1,
                              CAP, PIECE, 0)
    tl.store(bar_ptr + row, bar)


def probe(rows: int, passes: list[int], samples: int) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    held = TOPK + TOPK // 2
    keys = torch.full((rows, CAP), -(2**63), dtype=torch.int64, device=dev)
    keys[:, :held] = order_keys(torch.randn(rows, held, generator=g, device=dev))
    cand = keys.clone()
    counts = torch.full((rows,), held, dtype=torch.int32, device=dev)
    out = torch.empty(rows, dtype=torch.int32, device=dev)
    bars = torch.empty(rows, dtype=torch.int64, device=dev)
    thr = keys[:, :held].topk(TOPK, dim=1).values[:, -1].contiguous()

    def count_passes(p):
        return lambda: load_and_count_kernel[(rows,)](cand, counts, out, p, CAP, **OPTIONS)

    def compact():
        cand.copy_(keys)
        compact_kernel[(rows,)](cand, counts, bars, thr, CAP, TOPK, PIECE, **OPTIONS)

    def select():
        cand.copy_(keys)
        select_kernel[(rows,)](cand, counts, bars, CAP, TOPK, PIECE, **OPTIONS)

    def copy_only():
        cand.copy_(keys)

    fns = {f"passes {p}": count_passes(p) for p in passes}
    fns |= {"copy only": copy_only, "compact": compact, "select": select}
    ok = {}
    for n, f in fns.items():
        f()
        if not n.startswith("passes") and n != "copy only":
            torch.cuda.synchronize()
            ok[n] = bool(torch.equal(bars, thr))  # the new bar is the TOPK-th key
    stats = measure(fns, samples=samples)
    us = {n: s.median_us for n, s in stats.items()}
    slope = None
    if len(passes) >= 2:
        slope = (us[f"passes {max(passes)}"] - us[f"passes {min(passes)}"]) / (max(passes) - min(passes))
    return {"rows": rows, "held": held, "bar_is_the_topk_th_key": ok, "us": us,
            "us_per_pass": slope, "stats": {n: s.to_dict() for n, s in stats.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 64])
    ap.add_argument("--passes", type=int, nargs="+", default=[0, 8, 16, 32])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_select_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = [probe(r, args.passes, args.samples) for r in args.rows]
    for r in results:
        row = "  ".join(f"{n} {v:7.1f}" for n, v in r["us"].items())
        print(f"rows {r['rows']:4d}: {row} us; per pass {r['us_per_pass']:.2f} us; "
              f"bars right: {r['bar_is_the_topk_th_key']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "probe": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
