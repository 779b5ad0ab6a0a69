"""Activity traces of the fused TP kernels, exported as Chrome / Perfetto trace JSON.

Pass ``trace=Trace()`` to ``ag_gemm`` / ``gemm_rs``: every program of every kernel of the call
records, per work item (a GEMM tile, a pushed band piece), its start, split
and end ``%globaltimer`` (ns) and the time it spent in bounded waits. The split parts a GEMM
tile into its head (waits for rows, main loop) and its tail (epilogue: stores, pushes, the
owner's reduction), and a copied item into its waits and the copy. After the call, ``events()``
decodes them and ``to_chrome()`` writes a file that ui.perfetto.dev or chrome://tracing opens:
one process per rank, one thread per (role, program). Under the interpreter the clock reads 0:
the structure (which program did which item, in which order) is still exact.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from tilefuse.tp import _primitives as P
from tilefuse.tp._primitives import TRACE_FIELDS as _TRACE_FIELDS

TRACE_FIELDS = _TRACE_FIELDS.value  # a constexpr for the kernels, an int here

_ROLE_ITEM = {"gemm": "tile", "push": "band"}


@dataclass
class _Launch:
    role: str
    rank: int
    buf: torch.Tensor  # int64 [programs, max_events, TRACE_FIELDS]


@dataclass
class Trace:
    """Per-program event buffers of traced calls (``max_events`` items per program and launch)."""

    max_events: int = 512
    launches: list[_Launch] = field(default_factory=list)

    def __post_init__(self):
        if self.max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {self.max_events}")

    def buffer(self, role: str, rank: int, programs: int, device: torch.device) -> torch.Tensor:
        """A fresh buffer for one launch (filled with -1: unused slots stay recognisable)."""
        if role not in _ROLE_ITEM:
            raise ValueError(f"role must be one of {sorted(_ROLE_ITEM)}, got {role!r}")
        buf = torch.full((programs, self.max_events, TRACE_FIELDS), -1, dtype=torch.int64, device=device)
        self.launches.append(_Launch(role, rank, buf))
        return buf

    def events(self) -> list[dict]:
        """Decoded events (synchronizes with the device): role, rank, program, index in the
        program's sequence, start/split/end ns, wait ns, and the item (chunk/row/col or
        peer/band/piece)."""
        out = []
        for launch_id, la in enumerate(self.launches):
            data = la.buf.cpu()
            for prog in range(data.shape[0]):
                for idx in range(data.shape[1]):
                    start, split, end, wait, info = (int(x) for x in data[prog, idx])
                    if info < 0:
                        continue
                    a, b_, c = info >> 40, (info >> 20) & 0xFFFFF, info & 0xFFFFF
                    item = (
                        {"chunk": a, "tile_row": b_, "tile_col": c}
                        if la.role != "push"
                        else {"peer": a, "band": b_, "piece": c}
                    )
                    out.append({"role": la.role, "rank": la.rank, "launch": launch_id, "program": prog,
                                "seq": idx, "start_ns": start, "split_ns": split, "end_ns": end, "wait_ns": wait,
                                **item})
        return out

    def to_chrome(self, path: str | None = None) -> dict:
        """Chrome trace-event JSON of this trace (see :func:`chrome_trace`)."""
        return chrome_trace(self.events(), path)

    def summary(self) -> dict:
        """Per role: items, total busy µs, total wait µs (a quick look without a viewer)."""
        out: dict[str, dict] = {}
        for e in self.events():
            s = out.setdefault(e["role"], {"items": 0, "busy_us": 0.0, "wait_us": 0.0})
            s["items"] += 1
            s["busy_us"] += (e["end_ns"] - e["start_ns"]) / 1000.0
            s["wait_us"] += e["wait_ns"] / 1000.0
        return out


@triton.jit
def _read_clock_kernel(out_ptr, USE_TIMER: tl.constexpr):
    tl.store(out_ptr, P.now_ns(USE_TIMER))


# A device sleep ahead of each meeting, so that the clock read is already enqueued when the
# meeting ends on the device (else it would read the time the host enqueued it).
_CLOCK_SLEEP_CYCLES = 2_000_000


def clock_offsets(group=None, rounds: int = 5) -> list[int]:
    """Each rank's ``%globaltimer`` minus rank 0's, ns (collective over ``group``; zeros off a GPU).

    Every GPU has its own timer offset, so events of two ranks are comparable only after
    subtracting these. Each round the ranks meet in an all-reduce and read their timers right
    after it (the read is enqueued behind a device sleep, so it does not wait for its host);
    the median over the rounds is returned. Two ranks leave an all-reduce within a few µs of
    each other, which bounds the error."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None or dist.get_backend(group) != "nccl":
        return [0] * world
    stamps = torch.zeros(rounds, dtype=torch.int64, device=device)
    token = torch.ones(1, device=device)
    for r in range(rounds):
        torch.cuda._sleep(_CLOCK_SLEEP_CYCLES)
        dist.all_reduce(token, group=group)
        _read_clock_kernel[(1,)](stamps[r:], USE_TIMER=True)
    everyone = [torch.empty_like(stamps) for _ in range(world)]
    dist.all_gather(everyone, stamps, group=group)
    ref = everyone[0].cpu().tolist()
    return [int(statistics.median(t - t0 for t, t0 in zip(x.cpu().tolist(), ref))) for x in everyone]


def chrome_trace(events: list[dict], path: str | None = None, offsets: list[int] | None = None) -> dict:
    """Chrome trace-event JSON (``ph: X`` slices, µs from the earliest start) of decoded events,
    possibly of several ranks; written to ``path`` when given. Ranks are processes; each
    (role, program) is a thread. ``offsets``: per rank, ns to subtract from its times (its
    timer's offset, :func:`clock_offsets`) so that the ranks share one time axis."""
    if offsets is not None:
        shift = ("start_ns", "split_ns", "end_ns")
        events = [{**e, **{k: e[k] - offsets[e["rank"]] for k in shift}} for e in events]
    t0 = min((e["start_ns"] for e in events), default=0)
    roles = sorted({e["role"] for e in events})
    trace_events = []
    seen_threads = set()
    for e in events:
        tid = roles.index(e["role"]) * 100000 + e["program"]
        key = (e["rank"], tid)
        if key not in seen_threads:
            seen_threads.add(key)
            trace_events.append({"ph": "M", "name": "thread_name", "pid": e["rank"], "tid": tid,
                                 "args": {"name": f"{e['role']} program {e['program']}"}})
        kind = _ROLE_ITEM[e["role"]]
        if e["role"] == "push":
            name = f"{kind} {e['band']}.{e['piece']} -> rank {e['peer']}"
        else:
            name = f"{kind} c{e['chunk']} m{e['tile_row']} n{e['tile_col']}"
        args = {k: v for k, v in e.items() if k not in ("start_ns", "split_ns", "end_ns")}
        args["wait_us"] = e["wait_ns"] / 1000.0
        args["head_us"] = (e["split_ns"] - e["start_ns"]) / 1000.0  # waits + main loop / waits
        args["tail_us"] = (e["end_ns"] - e["split_ns"]) / 1000.0  # epilogue / the copy
        trace_events.append({"ph": "X", "name": name, "cat": e["role"], "pid": e["rank"], "tid": tid,
                             "ts": (e["start_ns"] - t0) / 1000.0,
                             "dur": max(0.0, (e["end_ns"] - e["start_ns"]) / 1000.0), "args": args})
    for rank in sorted({e["rank"] for e in events}):
        trace_events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
    doc = {"traceEvents": trace_events, "displayTimeUnit": "ns",
           "metadata": {"clock_offsets_ns": list(offsets) if offsets is not None else None}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc
