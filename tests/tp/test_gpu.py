"""2-GPU tests: run tests/tp/gpu_checks.py under torchrun (one process per GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tilefuse.tp._common import MULTICAST_OFF


@pytest.mark.gpu
@pytest.mark.multigpu
def test_fused_ops_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    script = Path(__file__).with_name("gpu_checks.py")
    env = dict(os.environ, **MULTICAST_OFF)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "\n0 failed checks" in out, out[-6000:]
