"""``tilefuse kernels``: compile every registered kernel configuration for sm_90a / sm_100a and
print, per kernel and configuration, registers, spills, shared memory and instruction counts.

    tilefuse kernels [--target sm_90a|sm_100a|all] [--kernel NAME] [--json FILE] [--jobs N]
                     [--no-sass] [--failures-only] [--quiet]
    tilefuse kernels list [--kernel NAME]

Works on any machine (no GPU needed); a line per configuration goes to stderr as it compiles.
Exit status: 0 every check passes or fails only as a known issue
(:mod:`tilefuse.kernelcheck.known_issues`, listed at the end), 1 a configuration fails a check
(see :mod:`tilefuse.kernelcheck.checks`) that no known issue accepts, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tilefuse.kernelcheck import checks, known_issues, variants
from tilefuse.kernelcheck.compile import TARGETS, KernelReport, compile_many

# (header, width, value of a report) of the table's columns after the configuration.
_COLUMNS = (
    ("regs", 4, lambda r: r.registers),
    ("spill", 5, lambda r: (r.spill_stores or 0) + (r.spill_loads or 0)),
    ("smem KiB", 8, lambda r: f"{r.shared / 1024:.1f}"),
    ("tmem", 4, lambda r: r.tmem_columns if r.target == "sm_100a" else "-"),
    ("mma", 4, lambda r: r.ptx.get(checks.FAST_MMA[r.target][1], 0)),
    ("mma.sync", 8, lambda r: r.ptx.get("mma.sync", 0)),
    ("fma", 5, lambda r: r.ptx.get("fma", 0)),
    ("ld.global", 9, lambda r: r.ptx.get("ld.global", 0)),
    ("st.global", 9, lambda r: r.ptx.get("st.global", 0)),
    ("tma", 3, lambda r: r.ptx.get("cp.async.bulk.tensor", 0)),
    ("ld.shared", 9, lambda r: r.ptx.get("ld.shared", 0)),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilefuse kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("action", nargs="?", choices=("report", "list"), default="report",
                   help="report (default): compile and check; list: the registered configurations")
    p.add_argument("--target", choices=(*TARGETS, "all"), default="all", help="GPU target (default: both)")
    p.add_argument("--kernel", help=f"one kernel: {', '.join(variants.kernel_names())}")
    p.add_argument("--json", metavar="FILE", help="also write every report (with failures) as JSON")
    p.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="compile processes (default: CPU count, at most 8)")
    p.add_argument("--no-sass", action="store_true", help="skip the SASS disassembly (faster; PTX counts only)")
    p.add_argument("--failures-only", action="store_true",
                   help="print only configurations that fail a check (known issues included)")
    p.add_argument("--compile-timeout", type=float, default=600.0, metavar="S",
                   help="a compile taking longer fails its configuration (default 600 s)")
    p.add_argument("--compile-only", action="store_true",
                   help="exit 1 only where a configuration does not compile (spills are reported, not failed)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    return p


def _fmt_row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def verdict(r: KernelReport) -> str:
    """``ok``, ``known: <failures> (<why>)`` for a known issue, else ``FAIL: <failures>``."""
    fails = checks.failures(r)
    if not fails:
        return "ok"
    if not r.ok:
        return "FAIL: does not compile"
    known = known_issues.accepted_by(r)
    if known:
        return f"known: {'; '.join(fails)} ({known[0].why})"
    return "FAIL: " + "; ".join(fails)


def format_table(kernel: str, target: str, reports: list[KernelReport]) -> str:
    """One kernel on one target: a row per configuration."""
    mma = checks.FAST_MMA[target][1]
    headers = ["configuration"] + [mma if h == "mma" else h for h, _, _ in _COLUMNS] + ["check"]
    rows = []
    for r in reports:
        if not r.ok:
            rows.append([r.variant] + ["-"] * len(_COLUMNS) + [verdict(r)])
            continue
        rows.append([r.variant] + [str(get(r)) for _, _, get in _COLUMNS] + [verdict(r)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if i < len(headers) - 1 else len(headers[-1])
              for i, h in enumerate(headers)]
    lines = [f"{kernel} on {target}: {len(reports)} configuration(s)", _fmt_row(headers, widths)]
    lines += [_fmt_row(row, widths) for row in rows]
    return "\n".join(lines)


def _ptxas_versions(targets: list[str]) -> dict[str, str]:
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
    except ImportError:
        return {}
    return {t: get_ptxas_version(TARGETS[t]).strip().splitlines()[-1] for t in targets}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        vs = variants.variants(args.kernel)
    except ValueError as e:
        print(f"tilefuse kernels: {e}", file=sys.stderr)
        return 2
    targets = list(TARGETS) if args.target == "all" else [args.target]
    items = [(v, t) for t in targets for v in vs if t in v.targets]
    if args.action == "list":
        for v, t in items:
            print(f"{v.kernel}  {t}  {v.origin:7}  {v.name}")
        return 0
    if args.jobs < 1:
        print("tilefuse kernels: --jobs must be >= 1", file=sys.stderr)
        return 2
    reports = compile_many(items, jobs=args.jobs, sass=not args.no_sass, compile_timeout=args.compile_timeout,
                           on_report=None if args.quiet else _progress(items, args.jobs))
    for t in targets:
        for kernel in dict.fromkeys(v.kernel for v in vs):
            rs = [r for (v, tt), r in zip(items, reports) if tt == t and v.kernel == kernel]
            if args.failures_only:
                rs = [r for r in rs if checks.failures(r)]
            if rs:
                print(format_table(kernel, t, rs) + "\n")
    accepted = [known_issues.accepted_by(r) for r in reports]
    known = [r for r, a in zip(reports, accepted) if a]
    new = [r for r, a in zip(reports, accepted) if checks.failures(r) and not a]
    if known:
        print(f"{len(known)} known issue(s), accepted by tilefuse/kernelcheck/known_issues.py:")
        for r in known:
            print(f"  {r.kernel} {r.target} {r.variant}: {'; '.join(checks.failures(r))}")
    stale = known_issues.stale(reports)
    if stale:
        print(f"{len(stale)} known issue(s) no longer occur (tighten or delete them in known_issues.py):")
        for e in stale:
            print(f"  {e.kernel} {e.target} {e.configuration!r}: {e.why}")
    print(f"{len(reports)} compiles, {len(new)} failing a check, {len(known)} known issue(s)"
          + (f" (failing: {', '.join(sorted({r.kernel for r in new}))})" if new else ""))
    if args.json:
        import triton

        doc = {"triton": triton.__version__, "ptxas": _ptxas_versions(targets), "targets": targets,
               "reports": [{**r.to_dict(), "origin": v.origin, "failures": checks.failures(r),
                            "known_issue": a[0].why if a else None}
                           for (v, _), r, a in zip(items, reports, accepted)]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.compile_only:
        broken = [r for r in reports if not r.ok]
        for r in broken:
            print(f"did not compile: {r.kernel} {r.target} {r.variant}: {r.error}")
        return 1 if broken else 0
    return 1 if new else 0


def _progress(items: list[tuple[variants.Variant, str]], jobs: int):
    """A line on stderr per compiled configuration: count, time, kernel, target, verdict."""
    t0 = time.monotonic()
    done = 0
    print(f"compiling {len(items)} configuration(s) in {min(jobs, len(items))} process(es)", file=sys.stderr,
          flush=True)

    def report(_index: int, r: KernelReport) -> None:
        nonlocal done
        done += 1
        width = len(str(len(items)))
        print(f"[{done:{width}}/{len(items)} {time.monotonic() - t0:5.0f}s] {r.kernel} {r.target} {r.variant}: "
              f"{verdict(r)}", file=sys.stderr, flush=True)

    return report


if __name__ == "__main__":
    sys.exit(main())
