"""The environment record every result file carries, and the GPU slug for result paths."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

import tilefuse

CPU_DEVICE = "cpu (Triton interpreter)"


def on_gpu() -> bool:
    """True when ops run on a CUDA device for real (not through ``TRITON_INTERPRET``)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.cuda.is_available() and not interpreted


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # NVML missing or no driver: recorded as unknown
        return None


def _git_commit() -> dict:
    """Commit of the tilefuse checkout (None when installed outside a git tree)."""
    if os.environ.get("TILEFUSE_COMMIT"):
        # Set by whoever shipped this tree to the benchmark host: it names the tree's commit,
        # whatever .git (if any, possibly stale) travelled with it.
        return {"commit": os.environ["TILEFUSE_COMMIT"], "dirty": None}
    root = Path(tilefuse.__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": bool(dirty)}


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def gpu_name() -> str:
    """Name of the current GPU, or ``"cpu (Triton interpreter)"``."""
    if on_gpu():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return CPU_DEVICE


def gpu_slug(name: str | None = None) -> str:
    """Short lower-case name for result paths: ``"NVIDIA H200"`` -> ``"h200"``; CPU -> ``"cpu"``."""
    name = gpu_name() if name is None else name
    if name == CPU_DEVICE or name.lower().startswith("cpu"):
        return "cpu"
    vendor = ("nvidia", "geforce", "tesla")
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in vendor]
    return words[0] if words else "gpu"


def environment(mode: str | None = None) -> dict:
    """What produced a result: device, software versions, commit, command line, timing mode."""
    gpu = on_gpu()
    env = {
        "gpu": gpu_name(),
        "gpu_count": torch.cuda.device_count() if gpu else 0,
        "gpu_slug": gpu_slug(),
        "driver": _driver_version() if gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "tilefuse": tilefuse.__version__,
        **_git_commit(),
        "python": platform.python_version(),
        "command": shlex.join(sys.argv),
        "timing_mode": mode,
        "interpreter": not gpu,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if gpu:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["sm_count"] = props.multi_processor_count
        env["capability"] = f"{props.major}.{props.minor}"
    return env
