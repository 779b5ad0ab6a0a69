"""The top-k of rows fewer than the SMs: a radix select across each row's programs
(``topk._topk_rows_across_programs``) against ``torch.topk`` and the merge kernel's one program a
row, on the same random fp32 logits ``[R, N]`` (every column in every row's window), each timed
in a CUDA graph. The two tilefuse results are checked index for index against each other and
their values against ``torch.topk``'s before timing.

    python benchmarks/topk_across_programs.py [--shapes 1x131072 8x65536 64x32768] [--topk 2048] [--output f.json]

(512 x 32768 is one row block of the prefill op at 32K keys: there the rows fill the GPU, and
the question is whether three histogram passes, a compaction and one short select beat the
merge's scan and selects per key.)
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


def one_program_a_row(logits, ks, ke, k: int):
    """The fused ops' merge on given logits: chunks of the default width, one program a row."""
    rows, n = logits.shape
    chunks = T._chunks(n, T.default_chunk_k(k, 1))
    bars, cand, counts = T._workspace(rows, k, len(chunks), logits.device)
    out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    for c, (lo, hi) in enumerate(chunks):
        T._merge(logits[:, lo:hi], bars, cand, counts, lo, hi - lo, ks, ke, n, n, 1, 1, 0, out, None, k,
                 kern.WIN_PREFILL, first=c == 0, final=c == len(chunks) - 1)
    return out


def run(rows: int, n: int, k: int, samples: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + n)
    logits = torch.randn(rows, n, generator=g, device="cuda")
    ks = torch.zeros(rows, dtype=torch.int32, device="cuda")
    ke = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    across, _ = T._topk_rows_across_programs(logits, ks, ke, k)
    merged = one_program_a_row(logits, ks, ke, k)
    ref = torch.topk(logits, k, dim=1).values
    assert torch.equal(across, merged), "across programs != one program a row"
    assert torch.equal(logits.gather(1, across.long()), ref), "values differ from torch.topk's"
    fns = {
        "torch.topk": lambda: torch.topk(logits, k, dim=1),
        "torch.topk unsorted": lambda: torch.topk(logits, k, dim=1, sorted=False),
        "across programs": lambda: T._topk_rows_across_programs(logits, ks, ke, k),
        "one program a row": lambda: one_program_a_row(logits, ks, ke, k),
    }
    stats = measure(fns, samples=samples)
    return {"rows": rows, "n": n, "topk": k, "us": {name: s.to_dict() for name, s in stats.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1x32768", "1x131072", "8x65536", "8x131072", "64x32768",
                                                     "128x65536", "512x32768"])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_across_programs: needs a CUDA GPU (the CPU tests are in tests/indexer/test_topk.py)",
              file=sys.stderr)
        return 2
    results = []
    for shape in args.shapes:
        rows, n = (int(v) for v in shape.split("x"))
        r = run(rows, n, args.topk, args.samples)
        results.append(r)
        print(f"{rows:4d} x {n:6d}: " + "  ".join(f"{name} {s['median_us']:7.1f}" for name, s in r["us"].items())
              + " us", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
