"""``scripts/lint.sh``, the lint step of ``scripts/test.sh``: it lints where ruff is installed,
notes and skips where it is not (a GPU image without dev tools), and fails in CI without it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PATH = "/usr/bin:/bin"


def _lint(py: str, tmp_path: Path, ci: bool):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PY=py, PATH=f"{tmp_path}:{SYSTEM_PATH}", **({"CI": "true"} if ci else {}))
    return subprocess.run(["bash", str(ROOT / "scripts" / "lint.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def python_without_ruff(tmp_path):
    if shutil.which("ruff", path=SYSTEM_PATH):
        pytest.skip("a system ruff is installed")
    shim = tmp_path / "python-without-ruff"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # -S: no site-packages, so no ruff
    shim.chmod(0o755)
    assert subprocess.run([str(shim), "-c", "import ruff"], capture_output=True).returncode != 0
    return str(shim)


def test_lint_is_skipped_without_ruff(python_without_ruff, tmp_path):
    run = _lint(python_without_ruff, tmp_path, ci=False)
    assert run.returncode == 0 and "lint: skipped, ruff is not installed" in run.stderr


def test_ci_requires_ruff(python_without_ruff, tmp_path):
    run = _lint(python_without_ruff, tmp_path, ci=True)
    assert run.returncode == 1 and "ruff is not installed" in run.stderr


def test_lint_runs_where_ruff_is_installed(tmp_path):
    pytest.importorskip("ruff")
    run = _lint(sys.executable, tmp_path, ci=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "All checks passed" in run.stdout
