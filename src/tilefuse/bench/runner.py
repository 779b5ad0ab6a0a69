"""Runs benchmark cases the same way for every suite.

For each case: build the inputs, then for each implementation (tilefuse, peers, eager torch)
run once on a poisoned allocation and check the complete output; time the implementations of
a group together (one :func:`~tilefuse.bench.timing.measure` call, so the variant order
rotates between them) under the NVML sampler; run once more and check again; derive TFLOP/s,
TB/s, the ratio to the run's ceiling and the ratios to the peers. A failed check marks the
row and never drops it; an exception becomes an ``error`` row and the suite goes on.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tilefuse.bench import ceilings as ceil
from tilefuse.bench import timing
from tilefuse.bench.clocks import ClockSampler
from tilefuse.bench.clocks import unavailable as clocks_unavailable
from tilefuse.bench.env import on_gpu
from tilefuse.bench.report import Progress


@dataclass
class Settings:
    """How a suite times: the mode and its parameters (recorded in the result file)."""

    mode: str = "graph"  # one of timing.MODES
    calls: int = 5  # graph mode: calls captured per graph
    samples: int = 40  # timed samples; the median is reported
    iters: int = 20  # batch mode: launches per sample
    warmup: int = 5  # untimed calls first
    l2_flush: bool = False  # flush L2 before each sample (graph / periter modes)
    clocks: bool = True  # record SM clocks and power beside the samples

    def __post_init__(self):
        if self.mode not in timing.MODES:
            raise ValueError(f"mode: expected one of {timing.MODES}, got {self.mode!r}")
        for name in ("calls", "samples", "iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected a non-negative int, got {self.warmup}")
        if self.l2_flush and self.mode == "batch":
            raise ValueError("l2_flush: batch mode times back-to-back launches with nothing between them; "
                             "use graph or periter mode to flush L2")

    def measure_kwargs(self, samples: int | None = None) -> dict:
        """Keyword arguments of :func:`~tilefuse.bench.timing.measure`; ``samples`` can only lower the count."""
        n = min(samples, self.samples) if samples else self.samples
        if self.mode == "graph":
            return {"calls": self.calls, "samples": n, "l2_flush": self.l2_flush}
        if self.mode == "batch":
            return {"iters": self.iters, "warmup": self.warmup, "samples": n}
        return {"samples": n, "warmup": min(self.warmup, 3), "l2_flush": self.l2_flush}

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Impl:
    """One implementation of a case: a zero-argument callable returning the output.

    ``check(output) -> dict`` must contain ``"passed": bool`` and may add measured errors;
    ``skipped`` gives the reason an implementation is not run (peer not installed, format not
    supported). Implementations of the same ``group`` are timed together; ``samples`` lowers
    the sample count for slow rows (eager torch at large shapes).
    """

    name: str
    fn: Callable[[], Any] | None = None
    check: Callable[[Any], dict] | None = None
    skipped: str | None = None
    group: str = "main"
    samples: int | None = None
    out_bytes: int = 0
    ceiling: str | None = None  # overrides the case's ceiling (e.g. MX variants in an FP8 case)


@dataclass
class Case:
    """One shape of a suite. ``build()`` creates the inputs lazily and returns the implementations;
    the first implementation is the subject the others are compared with (``peer_ratio``)
    unless ``compare_impls`` is False (variants of one op rather than peers)."""

    name: str
    build: Callable[[], list[Impl]]
    x: str = ""
    series: str = ""
    params: dict = field(default_factory=dict)
    flops: int | None = None
    bytes: int | None = None
    ceiling: str | None = None
    reset: Callable[[], None] | None = None
    compare_impls: bool = True


# ---------------------------------------------------------------------------------------
# Poisoned outputs
# ---------------------------------------------------------------------------------------
def poison_allocator(nbytes: int, device: str) -> tuple[int, int] | None:
    """Fill a block with 0xFF bytes (NaN in fp32 and bf16) and free it, so that the caching
    allocator hands it to the next allocation of that size. Returns its address range."""
    if nbytes <= 0:
        return None
    block = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)
    span = (block.data_ptr(), nbytes)
    del block
    return span


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


def landed_in_poison(out: Any, span: tuple[int, int] | None) -> bool:
    """Whether the output's storage lies inside the poisoned block (so unwritten elements show)."""
    t = _first_tensor(out)
    if t is None or span is None:
        return False
    start, n = span
    ptr = t.untyped_storage().data_ptr()
    return start <= ptr and ptr + t.untyped_storage().nbytes() <= start + n


def _device_of(case_device: str | None) -> str:
    return case_device or ("cuda" if on_gpu() else "cpu")


def _error_note(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})" if last else ""
    return f"{type(e).__name__}: {e}{where}"[:500]


def _run_check(impl: Impl, device: str, poison: bool) -> dict:
    poison = poison and impl.out_bytes > 0
    span = poison_allocator(impl.out_bytes, device) if poison else None
    out = impl.fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    result = impl.check(out) if impl.check is not None else {"passed": True, "note": "no check"}
    if poison:
        result["poisoned"] = landed_in_poison(out, span)
    return result


# ---------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------
def _base_row(suite: str, case: Case, impl: Impl, peer: bool = False) -> dict:
    return {
        "key": f"{suite}/{case.name} | {impl.name}",
        "case": case.name,
        "impl": impl.name,
        "peer": peer,
        "x": case.x or case.name,
        "series": f"{impl.name} {case.series}".strip(),
        "params": case.params,
        "status": "ok",
        "note": None,
        "check": None,
        "post_check": None,
        "stats": None,
        "flops": case.flops,
        "bytes": case.bytes,
        "tflops": None,
        "tbps": None,
        "ceiling": impl.ceiling or case.ceiling,
        "ratio_to_ceiling": None,
        "peer_ratio": {},
        "clocks": None,
        "throttled": None,
    }


def _fill_metrics(row: dict, ceilings: dict) -> None:
    st = row["stats"]
    if st is None:
        return
    t = st["median_us"] * 1e-6
    if t <= 0:
        return
    if row["flops"]:
        row["tflops"] = row["flops"] / t / 1e12
    if row["bytes"]:
        row["tbps"] = row["bytes"] / t / 1e12
    ref = ceil.ceiling_value(ceilings, row["ceiling"]) if row["ceiling"] else None
    if ref:
        achieved = row["tbps"] if ceil.UNITS.get(row["ceiling"]) == "TB/s" else row["tflops"]
        if achieved is not None:
            row["ratio_to_ceiling"] = achieved / ref


def _fill_peer_ratios(rows: list[dict]) -> None:
    """On the subject row (the first): peer median / subject median, i.e. the subject's speedup."""
    subject = rows[0]
    if subject["stats"] is None:
        return
    for r in rows[1:]:
        if r["stats"] is not None:
            subject["peer_ratio"][r["impl"]] = r["stats"]["median_us"] / subject["stats"]["median_us"]


def run_case(
    suite: str,
    case: Case,
    settings: Settings,
    ceilings: dict,
    *,
    device: str | None = None,
    backend: timing.Backend | None = None,
    sampler_factory: Callable[[], ClockSampler] | None = None,
) -> list[dict]:
    """All rows of one case (one per implementation, in the order ``build`` returned them)."""
    dev = _device_of(device)
    try:
        impls = case.build()
    except Exception as e:
        row = _base_row(suite, case, Impl("tilefuse"))
        row.update(status="error", note="building inputs: " + _error_note(e))
        return [row]
    # With compare_impls the implementations after the first are other libraries (peers).
    rows = {impl.name: _base_row(suite, case, impl, peer=case.compare_impls and i > 0) for i, impl in enumerate(impls)}
    timed: dict[str, dict[str, Impl]] = {}
    for impl in impls:
        row = rows[impl.name]
        if impl.skipped is not None or impl.fn is None:
            row.update(status="skipped", note=impl.skipped or "no implementation")
            continue
        try:
            if case.reset is not None:
                case.reset()
            row["check"] = _run_check(impl, dev, poison=True)
        except Exception as e:
            row.update(status="error", note=_error_note(e))
            continue
        if not row["check"].get("passed", False):
            row.update(status="failed", note=row["check"].get("failed") or "check failed before timing")
        timed.setdefault(impl.group, {})[impl.name] = impl

    for group in timed.values():
        samples = min((i.samples for i in group.values() if i.samples), default=None)
        kw = settings.measure_kwargs(samples)
        if backend is not None:
            kw["backend"] = backend
        sampler = (sampler_factory or ClockSampler)() if settings.clocks else None
        try:
            if sampler is not None:
                sampler.start()
            try:
                stats = timing.measure(
                    {n: i.fn for n, i in group.items()}, settings.mode, reset=case.reset, **kw
                )
            finally:
                if sampler is not None:
                    sampler.stop()
        except Exception as e:
            for n in group:
                rows[n].update(status="error", note="timing: " + _error_note(e))
            continue
        clocks = sampler.summary() if sampler is not None else clocks_unavailable("clock sampling disabled")
        for n, impl in group.items():
            row = rows[n]
            row["stats"] = stats[n].to_dict()
            row["clocks"] = clocks
            row["throttled"] = clocks.get("throttled") if clocks.get("available") else None
            try:
                if case.reset is not None:
                    case.reset()
                row["post_check"] = _run_check(impl, dev, poison=False)
            except Exception as e:
                row.update(status="error", note="after timing: " + _error_note(e))
                continue
            if row["status"] == "ok" and not row["post_check"].get("passed", False):
                row.update(status="failed", note="check failed after timing")

    ordered = [rows[i.name] for i in impls]
    for row in ordered:
        _fill_metrics(row, ceilings)
    if case.compare_impls:
        _fill_peer_ratios(ordered)
    if dev.startswith("cuda"):
        del impls, timed
        torch.cuda.empty_cache()
    return ordered


def run_cases(
    suite: str,
    cases: list[Case],
    settings: Settings,
    ceilings: dict,
    *,
    progress: Progress | None = None,
    checkpoint: Callable[[list[dict]], None] | None = None,
    checkpoint_s: float = 20.0,
    **kw,
) -> list[dict]:
    """Rows of every case, with a progress step per case; ``checkpoint(rows so far)`` at most
    every ``checkpoint_s`` seconds between cases."""
    rows: list[dict] = []
    last = time.monotonic()
    for i, case in enumerate(cases):
        if progress is not None:
            progress.step(case.name)
        rows.extend(run_case(suite, case, settings, ceilings, **kw))
        if checkpoint is not None and i + 1 < len(cases) and time.monotonic() - last >= checkpoint_s:
            checkpoint(rows)
            last = time.monotonic()
    return rows


def run_suite(
    suite: str,
    cases: list[Case],
    settings: Settings,
    *,
    ceilings: dict | None = None,
    progress: Progress | None = None,
    extra_settings: dict | None = None,
    partial: Callable[[dict], None] | None = None,
    **kw,
) -> dict:
    """A complete result: environment, the run's ceilings (measured now unless given), all rows.
    ``partial``, when given, receives the result of the cases run so far now and then (settings
    ``"partial": true``), so that a run stopped by a time limit keeps its rows."""
    from tilefuse.bench.env import environment
    from tilefuse.bench.report import make_result

    env = environment(settings.mode)
    if ceilings is None:
        ceilings = ceil.measure_ceilings(progress=progress.note if progress is not None else None)
    every = {**settings.to_dict(), **(extra_settings or {})}
    checkpoint = None
    if partial is not None:
        def checkpoint(rows):
            partial(make_result(suite, env, {**every, "partial": True}, ceilings, rows))
    rows = run_cases(suite, cases, settings, ceilings, progress=progress, checkpoint=checkpoint, **kw)
    if progress is not None:
        progress.close()
    return make_result(suite, env, every, ceilings, rows)
