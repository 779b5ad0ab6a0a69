"""``tilefuse plot results.json [-o out.png]``: one line per implementation against the shape.

The y axis is TFLOP/s when rows count FLOPs, TB/s when they count bytes, otherwise the median
time; the ceiling measured in the same run is drawn as a dashed reference line. Rows that
failed their check are drawn with a hollow marker; skipped and errored rows are left out.
"""

from __future__ import annotations

import os
from pathlib import Path


def _metric(rows: list[dict]) -> tuple[str, str]:
    if any(r.get("tflops") is not None for r in rows):
        return "tflops", "TFLOP/s"
    if any(r.get("tbps") is not None for r in rows):
        return "tbps", "TB/s"
    return "median_us", "median time (us)"


def _value(row: dict, field: str) -> float | None:
    if field == "median_us":
        return row["stats"]["median_us"] if row.get("stats") else None
    return row.get(field)


def interpreted_run(result: dict) -> bool:
    """Whether a result file's numbers came from Triton's interpreter (its environment says so;
    files written before it did: rows timed on the host clock)."""
    interpreted = result.get("environment", {}).get("interpreter")
    if interpreted is None:
        interpreted = any((r.get("stats") or {}).get("timer", "").startswith("host") for r in result["rows"])
    return bool(interpreted)


# Suites whose x values are separate measures (per step, per call), not points of a sweep.
_CATEGORICAL_SUITES = ("serving",)


def plot_result(result: dict, path: str | os.PathLike, title: str | None = None) -> Path:
    """Write a PNG of ``result`` (a result-file dict) to ``path`` (``.png`` added when it has no
    suffix); returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("stats")]
    field, label = _metric(rows)
    xs: list[str] = []
    for r in rows:
        if r["x"] not in xs:
            xs.append(r["x"])
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(r["series"], []).append(r)

    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(xs) + 6), 5.0))
    colors = plt.get_cmap("tab20").colors
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    markers = "osD^vP*X"
    values = []
    categorical = result.get("suite") in _CATEGORICAL_SUITES
    for i, (name, srows) in enumerate(series.items()):
        pts = [(xs.index(r["x"]), _value(r, field), r["status"] == "ok") for r in srows]
        pts = [p for p in pts if p[1] is not None]
        if not pts:
            continue
        values += [p[1] for p in pts]
        marker = markers[impls.index(srows[0]["impl"]) % len(markers)]
        # (a suite whose x values are different measures, not a sweep, gets no connecting lines)
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name,
                       color=colors[i % len(colors)], linestyle="none" if categorical else "-")[0]
        bad = [p for p in pts if not p[2]]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=90, facecolors="none",
                       edgecolors=line.get_color(), linewidths=2)
    unit = {"tflops": "TFLOP/s", "tbps": "TB/s"}.get(field)
    if unit:
        for name, rec in result.get("ceilings", {}).items():
            if rec.get("available") and rec.get("unit") == unit and any(r.get("ceiling") == name for r in rows):
                ax.axhline(rec["value"], linestyle="--", linewidth=1, color="gray")
                ax.annotate(f"{name} {rec['value']:.0f} {unit}" if unit == "TFLOP/s" else
                            f"{name} {rec['value']:.2f} {unit}",
                            (0, rec["value"]), textcoords="offset points", xytext=(2, 3), fontsize=8, color="gray")
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels(xs, rotation=30, ha="right")
    ax.set_ylabel(label)
    env = result.get("environment", {})
    ax.set_title(title or f"tilefuse {result.get('suite', '')} on {env.get('gpu', '?')} "
                          f"({result.get('settings', {}).get('mode', '?')} mode)")
    if interpreted_run(result):
        ax.text(0.5, 0.5, "interpreter run: not performance numbers", transform=ax.transAxes,
                ha="center", va="center", fontsize=14, color="red", alpha=0.3)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")  # peers and eager rows can be orders of magnitude apart
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
