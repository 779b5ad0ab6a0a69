"""Launch-configuration sweep of the indexer prefill kernel on one GPU.

Times every (shape, format, config) row in graph mode against the FP8 and BF16 matmul
ceilings measured in the same run, after checking each config's complete output against the
dequantised reference. This is the measurement behind ``default_config`` in
``tilefuse/indexer/prefill.py``; the outcome of each run goes to ``benchmarks/NOTES.md``.

    python benchmarks/prefill_sweep.py --output sweep.json [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import torch

import tilefuse  # noqa: E402
from tilefuse import formats as F  # noqa: E402
from tilefuse import reference as R  # noqa: E402
from tilefuse.bench import ceilings, env, timing  # noqa: E402
from tilefuse.indexer import windows as W  # noqa: E402
from tilefuse.indexer.prefill import PrefillConfig  # noqa: E402

C = PrefillConfig
FP8_CONFIGS = [
    C(64, 128, 4, 3, head_unroll=2), C(64, 128, 4, 3, head_unroll=2, clean_pass=True), C(64, 128, 4, 3),
    C(64, 128, 4, 2), C(64, 128, 4, 4, head_unroll=2),
    C(128, 128, 8, 3, head_unroll=2), C(64, 256, 8, 3), C(64, 64, 4, 3),
]
SMALL_Q_CONFIGS = FP8_CONFIGS[:1] + [
    # (query row, head) pairs on the MMA's N side: the key tile loaded once per program.
    C(16, 64, 4, 3, heads_on_n=True), C(16, 128, 4, 3, heads_on_n=True), C(16, 128, 8, 3, heads_on_n=True),
    C(32, 64, 4, 3, heads_on_n=True), C(64, 128, 8, 3, heads_on_n=True),
]
FP4_CONFIGS = [
    C(64, 256, 8, 3, fp4_via_fp8=True), C(64, 256, 8, 3, fp4_via_fp8=True, clean_pass=True), C(64, 256, 8, 3),
    C(64, 128, 4, 2, head_unroll=2, fp4_via_fp8=True),
]
MX_CONFIGS = [
    C(64, 128, 4, 2, head_unroll=2), C(64, 128, 4, 2, head_unroll=2, mxfp8_via_f16=True),
    C(64, 128, 4, 2, head_unroll=2, clean_pass=True), C(64, 128, 4, 2),
    C(64, 256, 8, 3), C(128, 128, 8, 2),
]
MXF16_CONFIGS = [C(64, 128, 4, 2, head_unroll=2, mxfp8_via_f16=True),
                 C(64, 128, 4, 2, head_unroll=2, mxfp8_via_f16=True, clean_pass=True), C(64, 128, 4, 2, head_unroll=2)]


def config_name(cfg: PrefillConfig) -> str:
    flags = [f for f, on in (("u2", cfg.head_unroll == 2),
                             ("via-fp8", cfg.fp4_via_fp8), ("clean-pass", cfg.clean_pass),
                             ("via-f16", cfg.mxfp8_via_f16), ("heads-on-n", cfg.heads_on_n),
                             ("gluon", cfg.gluon), (f"refill{cfg.gluon_refill}", cfg.gluon_refill != 1),
                             (f"abs{cfg.relu_via_abs}", cfg.relu_via_abs)) if on]
    return "/".join([f"{cfg.block_q}x{cfg.block_n}", f"w{cfg.num_warps}s{cfg.num_stages}", *flags])


def make(s_q, s_k, h, d, fmt, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(s_k, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(s_q, h, device="cuda", generator=g)
    return F.quantize_q(q, fmt), F.quantize_k(k, fmt), w


def check(out, ref, idx, full_mask, logits_dtype, clean):
    mask_ok = bool(torch.equal(torch.isneginf(out.float()), ~full_mask)) if clean else True
    inside = ~torch.isneginf(ref)
    diff = R.calc_diff(torch.where(inside, out[idx].float(), ref), ref)
    bar = 3e-5 if logits_dtype == torch.bfloat16 else 5e-6
    return {"ok": mask_ok and diff < bar, "calc_diff": diff, "mask_exact": mask_ok}


H32_CONFIGS = [C(64, 128, 4, 3, head_unroll=2), C(64, 256, 8, 3, head_unroll=2), C(128, 128, 8, 3, head_unroll=2),
               C(64, 128, 4, 4, head_unroll=2), C(64, 128, 4, 3)]


# The head loop in Gluon (async wgmma: head h+1's MMA under head h's epilogue) beside the
# Triton defaults; num_stages is its ring of query buffers.
GLUON = [C(64, 128, 4, 3, gluon=True), C(64, 128, 4, 4, gluon=True), C(64, 128, 8, 3, gluon=True)]


def gluon_rows():
    """The Gluon head loop (its 2-D grid at the H200 default: 4 warps, 4 buffers) against the
    Triton loop on the same rows. The rounds behind it are in NOTES (round 6)."""
    base = dict(s_q=2048, s_k=32768, h=64, d=128, fmt="fp8", clean=True, logits=torch.float32)
    loops = FP8_CONFIGS[:1] + GLUON[1:2]
    yield base, loops
    yield {**base, "h": 32}, loops
    yield {**base, "s_q": 128}, loops
    yield {**base, "s_q": 8192, "s_k": 65536}, loops
    yield {**base, "fmt": "mxfp8"}, MXF16_CONFIGS[:1] + [C(64, 128, 4, 4, mxfp8_via_f16=True, gluon=True)]


def abs_rows():
    """The head sum through |s| (``relu_via_abs``: one FMA per score, the linear half as 2
    extra MMAs per tile) against the plain head sum, on the target rows."""
    base = dict(s_q=2048, s_k=32768, h=64, d=128, fmt="fp8", clean=True, logits=torch.float32)
    gluon = C(64, 128, 4, 4, gluon=True, gluon_refill=2)
    loops = [gluon, dataclasses.replace(gluon, relu_via_abs=2)]
    yield base, loops
    yield {**base, "h": 32}, loops
    yield {**base, "s_q": 128}, loops
    yield {**base, "s_q": 8192, "s_k": 65536}, loops
    yield {**base, "clean": False}, loops[:2]
    fp4 = FP4_CONFIGS[0]
    yield {**base, "fmt": "mxfp4"}, [fp4, dataclasses.replace(fp4, relu_via_abs=2)]


def abs_tile_rows():
    """Tiles and rings around the relu_via_abs default, on the rows still short of their targets
    (128/32768: about 2 waves of 64x128 tiles; H32)."""
    base = dict(s_q=2048, s_k=32768, h=64, d=128, fmt="fp8", clean=True, logits=torch.float32)
    best = C(64, 128, 4, 4, gluon=True, gluon_refill=2, relu_via_abs=2)
    tiles = [best, dataclasses.replace(best, block_n=64), dataclasses.replace(best, num_stages=3),
             dataclasses.replace(best, gluon_refill=1), dataclasses.replace(best, num_stages=6)]
    yield {**base, "s_q": 128}, tiles
    yield {**base, "h": 32}, tiles[:1] + tiles[2:]
    yield base, tiles[:1] + tiles[3:4]
    yield {**base, "s_q": 8192, "s_k": 65536}, tiles[:1] + tiles[3:4]


def bf16_d64_rows():
    """The rows of the prefill issue still behind DeepGEMM's ratio target (bf16 logits, D 64):
    the Triton loop (the bf16 default) against the Gluon head loop, with and without |s|."""
    base = dict(s_q=2048, s_k=32768, h=64, d=128, fmt="fp8", clean=True, logits=torch.bfloat16)
    gluon = C(64, 128, 4, 4, gluon=True, relu_via_abs=2)
    loops = [C(64, 128, 4, 3, head_unroll=2, clean_pass=True), gluon, dataclasses.replace(gluon, gluon_refill=2),
             dataclasses.replace(gluon, relu_via_abs=0)]
    yield base, loops
    yield {**base, "s_q": 8192, "s_k": 65536}, loops[:3]
    yield {**base, "clean": False}, loops[:3]
    yield {**base, "d": 64, "s_k": 8192, "logits": torch.float32}, loops[1:]
    yield {**base, "d": 64, "s_k": 8192}, loops[:3]


def rows(quick: bool, row_set: str):
    base = dict(s_q=2048, s_k=32768, h=64, d=128, clean=True, logits=torch.float32)
    if row_set == "bf16-d64":
        yield from bf16_d64_rows()
        return
    if row_set == "gluon":
        yield from gluon_rows()
        return
    if row_set == "abs":
        yield from abs_rows()
        return
    if row_set == "abs-tiles":
        yield from abs_tile_rows()
        return
    if row_set == "small":
        for s_q, s_k in [(128, 32768), (16, 65536)]:
            yield {**base, "s_q": s_q, "s_k": s_k, "fmt": "fp8"}, SMALL_Q_CONFIGS
        return
    if row_set == "h32":
        yield {**base, "h": 32, "fmt": "fp8"}, H32_CONFIGS
        return
    if row_set == "schedules":
        # The clean-logits schedule per format (inline vs separate pass), and clean=False beside.
        for logits in (torch.float32, torch.bfloat16):
            yield {**base, "fmt": "fp8", "logits": logits}, FP8_CONFIGS[:2]
        yield {**base, "fmt": "fp8", "clean": False}, FP8_CONFIGS[:1]
        yield {**base, "fmt": "mxfp8"}, MXF16_CONFIGS
        yield {**base, "fmt": "mxfp8", "clean": False}, MXF16_CONFIGS[:1]
        yield {**base, "fmt": "mxfp4"}, FP4_CONFIGS[:2]
        yield {**base, "fmt": "mxfp4", "clean": False}, FP4_CONFIGS[:1]
        return
    big = [(2048, 32768)] + ([] if quick else [(4096, 8192)])
    for s_q, s_k in big:
        yield dict(s_q=s_q, s_k=s_k, h=64, d=128, fmt="fp8", clean=True, logits=torch.float32), FP8_CONFIGS
    for s_q, s_k in [(128, 32768), (16, 65536)]:
        yield dict(s_q=s_q, s_k=s_k, h=64, d=128, fmt="fp8", clean=True, logits=torch.float32), SMALL_Q_CONFIGS
    yield dict(s_q=2048, s_k=32768, h=64, d=128, fmt="fp8", clean=True, logits=torch.bfloat16), FP8_CONFIGS[:2]
    yield dict(s_q=2048, s_k=32768, h=64, d=128, fmt="mxfp8", clean=True, logits=torch.float32), MX_CONFIGS
    yield dict(s_q=2048, s_k=32768, h=64, d=128, fmt="mxfp4", clean=True, logits=torch.float32), FP4_CONFIGS


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="prefill-sweep.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--peer", action="store_true", help="DeepGEMM's FP8 call as a row of each FP8 shape (same graphs)")
    ap.add_argument("--set", default="all", choices=("all", "schedules", "small", "h32", "gluon", "abs", "abs-tiles",
                                                      "bf16-d64"),
                    help="rows: all; schedules (clean-logits schedule per format, clean on and off); small "
                         "(128/32768 and 16/65536 with the few-row tiles); h32 (H = 32 tiles); gluon (the "
                         "Gluon head loop against the Triton loop); abs (relu_via_abs against the defaults); abs-tiles "
                         "(tiles and rings around it); bf16-d64 (bf16 logits and D 64, the Triton and Gluon loops)")
    ap.add_argument("--formats", default="fp8,mxfp8,mxfp4", help="comma-separated formats to sweep")
    args = ap.parse_args(argv)
    record = {"environment": env.environment("graph"), "ceilings": ceilings.measure_ceilings(), "rows": []}
    fp8_ceiling = ceilings.ceiling_value(record["ceilings"], "fp8_matmul")
    bf16_ceiling = ceilings.ceiling_value(record["ceilings"], "bf16_matmul")
    print(f"ceilings: fp8 {fp8_ceiling:.0f}  bf16 {bf16_ceiling:.0f} TFLOP/s", flush=True)
    table = []
    for shape, configs in rows(args.quick, args.set):
        if shape["fmt"] not in args.formats.split(","):
            continue
        qq, kk, w = make(shape["s_q"], shape["s_k"], shape["h"], shape["d"], shape["fmt"])
        ks, ke = W.causal_tail(shape["s_q"], shape["s_k"], device="cuda")
        flops = 2 * W.valid_pairs(ks, ke, shape["s_k"]) * shape["h"] * shape["d"]
        # Complete -inf masks; values on 256 rows spread over the output (fp32 reference cost).
        idx = torch.linspace(0, shape["s_q"] - 1, min(256, shape["s_q"]), device="cuda").round().long().unique()
        full_mask = R.window_mask(ks, ke, shape["s_k"])
        q_rows = (qq[0][idx], None if qq[1] is None else qq[1][idx])
        ref = R.fp8_fp4_mqa_logits_ref(q_rows, kk, w[idx], ks[idx], ke[idx])
        fns, checks = {}, {}
        for cfg in configs:
            name = config_name(cfg)
            fn = functools.partial(tilefuse.fp8_fp4_mqa_logits, qq, kk, w, ks, ke, shape["clean"], 0,
                                   shape["logits"], config=cfg)
            try:
                t0 = time.time()
                out = fn()
                torch.cuda.synchronize()
                checks[name] = check(out, ref, idx, full_mask, shape["logits"], shape["clean"])
                checks[name]["first_call_s"] = time.time() - t0
                del out
                fns[name] = fn
            except Exception as e:  # a config that does not compile or launch is a row, not a crash
                checks[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{name}: {checks[name]['error']}", flush=True)
        if args.peer and shape["fmt"] == "fp8":
            try:
                import deep_gemm as dg

                fns["deep_gemm"] = functools.partial(dg.fp8_fp4_mqa_logits, qq, kk, w, ks, ke,
                                                     clean_logits=shape["clean"], logits_dtype=shape["logits"])
                checks["deep_gemm"] = check(fns["deep_gemm"](), ref, idx, full_mask, shape["logits"], shape["clean"])
            except Exception as e:  # no peer, or a peer without this call: the row says so
                fns.pop("deep_gemm", None)
                checks["deep_gemm"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        del ref, full_mask
        # Every captured call keeps its output alive: stay within ~40 GiB of retained logits.
        out_bytes = shape["s_q"] * shape["s_k"] * 4
        calls = max(1, min(5, (40 << 30) // max(1, out_bytes * len(fns))))
        stats = timing.time_graph(fns, calls=calls, samples=args.samples) if fns else {}
        ceiling = fp8_ceiling if shape["fmt"] == "fp8" else bf16_ceiling
        label = (f"{shape['fmt']} H{shape['h']} {shape['s_q']}/{shape['s_k']} clean={int(shape['clean'])} "
                 f"{str(shape['logits']).replace('torch.', '')}")
        for name in checks:
            row = {**{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in shape.items()}, "config": name,
                   "check": checks[name]}
            if name in stats:
                tflops = flops / (stats[name].median_us * 1e-6) / 1e12
                row.update(stats=stats[name].to_dict(), tflops=tflops, ceiling_ratio=tflops / ceiling)
                table.append((label, name, stats[name].median_us, tflops, tflops / ceiling, checks[name]["ok"]))
                print(f"{label} {name}: {stats[name].median_us:.1f} us {tflops:.0f} TFLOP/s "
                      f"ok={checks[name]['ok']}", flush=True)
            else:
                table.append((label, name, float("nan"), float("nan"), float("nan"), False))
            record["rows"].append(row)
        torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{'shape':44s} {'config':22s} {'us':>9s} {'TFLOP/s':>8s} {'ceil':>5s} ok")
    for label, name, us, tf, ratio, ok in table:
        print(f"{label:44s} {name:22s} {us:9.1f} {tf:8.0f} {ratio:5.2f} {'y' if ok else 'N'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
