"""Where the host time of one eager indexer call goes: cProfile over back-to-back calls (GPU).

Prints, per call shape, the wall time per call and the functions with the most time of their
own (cProfile inflates every Python frame, so read the shares, not the absolute numbers).

    python benchmarks/host_profile.py [--calls 500] [--top 18] [--only TEXT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paged_host_cost  # noqa: E402
import prefill_host_cost  # noqa: E402

import tilefuse  # noqa: E402

_SMS = 0


def _cases(device: str, calls_a_case: int) -> dict:
    global _SMS
    _SMS = torch.cuda.get_device_properties(0).multi_processor_count
    cases = {}
    for fmt, s_q in (("fp8", 128), ("fp8", 16), ("mxfp8", 128), ("mxfp4", 128)):
        calls = prefill_host_cost._calls(fmt, s_q, 4096, device)
        cases[f"prefill {fmt} {s_q}/4096"] = calls["new output"]
    for fmt in ("fp8", "mxfp8", "mxfp4"):  # a chunked prefill: S_q and S_k new every call
        calls = prefill_host_cost._new_size_calls(fmt, 128, 4096, device, 40 + 2 * calls_a_case)
        cases[f"prefill {fmt} 128/4096 new sizes"] = calls["new sizes, new output"]
    for fmt in ("fp8", "mxfp4"):
        qq, cache, w, lens, table = paged_host_cost.inputs(fmt, 32, 4096, 1, device)
        lens2 = lens.view(-1, 1).contiguous()
        meta = tilefuse.get_paged_mqa_logits_metadata(lens2, 64, _SMS)
        cases[f"paged {fmt} B32 ctx4096"] = (
            lambda qq=qq, cache=cache, w=w, lens2=lens2, table=table, meta=meta:
            tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, lens2, table, meta, 4096, False))
        cases[f"metadata {fmt} B32"] = (
            lambda lens2=lens2: tilefuse.get_paged_mqa_logits_metadata(lens2, 64, _SMS))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--only", default="", help="the cases whose name holds this text")
    a = ap.parse_args()
    device = "cuda"
    for name, fn in _cases(device, a.calls).items():
        if a.only not in name:
            continue
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        per_call = (time.perf_counter() - t0) / a.calls * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.top)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print(f"=== {name}: {per_call:.1f} us per call (unprofiled)")
        for ln in lines[start:start + a.top + 1]:
            print("  " + ln[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
