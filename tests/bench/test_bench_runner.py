"""The case runner: checks before and after timing, marked (never dropped) failures, metrics."""

import dataclasses

import pytest
import torch

from tilefuse.bench import ceilings as ceil
from tilefuse.bench.clocks import ClockSampler
from tilefuse.bench.runner import Case, Impl, Settings, landed_in_poison, run_case, run_suite

from .test_bench_clocks import FakeNvml
from .test_bench_timing import FakeBackend


def fake_ceilings():
    return {
        ceil.FP8_MATMUL: {"available": True, "value": 1000.0, "unit": "TFLOP/s"},
        ceil.BF16_MATMUL: {"available": True, "value": 500.0, "unit": "TFLOP/s"},
        ceil.COPY: {"available": True, "value": 4.0, "unit": "TB/s"},
    }


def no_clocks():
    """A sampler on a machine without NVML."""
    return ClockSampler(nvml=AbsentNvml())


class AbsentNvml:
    def nvmlDeviceGetHandleByIndex(self, i):
        raise RuntimeError("NVML absent")


def make_case(be, log, *, fail_subject=False, fail_after=False, raise_peer=False):
    calls = {"subject": 0}

    def build():
        def subject():
            calls["subject"] += 1
            log.append("subject")
            be.advance(2.0)
            return torch.ones(4)

        def peer():
            log.append("peer")
            if raise_peer:
                raise RuntimeError("peer exploded")
            be.advance(4.0)
            return torch.ones(4)

        def check_subject(out):
            log.append("check")
            if fail_subject:
                return {"passed": False, "failed": "mask differs"}
            if fail_after and calls["subject"] > 1:
                return {"passed": False, "failed": "drifted"}
            return {"passed": True}

        return [
            Impl("mine", subject, check_subject),
            Impl("peer", peer, lambda out: {"passed": True}),
            Impl("absent", skipped="skipped: not installed"),
            Impl("eager", peer, lambda out: {"passed": True}, group="slow", samples=2),
        ]

    return Case("shape A", build, x="A", series="fp8", params={"n": 1}, flops=4_000_000, bytes=8_000_000,
                ceiling=ceil.FP8_MATMUL)


def test_rows_metrics_and_ratios():
    be, log = FakeBackend(), []
    settings = Settings(mode="graph", calls=2, samples=4)
    rows = run_case("s", make_case(be, log), settings, fake_ceilings(), backend=be, sampler_factory=no_clocks)
    assert [r["impl"] for r in rows] == ["mine", "peer", "absent", "eager"]
    mine, peer, absent, eager = rows
    assert mine["key"] == "s/shape A | mine" and mine["series"] == "mine fp8"
    assert mine["status"] == "ok" and mine["check"]["passed"] and mine["post_check"]["passed"]
    assert mine["stats"]["median_us"] == 2.0 and len(mine["stats"]["samples_us"]) == 4
    assert eager["stats"] is not None and len(eager["stats"]["samples_us"]) == 2  # its own group, fewer samples
    assert mine["tflops"] == 4_000_000 / 2e-6 / 1e12
    assert mine["tbps"] == 8_000_000 / 2e-6 / 1e12
    assert mine["ratio_to_ceiling"] == mine["tflops"] / 1000.0
    assert mine["peer_ratio"] == {"peer": 2.0, "eager": 2.0}
    assert absent["status"] == "skipped" and absent["note"] == "skipped: not installed" and absent["stats"] is None
    assert mine["clocks"] == {"available": False, "reason": "no NVML device handle: NVML absent"}
    assert mine["throttled"] is None
    # Checks run before timing (first call) and after (last call of the subject).
    assert log[:2] == ["subject", "check"]
    assert log.count("check") == 2
    last_check = len(log) - 1 - log[::-1].index("check")
    assert log[last_check - 1] == "subject" and "subject" not in log[last_check + 1 :]


def test_failed_check_marks_row_and_still_times_it():
    be, log = FakeBackend(), []
    rows = run_case("s", make_case(be, log, fail_subject=True), Settings(samples=3, calls=1), fake_ceilings(),
                    backend=be, sampler_factory=no_clocks)
    mine = rows[0]
    assert mine["status"] == "failed" and mine["note"] == "mask differs"
    assert mine["stats"] is not None  # never dropped


def test_check_after_timing_can_fail():
    be, log = FakeBackend(), []
    rows = run_case("s", make_case(be, log, fail_after=True), Settings(samples=2, calls=1), fake_ceilings(),
                    backend=be, sampler_factory=no_clocks)
    assert rows[0]["check"]["passed"] and rows[0]["status"] == "failed"
    assert rows[0]["note"] == "check failed after timing"


def test_exception_becomes_error_row():
    be, log = FakeBackend(), []
    rows = run_case("s", make_case(be, log, raise_peer=True), Settings(samples=2, calls=1), fake_ceilings(),
                    backend=be, sampler_factory=no_clocks)
    peer = rows[1]
    assert peer["status"] == "error" and "peer exploded" in peer["note"] and peer["stats"] is None
    assert rows[0]["status"] == "ok"

    def bad_build():
        raise ValueError("no such shape")

    rows = run_case("s", Case("broken", bad_build), Settings(samples=2), fake_ceilings(), backend=be)
    assert len(rows) == 1 and rows[0]["status"] == "error" and "no such shape" in rows[0]["note"]


@pytest.mark.parametrize("mode", ["graph", "batch", "periter"])
def test_reset_runs_outside_timed_region_in_every_mode(mode):
    be = FakeBackend()

    def build():
        def fn():
            be.log.append(("call", "x"))
            be.advance(1.0)
            return torch.zeros(1)

        return [Impl("x", fn, lambda out: {"passed": True})]

    case = Case("c", build, reset=lambda: be.log.append(("reset",)))
    run_case("s", case, Settings(mode=mode, samples=3, calls=2, iters=2, warmup=1), {}, backend=be,
             sampler_factory=no_clocks)
    inside, marks = False, 0
    for e in be.log:
        if e == ("mark",):
            inside = not inside
            marks += 1
        elif e == ("reset",):
            assert not inside
    assert marks == 6
    assert be.log.count(("reset",)) >= 3


def test_run_suite_result_is_complete(tmp_path):
    from tilefuse.bench import report

    be, log = FakeBackend(), []
    result = run_suite("s", [make_case(be, log)], Settings(samples=2, calls=1), backend=be,
                       sampler_factory=no_clocks)
    report.validate_result(result)
    assert result["environment"]["timing_mode"] == "graph"
    assert set(result["ceilings"]) == {ceil.FP8_MATMUL, ceil.BF16_MATMUL, ceil.COPY}
    if not torch.cuda.is_available():
        assert all(not c["available"] for c in result["ceilings"].values())


def test_run_suite_keeps_partial_results(tmp_path):
    # Each case's rows reach the partial writer before the next case runs (never after the last):
    # a run cut by a time limit keeps a whole, valid file of what it finished.
    from tilefuse.bench import report

    be, log, seen = FakeBackend(), [], []
    path = tmp_path / "r.json"

    def partial(res):
        seen.append(len(res["rows"]))
        report.write_result(res, path)

    cases = [dataclasses.replace(make_case(be, log), name=f"shape {i}") for i in range(3)]
    result = run_suite("s", cases, Settings(samples=2, calls=1), backend=be, sampler_factory=no_clocks,
                       partial=partial, checkpoint_s=0.0)
    per_case = len(result["rows"]) // 3
    assert seen == [per_case, 2 * per_case]
    kept = report.load_result(path)
    assert kept["settings"]["partial"] is True and len(kept["rows"]) == 2 * per_case
    assert "partial" not in result["settings"]
    assert not list(tmp_path.glob("*.tmp"))


def test_landed_in_poison():
    t = torch.empty(16)
    start = t.untyped_storage().data_ptr()
    assert landed_in_poison(t, (start, 64))
    assert not landed_in_poison(t, (start + 4, 64))
    assert not landed_in_poison(t, None)
    assert landed_in_poison((t, 3), (start, 128))


def test_throttled_row_is_flagged():
    from tilefuse.bench import report

    be, log = FakeBackend(), []
    sampler = lambda: ClockSampler(device_index=0, nvml=FakeNvml([(1600, 690_000, 0x4)]), interval_s=10.0)
    result = run_suite("s", [make_case(be, log)], Settings(samples=2, calls=1), backend=be, sampler_factory=sampler)
    mine = result["rows"][0]
    assert mine["throttled"] is True and mine["clocks"]["reasons"] == ["sw_power_cap"]
    table = report.results_table(result)
    assert "THROTTLED" in table and "1600" in table
