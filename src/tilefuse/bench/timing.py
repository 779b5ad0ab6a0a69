"""Timing modes and statistics shared by every tilefuse benchmark.

Three modes, one definition each (see ``docs/benchmarking.md``):

* ``graph`` (default): capture ``calls`` invocations of an op in one CUDA graph, each with
  its own retained output; per sample replay once untimed, then time one replay with events;
  per-call time = replay / calls.
* ``batch``: warm up, then ``iters`` back-to-back launches inside one event pair, divided by
  ``iters``; no host work inside.
* ``periter``: one event pair per launch with the reset between launches. The idle gaps let
  clocks boost: a latency number, not comparable with the other two.

When several variants are timed together, their order changes every sample
(:func:`variant_order`) so that drift and warm-up bias fall evenly on all of them. Resets and
L2 flushes always run outside the timed region.

The device work goes through a small :class:`Backend` seam: :class:`CudaBackend` (CUDA
graphs and events) on a GPU, :class:`HostBackend` (``time.perf_counter``) when the ops run
on CPU tensors through the Triton interpreter, where the numbers are labelled as not being
performance numbers. Tests inject a fake backend to check call order.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import torch

MODES = ("graph", "batch", "periter")
CUDA_TIMER = "cuda events"
HOST_TIMER = "host (Triton interpreter, not a performance number)"
# L2 flush buffer when the device does not report its L2 size: larger than any current L2.
_DEFAULT_FLUSH_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------
@dataclass
class Stats:
    """Summary of one variant's samples, all in microseconds per call.

    ``timer`` says what produced the samples (CUDA events or a host clock) and ``mode`` the
    timing mode; both travel into the JSON so no number is read out of context.
    """

    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    mean_us: float
    samples_us: list[float]
    timer: str = CUDA_TIMER
    mode: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Stats:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of an already sorted list."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def summarize(samples_us: list[float], *, timer: str = CUDA_TIMER, mode: str = "") -> Stats:
    """Median, p10, p90, min and mean of ``samples_us`` (every sample is kept)."""
    if not samples_us:
        raise ValueError("samples_us: expected at least one sample")
    values = [float(v) for v in samples_us]
    s = sorted(values)
    return Stats(
        median_us=percentile(s, 50.0),
        p10_us=percentile(s, 10.0),
        p90_us=percentile(s, 90.0),
        min_us=s[0],
        mean_us=sum(s) / len(s),
        samples_us=values,
        timer=timer,
        mode=mode,
    )


def slowest_rank(per_rank: list[Stats]) -> Stats:
    """Distributed rule: the report takes the rank whose median is the largest."""
    if not per_rank:
        raise ValueError("per_rank: expected the stats of at least one rank")
    return max(per_rank, key=lambda s: s.median_us)


def variant_order(names: list[str], sample: int) -> list[str]:
    """Order of the variants in sample ``sample``.

    The order is rotated by one every two samples and reversed on odd samples. Over ``2n``
    samples every variant takes every position equally often (with two variants, a plain
    rotate-and-reverse on every sample would cancel out and never swap them).
    """
    n = len(names)
    if n == 0:
        return []
    shift = (sample // 2) % n
    order = list(names[shift:]) + list(names[:shift])
    if sample % 2:
        order.reverse()
    return order


# ---------------------------------------------------------------------------------------
# Backends: the only place that touches the device
# ---------------------------------------------------------------------------------------
class Backend(Protocol):
    """What the timing modes need from a device (a seam for tests)."""

    timer: str

    def synchronize(self) -> None: ...

    def mark(self) -> Any:
        """Record a point in time on the current stream and return its handle."""

    def elapsed_us(self, start: Any, end: Any) -> float:
        """Microseconds between two marks (after :meth:`synchronize`)."""

    def capture(self, fn: Callable[[], object], calls: int) -> Callable[[], None]:
        """Return a replay that runs ``calls`` invocations of ``fn``, each output retained."""

    def flush_l2(self) -> None: ...


class CudaBackend:
    """CUDA graphs and CUDA events on the current device and stream."""

    timer = CUDA_TIMER

    def __init__(self, flush_bytes: int | None = None):
        self._flush_bytes = flush_bytes
        self._flush_buf: torch.Tensor | None = None

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed_us(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) * 1000.0

    def capture(self, fn: Callable[[], object], calls: int) -> Callable[[], None]:
        # Warm up on a side stream first: compilation, autotuning and lazy allocations must
        # not happen inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        outputs: list[object] = []
        with torch.cuda.graph(graph):
            for _ in range(calls):
                outputs.append(fn())

        def replay() -> None:
            graph.replay()

        # The outputs live as long as the replay: every captured call keeps its own buffer.
        replay.outputs = outputs
        return replay

    def flush_l2(self) -> None:
        if self._flush_buf is None:
            size = self._flush_bytes
            if size is None:
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                l2 = getattr(props, "L2_cache_size", 0)
                size = 2 * l2 if l2 else _DEFAULT_FLUSH_BYTES
            self._flush_buf = torch.empty(size, dtype=torch.uint8, device="cuda")
        self._flush_buf.zero_()


class HostBackend:
    """Host clock for ops that run on CPU tensors (the Triton interpreter).

    "Capture" keeps the ``calls`` outputs of the last replay alive, the same memory shape as a
    graph; the numbers measure the interpreter, not a kernel.
    """

    timer = HOST_TIMER

    def synchronize(self) -> None:
        pass

    def mark(self) -> int:
        return time.perf_counter_ns()

    def elapsed_us(self, start: int, end: int) -> float:
        return (end - start) / 1000.0

    def capture(self, fn: Callable[[], object], calls: int) -> Callable[[], None]:
        retained: list[object] = []

        def replay() -> None:
            retained[:] = [fn() for _ in range(calls)]

        return replay

    def flush_l2(self) -> None:
        pass


def default_backend() -> Backend:
    """CUDA when a GPU is used for real; the host clock on CPU or under ``TRITON_INTERPRET``."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if torch.cuda.is_available() and not interpreted:
        return CudaBackend()
    return HostBackend()


# ---------------------------------------------------------------------------------------
# Timing modes
# ---------------------------------------------------------------------------------------
def _check_fns(fns: dict[str, Callable[[], object]]) -> list[str]:
    if not isinstance(fns, dict) or not fns:
        raise ValueError("fns: expected a non-empty dict of name -> zero-argument callable")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}]: expected a callable, got {type(fn).__name__}")
    return list(fns)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")


def _check_warmup(warmup: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative int, got {warmup!r}")


def _timed_us(be: Backend, fn: Callable[[], object], repeat: int = 1) -> float:
    """Microseconds per call of ``repeat`` back-to-back calls of ``fn`` between two marks."""
    start = be.mark()
    for _ in range(repeat):
        fn()
    end = be.mark()
    be.synchronize()
    return be.elapsed_us(start, end) / repeat


def _sample(names: list[str], samples: int, reset: Callable[[], None] | None, be: Backend, mode: str,
            sample_us: Callable[[str], float]) -> dict[str, Stats]:
    """Stats of ``samples`` rounds over the variants in :func:`variant_order`: per variant,
    ``reset`` (if any), then ``sample_us(name)``, the sample's microseconds."""
    values: dict[str, list[float]] = {n: [] for n in names}
    for s in range(samples):
        for n in variant_order(names, s):
            if reset is not None:
                reset()
            values[n].append(sample_us(n))
    return {n: summarize(values[n], timer=be.timer, mode=mode) for n in names}


def time_graph(
    fns: dict[str, Callable[[], object]],
    *,
    calls: int = 5,
    samples: int = 40,
    l2_flush: bool = False,
    reset: Callable[[], None] | None = None,
    backend: Backend | None = None,
) -> dict[str, Stats]:
    """Graph mode: per-call microseconds of each variant, from ``samples`` timed replays.

    Each variant is captured once (``calls`` invocations, each output retained). Per sample
    and per variant, in :func:`variant_order`: ``reset``, untimed replay, ``reset``, L2 flush,
    then one replay between two marks. ``reset`` must restore any state the op accumulates.
    """
    names = _check_fns(fns)
    _check_positive(calls=calls, samples=samples)
    be = backend or default_backend()
    replays = {n: be.capture(fns[n], calls) for n in names}
    be.synchronize()

    def replayed_us(n: str) -> float:
        replays[n]()
        if reset is not None:
            reset()
        if l2_flush:
            be.flush_l2()
        return _timed_us(be, replays[n]) / calls

    return _sample(names, samples, reset, be, "graph", replayed_us)


def time_batch(
    fns: dict[str, Callable[[], object]],
    *,
    iters: int = 20,
    warmup: int = 5,
    samples: int = 10,
    reset: Callable[[], None] | None = None,
    backend: Backend | None = None,
) -> dict[str, Stats]:
    """Batch mode: ``iters`` back-to-back launches inside one pair of marks, divided by ``iters``.

    ``warmup`` launches per variant first. ``reset`` (if any) runs once before each sample,
    never between the launches; an op whose state must be reset per launch belongs in graph
    or periter mode. No L2 flush: the launches follow each other with no host work between.
    """
    names = _check_fns(fns)
    _check_positive(iters=iters, samples=samples)
    _check_warmup(warmup)
    be = backend or default_backend()
    for n in names:
        if reset is not None:
            reset()
        for _ in range(warmup):
            fns[n]()
    be.synchronize()
    return _sample(names, samples, reset, be, "batch", lambda n: _timed_us(be, fns[n], iters))


def time_periter(
    fns: dict[str, Callable[[], object]],
    *,
    samples: int = 40,
    warmup: int = 3,
    l2_flush: bool = False,
    reset: Callable[[], None] | None = None,
    backend: Backend | None = None,
) -> dict[str, Stats]:
    """Periter mode: one pair of marks around each launch, ``reset`` and flush before it.

    Leaves idle gaps between launches in which clocks boost: use it for latency questions and
    do not compare it with graph or batch numbers.
    """
    names = _check_fns(fns)
    _check_positive(samples=samples)
    _check_warmup(warmup)
    be = backend or default_backend()
    for n in names:
        for _ in range(warmup):
            if reset is not None:
                reset()
            fns[n]()
    be.synchronize()

    def launch_us(n: str) -> float:
        if l2_flush:
            be.flush_l2()
        return _timed_us(be, fns[n])

    return _sample(names, samples, reset, be, "periter", launch_us)


_MODE_FUNCS = {"graph": time_graph, "batch": time_batch, "periter": time_periter}


def measure(fns: dict[str, Callable[[], object]], mode: str = "graph", **kw) -> dict[str, Stats]:
    """Time ``fns`` in ``mode`` ("graph", "batch" or "periter"); keyword arguments go to that mode.

    Raises ValueError for an unknown mode and TypeError for an argument the mode does not take.
    """
    func = _MODE_FUNCS.get(mode)
    if func is None:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return func(fns, **kw)
