"""Test setup: without CUDA, kernels run through Triton's interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function, so it is set here,
before any tilefuse kernel module is imported.
"""

import contextlib
import os
import sys
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tilefuse._interpreter import patch_interpreter_numerics  # noqa: E402
from tilefuse._jit import set_launch_audit  # noqa: E402

patch_interpreter_numerics()
# Every launch through tilefuse._jit.Launcher checks that its call site's key stands for one
# Triton specialisation (the direct-launch path relies on it).
set_launch_audit(True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    # Emulations of several ranks (or of an sm_100 kernel) on CPU tensors: they need the
    # interpreter, which this process turns on only where no GPU runs the kernels.
    skip_interpreter = pytest.mark.skip(reason="CPU-interpreter test (CPU machines and CI run it)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and ON_GPU:
            item.add_marker(skip_interpreter)


def pytest_runtest_logreport(report):
    """With ``TILEFUSE_TEST_INSTAFAIL=1`` (the GPU rounds' time-limited shards) a failure is
    written out as it happens, so a run stopped at its deadline still says what failed and why."""
    if report.failed and os.environ.get("TILEFUSE_TEST_INSTAFAIL") == "1":
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()


def skip_reason(report) -> str:
    """The reason a test was skipped, from its report (``longrepr`` is ``(path, line, reason)``;
    a list once it has come back from an xdist worker)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """Skips grouped by reason with their counts: a few lines instead of one per test."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = Counter(skip_reason(r) for r in skipped)
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"{n:6d}  {reason}")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def on_device():
    """Tensors made inside the test are on the test device (the GPU where there is one, else
    the CPU through the interpreter)."""
    with torch.device(DEVICE):
        yield


@pytest.fixture
def record_launches(monkeypatch):
    """``record_launches(module, name)`` -> list that collects the grid of every launch of the
    Triton kernel ``module.name`` (which still runs): proves an op went through the kernel."""

    from tilefuse import _jit

    stack = contextlib.ExitStack()

    def install(module, name):
        launched = []
        real = getattr(module, name)

        class Spy:
            def __getitem__(self, grid):
                launched.append(grid)
                return real[grid]

            def __getattr__(self, attr):
                return getattr(real, attr)

        spy = Spy()
        monkeypatch.setattr(module, name, spy)
        stack.enter_context(_jit.redirected(real, spy))  # launches through tilefuse._jit.Launcher
        return launched

    with stack:
        yield install
