"""The ``tilefuse`` command.

    tilefuse env                                  environment record (what result files carry)
    tilefuse bench indexer [--reproduce] [...]    prefill logits at the reference shapes
    tilefuse bench paged [...]                    paged decode logits
    tilefuse bench serving [...]                  the indexer in an engine's step loop
    tilefuse bench ag-gemm|gemm-rs [...]          fused tensor-parallel GEMMs (tilefuse.bench.suites.tp)
    tilefuse compare before.json after.json       per-row speedups; exit 1 on a regression of a tilefuse row
    tilefuse plot results.json [-o out.png]       PNG of a result file (default: results.png beside it)
    tilefuse kernels [...]                        kernel checks (tilefuse.kernelcheck.cli)

Exit codes: 0 success; 1 a regression (compare) or a row that failed its check (bench);
2 bad usage, files that share no tilefuse row (compare), or a part of tilefuse that is not
installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from tilefuse.bench import timing
from tilefuse.bench.report import results_root

_DELEGATED_BENCH = {"ag-gemm", "gemm-rs"}
# Interpreter runs take a fraction of a second per call: a few samples show the flow.
_CPU_DEFAULTS = {"samples": 3, "calls": 2, "iters": 2, "warmup": 1}


def _delegate(module: str, func: str, argv: list[str], what: str) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            print(f"tilefuse {what}: {module} is not part of this installation of tilefuse", file=sys.stderr)
            return 2
        raise
    rc = getattr(mod, func)(argv)
    return int(rc or 0)


# ---------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------
def _add_bench_options(p: argparse.ArgumentParser, shapes_help: str) -> None:
    p.add_argument("--mode", choices=timing.MODES, default="graph",
                   help="timing mode (default graph; periter numbers are not comparable)")
    p.add_argument("--samples", type=int, help="timed samples per row (default 40; 3 on CPU)")
    p.add_argument("--calls", type=int, help="calls captured per graph in graph mode (default 5)")
    p.add_argument("--iters", type=int, help="launches per sample in batch mode (default 20)")
    p.add_argument("--warmup", type=int, help="warm-up launches in batch/periter mode (default 5)")
    p.add_argument("--l2-flush", action="store_true", help="flush L2 before each timed replay/launch")
    p.add_argument("--no-clocks", action="store_true", help="do not sample clocks and power with NVML")
    p.add_argument("--shapes", nargs="+", help=shapes_help)
    p.add_argument("--output", "-o",
                   help=f"result JSON (default {results_root()}/<gpu>/<suite>-<time>.json: benchmarks/results of "
                        "the source checkout tilefuse runs from, whatever the current directory, else of the "
                        "current directory; the path written is printed)")
    p.add_argument("--no-output", action="store_true", help="do not write a result file")
    p.add_argument("--plot", help="also write a PNG plot here (needs matplotlib)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress, no table")


def _add_suite_parser(bsub, suite: str, suite_help: str, shapes_help: str, formats: str,
                      formats_help: str) -> argparse.ArgumentParser:
    """The parser of ``tilefuse bench <suite>``: the bench options and ``--formats`` (default
    ``formats``); the caller adds the suite's own options."""
    p = bsub.add_parser(suite, help=suite_help)
    _add_bench_options(p, shapes_help)
    p.add_argument("--formats", default=formats, help=formats_help)
    p.set_defaults(func=lambda a: _run_bench(suite, a))
    return p


def _settings(args, on_gpu: bool):
    from tilefuse.bench.runner import Settings

    defaults = {} if on_gpu else _CPU_DEFAULTS
    kw = {"mode": args.mode, "l2_flush": args.l2_flush, "clocks": not args.no_clocks}
    for name in ("samples", "calls", "iters", "warmup"):
        value = getattr(args, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            kw[name] = value
    return Settings(**kw)


def _run_bench(suite: str, args) -> int:
    from tilefuse.bench import report
    from tilefuse.bench.env import gpu_slug, on_gpu
    from tilefuse.bench.runner import run_suite

    if args.plot:
        import matplotlib  # noqa: F401  (fail before the run, not after it)
    gpu = on_gpu()
    device = "cuda" if gpu else "cpu"
    settings = _settings(args, gpu)
    if suite == "indexer":
        from tilefuse.bench.suites import indexer as mod

        fmts = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        cases = mod.cases(on_gpu=gpu, device=device, shapes=mod.parse_shapes(args.shapes), fmts=fmts,
                          reproduce=args.reproduce)
        extra = {"reproduce": args.reproduce, "formats": list(fmts)}
        name = "indexer-reproduce" if args.reproduce else "indexer"
    elif suite == "topk":
        from tilefuse.bench.suites import topk as mod

        fmts = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        chunks = {"chunk_k": mod.parse_chunks(args.chunk_k, "chunk-k"),
                  "chunk_q": mod.parse_chunks(args.chunk_q, "chunk-q")}
        cases = mod.cases(on_gpu=gpu, device=device, shapes=mod.parse_shapes(args.shapes), fmts=fmts, **chunks)
        extra, name = {"formats": list(fmts), **chunks}, "topk"
    else:
        from tilefuse.bench.suites import paged as mod

        fmts = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        cases = mod.cases(on_gpu=gpu, device=device, shapes=mod.parse_shapes(args.shapes), fmts=fmts,
                          sweep=args.sweep)
        extra = {"formats": list(fmts), "sweep": args.sweep}
        name = "paged-sweep" if args.sweep else "paged"
    progress = report.Progress(len(cases), enabled=not args.quiet)
    if not gpu:
        progress.note("no CUDA device: tiny shapes through the Triton interpreter (not performance numbers)")
    path = None if args.no_output else (args.output or report.default_output_path(name, gpu_slug()))
    # The rows done so far are kept in the file as the run goes: a run cut by a time limit keeps them.
    partial = (lambda res: report.write_result(res, path)) if path is not None else None
    result = run_suite(name, cases, settings, progress=progress, extra_settings=extra, partial=partial)
    if not args.quiet:
        print(report.results_table(result))
    if path is not None:
        print(f"results: {report.write_result(result, path)}", file=sys.stderr)
    if args.plot:
        from tilefuse.bench.plot import plot_result

        print(f"plot: {plot_result(result, args.plot)}", file=sys.stderr)
    bad = [r for r in result["rows"] if r["status"] in ("failed", "error")]
    for r in bad:
        print(f"{r['status'].upper()}: {r['key']}: {r['note']}", file=sys.stderr)
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------
# other commands
# ---------------------------------------------------------------------------------------
def _cmd_env(args) -> int:
    from tilefuse.bench.env import environment

    env = environment()
    if args.json:
        print(json.dumps(env, indent=1))
    else:
        width = max(len(k) for k in env)
        for k, v in env.items():
            print(f"{k.ljust(width)}  {v}")
    return 0


def _cmd_compare(args) -> int:
    from tilefuse.bench.compare import compare, comparison_table, context_warnings
    from tilefuse.bench.report import load_result

    before, after = load_result(args.before), load_result(args.after)
    diffs = compare(before, after, tolerance=args.tolerance, fail_on_missing=args.fail_on_missing,
                    significant_only=args.significant_only)
    for w in context_warnings(before, after):
        print(f"warning: {w}", file=sys.stderr)
    print(comparison_table(diffs))
    regressions = [d for d in diffs if d.regression]
    compared = [d for d in diffs if not d.peer and d.before_us is not None and d.after_us is not None]
    peers = sum(d.peer for d in diffs)
    print(f"{len(regressions)} regression(s) beyond {args.tolerance:.1%} in {len(compared)} tilefuse rows "
          f"timed in both files ({peers} peer rows shown, not gated)")
    return 1 if regressions else 0


def _cmd_plot(args) -> int:
    from tilefuse.bench.plot import plot_result
    from tilefuse.bench.report import load_result

    output = args.output or os.path.splitext(args.results)[0] + ".png"
    print(plot_result(load_result(args.results), output, title=args.title))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tilefuse", description="fused Triton kernels and their measurements")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="print the environment record")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_env)

    bench = sub.add_parser("bench", help="run a benchmark suite")
    bsub = bench.add_subparsers(dest="suite", required=True)
    p = _add_suite_parser(bsub, "indexer", "prefill logits at the reference shapes",
                          "only these S_QxS_K shapes, e.g. 2048x32768 128x32768 (--reproduce: the first)",
                          "fp8,mxfp8,mxfp4", "comma-separated formats")
    p.add_argument("--reproduce", action="store_true",
                   help="check all-zero and random outputs, then time clean x metadata x format on one shape")
    p = _add_suite_parser(bsub, "paged", "paged decode logits",
                          "only these BxNEXT_NxMEAN_CTX rows, e.g. 64x1x8192 256x2x32768",
                          "fp8", "comma-separated formats (fp8, mxfp8, mxfp4)")
    p.add_argument("--sweep", action="store_true",
                   help="the decode sweep grid (B x mean ctx x next_n x H x page size x logits dtype) beside DeepGEMM")
    bsub.add_parser("serving", help="the indexer in an engine's step loop; options: tilefuse bench serving --help")
    p = _add_suite_parser(bsub, "topk", "indexer logits + top-k, fused and unfused",
                          "only these S_QxS_K prefill and BxNEXT_NxMEAN_CTX decode rows, e.g. 2048x32768 64x2x8192",
                          "fp8", "comma-separated formats (fp8, mxfp8, mxfp4)")
    p.add_argument("--chunk-k", help="comma-separated key chunk sizes to sweep (default: the op's)")
    p.add_argument("--chunk-q", help="comma-separated prefill row block sizes to sweep (default: the op's)")
    for name in sorted(_DELEGATED_BENCH):
        bsub.add_parser(name, help=f"fused tensor-parallel GEMM ({name}); options: tilefuse bench {name} --help")

    p = sub.add_parser("compare", help="compare two result files; exit 1 on a regression of a tilefuse row",
                       description="Per-row medians and speedups of two result files. Only tilefuse's rows gate "
                                   "(exit 1 on a regression); peer rows (DeepGEMM, torch eager, cuBLAS, NCCL) are "
                                   "shown, not gated. Exit 2 when the files share no tilefuse row.")
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed slowdown as a fraction (default 0.05)")
    p.add_argument("--fail-on-missing", action="store_true", help="a row missing from AFTER is a regression")
    p.add_argument("--significant-only", action="store_true",
                   help="only slowdowns larger than the p10-p90 spread count as regressions")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("plot", help="PNG of a result file")
    p.add_argument("results")
    p.add_argument("-o", "--output",
                   help="PNG to write (default: the result file's name with .png; .png is added to a name "
                        "without a suffix); the path written is printed")
    p.add_argument("--title")
    p.set_defaults(func=_cmd_plot)

    sub.add_parser("kernels", help="kernel checks (see tilefuse kernels --help)")
    return parser


def _use_interpreter_without_cuda() -> None:
    """Without CUDA the kernels run through Triton's interpreter; the variable must be set
    before any kernel module is imported, and the interpreter's float numerics fixed."""
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tilefuse._interpreter import patch_interpreter_numerics

    patch_interpreter_numerics()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _use_interpreter_without_cuda()
    # Delegated commands take their own options: hand them the rest of the line untouched.
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in _DELEGATED_BENCH:
        return _delegate("tilefuse.bench.suites.tp", "main", [argv[1], *argv[2:]], f"bench {argv[1]}")
    if argv[:2] == ["bench", "serving"]:
        return _delegate("tilefuse.bench.suites.serving", "main", argv[2:], "bench serving")
    if argv and argv[0] == "kernels":
        return _delegate("tilefuse.kernelcheck.cli", "main", argv[1:], "kernels")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tilefuse {args.command}: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        if e.name in ("matplotlib", "pynvml"):
            print(f"tilefuse {args.command}: {e.name} is not installed (pip install 'tilefuse[bench]')",
                  file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
