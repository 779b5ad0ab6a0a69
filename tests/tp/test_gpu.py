"""GPU tests: the GEMM core's compile count on one GPU; tests/tp/gpu_checks.py under torchrun
(one process per GPU) on two."""

import os
import random
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


@pytest.mark.gpu
def test_gemm_core_compiles_once_per_class_not_per_m():
    """Issue 21.2 on one GPU: over a random sequence of M (N 4096, K 1024), the persistent GEMM
    compiles once per (tile from default_config, chunk alignment) class the sequence meets, and
    the outputs match cuBLAS."""
    from tilefuse.tp import _gemm_core as core

    dev = torch.cuda.current_device()
    rng = random.Random(21)
    ms = [rng.choice((1, 7, 64, 128, 300, 1000, 1024, 2048, 3000, 4096, 8192, 16384)) for _ in range(40)]
    k, n = 1024, 4096
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5
    sms = core.num_sms(torch.device("cuda"))
    kernel = core._persistent_gemm
    classes = set()

    def run(sequence):
        for m in sequence:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = core.default_config(m, n, k, sms)
            classes.add((cfg, m % cfg.block_m == 0))
            y = core.gemm(a, b)
            ref = a @ b
            assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2, m

    before = len(kernel.device_caches[dev][0])
    run(ms)
    first = len(kernel.device_caches[dev][0]) - before
    assert first <= len(classes), (ms, classes)  # (fewer when another test compiled a class already)
    run(rng.sample(ms, len(ms)))
    assert len(kernel.device_caches[dev][0]) - before == first, "compiled again for an M seen before"
