"""Result files, terminal tables and the progress bar.

A result file is one JSON object per run::

    {"schema": "tilefuse.bench/1", "suite": "indexer", "environment": {...},
     "settings": {"mode": "graph", ...}, "ceilings": {"fp8_matmul": {...}, ...},
     "rows": [{"key": ..., "case": ..., "impl": ..., "status": ..., "stats": {... "samples_us": [...]},
               "tflops": ..., "ratio_to_ceiling": ..., "clocks": {...}, ...}, ...]}

Every sample is kept. ``key`` identifies a row across runs (``tilefuse compare`` matches on it).
``peer`` says whether the row times another library (DeepGEMM, eager torch, cuBLAS, NCCL) rather
than tilefuse; files without it are read by the implementation's name (:func:`is_peer_row`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Iterable

SCHEMA = "tilefuse.bench/1"
ROW_STATUSES = ("ok", "failed", "error", "skipped")


# ---------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------
# Implementations that time other libraries, by the names the suites and the TP benchmark give
# them: how rows of files written before rows carried ``peer`` are told apart.
PEER_IMPLS = frozenset({"deep_gemm", "torch eager", "cublas", "nccl", "nccl+cublas", "symm_mem"})


def is_peer_row(row: dict) -> bool:
    """Whether ``row`` times another library (a peer or baseline) rather than tilefuse."""
    if "peer" in row:
        return bool(row["peer"])
    return row["impl"] in PEER_IMPLS


def checkout_root() -> Path | None:
    """The source checkout tilefuse is imported from (editable install or ``PYTHONPATH=src``),
    or None for an installed package."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "src" / "tilefuse").is_dir() and (root / "benchmarks").is_dir():
        return root
    return None


def results_root() -> Path:
    """Where result files go by default: ``benchmarks/results`` of the checkout tilefuse runs
    from, wherever the command is started; for an installed package, ``benchmarks/results``
    under the current directory. Absolute either way."""
    return (checkout_root() or Path.cwd()) / "benchmarks" / "results"


def default_output_path(suite: str, gpu_slug: str, root: str | os.PathLike | None = None) -> Path:
    """``<root>/<gpu-slug>/<suite>-<timestamp>.json``, ``root`` defaulting to :func:`results_root`."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(root if root is not None else results_root()) / gpu_slug / f"{suite}-{stamp}.json"


def _json_safe(x):
    """NaN and infinities are not JSON: write them as strings so the file stays standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def make_result(suite: str, environment: dict, settings: dict, ceilings: dict, rows: list[dict]) -> dict:
    return {
        "schema": SCHEMA,
        "suite": suite,
        "environment": environment,
        "settings": settings,
        "ceilings": ceilings,
        "rows": rows,
    }


def validate_result(result: dict) -> None:
    """Raise ValueError when ``result`` does not follow the result-file schema."""
    if not isinstance(result, dict):
        raise ValueError("result: expected a JSON object")
    if result.get("schema") != SCHEMA:
        raise ValueError(f"result: expected schema {SCHEMA!r}, got {result.get('schema')!r}")
    for key in ("suite", "environment", "settings", "ceilings", "rows"):
        if key not in result:
            raise ValueError(f"result: missing {key!r}")
    keys = set()
    for i, row in enumerate(result["rows"]):
        for key in ("key", "case", "impl", "status"):
            if key not in row:
                raise ValueError(f"result rows[{i}]: missing {key!r}")
        if row["status"] not in ROW_STATUSES:
            raise ValueError(f"result rows[{i}]: status must be one of {ROW_STATUSES}, got {row['status']!r}")
        if row["key"] in keys:
            raise ValueError(f"result rows[{i}]: duplicate key {row['key']!r}")
        keys.add(row["key"])
        stats = row.get("stats")
        if stats is not None and not stats.get("samples_us"):
            raise ValueError(f"result rows[{i}]: stats without samples")


def write_result(result: dict, path: str | os.PathLike) -> Path:
    validate_result(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed over: a run killed mid-write (a time limit) leaves the last whole file.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_json_safe(result), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_result(path: str | os.PathLike) -> dict:
    """Read and validate a result file (ValueError naming the file when it is not one)."""
    try:
        with open(path) as f:
            result = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    try:
        validate_result(result)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return result


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------
def format_table(headers: list[str], rows: Iterable[list[str]], align: str | None = None) -> str:
    """Plain-text table; ``align`` is one character per column, 'l' or 'r' (default: all 'l')."""
    rows = [[str(c) for c in r] for r in rows]
    align = align or "l" * len(headers)
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]

    def line(cells):
        out = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _clock_cell(clocks: dict | None) -> str:
    if not clocks or not clocks.get("available"):
        return "n/a"
    return f"{clocks['sm_clock_mhz']['median']:.0f}"


def row_flags(row: dict) -> str:
    flags = []
    if row.get("throttled"):
        flags.append("THROTTLED")
    if row["status"] != "ok":
        flags.append(row["status"].upper() + (f": {row['note']}" if row.get("note") else ""))
    return "; ".join(flags)


def results_table(result: dict) -> str:
    """The terminal table of a run: one line per row, ceilings and the timer underneath."""
    has_flops = any(r.get("tflops") is not None for r in result["rows"])
    has_bytes = any(r.get("tbps") is not None for r in result["rows"])
    headers = ["case", "impl", "median us", "p10-p90 us"]
    align = "llrr"
    if has_flops:
        headers.append("TFLOP/s")
        align += "r"
    if has_bytes:
        headers.append("TB/s")
        align += "r"
    headers += ["of ceiling", "vs peers", "SM MHz", "flags"]
    align += "rlrl"
    lines = []
    for r in result["rows"]:
        st = r.get("stats")
        cells = [
            r["case"],
            r["impl"],
            _num(st["median_us"], "{:.2f}") if st else "-",
            f"{st['p10_us']:.2f}-{st['p90_us']:.2f}" if st else "-",
        ]
        if has_flops:
            cells.append(_num(r.get("tflops")))
        if has_bytes:
            cells.append(_num(r.get("tbps"), "{:.2f}"))
        ratio = r.get("ratio_to_ceiling")
        cells.append("-" if ratio is None else f"{ratio:.2f} {r.get('ceiling', '')}".strip())
        peers = r.get("peer_ratio") or {}
        cells.append(", ".join(f"{v:.2f}x {k}" for k, v in peers.items()) or "-")
        cells.append(_clock_cell(r.get("clocks")))
        cells.append(row_flags(r))
        lines.append(cells)
    out = [format_table(headers, lines, align)]
    out.append(ceilings_line(result.get("ceilings", {})))
    timers = sorted({r["stats"]["timer"] for r in result["rows"] if r.get("stats")})
    mode = result.get("settings", {}).get("mode")
    out.append(f"timing: mode {mode}; timer {', '.join(timers) or '-'}")
    env = result.get("environment", {})
    out.append(f"device: {env.get('gpu')}; torch {env.get('torch')}; triton {env.get('triton')}")
    return "\n".join(out)


def ceilings_line(ceilings: dict) -> str:
    parts = []
    for name, rec in ceilings.items():
        if rec.get("available"):
            parts.append(f"{name} {rec['value']:.2f} {rec['unit']}")
        else:
            parts.append(f"{name} unavailable")
    return "ceilings (this run): " + ("; ".join(parts) or "none")


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------
class Progress:
    """A progress bar on a terminal, one line per step otherwise (logs, CI)."""

    def __init__(self, total: int, stream: IO[str] | None = None, width: int = 24, enabled: bool = True):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()

    def step(self, label: str) -> None:
        """Announce the step that starts now."""
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        if self.tty:
            filled = int(self.width * self.done / self.total)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r\x1b[K[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label}")
        else:
            self.stream.write(f"[{self.done + 1}/{self.total}] {label}\n")
        self.stream.flush()
        self.done = min(self.done + 1, self.total)

    def note(self, text: str) -> None:
        """A message that does not advance the bar."""
        if not self.enabled:
            return
        prefix = "\r\x1b[K" if self.tty else ""
        self.stream.write(f"{prefix}{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write(f"\r\x1b[K{self.total} steps in {time.monotonic() - self.t0:.0f}s\n")
            self.stream.flush()
