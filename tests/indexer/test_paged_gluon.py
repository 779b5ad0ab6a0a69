"""The Gluon decode kernel (``PagedConfig(gluon=True)``, ``_paged_kernel_gluon.py``): where the
launch picks it, and on a Hopper GPU the op's contract with it (both references, exact -inf
and NaN masks, every element written, bitwise reruns, bad values reported and never read out
of bounds) and its agreement with the Triton kernel.

Gluon has no interpreter: the dispatch is checked on CPU by the launch plan (nothing runs),
the kernel itself on an sm_90 GPU. Against the Triton kernel the logits may differ in the
order of the head sum only: the -inf and NaN positions must be equal and the rest within the
bound the contract tests use against the dequantised reference (``calc_diff`` < 5e-6, 3e-5
with bf16 weights or logits).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

import tilefuse
from tilefuse import _jit, _validate
from tilefuse import reference as R
from tilefuse.formats import FP8_DTYPE
from tilefuse.indexer import _paged_kernel_gluon as gk
from tilefuse.indexer import paged

from ..conftest import DEVICE, ON_GPU
from .test_paged import BAD_VALUES, Case, _args, _bits

pytestmark = pytest.mark.usefixtures("no_pending_errors")

HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9
on_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel runs on Hopper (sm_90) only")
F32, BF16 = torch.float32, torch.bfloat16


def _config(next_n: int, h: int, d: int, block_kv: int, **fields) -> paged.PagedConfig:
    """The op's own config for this model, on 64-key tiles, with the Gluon kernel asked for."""
    base = paged.resolve_paged_config("fp8", next_n, h, d, block_kv)
    return dataclasses.replace(base, **{"block_n": 64, "gluon": True, **fields})


def spying(real, seen: list):
    """Within the block, every launch of the kernel ``real`` (which still runs) appends its grid
    to ``seen``."""

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(grid)
                return real[grid](*args, **kwargs)
            return launch

    return _jit.redirected(real, Spy())  # the op launches through tilefuse._jit.Launcher


@pytest.fixture
def gluon_launches():
    """The grid of every launch of the Gluon kernel."""
    seen = []
    with spying(gk.paged_logits_gluon_kernel, seen):
        yield seen


def _persistent_config(next_n: int, h: int, d: int, block_kv: int, **fields) -> paged.PagedConfig:
    """The op's own config for this model with the persistent kernel asked for."""
    base = paged.resolve_paged_config("fp8", next_n, h, d, block_kv)
    return dataclasses.replace(base, **{"persistent": True, "num_stages": 4, **fields})


@pytest.fixture(params=["gluon", "persistent"])
def hopper_kernel(request):
    """Each Hopper decode kernel in turn: its config for ``(next_n, h, d, block_kv)`` and the
    grid of each of its launches."""
    from tilefuse.indexer import _paged_kernel_ws as ws

    config, real = ((_config, gk.paged_logits_gluon_kernel) if request.param == "gluon"
                    else (_persistent_config, ws.paged_logits_ws_kernel))
    seen = []
    with spying(real, seen):
        yield config, seen


def _tolerance(weights_dtype, logits_dtype) -> float:
    return 3e-5 if BF16 in (weights_dtype, logits_dtype) else 5e-6


def _agrees(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Same -inf and NaN (unwritten or without a page) positions; the rest within ``tol``."""
    a, b = a.float(), b.float()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "-inf positions differ"
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN positions differ"
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b))
    assert R.calc_diff(a[finite], b[finite]) < tol


# ---------------------------------------------------------------------------------------
# Dispatch (CPU: the launch plan, nothing runs)
# ---------------------------------------------------------------------------------------
def _plan(monkeypatch, *, sm90=True, fmt="fp8", h=64, next_n=1, d=128, block_kv=64, page_pad=0, q_pad=0,
          config=None):
    """The launch plan of a small batch with the GPU test answering ``sm90``; ``q_pad`` extra
    query rows a request in memory (the rows of a request's heads no longer evenly strided)."""
    from tilefuse.kernelcheck.variants import _scales, _values

    monkeypatch.setattr(paged, "_is_sm90", lambda device: sm90)
    monkeypatch.setattr(paged, "_plans", {})
    monkeypatch.setattr(_validate, "interpreter_enabled", lambda: True)
    batch, max_len = 3, 301
    lens = torch.tensor([37, max_len, 150], dtype=torch.int32)
    pages = -(-max_len // block_kv)
    width = paged.paged_kv_cache_width(d, fmt)
    cache = paged.new_paged_kv_cache(batch * pages, block_kv, d, fmt, page_stride=block_kv * width + page_pad)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    q = _values((batch, next_n + q_pad, h, d), fmt)[:, :next_n]
    q_sf = None if fmt == "fp8" else _scales((batch, next_n, h), fmt)
    w = torch.zeros(batch * next_n, h)
    meta = paged._schedule(lens, block_kv, 5)
    return paged._plan_for(q, q_sf, cache, w, lens, table, meta, max_len, False, torch.float32, None, None, config)


def test_dispatch_takes_the_gluon_kernel_where_it_runs(monkeypatch):
    # (16-token pages: D = 64, so that the page stride is a multiple of the value rows.)
    for block_kv, d, box in ((64, 128, 64), (32, 128, 32), (16, 64, 16), (128, 128, 64), (256, 128, 64)):
        plan = _plan(monkeypatch, block_kv=block_kv, d=d, config=_config(1, 64, d, block_kv))
        assert plan.gluon and plan.launcher is gk.launcher and plan.kv_descriptor == gk.kv_descriptor, block_kv
        assert plan.tma[1:] == (d, box, FP8_DTYPE)
        assert plan.consts["NUM_BUF"] == plan.cfg.num_stages and plan.options == {}
    # Two rows per dot at 64 heads (128 columns), four at 16, D = 64.
    assert _plan(monkeypatch, next_n=2, config=_config(2, 64, 128, 64)).consts["ROWS"] == 2
    assert _plan(monkeypatch, next_n=4, h=16, config=_config(4, 16, 128, 64)).gluon
    assert _plan(monkeypatch, d=64, h=32, config=_config(1, 32, 64, 64)).gluon
    # A ring of at least two buffers.
    assert _plan(monkeypatch, config=_config(1, 64, 128, 64, num_stages=1)).consts["NUM_BUF"] == 2
    # Two warpgroups where asked for and the rows split between them; else one.
    for next_n, h, warps, want in ((2, 64, 8, 8), (4, 16, 8, 8), (1, 64, 8, 4), (2, 64, 4, 4), (2, 8, 8, 4)):
        plan = _plan(monkeypatch, next_n=next_n, h=h, config=_config(next_n, h, 128, 64, num_warps=warps))
        assert plan.gluon and plan.consts["num_warps"] == want, (next_n, h, warps)


def test_dispatch_falls_back_to_the_triton_kernel(monkeypatch):
    cases = {
        "not asked": dict(config=dataclasses.replace(_config(1, 64, 128, 64), gluon=False)),
        "not sm_90": dict(sm90=False, config=_config(1, 64, 128, 64)),
        "mx format": dict(fmt="mxfp8", config=_config(1, 64, 128, 64)),
        "128-key tiles": dict(config=_config(1, 64, 128, 64, block_n=128)),
        "256 columns": dict(next_n=4, config=_config(4, 64, 128, 64, rows=4, num_warps=8)),
        "page stride": dict(page_pad=4, config=_config(1, 64, 128, 64)),
        "page size": dict(block_kv=48, config=_config(1, 64, 128, 48)),
    }
    for why, kw in cases.items():
        plan = _plan(monkeypatch, **kw)
        assert not plan.gluon and plan.launcher is paged._paged_launch, why
        assert "NUM_BUF" not in plan.consts and plan.options["num_warps"] == plan.cfg.num_warps, why


def test_dispatch_follows_the_config_override(monkeypatch):
    assert not _plan(monkeypatch).gluon  # off by default
    with tilefuse.config_override("paged", gluon=True):
        assert _plan(monkeypatch).gluon  # H 64, next_n 1: 64-key tiles by default
        assert not _plan(monkeypatch, h=16).gluon  # 16 columns: 128-key tiles by default
    with tilefuse.config_override("paged", gluon=True, block_n=64):
        assert _plan(monkeypatch, h=16).gluon


def test_the_two_kernels_take_the_same_runtime_arguments():
    n = paged._PAGED_RUNTIME_ARGS
    assert gk.arg_names[:n] == paged._paged_launch.arg_names[:n]
    assert "kv_desc" in gk.arg_names[n:]


def test_the_custom_op_unpacks_the_kernel_flags():
    for cfg in (paged.PagedConfig(block_n=64, rows=2, chunk=128, num_stages=3, tma=True, gluon=True),
                paged.PagedConfig(num_stages=5, persistent=True, ctas_per_sm=2)):
        packed = [int(v) for v in dataclasses.astuple(cfg)]
        assert paged._config_from_ints(packed) == cfg


def compiled_registered(kernel: str, names: tuple[str, ...]) -> list:
    """The named registered variants of ``kernel`` (Hopper only) compiled for sm_90a with their
    SASS, each passing the registry's checks (every wgmma of the PTX kept among them)."""
    from tilefuse.kernelcheck import checks, variants
    from tilefuse.kernelcheck.compile import compile_many

    picked = [v for v in variants.variants(kernel) if v.name in names]
    assert len(picked) == len(names) and all(v.targets == ("sm_90a",) for v in picked)
    reports = compile_many([(v, "sm_90a") for v in picked], jobs=2, sass=True)
    assert all(r.ok and r.sass_opcodes for r in reports), [r.error for r in reports]
    assert not [f for r in reports for f in checks.failures(r)]
    return reports


def test_registered_compiles_keep_every_wgmma():
    """Two registered variants compiled with their SASS: every wgmma of the PTX is there."""
    compiled_registered("indexer.paged_gluon", ("fp8 D128 H64 next_n1 kv64 rows1x64 n64 w4 buf4",
                                                "fp8 D128 H64 next_n2 kv64 rows2x64 n64 w8 buf4"))


# ---------------------------------------------------------------------------------------
# On the GPU: the contract, and the Triton kernel's logits
# ---------------------------------------------------------------------------------------
# (block_kv, next_n, H, D, rows (0: the default), 2-D lengths, clean, weights and logits dtype,
#  indices, extra output columns). Pages of 8 to 256 tokens (a tile is eight boxes of 8-token
# pages down to half a 256-token page; pages under 32 tokens at D 64 or 32, where their stride
# is a multiple of the value rows), one to four query rows per dot (16 to 128 columns; next_n 3
# leaves a row of the dot unused), D 32, 64 and 128.
GRID = [
    (64, 1, 64, 128, 0, False, False, F32, False, 5),
    (64, 1, 64, 128, 0, True, True, F32, False, 5),
    (64, 2, 64, 128, 0, False, True, F32, False, 5),
    (64, 2, 64, 128, 0, True, False, BF16, False, 5),
    (32, 1, 64, 128, 0, False, True, F32, False, 5),
    (32, 2, 16, 128, 0, True, True, BF16, False, 5),
    (32, 2, 64, 128, 0, False, False, F32, False, 5),
    (32, 4, 32, 128, 0, False, True, F32, False, 5),
    (128, 1, 32, 128, 0, True, True, F32, False, 5),
    (128, 2, 32, 128, 0, False, True, BF16, False, 5),
    (128, 4, 16, 128, 0, True, True, F32, False, 5),
    (64, 3, 16, 128, 0, False, True, F32, False, 5),
    (64, 3, 32, 128, 0, True, False, F32, False, 5),
    (64, 3, 64, 128, 2, True, True, F32, False, 5),
    (64, 4, 64, 128, 2, False, True, BF16, False, 5),
    (16, 2, 16, 64, 0, False, True, F32, False, 5),
    (256, 1, 64, 128, 0, True, True, F32, False, 1500),
    (64, 1, 16, 64, 0, False, True, F32, True, 5),
    (64, 2, 32, 64, 0, True, True, BF16, False, 5),
    (64, 1, 32, 128, 0, False, False, BF16, True, 1500),
    (32, 2, 16, 32, 0, True, True, F32, False, 5),
    (8, 1, 32, 32, 0, False, True, F32, False, 5),
]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("block_kv,next_n,h,d,rows,ctx_2d,clean,dtype,indices,extra", GRID)
def test_gluon_kernel_meets_the_contract_and_agrees_with_triton(block_kv, next_n, h, d, rows, ctx_2d, clean, dtype,
                                                                indices, extra, poisoned, gluon_launches):
    # Lengths: zero, one key, one past a tile, whole and partial chunks with odd and even tile counts.
    lens = (3000, 0, 65, 1, 130, 2049)
    case = Case("fp8", lens=lens, next_n=next_n, h=h, d=d, block_kv=block_kv, ctx_2d=ctx_2d, weights_dtype=dtype,
                extra_cols=extra, seed=block_kv + 3 * next_n + h + d)
    cfg = _config(next_n, h, d, block_kv, **({"rows": rows} if rows else {}))
    meets_the_contract_and_agrees_with_triton(case, cfg, dataclasses.replace(cfg, gluon=False), clean, dtype,
                                              indices, gluon_launches)


def meets_the_contract_and_agrees_with_triton(case: Case, cfg, triton_cfg, clean: bool, dtype, indices: bool,
                                              launches: list) -> None:
    """``case`` under ``cfg`` (a Hopper kernel whose launches ``launches`` spies on): the
    contract, a bitwise rerun, and the logits of the Triton kernel under ``triton_cfg``."""
    idx = torch.arange(case.ctx.shape[0], dtype=torch.int32, device=DEVICE) if indices else None
    out = case.run(clean=clean, logits_dtype=dtype, config=cfg, indices=idx)
    assert len(launches) == 1, "the kernel did not run"
    case.check(out, clean, dtype)
    again = case.run(clean=clean, logits_dtype=dtype, config=cfg, indices=idx)
    assert torch.equal(_bits(out), _bits(again)), "a rerun differs"
    triton = case.run(clean=clean, logits_dtype=dtype, config=triton_cfg, indices=idx)
    assert len(launches) == 2
    _agrees(out, triton, _tolerance(dtype, dtype))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("block_kv,next_n,h,ctx_2d,clean,dtype", [
    (64, 2, 64, False, True, F32), (32, 2, 32, True, True, BF16), (128, 4, 16, False, False, F32),
    (64, 3, 32, True, True, F32)])
def test_gluon_kernel_on_two_warpgroups(block_kv, next_n, h, ctx_2d, clean, dtype, poisoned, gluon_launches):
    """8 warps (``num_warps=8``): two warpgroups, one half of the rows each; the contract, and
    one warpgroup's logits."""
    case = Case("fp8", lens=(3000, 0, 65, 130, 2049), next_n=next_n, h=h, d=128, block_kv=block_kv,
                ctx_2d=ctx_2d, weights_dtype=dtype, seed=80 + block_kv + next_n)
    cfg = _config(next_n, h, 128, block_kv, num_warps=8)
    out = case.run(clean=clean, logits_dtype=dtype, config=cfg)
    case.check(out, clean, dtype)
    one = case.run(clean=clean, logits_dtype=dtype, config=dataclasses.replace(cfg, num_warps=4))
    assert len(gluon_launches) == 2
    _agrees(out, one, _tolerance(dtype, dtype))


@pytest.mark.gpu
@on_hopper
def test_gluon_kernel_is_bitwise_the_same_for_any_chunk_and_ring(gluon_launches):
    """Every key's logits depend on its own row only: chunks of one tile to 32 tiles and rings
    of 2 to 4 buffers give the same bits."""
    case = Case("fp8", lens=(9000, 0, 4097, 64, 63), next_n=2, h=64, d=128, block_kv=64, seed=71)
    first = case.run(clean=True, config=_config(2, 64, 128, 64))
    for chunk, stages in ((64, 4), (128, 2), (2048, 3), (1024, 4), (512, 2)):
        again = case.run(clean=True, config=_config(2, 64, 128, 64, chunk=chunk, num_stages=stages))
        assert torch.equal(_bits(first), _bits(again)), (chunk, stages)
    assert len(gluon_launches) == 6


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("block_kv", [32, 64, 128])
def test_hopper_bad_page_ids_score_nan_and_are_reported(block_kv, hopper_kernel):
    """Page ids -1, one past the cache and 10_000_000: those keys score NaN (a TMA box of them
    reads row 0 of the cache), every other element has the good table's bits, the error is
    recorded, nothing faults."""
    config, launches = hopper_kernel
    case = Case("fp8", lens=(5 * block_kv + 7, 4 * block_kv), next_n=1, h=64, d=128, block_kv=block_kv,
                seed=72 + block_kv)
    cfg = config(1, 64, 128, block_kv)
    good = case.run(clean=True, config=cfg)
    table = case.table.clone()
    table[0, 1] = -1
    table[1, 0] = case.cache.shape[0]
    table[1, 2] = 10_000_000
    out = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, case.ctx, table, case.meta,
                                            case.max_context_len, True, config=cfg)
    with pytest.raises(tilefuse.DeviceValueError, match="block_table: page id (-1|[0-9]+) is outside"):
        tilefuse.check_errors()
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[0, block_kv:2 * block_kv] = True
    bad[1, :block_kv] = True
    bad[1, 2 * block_kv:3 * block_kv] = True
    assert out[bad].isnan().all()
    assert torch.equal(_bits(out[~bad]), _bits(good[~bad]))
    assert len(launches) == 2


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name", [n for n, (_, text, _) in BAD_VALUES.items() if text is not None])
def test_hopper_bad_values_are_found_on_the_device(name, hopper_kernel):
    """Bad lengths and page ids (test_paged's cases) reported by the kernel, in bounds."""
    config, launches = hopper_kernel
    case = Case("fp8", lens=(60, 100), next_n=2, block_kv=32, seed=17)
    _, text, changes = BAD_VALUES[name]
    args = _args(case)
    for key, fn in changes.items():
        args[key] = fn(args[key])
    tilefuse.fp8_fp4_paged_mqa_logits(**args, clean_logits=True, config=config(2, 8, 64, 32))
    torch.cuda.synchronize()
    assert len(launches) == 1
    with pytest.raises(tilefuse.DeviceValueError, match=text):
        tilefuse.check_errors()


@pytest.mark.gpu
@on_hopper
def test_hopper_bad_request_ids_in_indices(hopper_kernel):
    config, launches = hopper_kernel
    base = Case("fp8", lens=(120, 0, 75), next_n=1, h=16, d=128, block_kv=64, seed=8)
    indices = torch.tensor([0, 3, 1], dtype=torch.int32, device=DEVICE)
    tilefuse.fp8_fp4_paged_mqa_logits(base.qq, base.cache, base.w, base.ctx, base.table, base.meta,
                                      base.max_context_len, True, indices=indices, config=config(1, 16, 128, 64))
    assert len(launches) == 1
    with pytest.raises(tilefuse.DeviceValueError, match="indices: request id 3 is outside the batch"):
        tilefuse.check_errors()


@pytest.mark.gpu
@on_hopper
def test_hopper_all_zero_lengths_and_the_config_override(poisoned, hopper_kernel):
    """All-zero lengths (only the -inf fill runs); the override selects the kernel by itself."""
    config, launches = hopper_kernel
    case = Case("fp8", lens=(0, 0, 0), next_n=1, h=64, d=128, block_kv=64, seed=5)
    out = case.run(clean=True, config=config(1, 64, 128, 64))
    assert torch.isneginf(out).all()
    case = Case("fp8", lens=(700, 0, 129), next_n=1, h=64, d=128, block_kv=64, seed=6)
    cfg = config(1, 64, 128, 64)
    flags = {"gluon": cfg.gluon, "persistent": cfg.persistent, "block_n": cfg.block_n, "num_stages": cfg.num_stages}
    with tilefuse.config_override("paged", **flags):
        out = case.run(clean=True)
    assert len(launches) == 2
    case.check(out, True)
    assert torch.equal(_bits(out), _bits(case.run(clean=True, config=cfg)))


def test_plans_need_no_gpu_to_import_the_kernel():
    """The module imports on any machine (also under the interpreter) and names its kernel."""
    with mock.patch.object(paged, "_is_sm90", lambda device: False):
        assert gk.paged_logits_gluon_kernel is not None and gk.BLOCK_N == paged._GLUON_BLOCK_N
        assert gk.MAX_COLUMNS == paged._GLUON_MAX_COLUMNS
