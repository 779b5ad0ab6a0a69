"""The end of a test run groups skipped tests by reason (the hook in ``tests/conftest.py``)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SKIPPING = '''
import pytest

@pytest.mark.parametrize("i", range(3))
def test_needs_hardware(i):
    pytest.skip("needs the hardware")

@pytest.mark.skipif(True, reason="too slow here")
@pytest.mark.parametrize("i", range(2))
def test_slow(i):
    pass

def test_runs():
    assert True
'''


def test_skips_are_counted_by_reason(tmp_path):
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "-p", "tests.conftest", str(tmp_path / "test_skipping.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if "5 skipped, by reason" in ln)
    assert [ln.split(None, 1) for ln in lines[at + 1:at + 3]] == [["3", "needs the hardware"], ["2", "too slow here"]]
