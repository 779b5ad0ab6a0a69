"""The decode chunk rule weighed against fixed chunks, from a ``paged_sweep.py --grid schedule`` run.

The per-call chunk (``chunk_pages_for``) halves below 512 keys only while the batch leaves
fewer than ``_RESIDENT_PER_SM`` programs an SM. The candidate rule also halves, down to
128 keys, while the halved chunk gives at most ``few`` programs an SM. A fixed
``PagedConfig(chunk=...)`` runs the same compiled kernel as the per-call choice of that chunk,
so the schedule grid's fixed-chunk rows time every pick of every threshold. For each row of
the given files (the default configuration's tile, rows, warps and stages) this prints the
time at the current pick, at each threshold's pick and at the best fixed chunk, then per
threshold the median and worst time against the current pick::

    python benchmarks/paged_chunk_rule.py benchmarks/results/h100/indexer-paged-schedule-*.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paged_sweep import BLOCK_KV, D, name_of  # noqa: E402

from tilefuse.indexer.paged import _RESIDENT_PER_SM, chunk_pages_for, default_paged_config  # noqa: E402

THRESHOLDS = (3, 4, 6, 8)  # programs an SM for ``few``
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
    """The chunk in keys the current rule and each threshold pick for this row."""
    def keys(few: int) -> int:
        return BLOCK_KV * chunk_pages_for(row["batch"], row["max_context_len"], BLOCK_KV, block_n,
                                          _RESIDENT_PER_SM * sms, groups, few * sms)
    return {"current": keys(0), **{f"few {s}": keys(s) for s in THRESHOLDS}}


def weigh(paths: list[str], sms: int | None = None) -> tuple[list[dict], dict]:
    """Per row the picks and their times; per threshold the time against the current pick."""
    groups_of_rows: dict[tuple, list[dict]] = {}
    layers = {}
    for p in paths:
        res = json.loads(Path(p).read_text())
        sms = sms or res["environment"].get("sm_count") or 132
        for r in res["rows"]:
            key = (r["batch"], r["next_n"], r["mean_context"], r["heads"], res.get("layers", 1))
            groups_of_rows.setdefault(key, []).append(r)
            layers[key] = res.get("layers", 1)
    table = []
    for key, rows in sorted(groups_of_rows.items()):
        b, next_n, ctx, heads, nlayers = key
        cfg = default_paged_config("fp8", next_n, heads, D, BLOCK_KV)
        times = fixed_chunk_times(rows, name_of(cfg))
        if 0 not in times:
            continue
        ref = next(r for r in rows if r["config"] == name_of(cfg))
        groups = -(-next_n // cfg.rows)
        pick = picks(ref, cfg.block_n, groups, sms)
        entry = {"batch": b, "next_n": next_n, "mean_context": ctx, "heads": heads, "layers": nlayers,
                 "max_context_len": ref["max_context_len"], "times_us": times, "picks": pick}
        for name, chunk in pick.items():
            t = times[0] if chunk == pick["current"] else times.get(chunk)
            entry[name] = None if t is None else {"chunk": chunk, "us": t, "vs_current": t / times[0]}
        best = min((c for c in times if c), key=times.get, default=None)
        entry["best_fixed"] = None if best is None else {"chunk": best, "us": times[best],
                                                         "vs_current": times[best] / times[0]}
        table.append(entry)
    summary = {}
    for s in THRESHOLDS:
        ratios = [e[f"few {s}"]["vs_current"] for e in table if e[f"few {s}"]]
        moved = [e for e in table if e[f"few {s}"] and e["picks"][f"few {s}"] != e["picks"]["current"]]
        summary[f"few {s}"] = {
            "rows": len(ratios), "rows_moved": len(moved),
            "unmeasured": sum(1 for e in table if not e[f"few {s}"]),
            "median_vs_current": statistics.median(ratios) if ratios else None,
            "worst_vs_current": max(ratios) if ratios else None,
            "best_vs_current": min(ratios) if ratios else None}
    return table, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--sms", type=int, default=None, help="SM count (default: the run's)")
    ap.add_argument("--output", help="write the per-row table and the summary as JSON")
    args = ap.parse_args()
    table, summary = weigh(args.files, args.sms)
    cols = ["current", *(f"few {s}" for s in THRESHOLDS), "best_fixed"]
    print(f"{'row':<28}" + "".join(f"{c:>16}" for c in cols))
    for e in table:
        name = f"B{e['batch']} n{e['next_n']} ctx{e['mean_context']} H{e['heads']} L{e['layers']}"
        cells = [f"{e[c]['chunk']}:{e[c]['us']:.2f}" if e[c] else f"{e['picks'].get(c, '?')}:--" for c in cols]
        print(f"{name:<28}" + "".join(f"{c:>16}" for c in cells))
    for name, s in summary.items():
        if s["rows"]:
            print(f"{name}: {s['rows_moved']} of {s['rows']} rows moved, median {s['median_vs_current']:.3f}x,"
                  f" best {s['best_vs_current']:.3f}x, worst {s['worst_vs_current']:.3f}x the current pick's time"
                  f" ({s['unmeasured']} rows whose pick was not timed)")
    if args.output:
        Path(args.output).write_text(json.dumps({"files": args.files, "rows": table, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
