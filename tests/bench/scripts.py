"""The scripts under ``benchmarks/`` imported by path (they are not a package)."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str):
    """``benchmarks/<name>.py`` as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
