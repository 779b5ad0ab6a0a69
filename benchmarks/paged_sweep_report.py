"""The decode sweep (``tilefuse bench paged --sweep``) read against the decode targets.

Reads one or more sweep result files (rows merged by key, a later file's row replacing an
earlier one's: a run cut by a time limit and the run that finished its rows) and checks every
tilefuse row against the targets of the decode sweep:

* faster than DeepGEMM in the same run (``speed`` = DeepGEMM time / tilefuse time > 1);
* at least 1.1x where DeepGEMM streams under 3.5 TB/s;
* at least 0.9 of the run's copy bandwidth at B >= 64 and mean context >= 8K;
* next_n 2 and 4 within 1.15x the next_n 1 time of the same B, context, H, page size, dtype.

Rows whose samples spread wide (p90 / p10 over 1.25, either implementation) are marked unsteady.
Prints the counts (the speed over DeepGEMM also by cached-token range), then every row that
misses a target (the worst first); ``--output`` writes the per-row table as JSON, ``--plot``
speed against the cached tokens as a PNG::

    python benchmarks/paged_sweep_report.py benchmarks/results/h100/indexer-paged-sweep-*.json \
        --output report.json --plot report.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.bench.report import load_result  # noqa: E402

SLOW_PEER_TBPS = 3.5
FAST_OVER_SLOW_PEER = 1.1
COPY_FRACTION = 0.9
NEXT_N_GROWTH = 1.15
# A row whose samples spread wider than this (p90 / p10, either implementation) is marked
# unsteady: its verdicts rest on a median that moved within the run.
UNSTEADY_SPREAD = 1.25


def spread(row: dict) -> float:
    """p90 / p10 of a timed row's samples."""
    st = row["stats"]
    return st["p90_us"] / st["p10_us"]


def merged_rows(paths: list[str]) -> tuple[dict, list[dict]]:
    """The rows of every file by key (later files win) and the last file's environment."""
    by_key, env = {}, {}
    for p in paths:
        res = load_result(p)
        env = res["environment"]
        for row in res["rows"]:
            by_key[row["key"]] = row
    return env, list(by_key.values())


def table(rows: list[dict]) -> list[dict]:
    """One entry per tilefuse row: its time, DeepGEMM's, the targets it meets or misses."""
    peers = {r["case"]: r for r in rows if r["impl"] == "deep_gemm" and r["status"] == "ok"}
    mine = [r for r in rows if r["impl"] == "tilefuse"]
    out = []
    for r in mine:
        p = r["params"]
        e = {"case": r["case"], "status": r["status"], "batch": p["batch"], "next_n": p["next_n"],
             "mean_context": p["mean_context"], "heads": p["heads"], "block_kv": p["block_kv"],
             "logits_dtype": p["logits_dtype"], "tilefuse_us": None, "deep_gemm_us": None, "speed": None,
             "copy_fraction": r.get("ratio_to_ceiling"), "deep_gemm_tbps": None, "spread": None,
             "unsteady": False, "misses": []}
        if r["status"] != "ok":
            e["misses"].append(f"not timed: {r['status']} {r.get('note') or ''}".strip())
            out.append(e)
            continue
        e["tilefuse_us"] = r["stats"]["median_us"]
        peer = peers.get(r["case"])
        e["spread"] = max([spread(r)] + ([spread(peer)] if peer is not None else []))
        e["unsteady"] = e["spread"] > UNSTEADY_SPREAD
        if peer is not None:
            e["deep_gemm_us"] = peer["stats"]["median_us"]
            e["deep_gemm_tbps"] = peer.get("tbps")
            e["speed"] = r["peer_ratio"]["deep_gemm"]  # the runner's: DeepGEMM median / tilefuse median
            if e["speed"] <= 1.0:
                e["misses"].append("slower than DeepGEMM")
            elif e["deep_gemm_tbps"] is not None and e["deep_gemm_tbps"] < SLOW_PEER_TBPS \
                    and e["speed"] < FAST_OVER_SLOW_PEER:
                e["misses"].append(f"under {FAST_OVER_SLOW_PEER}x where DeepGEMM < {SLOW_PEER_TBPS} TB/s")
        if p["batch"] >= 64 and p["mean_context"] >= 8192 and (e["copy_fraction"] or 0.0) < COPY_FRACTION:
            e["misses"].append(f"under {COPY_FRACTION} of copy bandwidth")
        out.append(e)
    one = {(e["batch"], e["mean_context"], e["heads"], e["block_kv"], e["logits_dtype"]): e["tilefuse_us"]
           for e in out if e["next_n"] == 1 and e["tilefuse_us"] is not None}
    for e in out:
        base = one.get((e["batch"], e["mean_context"], e["heads"], e["block_kv"], e["logits_dtype"]))
        e["next_n_growth"] = None
        if e["next_n"] > 1 and base and e["tilefuse_us"] is not None:
            e["next_n_growth"] = e["tilefuse_us"] / base
            if e["next_n_growth"] > NEXT_N_GROWTH:
                e["misses"].append(f"next_n {e['next_n']} over {NEXT_N_GROWTH}x next_n 1")
    return out


# Cached-token ranges (B x mean context) the speed is summarised over: one request's short rows,
# the middle rows (a few programs an SM, caches that stay in L2 when one is replayed), the rest.
TOKEN_RANGES = ((0, 2**14, "under 2^14"), (2**14, 2**20, "2^14 to under 2^20"), (2**20, None, "2^20 and over"))


def by_cached_tokens(beside: list[dict]) -> list[str]:
    """Speed over DeepGEMM by cached tokens: rows, range, median, rows ahead."""
    lines = []
    for lo, hi, label in TOKEN_RANGES:
        speeds = sorted(e["speed"] for e in beside
                        if lo <= e["batch"] * e["mean_context"] and (hi is None or e["batch"] * e["mean_context"] < hi))
        if speeds:
            lines.append(f"  cached tokens {label}: {len(speeds)} rows, {speeds[0]:.2f}-{speeds[-1]:.2f}x, "
                         f"median {statistics.median(speeds):.2f}x, ahead at {sum(s > 1.0 for s in speeds)}")
    return lines


def summary(entries: list[dict]) -> list[str]:
    timed = [e for e in entries if e["tilefuse_us"] is not None]
    beside = [e for e in timed if e["speed"] is not None]
    lines = [f"{len(entries)} tilefuse rows, {len(timed)} timed, {len(beside)} beside DeepGEMM "
             f"(on SM90 DeepGEMM runs pages of 64 tokens and next_n 1-2 only)"]
    if beside:
        speeds = sorted(e["speed"] for e in beside)
        ahead = sum(s > 1.0 for s in speeds)
        lines.append(f"speed over DeepGEMM: {speeds[0]:.2f}-{speeds[-1]:.2f}x, median {speeds[len(speeds) // 2]:.2f}x, "
                     f"ahead at {ahead}/{len(beside)}")
        lines += by_cached_tokens(beside)
    for label in ("slower than DeepGEMM", "where DeepGEMM <", "of copy bandwidth", "next_n", "not timed"):
        n = sum(any(label in m for m in e["misses"]) for e in entries)
        lines.append(f"  misses '{label}': {n}")
    unsteady = [e for e in timed if e["unsteady"]]
    lines.append(f"unsteady (samples' p90/p10 over {UNSTEADY_SPREAD}): {len(unsteady)} rows")
    lines += [f"  {e['case']:<48} spread {e['spread']:.2f}" for e in sorted(unsteady, key=lambda e: -e["spread"])]
    return lines


def run_line(env: dict) -> str:
    """The GPU and software a result came from, as one line."""
    return f"{env.get('gpu')}, tilefuse {env.get('commit')}, torch {env.get('torch')}, triton {env.get('triton')}"


def plot(entries: list[dict], path: str, env: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for n, marker in ((1, "o"), (2, "s"), (4, "^")):
        pts = [(e["batch"] * e["mean_context"], e["speed"]) for e in entries
               if e["speed"] is not None and e["next_n"] == n]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, s=14, label=f"next_n {n}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens (B x mean context)")
    ax.set_ylabel("DeepGEMM time / tilefuse time")
    ax.set_title("decode sweep beside DeepGEMM, same run" + (f"\n{run_line(env)}" if env else ""), fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--output", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--worst", type=int, default=40, help="rows that miss a target to print")
    args = ap.parse_args(argv)
    env, rows = merged_rows(args.results)
    entries = table(rows)
    print(run_line(env))
    print("\n".join(summary(entries)))
    missed = sorted((e for e in entries if e["misses"]), key=lambda e: e["speed"] if e["speed"] is not None else 9.0)
    for e in missed[: args.worst]:
        speed = f"{e['speed']:.2f}x" if e["speed"] is not None else "-"
        copy = f"{e['copy_fraction']:.2f}" if e["copy_fraction"] is not None else "-"
        misses = "; ".join(e["misses"]) + ("  (unsteady)" if e["unsteady"] else "")
        print(f"  {e['case']:<48} {e['tilefuse_us'] or 0:9.1f} us  {speed:>6}  copy {copy}  {misses}")
    if args.output:
        Path(args.output).write_text(json.dumps({"environment": env, "rows": entries}, indent=1) + "\n")
    if args.plot:
        plot(entries, args.plot, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
