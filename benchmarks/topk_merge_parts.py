"""Where the fused top-k's merge spends its time: the merge kernel's launches taken apart.

One row block as the prefill op runs it (``--rows`` rows, two chunks of ``--chunk`` random
fp32 logits, every column in every row's window), each part timed in a CUDA graph (the small
parts are three short launches: back to back they time the host's launch rate):

* ``first chunk``: the op's first merge (empty buffers, candidates above a rising bar, selects);
* ``both chunks``: the first, then the last (its selects and the one sort a row);
* ``scan only``: a middle chunk whose bar is above every key (loads, keys, the compaction's
  prefix sum; nothing stored, no select);
* ``select + sort``: a last chunk of no columns over buffers of 1.5 ``topk`` random keys;
* ``sort only``: the same over buffers of ``topk`` keys (the select has nothing to cut).

So the selects of a chunk are about ``first chunk - scan only``, a select's cost ``select +
sort - sort only``. Also the candidate count a row holds after the first chunk.

    python benchmarks/topk_merge_parts.py [--rows 512] [--chunk 16384] [--topk 2048] [--set NAME=INT]
        [--output parts.json]
    ncu -k regex:topk_merge python benchmarks/topk_merge_parts.py --rows 512 --samples 0
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilefuse.bench import env
from tilefuse.bench.timing import measure
from tilefuse.indexer import _topk_kernel as kern
from tilefuse.indexer import topk as T

_INT64_MAX = 2**63 - 1


def parts(rows: int, chunk: int, topk: int, samples: int, device: str = "cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    n_keys = 2 * chunk
    logits = [torch.randn(rows, chunk, generator=g, device=device) for _ in range(2)]
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = torch.full((rows,), n_keys, dtype=torch.int32, device=device)
    bars, cand, counts = T._workspace(rows, topk, 2, device)
    out = torch.empty(rows, topk, dtype=torch.int32, device=device)
    w = T.state_width(topk)

    def merge(c: int, lo: int, width: int, first: bool, final: bool) -> None:
        T._merge(logits[c], bars, cand, counts, lo, width, ks, ke, n_keys, n_keys, 1, 0, 0, out, None, topk,
                 kern.WIN_PREFILL, first=first, final=final)

    def first() -> None:
        merge(0, 0, chunk, True, False)

    def both() -> None:
        first()
        merge(1, chunk, chunk, False, True)

    def scan_only() -> None:
        bars.fill_(_INT64_MAX)
        counts.zero_()
        merge(1, chunk, chunk, False, False)

    def final_of(held: int):
        def run() -> None:
            counts.fill_(held)
            bars.fill_(-(2**63))
            merge(1, chunk, 0, False, True)
        return run

    random_keys = torch.randint(-(2**62), 2**62, (rows, 2 * w), generator=g, device=device)
    if samples == 0:  # once each, eagerly, for a profiler: first chunk, both chunks, scan only
        first(), both(), scan_only()
        torch.cuda.synchronize()
        return {"rows": rows, "chunk": chunk, "topk": topk, "us": {}}
    first()
    if logits[0].is_cuda:
        torch.cuda.synchronize()
    held = counts.float()
    fns = {"first chunk": first, "both chunks": both, "scan only": scan_only}
    stats = measure(fns, samples=samples)
    cand.copy_(random_keys)
    stats |= measure({"select + sort": final_of(topk + topk // 2)}, samples=samples)
    cand.copy_(random_keys)
    stats |= measure({"sort only": final_of(topk)}, samples=samples)
    return {"rows": rows, "chunk": chunk, "topk": topk,
            "held_after_first_chunk": {"mean": float(held.mean()), "max": float(held.max())},
            "us": {n: s.to_dict() for n, s in stats.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 64])
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20, help="0: each part run once, untimed (for a profiler)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=INT",
                    help="a module setting of tilefuse.indexer.topk for this run, e.g. _MERGE_MAXNREG=96")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    for item in args.set:
        name, _, value = item.partition("=")
        if not isinstance(getattr(T, name, None), int) or not value.lstrip("-").isdigit():
            print(f"topk_merge_parts: --set {item!r}: expected NAME=INT for an int setting of topk", file=sys.stderr)
            return 2
        setattr(T, name, int(value))
    if not torch.cuda.is_available():
        print("topk_merge_parts: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = [parts(r, args.chunk, args.topk, args.samples) for r in args.rows]
    if args.samples == 0:
        return 0
    for r in results:
        row = "  ".join(f"{n} {s['median_us']:8.1f}" for n, s in r["us"].items())
        print(f"rows {r['rows']:5d} chunk {r['chunk']} topk {r['topk']}: {row} us; held after the first chunk "
              f"{r['held_after_first_chunk']['mean']:.0f} (max {r['held_after_first_chunk']['max']:.0f})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "settings": args.set, "parts": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
