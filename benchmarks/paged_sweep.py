"""Launch-configuration sweep of the paged decode kernel on one GPU.

Times each (row, config) in graph mode against the copy bandwidth measured in the same run,
after checking each config's complete output against the dequantised reference, with
DeepGEMM's kernel in the same timing call when it imports (its ratio printed per config). The
rows are the speed targets of the paged op (block 64, FP8, fp32 logits, 2-D context lengths
uniform in 0.7-1.3 of the mean); bytes = KV pages read + logits written. The outcome goes to
``benchmarks/NOTES.md`` and the winners into ``default_paged_config``.

``--layers N``: N copies of the cache, queries and weights (one table, lengths and metadata, as a
model's layers share them), the captured calls cycling through them: a row whose pages fit in
the 60 MB L2 is then not timed out of L2 (every call of an engine's decode step reads another
layer's cache).

    python benchmarks/paged_sweep.py --output paged-sweep.json
    python benchmarks/paged_sweep.py --rows 8x1x32768 1x1x131072/32 --grid schedule --layers 5
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

import tilefuse
from tilefuse import formats as F
from tilefuse import reference as R
from tilefuse._jit import next_power_of_2
from tilefuse.bench import ceilings, env, timing
from tilefuse.indexer.paged import PagedConfig, default_paged_config, make_paged_kv_cache

# (B, next_n, mean context): the rows with targets, and next_n 2 / 4 beside next_n 1 at the
# same B and context (each key read once: <= 1.15x the next_n = 1 time).
ROWS = [(64, 1, 8192), (256, 1, 8192), (64, 2, 32768), (1, 1, 65536),
        (256, 2, 8192), (256, 4, 8192), (64, 4, 32768), (64, 1, 32768)]
# The same B = 64 row with the output as wide as a model's longest context, as serving engines
# call it (max_context_len = max_model_len): most chunk programs find no keys.
WIDE_ROWS = [(64, 1, 8192, 163840)]
H, D, BLOCK_KV = 64, 128, 64


def configs(next_n: int, heads: int = H, grid: str = "tuning") -> list[PagedConfig]:
    """``default``: the default alone; ``tuning``: the default and its neighbours; ``schedule``:
    also the chunk per program (64-4096 keys), the head sum on the tensor cores and two
    warpgroups per 128-key tile (128-key tiles where the default's are 64 lost: NOTES round (32));
    ``persistent``: the default beside the persistent kernel at
    one to three programs an SM, rings of 4 to 8 buffers and (next_n > 1) its MMA split by rows."""
    base = default_paged_config("fp8", next_n, heads, D, BLOCK_KV)
    rep = lambda **kw: PagedConfig(**{**base.__dict__, **kw})  # noqa: E731
    if grid == "default":
        return [base]
    if grid == "persistent":
        # (programs an SM are capped by the columns: 3 up to 64, 2 up to 128, 1 above)
        split = [rep(persistent=True, ctas_per_sm=0, num_stages=4, split_columns=True)] if next_n > 1 else []
        return list(dict.fromkeys([base, rep(persistent=True, ctas_per_sm=0, num_stages=4),
                                   rep(persistent=True, ctas_per_sm=0, num_stages=6),
                                   rep(persistent=True, ctas_per_sm=2, num_stages=4),
                                   rep(persistent=True, ctas_per_sm=1, num_stages=8), *split]))
    out = [base] + [rep(chunk=c) for c in (512, 1024, 2048)]
    out += [rep(block_n=64, num_stages=4), rep(num_stages=2), rep(num_stages=4), rep(num_warps=8)]
    if grid == "schedule":
        out += [rep(chunk=c) for c in (64, 128, 256, 4096)]
        out += [rep(head_sum_mma=True), rep(head_sum_mma=True, chunk=1024)]
        out += [rep(num_warps=8, chunk=c) for c in (256, 1024)]
        out += [rep(num_stages=2, chunk=c) for c in (256, 1024)]
    if next_n > 1:
        out += [rep(rows=1, num_warps=4, num_stages=4)]
    if next_n > 2:  # every row in one program (256 dot columns at H 64, 8 warps): slower at H 64
        out += [rep(rows=next_power_of_2(next_n), num_warps=8, num_stages=3)]
    return list(dict.fromkeys(out))


def name_of(cfg: PagedConfig) -> str:
    if cfg.persistent:
        return (f"persistent {cfg.ctas_per_sm or 'default'}/SM st{cfg.num_stages}"
                + (" split" if cfg.split_columns else ""))
    mma = " mma" if cfg.head_sum_mma else ""
    return f"n{cfg.block_n} r{cfg.rows} chunk{cfg.chunk} w{cfg.num_warps} st{cfg.num_stages}{mma}"


def parse_row(text: str) -> tuple[int, int, int, int]:
    """``BxNEXT_NxCTX`` or ``BxNEXT_NxCTX/H`` (heads, default 64)."""
    shape, _, heads = text.partition("/")
    b, n, c = (int(v) for v in shape.split("x"))
    return b, n, c, int(heads or H)


def make_row(b: int, next_n: int, mean: int, out_cols: int | None = None, seed: int = 0, heads: int = H):
    g = torch.Generator().manual_seed(seed)
    ctx = (mean * (0.7 + 0.6 * torch.rand(b, next_n, generator=g))).long().clamp(min=next_n)
    ctx = ctx.sort(dim=1).values.to(torch.int32).cuda()
    keys = torch.randn(b, int(ctx.max()), D, generator=g).to(torch.bfloat16).cuda()
    cache, table = make_paged_kv_cache(keys, ctx, BLOCK_KV, "fp8", generator=g)
    q = F.quantize_q(torch.randn(b, next_n, heads, D, generator=g).cuda(), "fp8")
    w = torch.randn(b * next_n, heads, generator=g).cuda()
    max_len = out_cols or int(ctx.max())
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = tilefuse.get_paged_mqa_logits_metadata(ctx, BLOCK_KV, num_sms)
    kv_bytes = int(((ctx.max(dim=1).values.long() + BLOCK_KV - 1) // BLOCK_KV).sum()) * BLOCK_KV * (D + 4)
    return dict(q=q, cache=cache, w=w, ctx=ctx, table=table, meta=meta, max_len=max_len,
                bytes=kv_bytes + b * next_n * int(ctx.max()) * 4)  # columns the kernel writes (no clean)


def add_layers(row, layers: int) -> None:
    """``row["layers"]``: ``layers`` (queries, cache, weights), the first the row's own, the others
    copies at other addresses (the same values: the check of the first holds for all)."""
    row["layers"] = [(row["q"], row["cache"], row["w"])]
    for _ in range(layers - 1):
        q, sf = row["q"]
        row["layers"].append(((q.clone(), None if sf is None else sf.clone()), row["cache"].clone(), row["w"].clone()))


def cycling(call_layer, layers: int):
    """A callable running ``call_layer(i)`` for i = 0, 1, .. layers - 1, 0, .. on successive calls
    (a graph of ``calls`` captured calls reads that many different layers)."""
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % layers
        return call_layer(i)
    return call


def deep_gemm_call(row):
    """DeepGEMM's decode kernel on the row's inputs (None when it does not import); with
    ``row["layers"]``, cycling through them."""
    try:
        import deep_gemm
    except Exception:
        return None
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = deep_gemm.get_paged_mqa_logits_metadata(row["ctx"], BLOCK_KV, num_sms)
    layers = row.get("layers") or [(row["q"], row["cache"], row["w"])]

    def layer(i):
        q, cache, w = layers[i]
        return deep_gemm.fp8_paged_mqa_logits(q[0], cache, w, row["ctx"], row["table"], meta, row["max_len"], False)
    return cycling(layer, len(layers))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="paged-sweep.json")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--rows", nargs="+", type=parse_row, help="BxNEXT_NxCTX[/H] (default: the target rows)")
    ap.add_argument("--grid", choices=("tuning", "schedule", "default", "persistent"), default="tuning")
    ap.add_argument("--layers", type=int, default=1, help="caches the timed calls cycle through (default 1)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("paged_sweep: needs a CUDA GPU (graph-mode timing beside the copy ceiling)", file=sys.stderr)
        return 2
    record = {"environment": env.environment("graph"), "ceilings": ceilings.measure_ceilings(), "rows": [],
              "grid": args.grid, "layers": args.layers}
    copy = ceilings.ceiling_value(record["ceilings"], "copy")
    print(f"copy ceiling {copy:.2f} TB/s", flush=True)
    rows = [(b, n, c, H, None) for b, n, c in ROWS] + [(b, n, c, H, w) for b, n, c, w in WIDE_ROWS]
    if args.rows:
        rows = [(b, n, c, h, None) for b, n, c, h in args.rows]
    table = []
    printed = 0
    for b, next_n, mean, heads, wide in rows:
        row = make_row(b, next_n, mean, wide, heads=heads)
        add_layers(row, args.layers)
        args_ = (row["q"], row["cache"], row["w"], row["ctx"], row["table"], row["meta"], row["max_len"])
        ref = R.fp8_fp4_paged_mqa_logits_ref(row["q"], row["cache"], row["w"], row["ctx"], row["table"],
                                             row["max_len"])
        inside = ~torch.isneginf(ref)
        fns, checks = {}, {}
        for cfg in configs(next_n, heads, args.grid):
            name = name_of(cfg)
            fn = functools.partial(tilefuse.fp8_fp4_paged_mqa_logits, *args_, config=cfg)
            try:
                out = fn()
                torch.cuda.synchronize()
                diff = R.calc_diff(torch.where(inside, out.float(), ref), ref)
                checks[name] = {"ok": diff < 5e-6 and not out[inside].isnan().any().item(), "calc_diff": diff}

                def layer(i, cfg=cfg, layers=row["layers"], shared=args_[3:]):
                    q, cache, w = layers[i]
                    return tilefuse.fp8_fp4_paged_mqa_logits(q, cache, w, *shared, config=cfg)
                fns[name] = cycling(layer, args.layers)
            except Exception as e:  # a config that does not compile or launch is a row, not a crash
                checks[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        peer = deep_gemm_call(row) if next_n <= 2 else None  # DeepGEMM runs next_n 1 and 2 on SM90
        if peer is not None:
            fns["deep_gemm"] = peer
            checks["deep_gemm"] = {"ok": True, "calc_diff": None}
        stats = timing.time_graph(fns, calls=5, samples=args.samples) if fns else {}
        peer_us = stats["deep_gemm"].median_us if "deep_gemm" in stats else None
        label = f"B{b} n{next_n} ctx{mean} H{heads}" + (f" cols{wide}" if wide else "")
        for name, check in checks.items():
            entry = {"batch": b, "next_n": next_n, "mean_context": mean, "heads": heads, "config": name,
                     "check": check, "bytes": row["bytes"], "max_context_len": row["max_len"]}
            if name in stats:
                us = stats[name].median_us
                tbps = row["bytes"] / (us * 1e-6) / 1e12
                speed = peer_us / us if peer_us else None
                entry.update(stats=stats[name].to_dict(), tbps=tbps, copy_ratio=tbps / copy, deep_gemm_speed=speed)
                table.append((label, name, us, tbps, tbps / copy, speed, check["ok"]))
            record["rows"].append(entry)
        del row, ref, inside, fns
        torch.cuda.empty_cache()
        # Each row as it is timed, the file rewritten: a run cut short by a time limit keeps its rows.
        for line in table[printed:]:
            print(_line(*line), flush=True)
        printed = len(table)
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)
    print(f"\n{'row':24s} {'config':30s} {'us':>8s} {'TB/s':>6s} {'copy':>5s} {'vs DG':>6s} ok")
    for line in table:
        print(_line(*line))
    return 0


def _line(label, name, us, tbps, ratio, speed, ok) -> str:
    vs = f"{speed:6.2f}" if speed else "     -"
    return f"{label:24s} {name:30s} {us:8.1f} {tbps:6.2f} {ratio:5.2f} {vs} {'y' if ok else 'N'}"


if __name__ == "__main__":
    sys.exit(main())
