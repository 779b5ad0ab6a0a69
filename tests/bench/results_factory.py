"""Synthetic result files for report, compare and plot tests."""

from tilefuse.bench.report import make_result
from tilefuse.bench.timing import summarize


def row(key, samples, status="ok", impl="tilefuse", x="2048/32768", series=None, tflops=None, ceiling=None):
    return {
        "key": key,
        "case": key.split(" | ")[0],
        "impl": impl,
        "x": x,
        "series": series or impl,
        "params": {},
        "status": status,
        "note": None if status == "ok" else "mask differs",
        "stats": summarize(samples, timer="cuda events", mode="graph").to_dict() if samples else None,
        "flops": None,
        "bytes": None,
        "tflops": tflops,
        "tbps": None,
        "ceiling": ceiling,
        "ratio_to_ceiling": None,
        "peer_ratio": {},
        "clocks": {"available": False, "reason": "test"},
        "throttled": None,
    }


def result(rows, gpu="NVIDIA H200", mode="graph", ceilings=None):
    env = {"gpu": gpu, "torch": "x", "triton": "y", "timing_mode": mode}
    return make_result("indexer", env, {"mode": mode}, ceilings or {}, rows)
