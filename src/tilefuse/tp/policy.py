"""Which path runs a TP GEMM: a fused design or NCCL + GEMM, per (op, M, N, K, W, dtype).

The choice comes from a table of measured rows (``policy_table.json`` beside this file, written
from ``benchmarks/results/<gpu>/`` by ``tilefuse.bench.suites.tp --write-policy``): each row is a
shape the benchmark timed, the winner (``"nccl"`` or a fused design) and the times behind it.
A query takes the rows of the same op and world size (else the nearest world size); if its M,
N or K lies outside the range those rows cover, nothing measured speaks for it and the answer
is NCCL + GEMM (e.g. decode-sized M below the smallest measured M); inside, the row whose
shape is nearest in log2(M), log2(N), log2(K) gives the winner. The reason names the row (its
index in the table, its result file where the row records one). Rows carry the timing mode they
were measured in: ``graph`` (CUDA-graph replay, no host work per call) answers calls made
while a CUDA graph is being captured, ``batch`` (back-to-back eager calls, host launch cost
included) answers eager calls; the two differ at small M, where an eager fused call is bound
by its launch path. A row may also name the options of its winner's fastest variant (in the
benchmark's syntax, e.g. ``push/p24/b128``); they apply to calls of exactly that shape, where
the caller left them unset (``Decision.options``). Rules before the table:

1. an explicit ``path=`` / ``design=`` argument, then :func:`override` / :func:`set_override`
   (nothing is read from the environment);
2. a group spanning more than one node, a world size above 8, or tensors not on a CUDA device
   (no symmetric memory) -> NCCL (the product then runs on the tilefuse GEMM kernel on CPU);
   forcing the fused path there raises ValueError;
3. world size 1 -> the GEMM alone.

``decide`` returns a :class:`Decision` that says which rule or row made the choice.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

OPS = ("ag_gemm", "gemm_rs")
PATHS = ("fused", "nccl")
DEFAULT_DESIGN = {"ag_gemm": "ce", "gemm_rs": "push"}
FUSED_DESIGNS = {"ag_gemm": ("ce", "push"), "gemm_rs": ("push",)}
MAX_WORLD = 8
# The variant syntax's option letters each op takes (``fused_variants``).
OP_OPTION_KEYS = {"ag_gemm": ("p", "s", "c", "r", "b"), "gemm_rs": ("l", "g", "t", "x", "b")}
TABLE_PATH = Path(__file__).with_name("policy_table.json")


@dataclass(frozen=True)
class Decision:
    """The path (``fused``/``nccl``/``gemm``), the fused design, and why."""

    path: str
    design: str | None
    reason: str
    row: dict | None = field(default=None, compare=False)
    options: dict = field(default_factory=dict, compare=False)  # measured options of this exact shape


_override: dict[str, dict] = {}
_table: list[dict] | None = None
_table_name = TABLE_PATH.name  # what reasons cite rows of
# decide() per call arguments -> Decision; emptied whenever the overrides or the table change.
_decisions: dict[tuple, Decision] = {}


def load_table(rows: list[dict] | str | Path | None = None) -> list[dict]:
    """Replace the measured table (rows, or a JSON file); ``None`` reloads the shipped file."""
    global _table, _table_name
    if rows is None:
        rows, name = (json.loads(TABLE_PATH.read_text())["rows"] if TABLE_PATH.exists() else []), TABLE_PATH.name
    elif isinstance(rows, (str, Path)):
        rows, name = json.loads(Path(rows).read_text())["rows"], Path(rows).name
    else:
        name = "the rows given to load_table"
    for i, r in enumerate(rows):
        missing = {"op", "m", "n", "k", "world", "winner"} - set(r)
        if missing:
            raise ValueError(f"policy row {i} lacks {sorted(missing)}")
        if r["op"] not in OPS:
            raise ValueError(f"policy row {i}: op must be one of {OPS}, got {r['op']!r}")
        if r["winner"] != "nccl" and r["winner"] not in FUSED_DESIGNS[r["op"]]:
            raise ValueError(f"policy row {i}: winner {r['winner']!r} is neither 'nccl' nor a design of {r['op']}")
    _table, _table_name = list(rows), name
    _decisions.clear()
    return _table


def table() -> list[dict]:
    """The measured rows in use."""
    return list(_table if _table is not None else load_table())


def set_override(op: str | None = None, *, path: str | None = None, design: str | None = None) -> None:
    """Force ``path`` (and ``design``) for ``op`` (both ops when None); all None clears."""
    ops = OPS if op is None else (op,)
    _decisions.clear()
    for o in ops:
        _check_op(o)
        if path is None and design is None:
            _override.pop(o, None)
        else:
            _check_choice(o, path, design)
            _override[o] = {"path": path, "design": design}


@contextlib.contextmanager
def override(op: str | None = None, *, path: str | None = None, design: str | None = None):
    """Context manager form of :func:`set_override` (restores the previous overrides)."""
    saved = dict(_override)
    set_override(op, path=path, design=design)
    try:
        yield
    finally:
        _override.clear()
        _override.update(saved)
        _decisions.clear()


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _check_choice(op: str, path: str | None, design: str | None) -> None:
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if design is not None and design not in FUSED_DESIGNS[op]:
        raise ValueError(f"design for {op} must be one of {FUSED_DESIGNS[op]}, got {design!r}")


def _distance(r: dict, m: int, n: int, k: int) -> float:
    return sum(abs(math.log2(max(a, 1)) - math.log2(max(b, 1))) for a, b in ((r["m"], m), (r["n"], n), (r["k"], k)))


def _candidates(op: str, world: int, dtype: torch.dtype | None, timing: str | None) -> list[dict]:
    """The rows a query is answered from: same op; rows of the timing mode ``graph`` or
    ``batch`` preferred; the nearest world size (ties: the larger); rows of the query's dtype
    preferred."""
    rows = [r for r in table() if r["op"] == op]
    if not rows:
        return []
    if timing is not None:
        rows = [r for r in rows if r.get("timing", "batch") == timing] or rows
    best_w = min({r["world"] for r in rows}, key=lambda w: (abs(w - world), -w))
    rows = [r for r in rows if r["world"] == best_w]
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        same = [r for r in rows if r.get("dtype", name) == name]
        rows = same or rows
    return rows


def lookup(op: str, m: int, n: int, k: int, world: int, dtype: torch.dtype | None = None,
           timing: str | None = None) -> dict | None:
    """The candidate row (``_candidates``) nearest to the query in log-shape."""
    rows = _candidates(op, world, dtype, timing)
    return min(rows, key=lambda r: _distance(r, m, n, k)) if rows else None


def outside_measured(op: str, m: int, n: int, k: int, world: int, dtype: torch.dtype | None = None,
                     timing: str | None = None) -> str | None:
    """Why the query lies outside the range of M, N or K its candidate rows cover (None when
    inside, or when there are no rows)."""
    rows = _candidates(op, world, dtype, timing)
    for dim, value in (("m", m), ("n", n), ("k", k)):
        if not rows:
            break
        lo, hi = min(r[dim] for r in rows), max(r[dim] for r in rows)
        if not lo <= value <= hi:
            return (f"{dim.upper()} = {value} is outside the measured {dim.upper()} = {lo}..{hi} of {op} "
                    f"W={rows[0]['world']} ({rows[0].get('timing', 'batch')} timing)")
    return None


def _cite(row: dict) -> str:
    """The row as reasons name it: the shape, the timing mode, where the row is."""
    index = next((i for i, r in enumerate(_table or []) if r is row), None)
    where = f"{_table_name} row {index}" + (f" from {row['source']}" if row.get("source") else "")
    return (f"measured row {row['op']} M={row['m']} N={row['n']} K={row['k']} W={row['world']} "
            f"({row.get('timing', 'batch')} timing; {where})")


def decide(
    op: str,
    m: int,
    n: int,
    k: int,
    world: int,
    dtype: torch.dtype | None = None,
    *,
    device_type: str = "cuda",
    nodes: int = 1,
    path: str | None = None,
    design: str | None = None,
    capturing: bool | None = None,
) -> Decision:
    """Pick the path for one call (see the module docstring for the order of the rules).
    ``capturing``: whether the call is being captured into a CUDA graph (picks the table's
    ``graph`` rows); None asks torch for the current stream. The answer is cached per
    arguments until the overrides or the table change."""
    if capturing is None:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    key = (op, m, n, k, world, dtype, device_type, nodes, path, design, capturing)
    dec = _decisions.get(key)
    if dec is None:
        dec = _decide(op, m, n, k, world, dtype, device_type, nodes, path, design, capturing)
        _decisions[key] = dec
    return dec


def _decide(op, m, n, k, world, dtype, device_type, nodes, path, design, capturing) -> Decision:
    _check_op(op)
    _check_choice(op, path, design)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if world == 1:
        return Decision("gemm", None, "world size 1: no communication")
    forced = path is not None or design is not None
    if not forced and op in _override:
        path, design = _override[op]["path"], _override[op]["design"]
        forced = True
    if path == "nccl":
        return Decision("nccl", None, "forced")
    unavailable = None
    if nodes > 1:
        unavailable = f"group spans {nodes} nodes: symmetric memory is per node"
    elif world > MAX_WORLD:
        unavailable = f"world size {world} > {MAX_WORLD}"
    elif device_type != "cuda":
        unavailable = f"tensors on {device_type}: no symmetric memory"
    if unavailable is not None:
        if forced:
            raise ValueError(f"{op}: the fused path was forced but is unavailable ({unavailable}); use path='nccl'")
        return Decision("nccl", None, unavailable)
    timing = "graph" if capturing else "batch"
    if forced:
        return Decision("fused", design or _table_design(op, m, n, k, world, dtype, timing) or DEFAULT_DESIGN[op],
                        "forced")
    row = lookup(op, m, n, k, world, dtype, timing)
    if row is None:
        return Decision("fused", DEFAULT_DESIGN[op], "no measured rows: default fused design")
    outside = outside_measured(op, m, n, k, world, dtype, timing)
    if outside is not None:
        return Decision("nccl", None, f"{outside}: nothing measured there, NCCL + GEMM")
    where = f"nearest {_cite(row)}"
    if row["winner"] == "nccl":
        return Decision("nccl", None, f"{where}: NCCL + GEMM was faster", row)
    variant = row.get("variant") or row["winner"]
    exact = (row["m"], row["n"], row["k"], row["world"]) == (m, n, k, world)
    if exact and variant != row["winner"]:
        return Decision("fused", row["winner"], f"{where}: fused '{variant}' was fastest", row,
                        variant_options(op, variant))
    return Decision("fused", row["winner"], f"{where}: fused '{row['winner']}' was fastest", row)


@functools.lru_cache(maxsize=256)
def _variant_options(op: str, variant: str) -> tuple:
    [(_, _, opts)] = fused_variants(op, variant)
    return tuple(opts.items())


def variant_options(op: str, variant: str) -> dict:
    """The keyword options of a variant in the benchmark's syntax (``push/p24/b128`` ->
    ``{"comm_programs": 24, "config": GemmConfig(128, 128, ...)}``)."""
    return dict(_variant_options(op, variant))


def _table_design(op, m, n, k, world, dtype, timing=None) -> str | None:
    row = lookup(op, m, n, k, world, dtype, timing)
    if row is None or row["winner"] == "nccl":
        return row.get("best_fused") if row else None
    return row["winner"]


def fused_variants(op: str, spec: str) -> list[tuple[str, str, dict]]:
    """Variants in the syntax of the benchmark's ``--designs`` and of the table's ``variant``:
    ``(name, design, options)`` from ``auto`` (design None: the policy's own choice) or
    ``design[/p16+32][/l0+66][/g132][/s4][/csm+ce][/r0+1][/t0+1][/x0+1][/b128+256]`` items, e.g.
    ``ce,push/p16+32``: ``p`` sets ag_gemm push's ``comm_programs``, ``l`` gemm_rs's ``lag``, ``g``
    gemm_rs's ``gemm_programs``, ``s`` ag_gemm's ``splits``, ``c`` ag_gemm push's ``local_copy``,
    ``t`` gemm_rs's ``recv_tma`` (0 / 1), ``x`` gemm_rs's ``send_tma`` (0 / 1), ``r`` ag_gemm's
    ``read_local`` (0 / 1), ``b`` the GEMM tile (128x128 / 5 stages or 128x256 /
    3 stages, as ``default_config`` builds them); one variant per combination."""
    import itertools

    keys = {"p": "comm_programs", "l": "lag", "g": "gemm_programs", "s": "splits", "c": "local_copy",
            "t": "recv_tma", "x": "send_tma", "r": "read_local", "b": "config"}
    words = {"c": ("sm", "ce")}
    flags = {"t", "x", "r"}  # 0 / 1 -> bool
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        design, *opts = item.split("/")
        if design == "auto":  # the call as users make it: the policy picks path, design, options
            if opts:
                raise ValueError(f"variant {item!r}: auto takes no options (the policy sets them)")
            out.append(("fused:auto", None, {}))
            continue
        if design not in FUSED_DESIGNS[op]:
            raise ValueError(f"design {design!r}: {op} has {FUSED_DESIGNS[op]}")
        axes = []
        for opt in opts:
            key, values = opt[:1], opt[1:].split("+")
            ok = key in keys and all(v in words[key] if key in words else v.isdigit() for v in values)
            if not ok:
                raise ValueError(f"variant option {opt!r} in {item!r}: expected p, l, g, s, t, x, r or b and "
                                 "<int>[+<int>...], or c and sm / ce")
            if key not in OP_OPTION_KEYS[op]:
                raise ValueError(f"variant option {opt!r} in {item!r}: {op} takes {', '.join(OP_OPTION_KEYS[op])}")
            if key in flags and not all(v in ("0", "1") for v in values):
                raise ValueError(f"variant option {opt!r} in {item!r}: {key} takes 0 or 1")
            if key == "b" and not all(v in ("128", "256") for v in values):
                raise ValueError(f"variant option {opt!r} in {item!r}: b takes 128 or 256 (the GEMM tile's N)")
            axes.append([(key, v if key in words else int(v)) for v in values])
        for combo in itertools.product(*axes):
            name = "fused:" + "/".join([design] + [f"{k}{v}" for k, v in combo])
            out.append((name, design, {keys[k]: _variant_value(k, v, flags) for k, v in combo}))
    return out


def _variant_value(key: str, value, flags: set):
    """A variant option's value: ``b<N>`` is one of the two tiles of ``default_config``."""
    if key == "b":
        from tilefuse.tp._gemm_core import NARROW_TILE, WIDE_TILE

        return WIDE_TILE if value == 256 else NARROW_TILE
    return bool(value) if key in flags else value


_NODES: dict[str, int] = {}


def group_nodes(group) -> int:
    """Number of hosts the group spans (collective on first use per group, cached)."""
    import socket

    import torch.distributed as dist

    g = group if group is not None else dist.group.WORLD
    key = g.group_name
    if key not in _NODES:
        names: list = [None] * dist.get_world_size(g)
        dist.all_gather_object(names, socket.gethostname(), group=g)
        _NODES[key] = len(set(names))
    return _NODES[key]
