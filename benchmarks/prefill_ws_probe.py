"""The warp-specialised Hopper prefill kernel against the Gluon 2-D kernel (the op's default)
and the FP8 matmul ceiling of the same run: bit-for-bit check first (random and causal windows,
ragged S_q), then CUDA-graph timing of both at the target rows.

    python benchmarks/prefill_ws_probe.py --output prefill-ws.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

os.environ.setdefault("TILEFUSE_CHECK_WINDOWS", "0")

import prefill_sweep  # noqa: E402

from tilefuse.bench import ceilings, env, timing  # noqa: E402
from tilefuse.indexer import _prefill_kernel_gluon as gk  # noqa: E402
from tilefuse.indexer import _prefill_kernel_gluon_ws as wk  # noqa: E402
from tilefuse.indexer import windows as W  # noqa: E402

SHAPES = [(2048, 32768, 64), (2048, 32768, 32), (128, 32768, 64), (8192, 65536, 64)]


def two(s_q, s_k, h, ks, ke, clean, compressed, seed, **ws):
    (q8, _), (k8, k_sf), w = prefill_sweep.make(s_q, s_k, h, 128, "fp8", seed=seed)
    width = s_k if not compressed else int((ke - ks).clamp(min=0).max().item()) or 1
    a = torch.full((s_q, width), float("nan"), device="cuda")
    b = torch.full((s_q, width), float("nan"), device="cuda")
    gk.launch(q8, k8, k_sf, w, ks, ke, a, clean, compressed, 64, 128, 4, 4)
    wk.launch(q8, k8, k_sf, w, ks, ke, b, clean, compressed, **ws)
    torch.cuda.synchronize()
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def checks(**ws):
    out = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for s_q, s_k, h in [(200, 1000, 64), (37, 300, 32), (1, 129, 4), (384, 4096, 16), (130, 2000, 8)]:
        starts = torch.randint(0, s_k, (s_q,), device="cuda", generator=g, dtype=torch.int32)
        lens = torch.randint(0, s_k, (s_q,), device="cuda", generator=g, dtype=torch.int32)
        ks, ke = starts, torch.minimum(starts + lens, torch.tensor(s_k, device="cuda")).to(torch.int32)
        ke[::7] = ks[::7]  # empty rows
        ct_ks, ct_ke = W.causal_tail(s_q, s_k, device="cuda")
        for name, (a, b) in (("random", (ks, ke)), ("causal", (ct_ks, ct_ke))):
            for clean, comp in ((True, False), (False, False), (False, True), (True, True)):
                ok = two(s_q, s_k, h, a, b, clean, comp, seed=s_q + h, **ws)
                out.append({"shape": [s_q, s_k, h], "windows": name, "clean": clean, "compressed": comp, "equal": ok})
    return out


VARIANTS = {"self": dict(self_load=True), "loader1": dict(loader_warps=1), "loader4": dict(loader_warps=4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="prefill-ws.json")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--regs", default="200")
    ap.add_argument("--variants", default="self,loader1,loader4")
    ap.add_argument("--quick", action="store_true", help="two shapes, 2 buffers, no bitwise sweep")
    ap.add_argument("--maxnreg", type=int, default=168)
    args = ap.parse_args(argv)
    record = {"environment": env.environment("graph"), "ceilings": ceilings.measure_ceilings(), "rows": []}
    fp8 = ceilings.ceiling_value(record["ceilings"], "fp8_matmul")
    live = {}
    for name in args.variants.split(","):
        for r in args.regs.split(","):
            opts = dict(VARIANTS[name], consumer_regs=int(r), maxnreg=args.maxnreg or None)
            try:
                res = checks(**opts) if not args.quick else []
            except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported, not fatal)
                print(f"{name} regs{r}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                record.setdefault("failed", {})[f"{name} regs{r}"] = f"{type(e).__name__}: {str(e)[:500]}"
                continue
            bad = [c for c in res if not c["equal"]]
            print(f"{name} regs{r}: bitwise checks {len(res) - len(bad)} equal, {len(bad)} differ", bad[:3])
            record.setdefault("checks", {})[f"{name} regs{r}"] = res
            live[f"ws {name} regs{r}"] = opts
    table = []
    for s_q, s_k, h in SHAPES[:2] if args.quick else SHAPES:
        (q8, _), (k8, k_sf), w = prefill_sweep.make(s_q, s_k, h, 128, "fp8")
        ks, ke = W.causal_tail(s_q, s_k, device="cuda")
        flops = 2 * W.valid_pairs(ks, ke, s_k) * h * 128
        a = torch.empty(s_q, s_k, device="cuda")
        b = torch.empty(s_q, s_k, device="cuda")
        fns = {"gluon 2-D": functools.partial(gk.launch, q8, k8, k_sf, w, ks, ke, a, True, False, 64, 128, 4, 4)}
        for label, opts in live.items():
            for nb in (2,) if args.quick else (2, 4):
                fns[f"{label} buf{nb}"] = functools.partial(wk.launch, q8, k8, k_sf, w, ks, ke, b, True, False,
                                                            num_buf=nb, **opts)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        equal = torch.equal(a.view(torch.int32), b.view(torch.int32))
        stats = timing.time_graph(fns, calls=5, samples=args.samples)
        for name, st in stats.items():
            tf = flops / (st.median_us * 1e-6) / 1e12
            record["rows"].append({"s_q": s_q, "s_k": s_k, "h": h, "variant": name, "stats": st.to_dict(),
                                   "tflops": tf, "ceiling_ratio": tf / fp8, "equal_to_2d": equal})
            table.append((f"H{h} {s_q}/{s_k}", name, st.median_us, tf, tf / fp8, equal))
        del a, b
        torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)
    print(f"fp8 ceiling {fp8:.0f} TFLOP/s")
    for label, name, us, tf, ratio, eq in table:
        print(f"{label:16s} {name:28s} {us:9.1f} {tf:7.0f} {ratio:5.2f} equal={eq}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
