"""Ceilings measured once per run; every result is reported as a fraction of one of them.

* ``fp8_matmul``: ``torch._scaled_mm`` (cuBLAS) E4M3 x E4M3 -> bf16 at a large square shape;
* ``bf16_matmul``: ``torch.matmul`` in bf16 at the same shape;
* ``copy``: device-to-device copy, bytes read + written per second;
* with two or more GPUs: peer-to-peer copy bandwidth per direction (:func:`p2p_bandwidth`) and
  an NCCL collective alone (:func:`collective_bandwidth`, inside an initialised process group).

Absolute numbers move between machines and runs; ratios to a ceiling measured in the same run
do not. Without CUDA every ceiling is recorded as unavailable.
"""

from __future__ import annotations

from typing import Callable

import torch

from tilefuse.bench import timing
from tilefuse.bench.env import on_gpu

FP8_MATMUL = "fp8_matmul"
BF16_MATMUL = "bf16_matmul"
COPY = "copy"
UNITS = {FP8_MATMUL: "TFLOP/s", BF16_MATMUL: "TFLOP/s", COPY: "TB/s"}


def unavailable(reason: str) -> dict:
    return {"available": False, "reason": reason}


def _timed(fn: Callable[[], object], calls: int, samples: int) -> timing.Stats:
    return timing.time_graph({"x": fn}, calls=calls, samples=samples)["x"]


def _record(value: float, unit: str, stats: timing.Stats, **what) -> dict:
    return {"available": True, "value": value, "unit": unit, **what, "stats": stats.to_dict()}


def fp8_matmul(size: int = 8192, *, fast_accum: bool = False, calls: int = 5, samples: int = 10) -> dict:
    """TFLOP/s of ``torch._scaled_mm`` on random E4M3 ``[size, size]`` operands, bf16 output."""
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
    one = torch.ones((), device="cuda")
    fn = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    stats = _timed(fn, calls, samples)
    tflops = 2 * size**3 / (stats.median_us * 1e-6) / 1e12
    return _record(tflops, "TFLOP/s", stats, shape=[size, size, size], fast_accum=fast_accum)


def bf16_matmul(size: int = 8192, *, calls: int = 5, samples: int = 10) -> dict:
    """TFLOP/s of ``torch.matmul`` on random bf16 ``[size, size]`` operands."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    stats = _timed(lambda: a @ b, calls, samples)
    tflops = 2 * size**3 / (stats.median_us * 1e-6) / 1e12
    return _record(tflops, "TFLOP/s", stats, shape=[size, size, size])


def copy_bandwidth(nbytes: int = 1 << 30, *, calls: int = 5, samples: int = 10) -> dict:
    """TB/s of a device-to-device copy, counting bytes read + written: the faster of a memcpy
    (``copy_``, a copy-engine node inside a graph) and an SM copy kernel (``torch.add(x, 0)``),
    since inside CUDA graphs the memcpy node alone sits well under the SM copy."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ways = {"memcpy": lambda: dst.copy_(src), "sm_kernel": lambda: torch.add(src, 0.0, out=dst)}
    stats = {name: _timed(fn, calls, samples) for name, fn in ways.items()}
    best = min(stats, key=lambda n: stats[n].median_us)
    tbps = 2 * nbytes / (stats[best].median_us * 1e-6) / 1e12
    others = {n: 2 * nbytes / (st.median_us * 1e-6) / 1e12 for n, st in stats.items()}
    return _record(tbps, "TB/s", stats[best], bytes=nbytes, method=best, by_method_tbps=others)


def p2p_bandwidth(src: int = 0, dst: int = 1, nbytes: int = 512 << 20, *, samples: int = 10) -> dict:
    """GB/s of a copy-engine copy from GPU ``src`` to GPU ``dst`` in one process (one direction).

    Timed with events on ``src``'s current stream in batch mode; call it twice with the
    devices swapped for both directions.
    """
    if torch.cuda.device_count() <= max(src, dst):
        return unavailable(f"needs GPUs {src} and {dst}, found {torch.cuda.device_count()}")
    if not torch.cuda.can_device_access_peer(src, dst):
        return unavailable(f"GPU {src} cannot access GPU {dst} as a peer")
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    with torch.cuda.device(src):
        stats = timing.time_batch({"x": lambda: b.copy_(a, non_blocking=True)}, iters=5, samples=samples)["x"]
    gbps = nbytes / (stats.median_us * 1e-6) / 1e9
    return _record(gbps, "GB/s", stats, direction=f"{src}->{dst}", bytes=nbytes)


def collective_bandwidth(op: str, nbytes: int = 1 << 30, *, group=None, samples: int = 10) -> dict:
    """Bus bandwidth (GB/s) of an NCCL ``all_gather`` or ``reduce_scatter`` of ``nbytes`` in total.

    Must be called on every rank of an initialised process group; every rank times (batch
    mode) and the slowest rank's median is reported, as for every distributed result.
    Bus bandwidth = ``nbytes * (W - 1) / W / t`` (the NCCL-tests convention).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return unavailable("no initialised torch.distributed process group")
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"op: expected 'all_gather' or 'reduce_scatter', got {op!r}")
    world = dist.get_world_size(group)
    n = nbytes // 2 // world * world  # bf16 elements, divisible by the world size
    full = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    shard = torch.empty(n // world, dtype=torch.bfloat16, device="cuda")
    if op == "all_gather":
        fn = lambda: dist.all_gather_into_tensor(full, shard, group=group)
    else:
        fn = lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    local = timing.time_batch({"x": fn}, iters=5, samples=samples)["x"]
    medians = [None] * world
    dist.all_gather_object(medians, local.to_dict(), group=group)
    slowest = timing.slowest_rank([timing.Stats.from_dict(m) for m in medians])
    busbw = 2 * n * (world - 1) / world / (slowest.median_us * 1e-6) / 1e9
    return _record(busbw, "GB/s", slowest, op=op, bytes=2 * n, world_size=world)


def measure_ceilings(
    *, matmul_size: int = 8192, copy_bytes: int = 1 << 30, progress: Callable[[str], None] | None = None
) -> dict:
    """The single-GPU ceilings of one run: ``{name: record}``; unavailable on a CPU run."""
    if not on_gpu():
        reason = "no CUDA device (Triton interpreter run)"
        return {name: unavailable(reason) for name in UNITS}
    out = {}
    for name, fn in (
        (FP8_MATMUL, lambda: fp8_matmul(matmul_size)),
        (BF16_MATMUL, lambda: bf16_matmul(matmul_size)),
        (COPY, lambda: copy_bandwidth(copy_bytes)),
    ):
        if progress is not None:
            progress(f"ceiling {name}")
        try:
            out[name] = fn()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # e.g. no FP8 cuBLAS on this GPU
            out[name] = unavailable(f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    return out


def ceiling_value(ceilings: dict, name: str) -> float | None:
    rec = ceilings.get(name) or {}
    return rec.get("value") if rec.get("available") else None
