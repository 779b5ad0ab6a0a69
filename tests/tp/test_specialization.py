"""No compile per M: the key Triton compiles the TP kernels under does not move with M.

The launches the ops make are recorded (not run) and bound the way Triton's launcher binds
them (``create_function_from_signature`` with the CUDA backend's argument specialisation, the
kernel's own ``do_not_specialize``): every value of M with the same GEMM tile and the same
chunk alignment gives the same key, so the compiles over any sequence of M are bounded by
those few classes, and none come after one call of each. ``gpu_checks.py`` counts the
compiles on a GPU.
"""

import pytest
import torch

from tilefuse.kernelcheck.variants import tracing
from tilefuse.tp import _ag_gemm as ag
from tilefuse.tp import _comm_kernels as comm
from tilefuse.tp import _gemm_core as core
from tilefuse.tp import _gemm_rs as rs
from tilefuse.tp._gemm_core import GemmConfig
from tilefuse.tp.symm import emulated_workspaces

CPU = torch.device("cpu")
CFG = GemmConfig(128, 128, 64, 8, 3, 8)
GEMM = f"{core.__name__}:_persistent_gemm"
PUSH = f"{ag.__name__}:_ag_push_kernel"  # the name _ag_gemm launches
TIMEOUT = 60 * 10**9


def _key(path: str, launch) -> tuple:
    """The specialisation and options Triton's launcher caches the compiled kernel under."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = getattr(core if path == GEMM else comm, path.partition(":")[2])  # the kernel itself
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(
        kernel.fn, do_not_specialize=kernel.kwargs.get("do_not_specialize"))
    binder = create_function_from_signature(jit.signature, jit.params, CUDABackend)
    _, spec, options = binder(**launch.arguments, **launch.options)
    return tuple(map(tuple, spec)), tuple(sorted(options.items()))


def _keys(run) -> list[tuple]:
    with tracing(GEMM, PUSH) as launches:
        run()
    return [(launch.function, _key(launch.function, launch)) for launch in launches]


def test_do_not_specialize_covers_what_moves_with_m():
    kernel = core._persistent_gemm
    names = set(kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else
                [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize])
    assert {"M", "Mc", "tile_begin", "tile_end", "num_programs", "lag", "n_reset_flags"} <= names
    assert "NUM_PROGRAMS" not in (kernel.arg_names if hasattr(kernel, "arg_names") else [])


@pytest.mark.parametrize("ms", [(256, 512, 1024, 4096, 128 * 7), (200, 328, 1000, 8 * 13, 24)])
def test_gemm_key_does_not_move_with_m(ms):
    """The GEMM alone (N 256, K 64, one tile config), aligned Ms and unaligned ones (M 24 runs
    one tile on one program: once a constant 1)."""
    keys = set()
    for m in ms:
        a = torch.zeros(m, 64, dtype=torch.bfloat16)
        b = torch.zeros(64, 256, dtype=torch.bfloat16)
        keys.update(_keys(lambda a=a, b=b: core.gemm(a, b, config=CFG, num_programs=132)))
    assert len(keys) == 1, keys


def _rs_keys(m, world, lag):
    plan = rs.make_plan("push", m, 256, 64, world, 0, torch.bfloat16, CPU, config=CFG, num_programs=132, lag=lag,
                        recv_tma=False, send_tma=False)
    ws = emulated_workspaces(world, plan.n_flags, plan.data_bytes)[0]
    a, b = torch.zeros(m, 64, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    out = torch.zeros(m // world, 256, dtype=torch.bfloat16)
    return _keys(lambda: rs.launch_gemm_part(plan, ws, a, b, out, "kn", TIMEOUT))


def _differences(keys: set) -> list:
    """Where two keys of one kernel differ: (argument index, each key's entry)."""
    a, b = sorted(keys, key=repr)[:2]
    spec_a, spec_b = a[1][0], b[1][0]
    diff = [(i, x, y) for i, (x, y) in enumerate(zip(spec_a, spec_b)) if x != y]
    return diff + ([("options", a[1][1], b[1][1])] if a[1][1] != b[1][1] else [])


def test_gemm_rs_key_does_not_move_with_m_or_lag():
    keys, seen = set(), {}
    for m, lag in ((512, 0), (1024, 3), (2048, 66), (128 * 2 * 9, 1), (8192, 0)):
        for key in _rs_keys(m, 2, lag):
            keys.add(key)
            seen.setdefault(key, (m, lag))
    assert len(keys) == 1, (_differences(keys), list(seen.values()))


def _ag_keys(m, world, design):
    plan = ag.make_plan(design, m, 256, 64, world, 0, torch.bfloat16, CPU, config=CFG, num_programs=132,
                        read_local=False, local_copy="sm" if design == "push" else None,
                        comm_programs=32 if design == "push" else None)
    ws = emulated_workspaces(world, plan.n_flags, plan.data_bytes)[0]
    a, b = torch.zeros(m // world, 64, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    out = torch.zeros(m, 256, dtype=torch.bfloat16)

    def run():
        if design == "push":
            ag.launch_push(plan, ws, a, TIMEOUT)
        ag.launch_gemm_part(plan, ws, a, b, out, "kn", TIMEOUT)

    return _keys(run)


@pytest.mark.parametrize("design", ["push", "ce"])
def test_ag_gemm_keys_do_not_move_with_m(design):
    """Both kernels of a call (the push kernel and the GEMM): M from one tile row per chunk to
    many, at W = 2 and W = 4."""
    for world in (2, 4):
        keys = set()
        for m in (world * 128, world * 256, world * 128 * 5, world * 4096):
            keys.update(_ag_keys(m, world, design))
        assert len(keys) == (2 if design == "push" else 1), keys


def test_the_key_moves_with_what_it_must():
    """The tile config and the chunk alignment stay compile-time (a bounded set of variants):
    the key does move with them, so the tests above would see a change of M."""
    a = torch.zeros(256, 64, dtype=torch.bfloat16)
    b = torch.zeros(64, 256, dtype=torch.bfloat16)
    aligned = _keys(lambda: core.gemm(a, b, config=CFG, num_programs=132))
    unaligned = _keys(lambda: core.gemm(a[:200], b, config=CFG, num_programs=132))
    narrow = _keys(lambda: core.gemm(a, b, config=GemmConfig(128, 64, 64, 8, 3, 8), num_programs=132))
    assert len({*aligned, *unaligned, *narrow}) == 3
