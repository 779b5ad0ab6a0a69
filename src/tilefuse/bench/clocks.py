"""Background NVML sampler: SM clock, power and throttle reasons while a row is measured.

A row measured while the GPU throttled (power cap, thermal or hardware slowdown) says so in
the tables and the JSON. Without NVML (no ``nvidia-ml-py``, no driver, a CPU machine) the
record says ``"available": false`` and why; that is never an error.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

# Reasons that lower the clock below what the workload asked for. Idle, application-clock
# settings and sync boost are not throttling and are reported but not flagged.
_THROTTLE_REASONS = {
    "sw_power_cap": ("nvmlClocksEventReasonSwPowerCap", 0x4),
    "hw_slowdown": ("nvmlClocksEventReasonHwSlowdown", 0x8),
    "sw_thermal": ("nvmlClocksEventReasonSwThermalSlowdown", 0x20),
    "hw_thermal": ("nvmlClocksEventReasonHwThermalSlowdown", 0x40),
    "hw_power_brake": ("nvmlClocksEventReasonHwPowerBrakeSlowdown", 0x80),
}
_OTHER_REASONS = {
    "gpu_idle": ("nvmlClocksEventReasonGpuIdle", 0x1),
    "applications_clocks": ("nvmlClocksEventReasonApplicationsClocksSetting", 0x2),
    "sync_boost": ("nvmlClocksEventReasonSyncBoost", 0x10),
}


def _load_nvml():
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver or no GPU: recorded, not raised
        return None, f"NVML init failed: {e}"
    return pynvml, None


def reason_names(mask: int, nvml: Any = None) -> list[str]:
    """Names of the clock-event reasons set in ``mask``."""
    names = []
    for name, (attr, default) in {**_THROTTLE_REASONS, **_OTHER_REASONS}.items():
        bit = getattr(nvml, attr, default) if nvml is not None else default
        if mask & bit:
            names.append(name)
    return names


def is_throttled(reasons: list[str]) -> bool:
    return any(r in _THROTTLE_REASONS for r in reasons)


def _device_handle(nvml, device_index: int | None):
    """NVML handle of the CUDA device in use (matched by UUID, since NVML ignores
    ``CUDA_VISIBLE_DEVICES``), or of ``device_index`` among all NVML devices."""
    if device_index is None:
        try:
            import torch

            if torch.cuda.is_available():
                uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                return nvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid if not uuid.startswith("GPU-") else uuid)
        except Exception:  # fall back to the first NVML device
            pass
        device_index = 0
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


class ClockSampler:
    """Samples the GPU every ``interval_s`` on a background thread between ``start`` and ``stop``.

    Use as a context manager around one measurement, then read :meth:`summary`::

        with ClockSampler() as clocks:
            stats = measure(fns)
        row["clocks"] = clocks.summary()

    ``nvml`` injects a module with pynvml's interface (tests); by default pynvml is loaded and
    its absence is recorded.
    """

    def __init__(self, device_index: int | None = None, interval_s: float = 0.01, nvml: Any = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s: expected a positive number of seconds, got {interval_s}")
        self.interval_s = interval_s
        self._device_index = device_index
        self._nvml = nvml
        self._unavailable: str | None = None
        self._handle = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.samples: list[dict] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> ClockSampler:
        if self._nvml is None:
            self._nvml, self._unavailable = _load_nvml()
        if self._nvml is not None and self._handle is None:
            try:
                self._handle = _device_handle(self._nvml, self._device_index)
            except Exception as e:
                self._unavailable = f"no NVML device handle: {e}"
                self._nvml = None
        self.samples = []
        if self._nvml is None:
            return self
        self._stop.clear()
        self._sample()  # at least one sample even for a measurement shorter than the interval
        self._thread = threading.Thread(target=self._run, name="tilefuse-nvml", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()

    def __enter__(self) -> ClockSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sampling ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        nvml, h = self._nvml, self._handle
        try:
            sm = nvml.nvmlDeviceGetClockInfo(h, getattr(nvml, "NVML_CLOCK_SM", 1))
            power_w = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            get_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if get_reasons is None:  # nvidia-ml-py before the "clocks event" rename
                get_reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            mask = int(get_reasons(h))
        except Exception:  # a failed read loses one sample, not the measurement
            return
        self.samples.append({"sm_clock_mhz": sm, "power_w": power_w, "reasons_mask": mask})

    # -- result --------------------------------------------------------------------------
    def summary(self) -> dict:
        """Per-row record: SM clock (min/median/max MHz), power (mean/max W), reasons seen."""
        if self._unavailable is not None or self._nvml is None:
            return {"available": False, "reason": self._unavailable or "NVML not started"}
        if not self.samples:
            return {"available": False, "reason": "no NVML sample could be read"}
        clocks = [s["sm_clock_mhz"] for s in self.samples]
        power = [s["power_w"] for s in self.samples]
        mask = 0
        for s in self.samples:
            mask |= s["reasons_mask"]
        throttled_samples = sum(1 for s in self.samples if is_throttled(reason_names(s["reasons_mask"], self._nvml)))
        reasons = reason_names(mask, self._nvml)
        return {
            "available": True,
            "samples": len(self.samples),
            "sm_clock_mhz": {"min": min(clocks), "median": statistics.median(clocks), "max": max(clocks)},
            "power_w": {"mean": sum(power) / len(power), "max": max(power)},
            "reasons": reasons,
            "throttled": throttled_samples > 0,
            "throttled_fraction": throttled_samples / len(self.samples),
        }


def unavailable(reason: str) -> dict:
    """The clock record of a row that had no sampler (e.g. a skipped row)."""
    return {"available": False, "reason": reason}
