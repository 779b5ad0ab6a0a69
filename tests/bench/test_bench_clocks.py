"""NVML sampler: absent NVML is recorded, throttle reasons are flagged."""

import sys

from tilefuse.bench import clocks
from tilefuse.bench.clocks import ClockSampler


class FakeNvml:
    """pynvml's interface with scripted readings."""

    NVML_CLOCK_SM = 1
    nvmlClocksEventReasonGpuIdle = 0x1
    nvmlClocksEventReasonSwPowerCap = 0x4
    nvmlClocksEventReasonHwSlowdown = 0x8

    def __init__(self, readings):
        self.readings = list(readings)
        self.i = 0

    def _reading(self):
        r = self.readings[min(self.i, len(self.readings) - 1)]
        return r

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return self._reading()[0]

    def nvmlDeviceGetPowerUsage(self, h):
        return self._reading()[1]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        mask = self._reading()[2]
        self.i += 1
        return mask


def test_absent_nvml_is_unavailable_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with ClockSampler() as s:
        pass
    summary = s.summary()
    assert summary == {"available": False, "reason": "nvidia-ml-py is not installed"}


def test_nvml_init_failure_is_unavailable(monkeypatch):
    class Broken:
        def nvmlInit(self):
            raise RuntimeError("driver not loaded")

    monkeypatch.setitem(sys.modules, "pynvml", Broken())
    with ClockSampler() as s:
        pass
    assert s.summary()["available"] is False
    assert "driver not loaded" in s.summary()["reason"]


def test_summary_and_throttle_flag():
    nvml = FakeNvml([(1980, 500_000, 0x0), (1755, 700_000, 0x4), (1980, 600_000, 0x1)])
    s = ClockSampler(device_index=0, nvml=nvml, interval_s=10.0)  # only the start/stop samples
    s.start()
    s._sample()  # one sample in the middle, deterministic
    s.stop()
    summary = s.summary()
    assert summary["available"] is True
    assert summary["samples"] == 3
    assert summary["sm_clock_mhz"] == {"min": 1755, "median": 1980, "max": 1980}
    assert summary["power_w"]["max"] == 700.0
    assert summary["power_w"]["mean"] == 600.0
    assert summary["reasons"] == ["sw_power_cap", "gpu_idle"]
    assert summary["throttled"] is True
    assert abs(summary["throttled_fraction"] - 1 / 3) < 1e-12


def test_idle_is_not_throttling():
    nvml = FakeNvml([(1980, 300_000, 0x1)])
    with ClockSampler(device_index=0, nvml=nvml, interval_s=10.0) as s:
        pass
    assert s.summary()["throttled"] is False
    assert s.summary()["reasons"] == ["gpu_idle"]


def test_background_thread_samples():
    nvml = FakeNvml([(1500, 100_000, 0x0)])
    import time

    with ClockSampler(device_index=0, nvml=nvml, interval_s=0.001) as s:
        time.sleep(0.05)
    assert s.summary()["samples"] >= 3


def test_reason_names():
    assert clocks.reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]
    assert clocks.is_throttled(["hw_slowdown"])
    assert not clocks.is_throttled(["gpu_idle", "sync_boost"])
