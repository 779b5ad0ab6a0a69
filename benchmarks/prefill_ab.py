"""Prefill kernel time of two or more source trees of tilefuse, same GPU, same inputs (GPU only).

Each tree (a directory holding ``src/tilefuse``, e.g. ``git archive <commit> src | tar -x -C
DIR``) is timed in its own process; the order of the trees rotates every round, and each
shape's time is the median over rounds of the per-round medians. FP8, H64 D128, causal
windows, clean logits; a CUDA graph of 5 calls per sample. ``--op topk``: the fused prefill
top-k (``fp8_fp4_mqa_topk``, k 2048) at ``TOPK_SHAPES`` instead; ``--op paged``: the decode
logits (``fp8_fp4_paged_mqa_logits``, default config, 64-token pages, 2-D lengths uniform in
0.7-1.3 of the mean, no clean) at ``PAGED_SHAPES``; ``--op paged-topk``: the fused decode top-k
(``fp8_fp4_paged_mqa_topk``, k 2048, fp32 logits) over the same caches at ``PAGED_TOPK_SHAPES``.

    python benchmarks/prefill_ab.py TREE [TREE ...] [--rounds 3] [--op topk|paged] [--output ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPES = [  # (S_q, S_k, logits dtype)
    (2048, 32768, "float32"), (2048, 32768, "bfloat16"), (8192, 65536, "float32"), (4096, 8192, "float32"),
    (128, 32768, "float32"),
]

TOPK_SHAPES = [(2048, 32768, "float32"), (2048, 131072, "float32")]

PAGED_SHAPES = [  # (B, next_n, mean context)
    (1, 1, 8192), (1, 1, 65536), (8, 1, 32768), (32, 1, 4096), (64, 1, 8192), (256, 1, 8192),
    (64, 2, 8192), (256, 2, 8192), (64, 2, 32768), (256, 4, 8192),
]

PAGED_TOPK_SHAPES = [(1, 1, 32768), (8, 1, 65536), (32, 1, 65536), (64, 1, 32768), (128, 1, 16384),
                     (256, 1, 8192), (64, 2, 32768)]

_CHILD = r"""
import json, sys, torch, tilefuse
shapes, op = json.loads(sys.argv[1]), sys.argv[2]
g = torch.Generator(device="cuda").manual_seed(0)
res = {}
if op in ("paged", "paged-topk"):
    from tilefuse import formats
    from tilefuse.indexer.paged import make_paged_kv_cache
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cpu = torch.Generator().manual_seed(0)
    for b, n, mean in shapes:
        ctx = (mean * (0.7 + 0.6 * torch.rand(b, n, generator=cpu))).long().clamp(min=n)
        ctx = ctx.sort(dim=1).values.to(torch.int32).cuda()
        keys = torch.randn(b, int(ctx.max()), 128, device="cuda", generator=g).to(torch.bfloat16)
        cache, table = make_paged_kv_cache(keys, ctx, 64, "fp8")
        del keys
        qd = formats.quantize_q(torch.randn(b, n, 64, 128, device="cuda", generator=g), "fp8")
        w = torch.randn(b * n, 64, device="cuda", generator=g)
        meta = tilefuse.get_paged_mqa_logits_metadata(ctx, 64, sms)
        width = int(ctx.max())
        if op == "paged-topk":
            fn = lambda: tilefuse.fp8_fp4_paged_mqa_topk(qd, cache, w, ctx, table, meta, width, 2048)
        else:
            fn = lambda: tilefuse.fp8_fp4_paged_mqa_logits(qd, cache, w, ctx, table, meta, width)
        shapes_done = f"B{b} n{n} ctx{mean}"
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                fn()
        samples = []
        for _ in range(25):
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); graph.replay(); e.record(); torch.cuda.synchronize()
            samples.append(a.elapsed_time(e) * 1e3 / 5)
        samples.sort()
        res[shapes_done] = samples[len(samples) // 2]
        del graph, cache, table
    shapes = []
for s_q, s_k, dt in shapes:
    q = torch.randn(s_q, 64, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(s_k, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
    ksc = torch.rand(s_k, device="cuda", generator=g) + 0.5
    w = torch.randn(s_q, 64, device="cuda", generator=g)
    ke = torch.arange(s_k - s_q + 1, s_k + 1, dtype=torch.int32, device="cuda")
    ks = torch.zeros(s_q, dtype=torch.int32, device="cuda")
    dtype = getattr(torch, dt)
    if op == "topk":
        fn = lambda: tilefuse.fp8_fp4_mqa_topk((q, None), (k, ksc), w, ks, ke, 2048, dtype)
    else:
        fn = lambda: tilefuse.fp8_fp4_mqa_logits((q, None), (k, ksc), w, ks, ke, True, 0, dtype)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(5):
            fn()
    samples = []
    for _ in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / 5)
    samples.sort()
    res[f"{s_q}/{s_k} {dt}"] = samples[len(samples) // 2]
    del graph
print("RESULT " + json.dumps(res))
"""


def _run_tree(tree: str, shapes, op: str = "logits") -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(shapes), op], env=env, capture_output=True,
                         text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{tree}: no result\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", type=int, default=None, help="time the first N shapes only")
    ap.add_argument("--op", choices=("logits", "topk", "paged", "paged-topk"), default="logits")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    shapes = {"topk": TOPK_SHAPES, "paged": PAGED_SHAPES, "paged-topk": PAGED_TOPK_SHAPES}.get(a.op, SHAPES)[:a.shapes]
    per_round: dict[str, list[dict]] = {t: [] for t in a.trees}
    for r in range(a.rounds):
        order = a.trees[r % len(a.trees):] + a.trees[:r % len(a.trees)]
        for tree in order:
            per_round[tree].append(_run_tree(tree, shapes, a.op))
            print(f"round {r} {tree} done", flush=True)
    table = {t: {k: statistics.median(rnd[k] for rnd in rounds) for k in rounds[0]}
             for t, rounds in per_round.items()}
    base = a.trees[0]
    names = list(table[base])
    print(f"{'shape':<22}" + "".join(f"{os.path.basename(t.rstrip('/')):>14}" for t in a.trees))
    for k in names:
        print(f"{k:<22}" + "".join(f"{table[t][k]:>11.1f} us" for t in a.trees))
    for k in names:
        print(f"{k:<22}" + "".join(f"{table[base][k] / table[t][k]:>13.3f}x" for t in a.trees))
    if a.output:
        from tilefuse.bench.env import environment

        with open(a.output, "w") as f:
            json.dump({"environment": environment(), "us": table, "rounds": per_round}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
