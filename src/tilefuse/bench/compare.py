"""``tilefuse compare before.json after.json``: per-row medians, speedup, spread, regression gate.

Rows are matched by their ``key``. For each row: both medians, the speedup (before / after,
> 1 is faster), whether the difference is larger than the p10-p90 spread of both sides, and a
verdict. A row regresses when it got slower by more than ``tolerance`` (a fraction), or when
its correctness check passed before and not after. Rows present in only one file are listed;
with ``fail_on_missing`` a row that disappeared counts as a regression.

Only tilefuse's own rows gate: rows that time another library (DeepGEMM, eager torch, cuBLAS,
NCCL; :func:`~tilefuse.bench.report.is_peer_row`) are compared and shown but never count as a
regression, since their noise says nothing about a tilefuse change. Two files without a common
tilefuse row cannot be compared: :class:`NothingToCompare`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilefuse.bench.report import format_table, is_peer_row


class NothingToCompare(ValueError):
    """The two result files share no tilefuse row (different suites, shapes or key scheme)."""


@dataclass
class RowDiff:
    key: str
    before_us: float | None
    after_us: float | None
    speedup: float | None
    beyond_spread: bool | None
    verdict: str
    regression: bool
    peer: bool = False  # another library's row: shown, never a regression


def _median(row: dict | None) -> float | None:
    st = (row or {}).get("stats")
    return st["median_us"] if st else None


def _spread(row: dict) -> float:
    st = row["stats"]
    return st["p90_us"] - st["p10_us"]


def diff_row(
    key: str, before: dict | None, after: dict | None, tolerance: float, fail_on_missing: bool, significant_only: bool
) -> RowDiff:
    b, a = _median(before), _median(after)
    if before is None:
        return RowDiff(key, None, a, None, None, "only in after", False)
    if after is None:
        return RowDiff(key, b, None, None, None, "only in before", fail_on_missing)
    was_ok, is_ok = before["status"] == "ok", after["status"] == "ok"
    if was_ok and after["status"] in ("failed", "error"):
        return RowDiff(key, b, a, b / a if a and b else None, None, f"now {after['status']}", True)
    if b is None or a is None:
        status = after["status"] if a is None else before["status"]
        return RowDiff(key, b, a, None, None, f"not timed ({status})", False)
    speedup = b / a
    beyond = abs(a - b) > max(_spread(before), _spread(after))
    slower = a / b - 1.0
    if slower > tolerance and (beyond or not significant_only):
        verdict, regression = f"REGRESSION ({slower:+.1%})", True
    elif -slower > tolerance:
        verdict, regression = "faster", False
    else:
        verdict, regression = "within tolerance", False
    if not was_ok and is_ok:
        verdict += "; check fixed"
    elif not is_ok:
        verdict += f"; still {after['status']}"
    return RowDiff(key, b, a, speedup, beyond, verdict, regression)


def compare(
    before: dict,
    after: dict,
    *,
    tolerance: float = 0.05,
    fail_on_missing: bool = False,
    significant_only: bool = False,
) -> list[RowDiff]:
    """Row-by-row comparison of two result files (rows of ``before`` first, then new ones).

    Raises:
        ValueError: negative ``tolerance``.
        NothingToCompare: no tilefuse row is in both files.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance: expected a non-negative fraction, got {tolerance}")
    rows_b = {r["key"]: r for r in before["rows"]}
    rows_a = {r["key"]: r for r in after["rows"]}
    shared = [k for k in rows_b if k in rows_a and not is_peer_row(rows_b[k])]
    if not shared:
        raise NothingToCompare(
            f"no tilefuse row is in both files ({len(rows_b)} rows before, {len(rows_a)} after, "
            f"{sum(k in rows_a for k in rows_b)} keys in common): different suites or shapes?")
    keys = list(rows_b) + [k for k in rows_a if k not in rows_b]
    diffs = []
    for k in keys:
        d = diff_row(k, rows_b.get(k), rows_a.get(k), tolerance, fail_on_missing, significant_only)
        if is_peer_row(rows_b.get(k) or rows_a[k]):
            d.peer = True
            if d.regression:
                d.regression = False
                d.verdict += " (peer: not gated)"
        diffs.append(d)
    return diffs


def context_warnings(before: dict, after: dict) -> list[str]:
    """Differences that make a comparison questionable (device, timer, mode)."""
    warnings = []
    eb, ea = before.get("environment", {}), after.get("environment", {})
    if eb.get("gpu") != ea.get("gpu"):
        warnings.append(f"different devices: {eb.get('gpu')} vs {ea.get('gpu')}")
    mb, ma = before.get("settings", {}).get("mode"), after.get("settings", {}).get("mode")
    if mb != ma:
        warnings.append(f"different timing modes: {mb} vs {ma}")
    timers = lambda res: {r["stats"]["timer"] for r in res["rows"] if r.get("stats")}
    if timers(before) != timers(after):
        warnings.append(f"different timers: {sorted(timers(before))} vs {sorted(timers(after))}")
    if any("interpreter" in t.lower() for t in timers(before) | timers(after)):
        warnings.append("host-timed interpreter results: not performance numbers")
    return warnings


def comparison_table(diffs: list[RowDiff]) -> str:
    def us(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [
        [
            d.key + (" [peer]" if d.peer else ""),
            us(d.before_us),
            us(d.after_us),
            "-" if d.speedup is None else f"{d.speedup:.3f}x",
            "-" if d.beyond_spread is None else ("yes" if d.beyond_spread else "no"),
            d.verdict,
        ]
        for d in diffs
    ]
    return format_table(
        ["row", "before us", "after us", "speedup", "beyond spread", "verdict"], lines, "lrrrll"
    )
