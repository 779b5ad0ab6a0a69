"""``tilefuse bench ag-gemm|gemm-rs``: the fused TP GEMMs against their baselines, same run.

Run from the command line (one process; it starts ``torchrun`` with one worker per GPU)::

    tilefuse bench ag-gemm --world 2 --shapes seed,llm
    tilefuse bench gemm-rs --world 2 --shapes 8192x8192x1024 --trace traces/

Per shape (per-GPU GEMM dims ``M x N x K``; ag_gemm gathers ``[M/W, K]`` shards, gemm_rs
scatters ``[M/W, N]`` rows) every rank times, in one rotation:

* ``cublas``: the GEMM alone (``torch.matmul``); ``tilefuse_gemm``: tilefuse's GEMM core alone;
* ``nccl``: the collective alone (``all_gather_into_tensor`` / ``reduce_scatter_tensor``);
* ``nccl+cublas``: the sequential baseline;
* ``symm_mem``: ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``;
* ``fused:auto``: the call with every choice left to the policy (path, design, measured options);
* ``fused:<design>[/p<programs>][/l<lag>][/g<programs>][/s<splits>][/c<sm|ce>][/r<0|1>][/t<0|1>][/x<0|1>]
  [/b<128|256>]``:
  tilefuse's fused designs (communication programs; gemm_rs push's tile order, program count,
  TMA loads of the partials and TMA stores of the pushed tiles; ag_gemm's copy-engine pieces,
  who stages push's local shard and whether the GEMM reads the own rows from the shard; the
  GEMM tile).

Every output is checked first (poisoned buffer, relative error to the sequential baseline);
a variant that fails on any rank is dropped on every rank and recorded. The result row of a
variant is the slowest rank's statistics (max over ranks of the per-rank medians); each fused
row also carries TFLOP/s per GPU, the speedup over ``nccl+cublas``, the ratio to the bound
``max(cublas, nccl)`` and to ``cublas``, and the ratio to ``symm_mem``. NVLink multicast stays
off in every worker (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from tilefuse.tp._common import MULTICAST_OFF
from tilefuse.tp.policy import fused_variants

OPS = {"ag-gemm": "ag_gemm", "gemm-rs": "gemm_rs"}
SEED_SIZES = (4096, 8192, 16384, 32768)
LLM_TOKENS = (1024, 4096, 8192, 16384)
# Per-GPU (K, N) of Llama-3 layers at TP = 8 (comm_gemm.md).
LLM_LAYERS = {
    "ag_gemm": {"llama3-70b-up": (8192, 7168), "llama3-8b-up": (4096, 3584)},
    "gemm_rs": {"llama3-70b-down": (3584, 8192), "llama3-8b-down": (1792, 4096)},
}
_GEMM_ALONE = ("cublas", "tilefuse_gemm", "tilefuse_gemm_nk")
TARGET_MS = {"ag_gemm": {4096: 0.07, 8192: 0.23}, "gemm_rs": {4096: 0.08, 8192: 0.26}}


def shapes(op: str, spec: str) -> list[tuple[int, int, int, str]]:
    """``(M, N, K, family)`` for ``seed``, ``llm`` or explicit ``MxNxK`` items (comma list)."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if item == "seed":
            for s in SEED_SIZES:
                out.append((s, s // 8, s, "seed") if op == "ag_gemm" else (s, s, s // 8, "seed"))
        elif item == "llm":
            for name, (k, n) in LLM_LAYERS[op].items():
                out += [(m, n, k, name) for m in LLM_TOKENS]
        elif item:
            try:
                m, n, k = (int(x) for x in item.lower().split("x"))
            except ValueError:
                raise ValueError(f"shape {item!r}: expected 'seed', 'llm' or MxNxK") from None
            out.append((m, n, k, "custom"))
    if not out:
        raise ValueError("no shapes given")
    unique = {}
    for m, n, k, fam in out:  # a shape listed twice is timed once (row keys must be unique)
        unique.setdefault((m, n, k), fam)
    return [(m, n, k, fam) for (m, n, k), fam in unique.items()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilefuse bench ag-gemm|gemm-rs", description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=sorted(OPS))
    p.add_argument("--world", type=int, default=None, help="GPUs (default: all visible)")
    p.add_argument("--shapes", default="seed,llm", help="seed, llm and/or MxNxK items (comma list)")
    p.add_argument("--designs", default=None,
                   help="fused variants, e.g. 'ce,push/p16+32' (default: every design at its default)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--mode", choices=("batch", "graph"), default="batch")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--samples-long", type=int, default=4,
                   help="samples of shapes whose estimated call time exceeds --long-ms (e.g. the 32768 seed shape)")
    p.add_argument("--long-ms", type=float, default=5.0)
    p.add_argument("--calls", type=int, default=5, help="graph mode: calls per captured graph")
    p.add_argument("--sample-ms", type=float, default=20.0, help="batch mode: target ms per timed sample")
    p.add_argument("--timeout", type=float, default=10.0, help="timeout_s of the fused ops' waits")
    p.add_argument("--no-symm-mem", action="store_true", help="skip torch's symm_mem fused ops")
    p.add_argument("--no-ceilings", action="store_true")
    p.add_argument("--trace", default=None, help="directory: a Perfetto trace per shape of the first design")
    p.add_argument("--trace-shapes", default=None, help="only trace these MxNxK shapes (comma list)")
    p.add_argument("--json", default=None, help="result file (default benchmarks/results/<gpu>x<W>/...)")
    p.add_argument("--write-policy", nargs="+", metavar="RESULT_JSON", default=None,
                   help="no run: merge these result files into the policy table (--policy-table) and exit")
    p.add_argument("--policy-table", default=None, help="policy table to write (default: the shipped one)")
    p.add_argument("--policy-tie", type=float, default=0.03,
                   help="a design displaces the op's default design only when faster by more than this fraction")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``tilefuse bench ag-gemm|gemm-rs`` (``argv`` starts with the op; ``host``:
    :func:`host_main`)."""
    if argv[:1] == ["host"]:
        return host_main(argv[1:])
    args = build_parser().parse_args(argv)
    op = OPS[args.op]
    if args.write_policy:
        from tilefuse.tp.policy import TABLE_PATH

        target = args.policy_table or str(TABLE_PATH)
        rows = write_policy(args.write_policy, target, args.policy_tie)
        print(f"wrote {len(rows)} policy rows to {target}")
        return 0
    shapes(op, args.shapes)  # validate before starting processes
    if args.designs:
        fused_variants(op, args.designs)
    if args.worker:
        return _worker(args)
    world = args.world or torch.cuda.device_count()
    if world < 2:
        print(f"tilefuse bench {args.op}: needs at least 2 GPUs, found {world}", file=sys.stderr)
        return 2
    env = dict(os.environ, **MULTICAST_OFF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "tilefuse.bench.suites.tp", *argv, "--worker"]
    return subprocess.call(cmd, env=env)


# ---------------------------------------------------------------------------------------------
# Host cost per eager call


def _per_call_us(fn, calls: int, device: torch.device) -> tuple[float, float]:
    """(host µs to issue one call, device µs per call) over ``calls`` back-to-back calls: the
    host time is the wall time of the issuing loop alone (nothing waits for the device inside
    it), the device time the wall time until the device has finished them all."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def _host_pair(op: str, a: torch.Tensor, b: torch.Tensor, m: int, world: int):
    """(NCCL + cuBLAS, fused call) of ``op`` on these operands."""
    import torch.distributed as dist

    import tilefuse.tp as td

    if op == "ag_gemm":
        gathered = torch.empty(m, a.shape[1], device=a.device, dtype=a.dtype)

        def seq():
            dist.all_gather_into_tensor(gathered, a)
            return torch.matmul(gathered, b)

        return seq, lambda: td.ag_gemm(a, b, path="fused")
    part = torch.empty(m // world, b.shape[1], device=a.device, dtype=a.dtype)

    def seq():
        dist.reduce_scatter_tensor(part, torch.matmul(a, b))
        return part

    return seq, lambda: td.gemm_rs(a, b, path="fused")


def host_main(argv: list[str]) -> int:
    """``python -m tilefuse.bench.suites.tp host [--m 4096 --n 4096 --k 1024] [--world W]``:
    eager cost per call. One process: ``tilefuse.tp.gemm`` against ``torch.matmul`` (cuBLAS) on
    one GPU (on CPU, tiny shapes: the interpreter, a check that it runs). With ``--world`` >= 2
    (torchrun): per op, a fused call (``path="fused"``) against NCCL + cuBLAS. Prints one JSON
    line per row (``--json`` also writes them to a file)."""
    p = argparse.ArgumentParser(prog="python -m tilefuse.bench.suites.tp host")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.world > 1 and not args.worker:
        env = dict(os.environ, **MULTICAST_OFF)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
               "-m", "tilefuse.bench.suites.tp", "host", *argv, "--worker"]
        return subprocess.call(cmd, env=env)
    import tilefuse.tp as td

    on_gpu = torch.cuda.is_available()
    rows = []
    if not args.worker:
        dev = torch.device("cuda" if on_gpu else "cpu")
        a = torch.randn(args.m, args.k, device=dev).to(torch.bfloat16)
        b = torch.randn(args.k, args.n, device=dev).to(torch.bfloat16)
        out = torch.empty(args.m, args.n, device=dev, dtype=torch.bfloat16)
        fns = {"tilefuse_gemm": lambda: td.gemm(a, b, out)}
        if on_gpu:
            fns["cublas"] = lambda: torch.matmul(a, b, out=out)
        for name, fn in fns.items():
            host, device = _per_call_us(fn, args.calls, dev)
            rows.append({"variant": name, "m": args.m, "n": args.n, "k": args.k, "host_us": host, "call_us": device})
    else:
        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        world, dev = dist.get_world_size(), torch.device("cuda", local)
        for op in OPS.values():
            rows_a = args.m // world if op == "ag_gemm" else args.m
            a = torch.randn(rows_a, args.k, device=dev).to(torch.bfloat16)
            b = (torch.randn(args.k, args.n, device=dev) * args.k**-0.5).to(torch.bfloat16)
            seq, fused = _host_pair(op, a, b, args.m, world)
            for name, fn in (("nccl+cublas", seq), ("fused", fused)):
                host, device = _per_call_us(fn, args.calls, dev)
                rows.append({"op": op, "variant": name, "m": args.m, "n": args.n, "k": args.k, "world": world,
                             "rank": dist.get_rank(), "host_us": host, "call_us": device})
        dist.destroy_process_group()
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


# ---------------------------------------------------------------------------------------------
# Worker (one per GPU)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return float("nan")
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _iters(sample_ms: float, est_us: float) -> int:
    return int(max(2, min(50, sample_ms * 1000.0 / max(est_us, 1.0))))


class _Case:
    """Inputs, outputs and variant callables of one shape on one rank."""

    def __init__(self, op, m, n, k, world, rank, dtype, group, args):
        from torch.distributed import distributed_c10d as c10d

        import tilefuse.tp as tdist

        self.op, self.m, self.n, self.k, self.world, self.rank = op, m, n, k, world, rank
        dev = torch.device("cuda", torch.cuda.current_device())
        g = torch.Generator(device=dev)
        g.manual_seed(1000 + rank)
        self.group = group
        self.group_name = c10d._get_default_group().group_name if group is None else group.group_name
        mc = m // world
        scale = k ** -0.5
        if op == "ag_gemm":
            self.a = torch.randn(mc, k, device=dev, dtype=dtype, generator=g)
            self.b = (torch.randn(k, n, device=dev, dtype=torch.float32, generator=g) * scale).to(dtype)
            self.full_a = torch.empty(m, k, device=dev, dtype=dtype)
            torch.distributed.all_gather_into_tensor(self.full_a, self.a)
            out_shape = (m, n)
        else:
            self.a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
            self.b = (torch.randn(k, n, device=dev, dtype=torch.float32, generator=g) * scale).to(dtype)
            self.full_a = self.a
            out_shape = (mc, n)
        self.b_nk = self.b.t().contiguous()  # nn.Linear layout, for the GEMM core alone
        self.prod = torch.empty(m, n, device=dev, dtype=dtype)  # the per-rank GEMM output
        self.coll = torch.empty(m, k, device=dev, dtype=dtype) if op == "ag_gemm" else torch.empty(
            mc, n, device=dev, dtype=dtype)
        self.out_shape = out_shape
        self.outs: dict[str, torch.Tensor] = {}
        self.dist = tdist
        self.args = args

    def out(self, name: str) -> torch.Tensor:
        if name not in self.outs:
            shape = (self.m, self.n) if name in _GEMM_ALONE else self.out_shape
            self.outs[name] = torch.empty(shape, device=self.a.device, dtype=self.a.dtype)
        return self.outs[name]

    def variants(self, fused: list[tuple[str, str, int | None]], symm_mem: bool) -> dict:
        dist = torch.distributed
        td = self.dist
        a, b, op = self.a, self.b, self.op
        fns = {
            "cublas": lambda: torch.matmul(self.full_a, b, out=self.out("cublas")),
            "tilefuse_gemm": lambda: td.gemm(self.full_a, b, self.out("tilefuse_gemm")),
            "tilefuse_gemm_nk": lambda: td.gemm(self.full_a, self.b_nk, self.out("tilefuse_gemm_nk"), b_layout="nk"),
        }
        if op == "ag_gemm":
            fns["nccl"] = lambda: dist.all_gather_into_tensor(self.coll, a)

            def seq():
                dist.all_gather_into_tensor(self.coll, a)
                return torch.matmul(self.coll, b, out=self.out("nccl+cublas"))

            fns["nccl+cublas"] = seq
            if symm_mem:
                fns["symm_mem"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a, [b], 0, self.group_name)[1][0]
            for name, design, opts in fused:
                fns[name] = (lambda d=design, o=opts, nm=name: td.ag_gemm(
                    a, b, out=self.out(nm), **_fused_call(d, td.AgGemmOptions(**o, timeout_s=self.args.timeout))))
        else:
            fns["nccl"] = lambda: dist.reduce_scatter_tensor(self.coll, self.prod)

            def seq():
                torch.matmul(a, b, out=self.prod)
                out = self.out("nccl+cublas")
                dist.reduce_scatter_tensor(out, self.prod)
                return out

            fns["nccl+cublas"] = seq
            if symm_mem:
                fns["symm_mem"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b, "sum", 0, self.group_name)
            for name, design, opts in fused:
                fns[name] = (lambda d=design, o=opts, nm=name: td.gemm_rs(
                    a, b, out=self.out(nm), **_fused_call(d, td.GemmRsOptions(**o, timeout_s=self.args.timeout))))
        return fns

    def reference(self) -> torch.Tensor:
        from tilefuse.reference.comm_gemm import ag_gemm_ref, gemm_rs_ref

        if self.op == "ag_gemm":
            return ag_gemm_ref(self.a, self.b, self.group)
        return gemm_rs_ref(self.a, self.b, self.group)


def _fused_call(design: str | None, options) -> dict:
    """Keyword arguments of a fused variant's call; ``auto`` (design None) leaves the path, the
    design and the options but the timeout to the policy."""
    return dict(path=None if design is None else "fused", design=design, options=options)


def _agree(ok: bool) -> bool:
    """True when ``ok`` holds on every rank."""
    t = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def _check_variants(case: _Case, fns: dict, notes: dict) -> dict:
    """Run every variant once on a poisoned output; keep those correct on every rank."""
    import tilefuse.tp as tdist

    ref = case.reference()
    ref_gemm = case.full_a.float() @ case.b.float()
    checks = {}
    kept = {}
    for name, fn in fns.items():
        err = None
        ok = True
        try:
            if name in case.outs:
                case.outs[name].fill_(float("nan"))
            elif name not in ("nccl", "symm_mem"):
                case.out(name).fill_(float("nan"))
            y = fn()
            if name == "nccl":
                rel = None
            elif name in _GEMM_ALONE:
                rel = _rel_err(y, ref_gemm)
            else:
                rel = _rel_err(y, ref)
            torch.cuda.synchronize()
            if name.startswith("fused"):
                tdist.check_errors()
            if rel is not None and not rel < 2e-2:
                ok, err = False, f"relative error {rel:.3g}"
            checks[name] = {"rel_err": rel, "passed": ok}
        except Exception as e:  # a broken variant must not stop the others
            ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            checks[name] = {"passed": False, "error": err}
            traceback.print_exc()
        everywhere = _agree(ok)
        if everywhere:
            kept[name] = fn
        else:
            notes[name] = err or "failed on another rank"
            if name.startswith("fused"):
                torch.cuda.synchronize()
                tdist.reset_group()
    return kept, checks


def _sync():
    torch.cuda.synchronize()
    t = torch.zeros(1, device="cuda")
    torch.distributed.all_reduce(t)
    torch.cuda.synchronize()


def _samples(args, est_us: float) -> int:
    """Fewer samples for long calls: their medians settle sooner and the step has a time limit."""
    return min(args.samples, args.samples_long) if est_us > args.long_ms * 1000 else args.samples


def _time(fns: dict, args, est_us: float) -> dict:
    from tilefuse.bench import timing

    samples = _samples(args, est_us)
    if args.mode == "graph":
        return timing.time_graph(fns, calls=args.calls, samples=samples, reset=_sync)
    return timing.time_batch(fns, iters=_iters(args.sample_ms, est_us), warmup=2, samples=samples, reset=_sync)


TRACE_ALIGN_CYCLES = 20_000_000  # ~10 ms at the H200's 1.98 GHz: far more than the hosts' skew


def _trace(case: _Case, fused, path: Path) -> str | None:
    """One traced call of the first fused variant, every rank's events merged into one file. In
    graph mode the call is captured and replayed once, as it was timed (an eager call's streams
    start as fast as the host enqueues their work, which moves the kernels apart). The ranks
    meet on the device right before the call (an all-reduce, then a device-side sleep of the same
    length on every rank, enqueued just ahead of it): a host barrier alone left them ~100 µs
    apart, which the trace showed as start-barrier waits."""
    import tilefuse.tp as tdist
    from tilefuse.tp.trace import Trace, chrome_trace, clock_offsets

    if not fused:
        return None
    name, design, opts = fused[0]
    fn = tdist.ag_gemm if case.op == "ag_gemm" else tdist.gemm_rs

    def call(trace):
        kind = tdist.AgGemmOptions if case.op == "ag_gemm" else tdist.GemmRsOptions
        fn(case.a, case.b, out=case.out(name), trace=trace,
           **_fused_call(design, kind(**opts, timeout_s=case.args.timeout)))

    tr = Trace()
    graph = None
    if case.args.mode == "graph":
        call(Trace())  # compiles and loads the traced kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(tr)
        graph.replay()  # keeps the first replay's graph upload (host work) out of the traced call
    torch.distributed.barrier()  # capture takes each rank a different time
    torch.cuda.synchronize()
    torch.distributed.all_reduce(torch.ones(1, device=case.a.device))  # both streams leave this together
    # ... and then sleep the same time on the device, long enough for the slower host to enqueue
    # the call behind it. (Even so one rank sometimes starts 0.1-0.3 ms late: benchmarks/NOTES.md,
    # fused TP round 14. The merged file subtracts each GPU's timer offset, ``clock_offsets``.)
    if case.a.is_cuda:
        torch.cuda._sleep(TRACE_ALIGN_CYCLES)
    if graph is not None:
        graph.replay()
    else:
        call(tr)
    torch.cuda.synchronize()
    events = tr.events()
    offsets = clock_offsets()
    everyone = [None] * case.world
    torch.distributed.all_gather_object(everyone, events)
    if case.rank != 0:
        return None
    merged = [e for evs in everyone for e in evs]
    path.parent.mkdir(parents=True, exist_ok=True)
    chrome_trace(merged, str(path), offsets)
    return str(path)


def _row(op, case_name, params, impl, stats, world_stats, flops, status="ok", note=None, check=None):
    row = {"key": f"{case_name}/{impl}", "case": case_name, "impl": impl, "status": status, "params": params,
           "stats": stats}
    if stats:
        row["tflops"] = flops / (stats["median_us"] * 1e-6) / 1e12
        row["rank_medians_us"] = world_stats
    if note:
        row["note"] = note
    if check:
        row["check"] = check
    return row


def _summary(op, m, n, k, world, med: dict) -> dict:
    """Derived numbers of one shape from the slowest-rank medians (µs)."""
    fused = {k_: v for k_, v in med.items() if k_.startswith("fused")}
    s: dict = {"op": op, "m": m, "n": n, "k": k, "world": world}
    for key in ("cublas", "tilefuse_gemm", "tilefuse_gemm_nk", "nccl", "nccl+cublas", "symm_mem"):
        s[f"{key}_us"] = med.get(key)
    for key in ("tilefuse_gemm", "tilefuse_gemm_nk"):
        if med.get("cublas") and med.get(key):
            s[f"{key}_vs_cublas"] = med["cublas"] / med[key]
    if med.get("cublas") and med.get("nccl"):
        s["bound_us"] = max(med["cublas"], med["nccl"])
    s["fused_us"] = {k_: v for k_, v in fused.items()}
    if not fused:
        return s
    best = min(fused, key=fused.get)
    t = fused[best]
    s.update(best_fused=best, best_fused_us=t)
    if med.get("nccl+cublas"):
        s["speedup_vs_seq"] = med["nccl+cublas"] / t
    if s.get("bound_us"):
        s["fused_over_bound"] = t / s["bound_us"]
    if med.get("cublas"):
        s["fused_over_gemm"] = t / med["cublas"]
    if med.get("symm_mem"):
        s["speedup_vs_symm_mem"] = med["symm_mem"] / t
    targets = {}
    if m >= 16384 and med.get("cublas"):
        targets["fused<=1.05x_gemm"] = t <= 1.05 * med["cublas"]
    if world == 2 and m in TARGET_MS[op] and (m, n, k) == _seed_dims(op, m):
        targets[f"fused<={TARGET_MS[op][m]}ms"] = t <= TARGET_MS[op][m] * 1000
    if med.get("nccl+cublas"):
        targets["faster_than_nccl+cublas"] = t < med["nccl+cublas"]
    if med.get("symm_mem"):
        targets["faster_than_symm_mem"] = t < med["symm_mem"]
    s["targets"] = targets
    return s


def _seed_dims(op, s):
    return (s, s // 8, s) if op == "ag_gemm" else (s, s, s // 8)


def _worker(args) -> int:
    import torch.distributed as dist

    from tilefuse.bench import env as benv
    from tilefuse.bench import report
    from tilefuse.bench.timing import Stats, slowest_rank

    for k_, v in MULTICAST_OFF.items():
        os.environ.setdefault(k_, v)
    # Registers torch.ops.symm_mem.*: without it the first symm_mem baseline is not found.
    import torch.distributed._symmetric_memory  # noqa: F401

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    op = OPS[args.op]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    from tilefuse.tp.policy import FUSED_DESIGNS

    fused = fused_variants(op, args.designs or ",".join(FUSED_DESIGNS[op]))
    ceilings = {}
    if not args.no_ceilings:
        from tilefuse.bench import ceilings as ceil

        ceilings = ceil.measure_ceilings() if rank == 0 else {}
        if rank == 0 and world > 1:
            # Copy-engine bandwidth per direction between this rank's GPU and the next one's.
            peer = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
            for src, dst in ((torch.cuda.current_device(), peer), (peer, torch.cuda.current_device())):
                try:
                    ceilings[f"p2p_{src}to{dst}"] = ceil.p2p_bandwidth(src, dst)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                    ceilings[f"p2p_{src}to{dst}"] = ceil.unavailable(f"{type(e).__name__}: {e}")
        coll = "all_gather" if op == "ag_gemm" else "reduce_scatter"
        rec = ceil.collective_bandwidth(coll)
        if rank == 0:
            ceilings[f"nccl_{coll}_busbw"] = rec
    rows, summaries = [], []
    dead: dict[str, str] = {}  # fused variants that failed once are not retried at later shapes
    t_start = time.time()
    path = None
    if rank == 0:
        environment = benv.environment(args.mode)
        environment["world_size"] = world
        environment["multicast"] = "off"
        settings = {"mode": args.mode, "samples": args.samples, "samples_long": args.samples_long,
                    "long_ms": args.long_ms, "calls": args.calls, "sample_ms": args.sample_ms,
                    "designs": [f[0] for f in fused]}
        path = args.json or str(report.default_output_path(op, f"{benv.gpu_slug()}x{world}"))

    def progress(what: str) -> None:
        if rank == 0:
            print(f"[{time.time() - t_start:6.1f}s]   {what}", flush=True)

    def write() -> None:  # after every shape: a step killed by its time limit still leaves results
        result = report.make_result(op, environment, settings, ceilings, rows)
        result["summary"] = summaries
        report.write_result(result, path)

    for m, n, k, family in shapes(op, args.shapes):
        case_name = f"{op} {m}x{n}x{k} W{world} {args.dtype}"
        params = {"op": op, "m": m, "n": n, "k": k, "world": world, "dtype": args.dtype, "family": family}
        flops = 2 * m * n * k
        if m % world:
            if rank == 0:
                rows.append(_row(op, case_name, params, "all", None, None, flops, "skipped",
                                 f"M={m} not divisible by W={world}"))
            continue
        notes: dict = {}
        try:
            progress(f"{m}x{n}x{k}: inputs")
            case = _Case(op, m, n, k, world, rank, dtype, None, args)
            fns = case.variants([f for f in fused if f[0] not in dead], not args.no_symm_mem)
            kept, checks = _check_variants(case, fns, notes)
            dead.update({nm: notes[nm] for nm in fns if nm.startswith("fused") and nm not in kept})
            bytes_comm = (m // world) * k * 2 * (world - 1) if op == "ag_gemm" else m * n * 2 * (world - 1) / world
            est_us = flops / 600e12 * 1e6 + bytes_comm / 250e9 * 1e6
            progress(f"{m}x{n}x{k}: checked ({len(kept)}/{len(fns)} variants), timing {_samples(args, est_us)} samples")
            stats = _time(kept, args, est_us)
        except Exception as e:
            traceback.print_exc()
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            if rank == 0:
                rows.append(_row(op, case_name, params, "all", None, None, flops, "error", msg))
            continue
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {nm: st.to_dict() for nm, st in stats.items()})
        trace_file = None
        if args.trace and (not args.trace_shapes or f"{m}x{n}x{k}" in args.trace_shapes.split(",")):
            try:
                trace_file = _trace(case, [f for f in fused if f[0] in kept],
                                    Path(args.trace) / f"{op}_{m}x{n}x{k}_w{world}.trace.json")
            except Exception:
                traceback.print_exc()
        if rank == 0:
            med = {}
            for nm in fns:
                if nm not in kept:
                    rows.append(_row(op, case_name, params, nm, None, None, flops, "failed", notes.get(nm),
                                     checks.get(nm)))
                    continue
                sts = [Stats.from_dict(pr[nm]) for pr in per_rank]
                slow = slowest_rank(sts)
                med[nm] = slow.median_us
                rows.append(_row(op, case_name, params, nm, slow.to_dict(), [s.median_us for s in sts], flops,
                                 check=checks.get(nm)))
            summ = _summary(op, m, n, k, world, med)
            summ.update(family=family, dtype=args.dtype, case=case_name)
            if trace_file:
                summ["trace"] = trace_file
            summaries.append(summ)
            print(f"[{time.time() - t_start:6.1f}s] {_summary_line(summ)}", flush=True)
            write()
        del case
        torch.cuda.empty_cache()
    if rank == 0:
        write()
        print(f"wrote {path}")
        print(summary_table(summaries))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _fmt(x, f="{:.3f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f.format(x)


def _summary_line(s: dict) -> str:
    ms = lambda x: _fmt(None if x is None else x / 1000)
    return (f"{s['op']} {s['m']}x{s['n']}x{s['k']}: cublas {ms(s.get('cublas_us'))} nccl {ms(s.get('nccl_us'))} "
            f"seq {ms(s.get('nccl+cublas_us'))} symm {ms(s.get('symm_mem_us'))} best {s.get('best_fused')} "
            f"{ms(s.get('best_fused_us'))} ms; fused/bound {_fmt(s.get('fused_over_bound'), '{:.2f}')}")


def summary_table(summaries: list[dict]) -> str:
    """Short terminal table (ms; ratios)."""
    from tilefuse.bench.report import format_table

    headers = ["shape MxNxK", "cublas", "tf/cublas", "nccl", "seq", "symm_mem", "best fused", "ms", "/bound",
               "/gemm", "vs seq", "targets"]
    lines = []
    for s in summaries:
        ms = lambda x: _fmt(None if x is None else x / 1000)
        tg = s.get("targets", {})
        tf = max(s.get("tilefuse_gemm_vs_cublas") or 0, s.get("tilefuse_gemm_nk_vs_cublas") or 0) or None
        lines.append([f"{s['m']}x{s['n']}x{s['k']}", ms(s.get("cublas_us")), _fmt(tf, "{:.2f}"),
                      ms(s.get("nccl_us")), ms(s.get("nccl+cublas_us")), ms(s.get("symm_mem_us")),
                      str(s.get("best_fused", "-")).replace("fused:", ""), ms(s.get("best_fused_us")),
                      _fmt(s.get("fused_over_bound"), "{:.2f}"), _fmt(s.get("fused_over_gemm"), "{:.2f}"),
                      _fmt(s.get("speedup_vs_seq"), "{:.2f}"),
                      f"{sum(tg.values())}/{len(tg)}" if tg else "-"])
    return format_table(headers, lines, "l" + "r" * (len(headers) - 1))


def policy_rows(result: dict, tie: float = 0.03) -> list[dict]:
    """Policy-table rows from a result file: per shape the winner among NCCL + cuBLAS and the
    fused designs (each design's best variant). Another design displaces the op's default
    design, and a variant with options its design's defaults, only when it is more than ``tie``
    (a fraction) faster: closer than that is within the run-to-run spread of the measurements."""
    from tilefuse.tp.policy import DEFAULT_DESIGN

    if not 0 <= tie < 1:
        raise ValueError(f"tie must be a fraction in [0, 1), got {tie!r}")
    rows = []
    timing = result.get("settings", {}).get("mode", "batch")
    for s in result.get("summary", []):
        fused = s.get("fused_us") or {}
        by_design: dict[str, dict[str, float]] = {}
        for name, t in fused.items():
            variant = name.replace("fused:", "")
            if variant == "auto":  # the policy's own choice, not a design
                continue
            by_design.setdefault(variant.split("/")[0], {})[variant] = t
        cands = {d: min(v.values()) for d, v in by_design.items()}
        # each design's fastest variant; the bare design (the defaults) unless beaten by more than tie
        variants = {}
        for d, v in by_design.items():
            best = min(v, key=v.get)
            variants[d] = d if d in v and v[best] > (1 - tie) * v[d] else best
        if not cands and s.get("nccl+cublas_us") is None:
            continue
        best_design = min(cands, key=cands.get) if cands else None
        default = DEFAULT_DESIGN[s["op"]]
        if best_design not in (None, default) and default in cands and cands[best_design] > (1 - tie) * cands[default]:
            best_design = default
        seq = s.get("nccl+cublas_us")
        winner = "nccl" if best_design is None or (seq is not None and seq < cands[best_design]) else best_design
        rows.append({"op": s["op"], "m": s["m"], "n": s["n"], "k": s["k"], "world": s["world"],
                     "dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(s.get("dtype"), s.get("dtype")),
                     "timing": timing,
                     "winner": winner, "best_fused": best_design, "nccl+cublas_us": seq,
                     "variant": variants.get(best_design),
                     "fused_us": {d: round(t, 2) for d, t in cands.items()}})
    return rows


def write_policy(results: list[str], path: str, tie: float = 0.03) -> list[dict]:
    """Merge the policy rows of result files into a policy table file (later files win per shape
    and timing mode: eager ``batch`` rows and CUDA-graph ``graph`` rows are kept side by side)."""
    rows: dict[tuple, dict] = {}
    for p in results:
        with open(p) as f:
            for r in policy_rows(json.load(f), tie):
                r["source"] = os.path.basename(p)  # the result file the row was measured in
                rows[(r["op"], r["m"], r["n"], r["k"], r["world"], r["dtype"], r["timing"])] = r
    out = sorted(rows.values(), key=lambda r: (r["op"], r["timing"], r["world"], r["m"], r["n"], r["k"]))
    with open(path, "w") as f:
        json.dump({"source": [os.path.basename(p) for p in results], "rows": out}, f, indent=1)
        f.write("\n")
    importlib.import_module("tilefuse.tp.policy").load_table(path)  # reasons then cite this file
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
