"""The decode chunk rule weighed against fixed chunks, from a ``paged_sweep.py --grid schedule`` run.

The per-call chunk (``chunk_pages_for``) halves below 512 keys while the batch leaves fewer than
``_RESIDENT_PER_SM`` programs an SM, and (two or more requests) down to 128 keys while the
halved chunk gives at most ``few`` programs an SM (``_FEW_PER_SM`` by default). A fixed
``PagedConfig(chunk=...)`` runs the same compiled kernel as the per-call choice of that chunk,
so the schedule grid's fixed-chunk rows time the pick of every threshold. For each row of the
given files (the default configuration's tile, rows, warps and stages) this prints the time
at the wave's rule alone (``few 0``), at each threshold's pick and at the best fixed chunk,
then per threshold the median and worst time against ``few 0``'s (``current``: the default).
Every pick is timed by its fixed-chunk row (a run's per-call row ran the rule of its commit)::

    python benchmarks/paged_chunk_rule.py benchmarks/results/h100/indexer-paged-schedule-*.json

With ``--sweep-ab``: the files are whole decode sweeps (``tilefuse bench paged --sweep``) of one
rule, baseline runs first and the run of another rule last; ``--few`` names the threshold that
last run took. Each tilefuse row's time over the baselines' geometric mean, by class: one
request, and two or more split by whether ``few`` moves the pick (the sweep's own lengths)::

    python benchmarks/paged_chunk_rule.py --sweep-ab --few 4 base.json base-again.json few4.json

Between two trees (``--base-src``: the baselines' ``src`` folder; ``--variants N``: the last N
files are this tree's runs), the rows split by whether this tree's rule moves their chunk::

    python benchmarks/paged_chunk_rule.py --sweep-ab --base-src .ab/base/src --variants 2 \
        base-1.json base-2.json new-1.json new-2.json

With ``--run-sweep FILE`` (a GPU): the decode sweep at ``--few`` programs an SM (the launch's
``_FEW_PER_SM`` replaced for the run), written to FILE with the threshold in its settings::

    python benchmarks/paged_chunk_rule.py --run-sweep few6.json --few 6 -- --samples 10
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paged_sweep import BLOCK_KV, D, name_of  # noqa: E402

from tilefuse._jit import cdiv  # noqa: E402
from tilefuse.indexer.paged import _FEW_PER_SM, _RESIDENT_PER_SM, chunk_pages_for, default_paged_config  # noqa: E402

THRESHOLDS = (0, 3, 4, 6, 8)  # programs an SM for ``few``
_FIXED = re.compile(r"(.*) chunk(\d+) (.*)")


def fixed_chunk_times(rows: list[dict], default_name: str) -> dict[int, float]:
    """Median us by chunk in keys (0: the per-call pick) of the default's tile and pipeline."""
    head, _, tail = _FIXED.match(default_name).groups()
    out = {}
    for r in rows:
        m = _FIXED.match(r["config"])
        if m and m.group(1) == head and m.group(3) == tail and r.get("stats"):
            out[int(m.group(2))] = r["stats"]["median_us"]
    return out


def picks(row: dict, block_n: int, groups: int, sms: int) -> dict:
    """The chunk in keys the default and each threshold pick for this row."""
    def keys(few: int) -> int:
        return BLOCK_KV * chunk_pages_for(row["batch"], row["max_context_len"], BLOCK_KV, block_n,
                                          _RESIDENT_PER_SM * sms, groups, few * sms)
    return {"current": keys(_FEW_PER_SM), **{f"few {s}": keys(s) for s in THRESHOLDS}}


def weigh(paths: list[str], sms: int | None = None) -> tuple[list[dict], dict]:
    """Per row the picks and their times; per threshold the time against ``few 0``'s pick."""
    groups_of_rows: dict[tuple, list[dict]] = {}
    for p in paths:
        res = json.loads(Path(p).read_text())
        sms = sms or res["environment"].get("sm_count") or 132
        for r in res["rows"]:
            key = (r["batch"], r["next_n"], r["mean_context"], r["heads"], res.get("layers", 1))
            groups_of_rows.setdefault(key, []).append(r)
    table = []
    for key, rows in sorted(groups_of_rows.items()):
        b, next_n, ctx, heads, nlayers = key
        cfg = default_paged_config("fp8", next_n, heads, D, BLOCK_KV)
        times = fixed_chunk_times(rows, name_of(cfg))
        ref = next((r for r in rows if r["config"] == name_of(cfg)), None)
        if ref is None:
            continue
        pick = picks(ref, cfg.block_n, cdiv(next_n, cfg.rows), sms)
        entry = {"batch": b, "next_n": next_n, "mean_context": ctx, "heads": heads, "layers": nlayers,
                 "max_context_len": ref["max_context_len"], "times_us": times, "picks": pick}
        base = times.get(pick["few 0"])
        for name, chunk in pick.items():
            t = times.get(chunk)
            entry[name] = None if t is None or base is None else {"chunk": chunk, "us": t, "vs_wave_rule": t / base}
        best = min((c for c in times if c), key=times.get, default=None)
        entry["best_fixed"] = None if best is None or base is None else {
            "chunk": best, "us": times[best], "vs_wave_rule": times[best] / base}
        table.append(entry)
    summary = {}
    for name in ("current", *(f"few {s}" for s in THRESHOLDS if s)):
        ratios = [e[name]["vs_wave_rule"] for e in table if e[name]]
        moved = [e for e in table if e[name] and e["picks"][name] != e["picks"]["few 0"]]
        summary[name] = {
            "rows": len(ratios), "rows_moved": len(moved),
            "unmeasured": sum(1 for e in table if not e[name]),
            "median_vs_wave_rule": statistics.median(ratios) if ratios else None,
            "worst_vs_wave_rule": max(ratios) if ratios else None,
            "best_vs_wave_rule": min(ratios) if ratios else None}
    return table, summary


_BASE_PICKS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tilefuse.indexer import paged
few = getattr(paged, "_FEW_PER_SM", 0)
print(json.dumps([paged.chunk_pages_for(*c[:6], few * c[6]) if few else paged.chunk_pages_for(*c[:6])
                  for c in json.loads(sys.stdin.read())]))
"""


def base_picks(src: str, calls: list[tuple]) -> list[int]:
    """Pages per program that the tree at ``src`` (its ``src`` folder) picks for each
    ``(batch, max_context_len, block_kv, block_n, wave, groups, sms)``, at its own defaults
    (read in a process of its own: two trees' packages do not share one)."""
    run = subprocess.run([sys.executable, "-c", _BASE_PICKS, src], input=json.dumps(calls),
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def sweep_ab(paths: list[str], few: int, sms: int = 132, base_src: str | None = None, variants: int = 1) -> dict:
    """Per class of rows the count, median, geometric mean, best and worst of the variant's
    time (the geometric mean of the last ``variants`` runs) over the baselines' (the runs
    before). Classes: one request, and two or more split by whether ``few`` moves the pick;
    with ``base_src`` (the baselines' tree, its ``src`` folder) the rows whose chunk this
    tree's rule moves against that tree's, and the others. ``bases agree``: the p10, median
    and p90 over the rows of the last baseline's time over the first's; ``commits``: each
    file's tree."""
    from tilefuse.bench.report import load_result
    from tilefuse.bench.suites.paged import Spec, context_lengths

    results = [load_result(p) for p in paths]
    runs = [{r["case"]: (r["stats"]["median_us"], r["params"]) for r in res["rows"]
             if r["impl"] == "tilefuse" and r.get("stats")} for res in results]
    bases, tried = runs[:-variants], runs[-variants:]
    cases = [c for c in tried[0] if all(c in r for r in runs)]

    def call(p) -> tuple:
        """The row's ``chunk_pages_for`` arguments (the sweep's lengths drawn once)."""
        spec = Spec(p["format"], p["batch"], p["next_n"], p["mean_context"], p["heads"], p["head_dim"], p["block_kv"])
        lens, _ = context_lengths(spec)
        cfg = default_paged_config(p["format"], p["next_n"], p["heads"], p["head_dim"], p["block_kv"])
        return (p["batch"], int(lens.max()), p["block_kv"], cfg.block_n, _RESIDENT_PER_SM * sms,
                cdiv(p["next_n"], cfg.rows))

    calls = {c: call(tried[0][c][1]) for c in cases}
    if base_src:
        before = dict(zip(cases, base_picks(base_src, [(*calls[c], sms) for c in cases])))
        now = {c: chunk_pages_for(*calls[c], _FEW_PER_SM * sms) for c in cases}
        classes: dict[str, list[tuple[float, str]]] = {"chunk unmoved": [], "chunk moved": []}
        name_of_case = {c: "chunk moved" if now[c] != before[c] else "chunk unmoved" for c in cases}
    else:
        # (one request takes the wave's rule whatever ``few``: its rows are a class of their own)
        classes = {"one request": [], "two or more, pick unmoved": [], "two or more, pick moved": []}
        name_of_case = {c: "one request" if calls[c][0] == 1 else "two or more, pick moved"
                        if chunk_pages_for(*calls[c], few * sms) != chunk_pages_for(*calls[c], 0)
                        else "two or more, pick unmoved" for c in cases}
    for c in cases:
        base = statistics.geometric_mean([b[c][0] for b in bases])
        classes[name_of_case[c]].append((statistics.geometric_mean([r[c][0] for r in tried]) / base, c))
    out = {}
    for name, rows in classes.items():
        if rows:
            r = sorted(rows)
            out[name] = {"rows": len(r), "median": statistics.median(v for v, _ in r),
                         "geomean": statistics.geometric_mean(v for v, _ in r),
                         "best": r[0], "worst": r[-1], "over_1.02": sum(v > 1.02 for v, _ in r)}
            if base_src and name == "chunk moved":
                out[name]["per_row"] = [{"case": c, "time_over_base": v, "chunk_keys_base": before[c] * calls[c][2],
                                         "chunk_keys": now[c] * calls[c][2]} for v, c in r]
    if len(bases) > 1:
        agree = sorted(bases[-1][c][0] / bases[0][c][0] for c in cases)
        out["bases agree"] = [agree[len(agree) // 10], statistics.median(agree), agree[9 * len(agree) // 10]]
    out["commits"] = [res["environment"].get("commit") for res in results]
    return out


def run_sweep(path: str, few: int, sweep_args: list[str]) -> int:
    """``tilefuse bench paged --sweep`` with ``few`` programs an SM, the threshold recorded in
    the result's settings (``chunk_rule``)."""
    from tilefuse import cli
    from tilefuse.indexer import paged

    paged._FEW_PER_SM = few  # read when a call's plan is made: before the first call
    rc = cli.main(["bench", "paged", "--sweep", *sweep_args, "-o", path])
    if Path(path).exists():
        record_threshold(path, few)
    return rc


def record_threshold(path: str, few: int) -> None:
    """The threshold a sweep ran at, in its result file's settings."""
    from tilefuse.bench.report import load_result, write_result

    result = load_result(path)
    result["settings"]["chunk_rule"] = (f"chunk_pages_for(few={few} programs an SM) for two or more requests,"
                                        f" set for this run (the default: {_FEW_PER_SM})")
    write_result(result, path)


def environment_of(paths: list[str]) -> dict:
    """The GPU and software of the runs read (the last file's environment)."""
    return json.loads(Path(paths[-1]).read_text()).get("environment", {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--sms", type=int, default=None, help="SM count (default: the run's)")
    ap.add_argument("--output", help="write the per-row table and the summary as JSON")
    ap.add_argument("--sweep-ab", action="store_true", help="the files are whole sweeps: baselines, then a variant")
    ap.add_argument("--few", type=int, default=_FEW_PER_SM,
                    help="with --sweep-ab: the variant's programs an SM; with --run-sweep: the run's")
    ap.add_argument("--base-src", help="with --sweep-ab: the baselines' tree (its src folder); the rows split by"
                    " whether this tree's chunk rule moves their chunk against that tree's")
    ap.add_argument("--variants", type=int, default=1, help="with --sweep-ab: how many of the last files are the"
                    " variant's runs (default 1)")
    ap.add_argument("--run-sweep", metavar="FILE", help="run the decode sweep at --few into FILE (arguments"
                    " after -- go to tilefuse bench paged --sweep)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.run_sweep:
        sys.exit(run_sweep(args.run_sweep, args.few, extra))
    if args.sweep_ab:
        result = sweep_ab(args.files, args.few, args.sms or 132, args.base_src, args.variants)
        commits = result.pop("commits")
        for name, c in result.items():
            if name == "bases agree":
                print(f"last baseline over the first, p10 / median / p90: {' / '.join(f'{v:.3f}' for v in c)}")
                continue
            print(f"{name}: {c['rows']} rows, time over the baselines median {c['median']:.3f}, geomean"
                  f" {c['geomean']:.3f}, best {c['best'][0]:.3f} ({c['best'][1]}), worst {c['worst'][0]:.3f}"
                  f" ({c['worst'][1]}), {c['over_1.02']} over 1.02")
        if args.output:
            record = {"environment": environment_of(args.files), "files": args.files, "few": args.few,
                      "commits": commits,
                      "base_src": args.base_src, "variants": args.variants, "classes": result}
            Path(args.output).write_text(json.dumps(record, indent=1))
        return
    table, summary = weigh(args.files, args.sms)
    cols = [*(f"few {s}" for s in THRESHOLDS), "current", "best_fixed"]
    print(f"{'row':<28}" + "".join(f"{c:>16}" for c in cols))
    for e in table:
        name = f"B{e['batch']} n{e['next_n']} ctx{e['mean_context']} H{e['heads']} L{e['layers']}"
        cells = [f"{e[c]['chunk']}:{e[c]['us']:.2f}" if e[c] else f"{e['picks'].get(c, '?')}:--" for c in cols]
        print(f"{name:<28}" + "".join(f"{c:>16}" for c in cells))
    for name, s in summary.items():
        if s["rows"]:
            print(f"{name}: {s['rows_moved']} of {s['rows']} rows moved, median {s['median_vs_wave_rule']:.3f}x,"
                  f" best {s['best_vs_wave_rule']:.3f}x, worst {s['worst_vs_wave_rule']:.3f}x the time at the"
                  f" wave's rule alone ({s['unmeasured']} rows whose pick was not timed)")
    if args.output:
        record = {"environment": environment_of(args.files), "files": args.files, "rows": table, "summary": summary}
        Path(args.output).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
