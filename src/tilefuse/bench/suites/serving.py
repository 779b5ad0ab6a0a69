"""``tilefuse bench serving``: DeepSeek-V3.2's indexer inside a serving engine's step loop.

Each step does what an engine does for the indexer (``shared/notes/engines.md``): the decode
schedule metadata once (``get_paged_mqa_logits_metadata`` into a fixed buffer), then for each
of L layers one chunk of prefill (``fp8_mqa_logits``, ``clean_logits=False``, a new S_q and S_k
every step) and one decode call (``fp8_paged_mqa_logits``, ``next_n`` rows per request, width
``max_model_len``, a new batch and new context lengths every step). The top-k after the
logits is not included. Modes:

* ``eager``: every call launched from Python, as engines run prefill (and decode past their
  largest captured batch);
* ``graph``: prefill eager, decode replayed from CUDA graphs captured per batch bucket
  (1, 2, 4, 8, 16, ... as engines capture), the step's batch padded up to its bucket.

Per step it records the wall time (host enqueue until the GPU is done), the GPU time (CUDA
events around the step), the host time per call (time to enqueue the step's calls, over the
calls) and the kernel compilations seen (after a warm-up, which must be zero). DeepGEMM runs
the same steps on the same inputs when ``import deep_gemm`` works. On a CPU machine a couple
of steps at tiny shapes run through the Triton interpreter (the flow, not performance).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tilefuse import _jit
from tilefuse.bench import timing
from tilefuse.bench.suites.indexer import deep_gemm_module
from tilefuse.reference import paged_row_ends

HOST_TIMER = "host perf_counter"


@dataclasses.dataclass(frozen=True)
class ServingShape:
    """The model and the step sequence. Defaults: DeepSeek-V3.2 on a GPU."""

    layers: int = 61  # indexer layers per step
    steps: int = 12  # timed steps
    heads: int = 64  # indexer heads
    head_dim: int = 128
    block_kv: int = 64  # tokens per KV page
    next_n: int = 1  # decode rows per request (MTP)
    max_model_len: int = 163840  # the decode output's width
    prefill_rows: tuple[int, int] = (256, 8192)  # chunk S_q, uniform in [lo, hi]
    prefill_prefix: tuple[int, int] = (0, 32768)  # keys before the chunk: S_k = prefix + S_q
    decode_batch: tuple[int, int] = (1, 256)  # requests per decode step, uniform in [lo, hi]
    decode_context: tuple[int, int] = (1024, 65536)  # context length per request, uniform
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    seed: int = 0


CPU_SHAPE = ServingShape(layers=2, steps=2, heads=8, head_dim=64, block_kv=64, max_model_len=256,
                         prefill_rows=(4, 24), prefill_prefix=(0, 64), decode_batch=(1, 3), decode_context=(1, 200),
                         graph_buckets=(1, 2, 4))


def _uniform(g: torch.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


@dataclasses.dataclass
class Step:
    """One step's shapes (the same for every implementation)."""

    s_q: int
    s_k: int
    batch: int
    context_lens: list[int]


def step_sequence(shape: ServingShape) -> list[Step]:
    g = torch.Generator().manual_seed(shape.seed)
    out = []
    for _ in range(shape.steps):
        s_q = _uniform(g, shape.prefill_rows)
        s_k = s_q + _uniform(g, shape.prefill_prefix)
        batch = _uniform(g, shape.decode_batch)
        lens = [_uniform(g, shape.decode_context) for _ in range(batch)]
        out.append(Step(s_q, s_k, batch, lens))
    return out


def bucket_of(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest captured batch size that holds ``batch`` (None: past the largest, eager)."""
    return next((b for b in buckets if b >= batch), None)


# ---------------------------------------------------------------------------------------
# Inputs: one pool per run, sliced per step (an engine's buffers are reused the same way)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Pool:
    q: torch.Tensor  # e4m3 [max S_q, H, D]
    k: torch.Tensor  # e4m3 [max S_k, D]
    k_scale: torch.Tensor  # fp32 [max S_k]
    weights: torch.Tensor  # fp32 [max S_q, H]
    q_decode: torch.Tensor  # e4m3 [max B, next_n, H, D]
    w_decode: torch.Tensor  # fp32 [max B * next_n, H]
    kv_cache: torch.Tensor  # uint8 [pages, block_kv, 1, D + 4]
    block_table: torch.Tensor  # int32 [max B, pages per request]
    context_lens: torch.Tensor  # int32 [max B] (fixed buffer, rewritten per step)
    num_sms: int


def make_pool(shape: ServingShape, steps: list[Step], device: str) -> Pool:
    from tilefuse import formats
    from tilefuse.indexer import paged

    g = torch.Generator(device=device).manual_seed(shape.seed)
    h, d = shape.heads, shape.head_dim
    max_q = max(s.s_q for s in steps)
    max_k = max(s.s_k for s in steps)
    max_b = max(max(s.batch for s in steps), max(shape.graph_buckets))
    q, _ = formats.quantize_q(torch.randn(max_q, h, d, device=device, generator=g), "fp8")
    k, k_scale = formats.quantize_k(torch.randn(max_k, d, device=device, generator=g), "fp8")
    pages_per_req = -(-shape.max_model_len // shape.block_kv)
    # Requests share one pool of pages (the cache holds at most the longest context per request).
    longest = max(max(s.context_lens) for s in steps)
    pages = max_b * -(-longest // shape.block_kv)
    cache = paged.new_paged_kv_cache(pages, shape.block_kv, d, "fp8", device=device)
    cache.view(torch.uint8).copy_(torch.randint(0, 120, cache.shape, device=device, generator=g, dtype=torch.uint8))
    scales = cache.view(pages, -1)[:, shape.block_kv * d:].view(torch.float32)
    scales.copy_(torch.rand(scales.shape, device=device, generator=g) * 0.01 + 1e-3)
    table = torch.randint(0, pages, (max_b, pages_per_req), device=device, generator=g, dtype=torch.int32)
    q_dec, _ = formats.quantize_q(torch.randn(max_b, shape.next_n, h, d, device=device, generator=g), "fp8")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.startswith("cuda") else 8
    return Pool(q, k, k_scale, torch.randn(max_q, h, device=device, generator=g), q_dec,
                torch.randn(max_b * shape.next_n, h, device=device, generator=g), cache, table,
                torch.zeros(max_b, dtype=torch.int32, device=device), num_sms)


# ---------------------------------------------------------------------------------------
# One implementation's step loop
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Api:
    """The three calls of a step, as an implementation spells them."""

    name: str
    metadata: object  # get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)
    prefill: object  # fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits)
    decode: object  # fp8_paged_mqa_logits(q, cache, weights, lens, table, meta, max_len, clean_logits)


def tilefuse_api() -> Api:
    import tilefuse

    return Api("tilefuse", tilefuse.get_paged_mqa_logits_metadata, tilefuse.fp8_mqa_logits,
               tilefuse.fp8_paged_mqa_logits)


def deep_gemm_api(dg) -> Api:
    """DeepGEMM on the same inputs; its lengths in the 2-D form it requires (one small torch op
    per call, counted in its host time)."""

    def metadata(lens, block_kv, num_sms):
        return dg.get_paged_mqa_logits_metadata(paged_row_ends(lens, 1), block_kv, num_sms)

    def decode(q, kv_cache, weights, lens, table, meta, max_len, *args):
        rows_ends = paged_row_ends(lens, q.shape[1])
        return dg.fp8_paged_mqa_logits(q, kv_cache, weights, rows_ends, table, meta, max_len, *args)

    return Api("deep_gemm", metadata, dg.fp8_mqa_logits, decode)


class StepRunner:
    """Runs the steps of one implementation in one mode; graphs captured per bucket on first use."""

    def __init__(self, api: Api, shape: ServingShape, pool: Pool, device: str, mode: str):
        self.api, self.shape, self.pool, self.device, self.mode = api, shape, pool, device, mode
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.meta_buffers: dict[int, torch.Tensor] = {}

    def _windows(self, s_q: int, s_k: int):
        i = torch.arange(s_q, device=self.device, dtype=torch.int32)
        return torch.zeros(s_q, dtype=torch.int32, device=self.device), i + (s_k - s_q + 1)

    def prefill(self, step: Step) -> None:
        p = self.pool
        ks, ke = self._windows(step.s_q, step.s_k)
        for _ in range(self.shape.layers):
            self.api.prefill(p.q[:step.s_q], (p.k[:step.s_k], p.k_scale[:step.s_k]), p.weights[:step.s_q], ks, ke,
                             False)

    def _decode_layers(self, batch: int, meta: torch.Tensor) -> None:
        p, n = self.pool, self.shape.next_n
        for _ in range(self.shape.layers):
            self.api.decode(p.q_decode[:batch], p.kv_cache, p.w_decode[:batch * n], p.context_lens[:batch],
                            p.block_table[:batch], meta, self.shape.max_model_len, False)

    def _graph(self, bucket: int, meta: torch.Tensor) -> torch.cuda.CUDAGraph:
        """The bucket's graph of L decode calls, captured on first use (after one eager run:
        allocations and lazy initialisation stay out of the capture)."""
        graph = self.graphs.get(bucket)
        if graph is None:
            buf = self.meta_buffers[bucket] = meta.clone()
            torch.cuda.synchronize()
            self._decode_layers(bucket, buf)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode_layers(bucket, buf)
            self.graphs[bucket] = graph
        return graph

    def _set_lengths(self, lens: list[int], rows: int) -> torch.Tensor:
        p = self.pool
        # Requests padded into a graph bucket get one token (DeepGEMM's metadata fails on empty ones).
        p.context_lens[:rows].fill_(1)
        p.context_lens[:len(lens)].copy_(torch.tensor(lens, dtype=torch.int32))
        return self.api.metadata(p.context_lens[:rows], self.shape.block_kv, p.num_sms)

    def capture(self, batch: int) -> None:
        """Capture the graph of ``batch``'s bucket now (before timing)."""
        bucket = bucket_of(batch, self.shape.graph_buckets)
        if bucket is not None:
            self._graph(bucket, self._set_lengths([1] * bucket, bucket))

    def decode(self, step: Step) -> int:
        """The step's decode; returns the calls it enqueued (metadata included)."""
        bucket = bucket_of(step.batch, self.shape.graph_buckets) if self.mode == "graph" else None
        rows = bucket or step.batch
        meta = self._set_lengths(step.context_lens, rows)
        if bucket is None:
            self._decode_layers(rows, meta)
            return 2 + self.shape.layers  # lengths, metadata, L decode calls
        graph = self._graph(bucket, meta)
        self.meta_buffers[bucket].copy_(meta)
        graph.replay()
        return 4  # lengths, metadata, its copy into the captured buffer, the replay

    def run(self, step: Step) -> dict:
        """One step; returns wall, GPU and host-enqueue times (us)."""
        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record()
        t0 = time.perf_counter()
        self.prefill(step)
        decode_calls = self.decode(step)
        t1 = time.perf_counter()
        gpu_us = None
        if cuda:
            end_ev.record()
            torch.cuda.synchronize()
            gpu_us = start_ev.elapsed_time(end_ev) * 1e3
        t2 = time.perf_counter()
        return {"wall_us": (t2 - t0) * 1e6, "host_us": (t1 - t0) * 1e6, "gpu_us": gpu_us,
                "calls": self.shape.layers + decode_calls}


# ---------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------
def _stats(values: list[float], timer: str, mode: str) -> dict:
    return timing.summarize(values, timer=timer, mode=mode).to_dict()


def run_impl(api: Api, shape: ServingShape, steps: list[Step], warm_steps: list[Step], pool: Pool, device: str,
             mode: str) -> list[dict]:
    """Warm-up (tilefuse.warmup, steps of another seed, the graphs of the buckets the timed
    steps use), then the timed steps: rows of per-step wall time, GPU time and host time per
    call, and the Triton compiles seen while timed (shapes the warm-up never ran)."""
    import tilefuse

    runner = StepRunner(api, shape, pool, device, mode)
    if api.name == "tilefuse":
        tilefuse.warmup(tilefuse.IndexerModel(num_heads=shape.heads, head_dim=shape.head_dim, block_kv=shape.block_kv,
                                              next_n=shape.next_n), device=device)
    for step in warm_steps:
        runner.run(step)
    if mode == "graph":
        for batch in sorted({s.batch for s in steps}):
            runner.capture(batch)
    records = []
    with _jit.count_compiles() as log:
        for step in steps:
            records.append(runner.run(step))
    cuda = device.startswith("cuda")
    case = f"{mode} step L{shape.layers} H{shape.heads} D{shape.head_dim} next_n{shape.next_n}"
    params = {**dataclasses.asdict(shape), "mode": mode, "steps_run": len(steps)}
    base = {"case": case, "impl": api.name, "params": params, "status": "ok", "note": None, "check": None,
            "post_check": None, "flops": None, "bytes": None, "tflops": None, "tbps": None, "ceiling": None,
            "ratio_to_ceiling": None, "peer_ratio": {}, "clocks": None, "throttled": None,
            "compiles_after_warmup": log.count, "compiled": log.kernels()}
    if log.count:
        base["status"], base["note"] = "failed", f"{log.count} compile(s) after warm-up: {log.kernels()}"
    rows = []
    metrics = [("wall per step", "wall_us", HOST_TIMER), ("host per call", None, HOST_TIMER)]
    if cuda:
        metrics.insert(1, ("GPU per step", "gpu_us", timing.CUDA_TIMER))
    for label, field, timer in metrics:
        values = ([r["host_us"] / r["calls"] for r in records] if field is None else [r[field] for r in records])
        rows.append({**base, "case": f"{case}: {label}", "key": f"serving/{case} {label} | {api.name}", "x": label,
                     "series": f"{api.name} {mode}", "stats": _stats(values, timer, mode)})
    return rows


def _fill_peer_ratios(rows: list[dict]) -> None:
    by_key = {(r["case"], r["x"]): r for r in rows if r["impl"] == "tilefuse" and r.get("stats")}
    for r in rows:
        subject = by_key.get((r["case"], r["x"]))
        if r["impl"] != "tilefuse" and subject is not None and r.get("stats"):
            subject["peer_ratio"][r["impl"]] = r["stats"]["median_us"] / subject["stats"]["median_us"]


def run(shape: ServingShape, device: str, modes=("eager", "graph"), with_peer: bool = True) -> tuple[list, dict]:
    """Rows for every mode and implementation, and notes (peer availability)."""
    steps = step_sequence(shape)
    warm_steps = step_sequence(dataclasses.replace(shape, seed=shape.seed + 1))
    pool = make_pool(shape, steps + warm_steps, device)
    apis = [tilefuse_api()]
    notes = {}
    if with_peer:
        dg, skip = deep_gemm_module()
        if dg is not None:
            apis.append(deep_gemm_api(dg))
        else:
            notes["deep_gemm"] = skip
    rows = []
    for mode in modes:
        if mode == "graph" and not device.startswith("cuda"):
            notes["graph"] = "skipped: CUDA graphs need a GPU"
            continue
        for api in apis:
            try:
                rows += run_impl(api, shape, steps, warm_steps, pool, device, mode)
            except Exception as e:  # a peer's failure is a row, not the end of the run
                rows.append({"key": f"serving/{mode} | {api.name}", "case": f"{mode} step", "impl": api.name,
                             "x": "error", "series": f"{api.name} {mode}", "status": "error",
                             "note": f"{type(e).__name__}: {e}"[:500], "stats": None, "peer_ratio": {}})
    _fill_peer_ratios(rows)
    return rows, notes


# ---------------------------------------------------------------------------------------
# Command line: tilefuse bench serving
# ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="tilefuse bench serving", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, help="indexer layers per step (default 61; 2 on CPU)")
    ap.add_argument("--steps", type=int, help="timed steps (default 12; 2 on CPU)")
    ap.add_argument("--next-n", type=int, default=1, help="decode rows per request (MTP), default 1")
    ap.add_argument("--max-model-len", type=int, help="decode logits width (default 163840)")
    ap.add_argument("--modes", default="eager,graph", help="comma-separated: eager, graph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="do not run DeepGEMM even when it imports")
    ap.add_argument("--output", "-o", help="result JSON (default benchmarks/results/<gpu>/serving-<time>.json)")
    ap.add_argument("--no-output", action="store_true", help="do not write a result file")
    ap.add_argument("--plot", help="also write a PNG plot here")
    ap.add_argument("--quiet", "-q", action="store_true", help="no table")
    return ap.parse_args(argv)


def shape_from_args(args, on_gpu: bool) -> ServingShape:
    base = ServingShape() if on_gpu else CPU_SHAPE
    fields = {"next_n": args.next_n, "seed": args.seed}
    for name, value in (("layers", args.layers), ("steps", args.steps), ("max_model_len", args.max_model_len)):
        if value is not None:
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive int, got {value}")
            fields[name] = value
    if not 1 <= args.next_n <= 8:
        raise ValueError(f"--next-n: expected 1..8, got {args.next_n}")
    return dataclasses.replace(base, **fields)


def main(argv=None) -> int:
    from tilefuse.bench import env, report

    args = parse_args(argv)
    gpu = env.on_gpu()
    device = "cuda" if gpu else "cpu"
    try:
        shape = shape_from_args(args, gpu)
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        bad = [m for m in modes if m not in ("eager", "graph")]
        if bad or not modes:
            raise ValueError(f"--modes: expected eager and/or graph, got {args.modes!r}")
    except ValueError as e:
        print(f"tilefuse bench serving: {e}", flush=True)
        return 2
    if not gpu:
        print("no CUDA device: tiny shapes through the Triton interpreter (not performance numbers)")
    rows, notes = run(shape, device, modes, with_peer=not args.no_peer)
    settings = {"mode": ",".join(modes), "steps": shape.steps, "layers": shape.layers, **notes}
    result = report.make_result("serving", env.environment(",".join(modes)), settings, {}, rows)
    if not args.quiet:
        print(report.results_table(result))
    if not args.no_output:
        path = args.output or report.default_output_path("serving", env.gpu_slug())
        print(f"results: {report.write_result(result, path)}")
    if args.plot:
        from tilefuse.bench.plot import plot_result

        print(f"plot: {plot_result(result, args.plot)}")
    return 1 if any(r["status"] in ("failed", "error") for r in rows) else 0
