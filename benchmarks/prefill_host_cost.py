"""Host time per call of the prefill op, as an engine calls it eagerly (back to back).

With ``--stub`` (the default without a GPU) every prefill kernel is replaced by a launcher that
does nothing, so what is timed is the Python wrapper alone: validation, the cached config,
the output allocation, descriptors and argument packing. That is a sanity check that runs on
any machine; Triton's own launch cost (about 14 us on an H200 host, 27 us with a host tensor
descriptor) comes on top. On a GPU without ``--stub`` the real kernels run at a small shape
and the host time is the time to enqueue the calls, read without a sync, the best of three
rounds; the wall time per call after a final sync and the GPU time of one call (a CUDA graph)
are printed beside it. A round's launches must stay below what the launch queue holds (about a
thousand: ``--calls 250`` for the three-launch MX paths), or the host time reads the GPU's pace
where the GPU time is the larger. Each shape is timed twice: the same sizes every call, and
new sizes every call (a chunked prefill: S_q and S_k change from chunk to chunk, so no call
finds one of the same sizes before it). DeepGEMM's ``fp8_mqa_logits`` is timed the same way in
the same run where ``import deep_gemm`` works (its kernel does not compile per size), and
against ours in alternating rounds: the median ratio holds where a host's speed drifts.

    python benchmarks/prefill_host_cost.py [--stub] [--calls 250] [--output host-cost.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_host_cost import alternating, graph_gpu_us  # noqa: E402  (a sibling script: benchmarks/ is on sys.path)

import tilefuse  # noqa: E402
from tilefuse import _jit  # noqa: E402
from tilefuse import formats as F  # noqa: E402
from tilefuse.indexer import _prefill_kernel, _prefill_kernel_sm100  # noqa: E402
from tilefuse.indexer import windows as W  # noqa: E402

_KERNELS = [(_prefill_kernel, name) for name in (
    "prefill_logits_kernel", "prefill_heads_on_n_kernel", "fill_outside_windows_kernel",
    "mx_rows_renormalise_kernel", "linear_term_parts_kernel", "prefill_mx_few_rows_kernel")] + [
    (_prefill_kernel_sm100, "prefill_logits_mx_kernel")]


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_kernels():
    """Every prefill kernel launch does nothing (the Gluon kernel too, where it is imported)."""
    targets = list(_KERNELS)
    if torch.cuda.is_available():
        from tilefuse.indexer import _prefill_kernel_gluon

        targets.append((_prefill_kernel_gluon, "prefill_logits_gluon_kernel"))
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    try:
        with contextlib.ExitStack() as stack:
            for mod, name, fn in saved:
                setattr(mod, name, _NoLaunch())
                stack.enter_context(_jit.redirected(fn, _NoLaunch()))  # launches through tilefuse._jit.Launcher
            yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _case(fmt: str, s_q: int, s_k: int, h: int, d: int, device: str):
    """Random quantised operands (the MX paths' recompute flags, and the GPU time, depend on them)."""
    g = torch.Generator().manual_seed(s_q * 7 + s_k)
    q = tuple(None if t is None else t.to(device)
              for t in F.quantize_q(torch.randn(s_q, h, d, generator=g).to(torch.bfloat16), fmt))
    kv = tuple(t.to(device) for t in F.quantize_k(torch.randn(s_k, d, generator=g).to(torch.bfloat16), fmt))
    w = torch.randn(s_q, h, generator=g).to(device)
    ks, ke = W.causal_tail(s_q, s_k, device=device)
    return q, kv, w, ks, ke


def _calls(fmt: str, s_q: int, s_k: int, device: str, peer=None) -> dict:
    """The calls an engine makes (H64 D128, clean_logits=False): new output, out=, DeepGEMM's FP8
    name; ``peer``: the deep_gemm module, whose own call is added (FP8) for the same run."""
    q, kv, w, ks, ke = _case(fmt, s_q, s_k, 64, 128, device)
    out = torch.empty(s_q, s_k, device=device)
    calls = {"new output": lambda: tilefuse.fp8_fp4_mqa_logits(q, kv, w, ks, ke, False),
             "out=": lambda: tilefuse.fp8_fp4_mqa_logits(q, kv, w, ks, ke, False, out=out)}
    if fmt == "fp8":
        calls["fp8_mqa_logits"] = lambda: tilefuse.fp8_mqa_logits(q[0], kv, w, ks, ke, False)
        if peer is not None:
            calls["deep_gemm"] = lambda: peer.fp8_mqa_logits(q[0], kv, w, ks, ke, clean_logits=False)
    return calls


def _new_size_calls(fmt: str, s_q: int, s_k: int, device: str, n: int, peer=None) -> dict:
    """The calls of a chunked prefill: S_q and S_k new every call (``n`` calls, none of the same
    sizes: S_k grows by one key a call, S_q cycles over 8 values below ``s_q``), as views of
    one set of operands made beforehand; ``out=`` as a slice of one caller-owned buffer."""
    q, kv, w, ks, ke = _case(fmt, s_q, s_k + n, 64, 128, device)
    buffer = torch.empty(s_q, -(-(s_k + n) // 16) * 16, device=device)  # rows 16-byte aligned
    sizes = [(s_q - i % 8, s_k + i) for i in range(n)]
    views = [((q[0][:a], None if q[1] is None else q[1][:a]), (kv[0][:b], kv[1][:b]), w[:a], ks[:a], ke[:a],
              buffer[:a, :b]) for a, b in sizes]
    steps = {"new": 0, "out": 0, "peer": 0}

    def step(name):  # (the sizes repeat only after n calls: more than a timed round makes)
        i = steps[name]
        steps[name] = i + 1
        return views[i % n]

    def new():
        q_, kv_, w_, ks_, ke_, _ = step("new")
        tilefuse.fp8_fp4_mqa_logits(q_, kv_, w_, ks_, ke_, False)

    def into():
        q_, kv_, w_, ks_, ke_, out_ = step("out")
        tilefuse.fp8_fp4_mqa_logits(q_, kv_, w_, ks_, ke_, False, out=out_)

    calls = {"new sizes, new output": new, "new sizes, out=": into}
    if fmt == "fp8" and peer is not None:
        def theirs():
            q_, kv_, w_, ks_, ke_, _ = step("peer")
            peer.fp8_mqa_logits(q_[0], kv_, w_, ks_, ke_, clean_logits=False)

        calls["deep_gemm new sizes"] = theirs
    return calls


def time_calls(fn, calls: int, device: str, rounds: int = 3) -> dict:
    """Host and wall time per call, the best of ``rounds`` rounds of ``calls`` back-to-back
    calls (a sync before each): with fewer launches a round than the launch queue holds (about
    a thousand), the host time is the host's own even where the GPU time is the larger."""
    for _ in range(10):
        fn()
    best = {"host_us": float("inf"), "wall_us": float("inf")}
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueued = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        best["host_us"] = min(best["host_us"], (enqueued - start) / calls * 1e6)
        best["wall_us"] = min(best["wall_us"], (done - start) / calls * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stub", action="store_true", help="time the wrapper alone (kernels not launched)")
    ap.add_argument("--calls", type=int, default=250, help="calls a round (3 rounds, the best kept)")
    ap.add_argument("--output", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stub = args.stub or device == "cpu"
    rows = []
    cases = [("fp8", 128, 4096), ("fp8", 16, 4096), ("mxfp8", 128, 4096), ("mxfp4", 128, 4096), ("mxfp8", 16, 4096),
             ("mxfp4", 16, 4096)]
    peer = None
    if not stub:
        try:
            import deep_gemm as peer
        except ImportError:
            pass
    def against_peer(fmt, s_q, s_k, name, ours, theirs):
        """Ours against DeepGEMM's call in alternating rounds: the ratio that holds from host to host."""
        pair = alternating(ours, theirs, args.calls, torch.cuda.synchronize)
        rows.append({"fmt": fmt, "s_q": s_q, "s_k": s_k, "call": f"{name}: tilefuse / deep_gemm", **pair})
        print(f"{fmt:6} {s_q:5}/{s_k:<6} {name}: tilefuse {pair['ours_us']:.1f} us / deep_gemm "
              f"{pair['theirs_us']:.1f} us, median ratio of alternating rounds {pair['ratio_median']:.2f}")

    with stubbed_kernels() if stub else contextlib.nullcontext():
        for fmt, s_q, s_k in cases:
            calls = _calls(fmt, s_q, s_k, device, peer)
            if "deep_gemm" in calls:
                against_peer(fmt, s_q, s_k, "same sizes", calls["new output"], calls["deep_gemm"])
            new_sizes = _new_size_calls(fmt, s_q, s_k, device, 10 + 11 * args.calls, peer)  # (every call timed)
            if "deep_gemm new sizes" in new_sizes:
                against_peer(fmt, s_q, s_k, "new sizes", new_sizes["new sizes, new output"],
                             new_sizes["deep_gemm new sizes"])
            for name, fn in calls.items():
                row = {"fmt": fmt, "s_q": s_q, "s_k": s_k, "call": name, "stub": stub, "device": device,
                       **time_calls(fn, args.calls, device)}
                if not stub:  # where the GPU time is the larger, the wall time reads it, not the host's
                    row["gpu_us"] = graph_gpu_us(fn, 5)
                rows.append(row)
                gpu = f"   gpu {row['gpu_us']:8.1f} us" if "gpu_us" in row else "   (kernels stubbed)"
                print(f"{fmt:6} {s_q:5}/{s_k:<6} {name:15} host {row['host_us']:8.1f} us   "
                      f"wall {row['wall_us']:8.1f} us{gpu}")
            for name, fn in new_sizes.items():
                row = {"fmt": fmt, "s_q": s_q, "s_k": s_k, "call": name, "stub": stub, "device": device,
                       **time_calls(fn, args.calls, device)}
                rows.append(row)
                print(f"{fmt:6} {s_q:5}/{s_k:<6} {name:15} host {row['host_us']:8.1f} us   "
                      f"wall {row['wall_us']:8.1f} us")
    if args.output:
        with open(args.output, "w") as f:
            from tilefuse.bench.env import environment

            json.dump({"environment": environment("eager"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
