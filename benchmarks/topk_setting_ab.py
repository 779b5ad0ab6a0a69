"""The fused top-k at several values of its module settings (``tilefuse.indexer.topk``'s ints),
side by side in one rotation with tilefuse logits + ``torch.topk``.

Each variant is captured in its own CUDA graph with the values it names, every output checked
bitwise against the first variant's (and that one against the suite's reference rows).

    python benchmarks/topk_setting_ab.py --setting _MERGE_MAXNREG --values 64 80 [--shapes 2048x32768 64x1x32768]
        [--fix _WHOLE_ROWS_BYTES=0 ...] [--output ab.json]
    python benchmarks/topk_setting_ab.py --variants _WHOLE_ROWS_BYTES=100663296 \
        _WHOLE_ROWS_BYTES=0,_DECODE_CHUNK_STATES=32 [--shapes 64x1x32768]

``--fix NAME=VALUE`` holds other settings at a value for every variant (e.g. decode rows in
chunks where they would be taken whole); ``--variants`` names several settings a variant.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilefuse.bench import env
from tilefuse.bench.suites import topk as suite
from tilefuse.bench.timing import measure
from tilefuse.indexer import topk as T


def _with(fn, settings: dict[str, int]):
    def run():
        for name, value in settings.items():
            setattr(T, name, value)
        return fn()
    return run


def _label(settings: dict[str, int]) -> str:
    return "fused " + ",".join(f"{n}={v}" for n, v in settings.items())


def full_settings(variants: list[dict[str, int]], before: dict[str, int]) -> list[dict[str, int]]:
    """Each variant's value of every setting any variant names: its own, else the value
    ``before`` the run (else a variant would run with whatever the variant before it left)."""
    return [{**before, **v} for v in variants]


def ab(case, variants: list[dict[str, int]], samples: int) -> dict:
    impls = {i.name: i for i in case.build()}
    fused, pair = impls["tilefuse"], impls["tilefuse+torch.topk"]
    before = {n: getattr(T, n) for v in variants for n in v}
    fns = {_label(v): _with(fused.fn, full) for v, full in zip(variants, full_settings(variants, before))}
    fns["tilefuse+torch.topk"] = pair.fn
    outs = {n: f() for n, f in fns.items() if n.startswith("fused")}
    torch.cuda.synchronize()
    base = outs[_label(variants[0])]
    checked = fused.check(base)
    same = {n: bool(torch.equal(o, base)) for n, o in outs.items()}
    stats = measure(fns, samples=samples)
    for name, value in before.items():
        setattr(T, name, value)
    us = {n: s.median_us for n, s in stats.items()}
    return {"case": case.name, "params": case.params, "us": us, "check": checked, "bitwise_equal_to_first": same,
            "stats": {n: s.to_dict() for n, s in stats.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", help="a module-level int of tilefuse.indexer.topk")
    ap.add_argument("--values", type=int, nargs="+", help="the setting's values; the first is the reference")
    ap.add_argument("--variants", nargs="+", metavar="NAME=VALUE[,NAME=VALUE]",
                    help="instead of --setting / --values: the settings of each variant, the first the reference")
    ap.add_argument("--shapes", nargs="+", default=["2048x32768", "2048x131072", "64x1x32768", "256x1x8192"])
    ap.add_argument("--fix", nargs="*", default=[], metavar="NAME=VALUE",
                    help="other int settings held at a value for every variant")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)

    def parse(text: str) -> dict[str, int]:
        return {n: int(v) for n, v in (item.split("=", 1) for item in text.split(",") if item)}

    if args.variants:
        variants = [parse(v) for v in args.variants]
    elif args.setting and args.values:
        variants = [{args.setting: v} for v in args.values]
    else:
        ap.error("give --setting and --values, or --variants")
    fixed = parse(",".join(args.fix))
    for name in {n for v in variants for n in v} | set(fixed):
        if not isinstance(getattr(T, name, None), int):
            print(f"topk_setting_ab: tilefuse.indexer.topk has no int setting {name!r}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("topk_setting_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    for name, value in fixed.items():
        setattr(T, name, int(value))
    cases = suite.cases(on_gpu=True, device="cuda", shapes=suite.parse_shapes(args.shapes))
    results = []
    for case in cases:
        r = ab(case, variants, args.samples)
        results.append(r)
        pair = r["us"]["tilefuse+torch.topk"]
        row = "  ".join(f"{n} {v:8.1f} ({pair / v:4.2f}x)" for n, v in r["us"].items() if n.startswith("fused"))
        print(f"{case.name}: {row}  pair {pair:8.1f}  "
              f"equal {all(r['bitwise_equal_to_first'].values())} checked {r['check']['passed']}",
              flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": env.environment("graph"), "variants": variants, "fixed": fixed,
                       "ab": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
