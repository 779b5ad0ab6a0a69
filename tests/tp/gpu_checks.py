"""Multi-GPU checks of tilefuse.tp, one process per GPU:

    torchrun --standalone --nproc-per-node 2 tests/tp/gpu_checks.py [--quick] [--stalled-first]
        [--stalled-only] [--reverse]

Both ops and every fused design against the sequential reference (all_gather_into_tensor +
matmul; matmul + reduce_scatter_tensor) at the seed and LLM shapes of comm_gemm.md, odd M,
nn.Linear layout, fp16, bitwise ag_gemm == tilefuse GEMM of the gathered rows, repeated calls,
determinism, CUDA-graph capture, captures / eager calls / replays of other shapes interleaved,
no compile per M after a warm-up, and last a stalled peer that must raise, not hang. Every
output buffer is poisoned (NaN) first. Prints one PASS/FAIL line per check (rank 0) and exits
non-zero if any check failed on any rank. ``tests/tp/test_gpu.py`` runs it under pytest.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback

from tilefuse.tp._common import MULTICAST_OFF  # noqa: E402  (imports no torch.distributed state)

for _k, _v in MULTICAST_OFF.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tilefuse.tp as td  # noqa: E402
from tilefuse.bench.suites.tp import LLM_LAYERS, SEED_SIZES, fused_variants  # noqa: E402
from tilefuse.reference.comm_gemm import ag_gemm_ref, gemm_rs_ref  # noqa: E402

TOL = 1e-2  # ||out - ref|| / ||ref||: bf16 rounding of the output and (gemm_rs) of the partials
TIMEOUT_S = 5.0
# Fused variants in the bench's syntax: a design and its options (ce/r0: ag_gemm ce with the own
# rows read from the staged buffer, not from the shard; push/cce: ag_gemm push with
# the local shard staged by copy engines; gemm_rs push at W = 2 is the Gluon kernel where chunks
# are whole tiles, push/x0 the Triton kernel, push/x0/t1 that with the partials loaded by TMA;
# at other world sizes push is the Triton kernel, push/t1 with TMA partials).
DESIGNS = {"ag_gemm": ("ce", "ce/r0", "push", "push/cce"), "gemm_rs": ("push", "push/x0/t1", "push/x0")}
failures: list[str] = []
dead: set[tuple[str, str]] = set()  # designs that failed once are not retried at other shapes


def rel_err(x, ref):
    if torch.isnan(x).any():
        return float("nan")
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def agree(ok: bool) -> bool:
    t = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def check(name: str, fn) -> bool:
    rank = dist.get_rank()
    t0 = time.time()
    try:
        msg = fn() or ""
        torch.cuda.synchronize()
        ok = True
    except Exception as e:
        ok, msg = False, f"{type(e).__name__}: {e}"
        traceback.print_exc()
    everywhere = agree(ok)
    if not everywhere:
        failures.append(name)
        torch.cuda.synchronize()
        td.reset_group()  # a failed call may leave half-set flags behind
    if rank == 0 or not ok:
        print(f"[rank {rank}] {'PASS' if everywhere else 'FAIL'} {name} ({time.time() - t0:.1f}s) {msg}", flush=True)
    return everywhere


def inputs(op, m, n, k, dtype=torch.bfloat16, layout="kn", seed=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 100 + rank)
    rows = m // world if op == "ag_gemm" else m
    a = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    shape = (k, n) if layout == "kn" else (n, k)
    b = (torch.randn(*shape, device="cuda", generator=g) * k**-0.5).to(dtype)
    return a, b


def run_op(op, a, b, variant, layout="kn", timeout_s=TIMEOUT_S, **call):
    """One fused call of ``variant`` (the stalled-peer check passes a shorter timeout; ``call``:
    further keywords of the op, e.g. ``return_gathered``)."""
    world = dist.get_world_size()
    [(_, design, opts)] = fused_variants(op, variant)
    if op == "ag_gemm":
        out = torch.full((a.shape[0] * world, b.shape[1] if layout == "kn" else b.shape[0]), float("nan"),
                         device="cuda", dtype=a.dtype)
        return td.ag_gemm(a, b, out=out, b_layout=layout, path="fused", design=design,
                          options=td.AgGemmOptions(**opts, timeout_s=timeout_s), **call)
    out = torch.full((a.shape[0] // world, b.shape[1] if layout == "kn" else b.shape[0]), float("nan"),
                     device="cuda", dtype=a.dtype)
    return td.gemm_rs(a, b, out=out, b_layout=layout, path="fused", design=design,
                      options=td.GemmRsOptions(**opts, timeout_s=timeout_s), **call)


def reference(op, a, b, layout="kn"):
    return ag_gemm_ref(a, b, b_layout=layout) if op == "ag_gemm" else gemm_rs_ref(a, b, b_layout=layout)


def eager_err(op, a, b, variant) -> float:
    """Relative error of one eager fused call against the reference."""
    return rel_err(run_op(op, a, b, variant), reference(op, a, b))


def capture(op, a, b, variant):
    """``(graph, output)``: one eager call on ``a``, ``b`` (the workspace is allocated outside
    the capture), then a CUDA graph of the call on them."""
    run_op(op, a, b, variant)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run_op(op, a, b, variant)
    return g, y


def replay_err(g, y, op, a, b, m, n, k, seed) -> float:
    """Fresh inputs (``seed``) copied into the captured ``a``, ``b``, the output poisoned, one
    replay of ``g``: the relative error of ``y``."""
    a2, b2 = inputs(op, m, n, k, seed=seed)
    a.copy_(a2)
    b.copy_(b2)
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return rel_err(y, reference(op, a, b))


def against_reference(op, design, m, n, k, layout="kn", dtype=torch.bfloat16, seed=0):
    def body():
        a, b = inputs(op, m, n, k, dtype, layout, seed)
        y = run_op(op, a, b, design, layout)
        td.check_errors()
        err = rel_err(y, reference(op, a, b, layout))
        assert err < TOL, f"relative error {err:.3g}"
        return f"rel err {err:.2e}"

    name = f"{op}/{design} {m}x{n}x{k} {layout} {str(dtype)[6:]}"
    if (op, design) in dead:
        print(f"SKIP {name} (design failed earlier)", flush=True)
        return
    if not check(name, body):
        dead.add((op, design))


def seed_and_llm(quick: bool):
    sizes = SEED_SIZES[:2] if quick else SEED_SIZES
    for op in DESIGNS:
        for s in sizes:
            m, n, k = (s, s // 8, s) if op == "ag_gemm" else (s, s, s // 8)
            for d in DESIGNS[op]:
                against_reference(op, d, m, n, k)
        for k, n in LLM_LAYERS[op].values():
            for m in (1024, 4096) if quick else (1024, 4096, 8192, 16384):
                for d in DESIGNS[op]:
                    against_reference(op, d, m, n, k)


def odd_shapes():
    for op in DESIGNS:
        for d in DESIGNS[op]:
            against_reference(op, d, 2000, 768, 512)
            against_reference(op, d, 2000, 768, 512, layout="nk")
            against_reference(op, d, 2 * 136, 264, 72, dtype=torch.float16)
            # chunks of whole tiles (gemm_rs push at W = 2: the Gluon kernel) in the nn.Linear
            # layout and in fp16, N and K not multiples of the tile
            against_reference(op, d, 1024, 768, 512, layout="nk")
            against_reference(op, d, 1024, 264, 72, dtype=torch.float16)


def bitwise_and_repeat():
    from tilefuse.tp._gemm_core import default_config, num_sms

    for d in DESIGNS["ag_gemm"]:
        def ag_bitwise(d=d):
            a, b = inputs("ag_gemm", 4096, 1024, 2048)
            y = run_op("ag_gemm", a, b, d, return_gathered=True)
            out, gathered = y
            ref = reference("ag_gemm", a, b)
            assert torch.equal(gathered, torch.cat([t for t in _gather(a)])), "gathered rows differ"
            cfg = default_config(4096, 1024, 2048, num_sms(a.device))
            mine = td.gemm(gathered, b, config=cfg)
            assert torch.equal(out, mine), "fused ag_gemm is not bitwise equal to the GEMM of the gathered rows"
            return f"rel err vs cuBLAS {rel_err(out, ref):.2e}"

        check(f"ag_gemm/{d} bitwise == tilefuse gemm(gathered)", ag_bitwise)

    for op in DESIGNS:
        for d in DESIGNS[op]:
            def repeat(op=op, d=d):
                m, n, k = (4096, 1024, 2048)
                outs = []
                for seed in range(3):  # fresh inputs each call: flags and buffers reset between calls
                    a, b = inputs(op, m, n, k, seed=seed)
                    y = run_op(op, a, b, d)
                    err = rel_err(y, reference(op, a, b))
                    assert err < TOL, f"call {seed}: relative error {err:.3g}"
                    outs.append((a, b, y.clone()))
                a, b, y0 = outs[0]
                again = run_op(op, a, b, d)
                assert torch.equal(again, y0), "rerun on the same inputs is not bitwise identical"
                td.check_errors()

            check(f"{op}/{d} repeated calls + determinism", repeat)

    def interleaved():
        for i in range(4):
            for op in DESIGNS:
                d = DESIGNS[op][i % 2]
                a, b = inputs(op, 2048, 512, 1024, seed=10 + i)
                err = eager_err(op, a, b, d)
                assert err < TOL, f"{op}/{d} call {i}: relative error {err:.3g}"

    check("interleaved ops and designs", interleaved)


def _gather(a):
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a)
    return parts


def graphs():
    for op in DESIGNS:
        for d in DESIGNS[op]:
            def body(op=op, d=d):
                a, b = inputs(op, 4096, 1024, 2048)
                g, y = capture(op, a, b, d)
                for seed in (5, 6):
                    err = replay_err(g, y, op, a, b, 4096, 1024, 2048, seed)
                    assert err < TOL, f"replay {seed}: relative error {err:.3g}"
                td.check_errors()

            check(f"{op}/{d} CUDA graph capture + replays", body)


def graph_eager_interleavings():
    """The issue-21 race: capture A, eager B with more flags (larger M), replay A, eager B again,
    replay A, eager C: every output right. With flags in the data region of an earlier shape a
    wait of B could pass on A's data and read partials before they arrived."""
    for op in DESIGNS:
        for d in DESIGNS[op]:
            def body(op=op, d=d):
                n, k = (1024, 2048) if op == "ag_gemm" else (2048, 1024)
                big_a, big_b = inputs(op, 8192, n, k, seed=40)
                run_op(op, big_a, big_b, d)  # warm-up at the largest shape: the workspace holds every call
                a, b = inputs(op, 1024, n, k, seed=41)
                g, y = capture(op, a, b, d)
                for step in range(3):
                    m_eager = (8192, 4096, 2048)[step]
                    ea, eb = inputs(op, m_eager, n, k, seed=50 + step)
                    err = eager_err(op, ea, eb, d)
                    assert err < TOL, f"eager M = {m_eager} after {step} replays: relative error {err:.3g}"
                    err = replay_err(g, y, op, a, b, 1024, n, k, 60 + step)
                    assert err < TOL, f"replay {step} after eager M = {m_eager}: relative error {err:.3g}"
                td.check_errors()

            check(f"{op}/{d} capture / eager / replay interleavings", body)


def compile_counts():
    """No compile per M: over a random sequence of M at one layer shape, the fused ops compile
    their kernels once per class (GEMM tile from default_config x chunk alignment x ag_gemm's
    own-rows launch), none after one call of each class."""
    import random

    from tilefuse.tp import _comm_kernels, _gemm_core, _gemm_rs_gluon

    kernels = (_gemm_core._persistent_gemm, _comm_kernels._ag_push_kernel, _gemm_rs_gluon.rs_push_gluon_kernel)

    def compiled():
        dev = torch.cuda.current_device()
        return sum(len(kern.device_caches[dev][0]) for kern in kernels)

    world = dist.get_world_size()
    rng = random.Random(21)  # the same sequence on every rank
    ms = [world * rng.choice((1, 3, 8, 64, 100, 128, 500, 1024, 2048)) for _ in range(24)]
    for op in DESIGNS:
        for d in DESIGNS[op]:
            def body(op=op, d=d):
                n, k = (3584, 4096) if op == "ag_gemm" else (4096, 1792)
                for m in ms:  # warm-up: every M once
                    a, b = inputs(op, m, n, k)
                    run_op(op, a, b, d)
                torch.cuda.synchronize()
                before = compiled()
                for m in rng.sample(ms, len(ms)):
                    a, b = inputs(op, m, n, k, seed=m)
                    err = eager_err(op, a, b, d)
                    assert err < TOL, f"M = {m}: relative error {err:.3g}"
                assert compiled() == before, f"{compiled() - before} compiles after the warm-up"
                return f"{before} kernels compiled for {len(set(ms))} values of M"

            check(f"{op}/{d} no compile per M", body)


def stalled_peer():
    rank = dist.get_rank()
    for op in DESIGNS:
        for d in DESIGNS[op]:
            # Both ranks call once first: the workspace then exists (reset_group drops it, and
            # its allocation is a collective rendezvous that a missing peer would block outside
            # tilefuse's bounded waits) and the kernels are loaded.
            against_reference(op, d, 2048, 512, 1024, seed=2)
            if (op, d) in dead:
                print(f"SKIP {op}/{d} stalled peer raises (design failed earlier)", flush=True)
                continue

            def body(op=op, d=d):
                a, b = inputs(op, 2048, 512, 1024)
                if rank != 0:
                    return "stalled (did not call)"
                t0 = time.time()
                run_op(op, a, b, d, timeout_s=1.0)
                try:
                    td.check_errors()
                except td.CommTimeoutError as e:
                    dt = time.time() - t0
                    assert "rank 0" in str(e) and op in str(e), f"message does not name rank and op: {e}"
                    assert dt < 10, f"took {dt:.1f}s to raise"
                    return f"raised after {dt:.1f}s: {str(e)[:160]}"
                raise AssertionError("no CommTimeoutError with a stalled peer")

            check(f"{op}/{d} stalled peer raises", body)
            dist.barrier()
            td.reset_group()
            against_reference(op, d, 2048, 512, 1024, seed=3)  # usable again after reset_group


def main():
    quick = "--quick" in sys.argv
    dump_s = float(os.environ.get("TILEFUSE_CHECKS_DUMP_S", "0"))
    if dump_s > 0:  # a hang prints every thread's stack (both ranks) instead of dying silently
        faulthandler.dump_traceback_later(dump_s, exit=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    t0 = time.time()
    def first():  # one call of each design before anything else: the first failures say the most
        for op in DESIGNS:
            for d in DESIGNS[op]:
                against_reference(op, d, *((4096, 512, 4096) if op == "ag_gemm" else (4096, 4096, 512)))

    if dist.get_world_size() != 2:  # the Gluon kernel (x1) needs one peer: x0 would repeat push
        DESIGNS["gemm_rs"] = ("push", "push/t1")
    if "--reverse" in sys.argv:  # each op's variants in the opposite order
        for op in DESIGNS:
            DESIGNS[op] = DESIGNS[op][::-1]
    parts = [graphs, graph_eager_interleavings, compile_counts, odd_shapes, bitwise_and_repeat,
             lambda: seed_and_llm(quick)]
    if "--stalled-only" in sys.argv:
        parts = [stalled_peer]
    else:
        parts = [stalled_peer, *parts] if "--stalled-first" in sys.argv else [*parts, stalled_peer]
    for part in (first, *parts):
        part()
    if dist.get_rank() == 0:
        print(f"{len(failures)} failed checks in {time.time() - t0:.0f}s: {failures}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
