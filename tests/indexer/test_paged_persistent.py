"""The persistent warp-specialised decode kernel (``PagedConfig(persistent=True)``,
``_paged_kernel_ws.py``): where the launch picks it, and on a Hopper GPU the op's contract with
it (both references, exact -inf and NaN masks, every element written, bitwise reruns), its
agreement with the Triton kernel, and the same bits whatever its programs an SM, ring depth,
batch split and CUDA-graph replays. Bad values (reported, never read out of bounds) are
test_paged_gluon.py's tests, run on both Hopper kernels.

Gluon has no interpreter: the dispatch is checked on CPU by the launch plan (nothing runs) and
the kernel compiled for sm_90a; the kernel itself runs on an sm_90 GPU. Against the Triton
kernel the logits may differ in the order of the head sum only (see test_paged_gluon.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

import tilefuse
from tilefuse import _jit, _validate
from tilefuse import formats as F
from tilefuse.indexer import _paged_kernel_ws as ws
from tilefuse.indexer import paged

from ..conftest import DEVICE, ON_GPU
from .test_paged import Case, _bits
from .test_paged_gluon import (
    _persistent_config,
    _plan,
    compiled_registered,
    meets_the_contract_and_agrees_with_triton,
    spying,
)

pytestmark = pytest.mark.usefixtures("no_pending_errors")

HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9
on_hopper = pytest.mark.skipif(not HOPPER, reason="the persistent decode kernel runs on Hopper (sm_90) only")
F32, BF16 = torch.float32, torch.bfloat16


_config = _persistent_config


@pytest.fixture
def ws_launches():
    """The grid of every launch of the persistent kernel."""
    seen = []
    with spying(ws.paged_logits_ws_kernel, seen):
        yield seen


# ---------------------------------------------------------------------------------------
# Dispatch (CPU: the launch plan, nothing runs)
# ---------------------------------------------------------------------------------------
def test_dispatch_takes_the_persistent_kernel_where_it_runs(monkeypatch):
    for next_n, h, d, block_kv, columns in ((1, 64, 128, 64, 64), (2, 64, 128, 32, 128), (4, 64, 128, 128, 256),
                                            (1, 16, 64, 64, 16), (8, 16, 32, 32, 128), (1, 128, 128, 256, 128),
                                            (2, 8, 128, 64, 16), (3, 64, 128, 64, 256), (3, 16, 64, 32, 64)):
        p = _plan(monkeypatch, next_n=next_n, h=h, d=d, block_kv=block_kv,
                  config=_config(next_n, h, d, block_kv)).persistent
        assert p is not None, (next_n, h, d, block_kv)
        assert p.columns == columns and p.box == min(64, block_kv) and p.data_words == block_kv * (d + 4) // 4
        # Three programs an SM up to 64 columns, two up to 128, one above; the register cap
        # follows (each program launched as two warpgroups: 256 threads).
        assert p.programs_per_sm == (3 if columns <= 64 else 2 if columns <= 128 else 1)
        assert p.options["maxnreg"] == {3: 80, 2: 128, 1: 255}[p.programs_per_sm]
    p = _plan(monkeypatch, config=_config(1, 64, 128, 64, ctas_per_sm=1, num_stages=1)).persistent
    assert p.programs_per_sm == 1 and p.options["maxnreg"] == 255
    assert p.consts[ws.arg_names.index("NUM_BUF") - ws.arg_names.index("NEXT_N")] == 2  # at least two buffers
    p = _plan(monkeypatch, next_n=2, config=_config(2, 64, 128, 64, ctas_per_sm=3)).persistent
    assert p.programs_per_sm == 2 and p.options["maxnreg"] == 128  # no more than 128 columns' registers allow
    # (eight buffers at 64 columns: three programs would need more shared memory than an SM has)
    p = _plan(monkeypatch, config=_config(1, 64, 128, 64, num_stages=8)).persistent
    assert p.programs_per_sm == 2 and p.options["maxnreg"] == 128
    split = ws.arg_names.index("SPLIT") - ws.arg_names.index("NEXT_N")
    assert not p.consts[split]
    for next_n, want in ((4, True), (3, True), (1, False)):  # halves of whole query rows: next_n > 1
        p = _plan(monkeypatch, next_n=next_n, config=_config(next_n, 64, 128, 64, split_columns=True)).persistent
        assert p.consts[split] is want and p.launch_key[1][split] is want, next_n
    with tilefuse.config_override("paged", persistent=True):
        assert _plan(monkeypatch).persistent is not None


def test_dispatch_falls_back_where_it_does_not_apply(monkeypatch):
    cases = {
        "not asked": dict(config=dataclasses.replace(_config(1, 64, 128, 64), persistent=False)),
        "not sm_90": dict(sm90=False, config=_config(1, 64, 128, 64)),
        "mx format": dict(fmt="mxfp8", config=_config(1, 64, 128, 64)),
        "heads not a power of two": dict(h=48, config=_config(1, 48, 128, 64)),
        "over 256 columns": dict(next_n=8, h=64, config=_config(8, 64, 128, 64)),
        "over 256 columns, rows padded": dict(next_n=3, h=128, config=_config(3, 128, 128, 64)),
        "under 16 columns": dict(next_n=2, h=4, config=_config(2, 4, 128, 64)),
        "page stride": dict(page_pad=4, config=_config(1, 64, 128, 64)),
        "page size": dict(block_kv=48, config=_config(1, 64, 128, 48)),
        # (a tile's scale boxes of 8 or 16 words would land off TMA's 128-byte alignment)
        "pages of 8 tokens": dict(block_kv=8, config=_config(1, 64, 128, 8)),
        "pages of 16 tokens": dict(next_n=2, h=16, d=64, block_kv=16, config=_config(2, 16, 64, 16)),
        "queries' rows": dict(next_n=2, q_pad=1, config=_config(2, 64, 128, 64)),
    }
    for why, kw in cases.items():
        plan = _plan(monkeypatch, **kw)
        assert plan.persistent is None, why


@pytest.mark.parametrize("next_n,h,d,block_kv,page_pad", [(2, 64, 128, 64, 128), (3, 16, 64, 32, 0),
                                                          (1, 32, 128, 128, 256)])
def test_persistent_launch_views_address_the_cache(next_n, h, d, block_kv, page_pad, monkeypatch):
    """What the kernel is given, on CPU (the launch recorded, nothing runs): the descriptors'
    views address the bytes the kernel's coordinates mean (key row ``page * page_rows + slot``,
    scale ``[page, block_kv * D / 4 + slot]``, a request's queries from row ``b * next_n * H``),
    the sizes and strides are the call's, and the grid is the programs an SM's share."""
    monkeypatch.setattr(paged, "_is_sm90", lambda device: True)
    monkeypatch.setattr(paged, "_plans", {})
    monkeypatch.setattr(paged, "sm_count", lambda device: 4)
    monkeypatch.setattr(_validate, "interpreter_enabled", lambda: True)
    g = torch.Generator().manual_seed(next_n + h + block_kv)
    lens = torch.tensor([5 * block_kv + 3, 0, block_kv + 1], dtype=torch.int32)
    width = paged.paged_kv_cache_width(d, "fp8")
    cache, table = paged.make_paged_kv_cache(torch.randn(3, int(lens.max()), d, generator=g), lens, block_kv, "fp8",
                                             num_blocks=16, page_stride=block_kv * width + page_pad, generator=g)
    q = F.quantize_q(torch.randn(3, next_n, h, d, generator=g), "fp8")[0]
    w = torch.randn(3 * next_n, h, generator=g)
    meta = paged._schedule(lens, block_kv, 5)
    launches = []

    class Record:
        def __getitem__(self, grid):
            return lambda **kwargs: launches.append((grid, kwargs))

    with _jit.redirected(ws.paged_logits_ws_kernel, Record()):
        out = tilefuse.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, meta, 400, True,
                                                config=_config(next_n, h, d, block_kv))
    ((grid, a),) = launches
    ctas = 3 if triton.next_power_of_2(next_n) * h <= 64 else 2
    assert grid == (min(ctas * 4, 3 * (400 + 63) // 64),) and a["maxnreg"] == {3: 80, 2: 128}[ctas]
    assert (a["batch"], a["max_context_len"], a["max_blocks"], a["num_blocks"]) == (3, 400, table.shape[1], 16)
    assert (a["stride_w"], a["stride_ctx"], a["stride_bt"], a["stride_out"]) == (h, 1, table.shape[1], out.stride(0))
    assert a["NEXT_N"] == next_n and a["NEXT_N_P"] == triton.next_power_of_2(next_n) and a["NUM_HEADS"] == h

    def view(desc, dtype):
        """The descriptor's [rows, cols] view of its base's bytes (what TMA reads)."""
        base = desc.base.view(torch.uint8)
        size = torch.tensor([], dtype=dtype).element_size()
        raw = base.as_strided((desc.shape[0], desc.shape[1] * size), (desc.strides[0] * size, 1),
                              base.storage_offset())
        return raw.view(dtype) if dtype != torch.uint8 else raw

    values, scales = paged._page_views(cache, d)
    keys = view(a["kv_desc"], torch.uint8)
    assert a["kv_desc"].block_shape == [min(64, block_kv), d]
    sf = view(a["sf_desc"], torch.float32)
    assert a["sf_desc"].block_shape == [1, min(64, block_kv)]
    page_rows = a["page_rows"]
    for page in (0, 7, 15):
        for slot in (0, block_kv - 1):
            assert torch.equal(keys[page * page_rows + slot], values[page, slot])
            assert sf[page, block_kv * d // 4 + slot] == scales.view(torch.float32)[page, slot]
    rows = view(a["q_desc"], torch.uint8)
    assert a["q_desc"].block_shape == [triton.next_power_of_2(next_n) * h, d] and rows.shape[0] == 3 * next_n * h
    for b in range(3):
        first = b * next_n * h
        assert torch.equal(rows[first:first + next_n * h], q[b].reshape(next_n * h, d).view(torch.uint8))


def test_registered_compiles_keep_every_wgmma():
    """Three registered variants compiled with their SASS: every wgmma of the PTX is there, no
    spill under the register cap of three, two and one programs an SM."""
    reports = compiled_registered("indexer.paged_persistent", ("fp8 D128 H64 next_n1 kv64 buf4 regs80",
                                                               "fp8 D128 H64 next_n2 kv64 buf4 regs128",
                                                               "fp8 D128 H64 next_n4 kv64 buf4 regs255"))
    assert all(r.spill_stores == 0 for r in reports)


# ---------------------------------------------------------------------------------------
# On the GPU: the contract, and the Triton kernel's logits
# ---------------------------------------------------------------------------------------
# (block_kv, next_n, H, D, 2-D lengths, clean, weights and logits dtype, indices, extra output
#  columns): pages of 32 to 256 tokens, 16 to 256 (row, head) columns, D 32, 64 and 128.
GRID = [
    (64, 1, 64, 128, False, False, F32, False, 5),
    (64, 1, 64, 128, True, True, F32, False, 5),
    (64, 2, 64, 128, False, True, F32, False, 5),
    (64, 2, 64, 128, True, False, BF16, False, 5),
    (64, 4, 64, 128, True, True, F32, False, 5),
    (32, 1, 64, 128, False, True, F32, False, 5),
    (32, 2, 32, 128, True, True, BF16, False, 5),
    (32, 4, 32, 128, False, True, F32, False, 5),
    (128, 1, 32, 128, True, True, F32, False, 5),
    (128, 2, 64, 128, False, True, BF16, False, 5),
    (256, 1, 64, 128, True, True, F32, False, 1500),
    (32, 2, 16, 64, False, True, F32, False, 5),
    (32, 1, 32, 32, False, True, F32, False, 5),
    (64, 1, 16, 64, False, True, F32, True, 5),
    (64, 8, 16, 32, True, True, F32, False, 5),
    (64, 3, 64, 128, False, True, F32, False, 5),
    (32, 3, 16, 128, True, True, BF16, False, 5),
    (64, 1, 128, 128, True, False, BF16, True, 1500),
]


@pytest.fixture(params=["all SMs", "one SM"])
def programs(request, monkeypatch):
    """The programs of a launch: a grid over every SM (at the tests' sizes, at most a tile or two
    a program), or one SM's worth, whose programs each walk tens of tiles over several requests
    (the loop, a request changing within a share, the ring's buffers reused)."""
    if request.param == "one SM":
        monkeypatch.setattr(paged, "sm_count", lambda device: 1)
    return request.param


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("block_kv,next_n,h,d,ctx_2d,clean,dtype,indices,extra", GRID)
def test_persistent_kernel_meets_the_contract_and_agrees_with_triton(block_kv, next_n, h, d, ctx_2d, clean, dtype,
                                                                     indices, extra, programs, poisoned, ws_launches):
    # Lengths: zero, one key, one past a tile, whole and partial tiles, requests spanning programs.
    lens = (3000, 0, 65, 1, 130, 2049, 0, 64)
    case = Case("fp8", lens=lens, next_n=next_n, h=h, d=d, block_kv=block_kv, ctx_2d=ctx_2d, weights_dtype=dtype,
                extra_cols=extra, seed=block_kv + 3 * next_n + h + d)
    cfg = _config(next_n, h, d, block_kv)
    meets_the_contract_and_agrees_with_triton(case, cfg, dataclasses.replace(cfg, persistent=False), clean, dtype,
                                              indices, ws_launches)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("block_kv,next_n,h,d,ctx_2d,clean,dtype,indices,extra", [
    (64, 2, 64, 128, False, True, F32, False, 5),
    (64, 4, 64, 128, True, True, F32, False, 5),
    (32, 3, 16, 128, True, True, BF16, False, 5),
    (128, 2, 128, 128, True, False, BF16, False, 1500),
    (32, 8, 16, 32, False, True, F32, False, 5),
])
@pytest.mark.parametrize("stages", [4, 2])
def test_persistent_kernel_with_the_mma_split_by_rows(block_kv, next_n, h, d, ctx_2d, clean, dtype, indices, extra,
                                                      stages, programs, poisoned, ws_launches):
    """``split_columns``: each tile's MMA in two halves of the query rows, one in flight under the
    other's epilogue; the contract, a bitwise rerun and the Triton kernel's logits; on one SM's
    programs, over requests that change within a program's share (the previous request's slot
    handed back late) and a ring of two buffers reused every other tile."""
    lens = (3000, 0, 65, 1, 130, 2049, 0, 64)
    case = Case("fp8", lens=lens, next_n=next_n, h=h, d=d, block_kv=block_kv, ctx_2d=ctx_2d, weights_dtype=dtype,
                extra_cols=extra, seed=block_kv + 5 * next_n + h + d)
    cfg = _config(next_n, h, d, block_kv, split_columns=True, num_stages=stages)
    meets_the_contract_and_agrees_with_triton(case, cfg, dataclasses.replace(cfg, persistent=False), clean, dtype,
                                              indices, ws_launches)


@pytest.mark.gpu
@on_hopper
def test_persistent_kernel_is_bitwise_the_same_for_any_share_and_ring(ws_launches):
    """Every key's logits depend on its own row only: one to three programs an SM (64 columns:
    each count runs), rings of 2 to 6 buffers give the same bits."""
    case = Case("fp8", lens=(9000, 0, 4097, 64, 63, 1, 0, 700), next_n=1, h=64, d=128, block_kv=64, seed=71)
    first = case.run(clean=True, config=_config(1, 64, 128, 64))
    for ctas, stages in ((1, 4), (2, 2), (3, 6), (2, 3)):
        again = case.run(clean=True, config=_config(1, 64, 128, 64, ctas_per_sm=ctas, num_stages=stages))
        assert torch.equal(_bits(first), _bits(again)), (ctas, stages)
    assert len(ws_launches) == 5


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("ctx_2d,split", [(False, False), (True, False), (True, True)])
def test_persistent_kernel_over_many_requests(ctx_2d, split, poisoned, ws_launches):
    """More requests than one pass of the share search reads (1024), many of them empty; shares
    of several requests each (also with the MMA split by rows)."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 300, (1500,), generator=g)
    lens[torch.rand(1500, generator=g) < 0.3] = 0
    case = Case("fp8", lens=tuple(lens.tolist()), next_n=2, h=32, d=128, block_kv=64, ctx_2d=ctx_2d, seed=9)
    for clean in (False, True):
        out = case.run(clean=clean, config=_config(2, 32, 128, 64, split_columns=split))
        case.check(out, clean)
    assert len(ws_launches) == 2


@pytest.mark.gpu
@on_hopper
def test_persistent_kernel_replays_in_a_graph_with_new_lengths(ws_launches):
    """Captured once, replayed after the lengths (and so every program's share) changed in place.
    The cache and table hold 4000 keys a request (a table entry past a request's length points
    at a poisoned page: the lengths of every call stay within the pages the table holds)."""
    case = Case("fp8", lens=(4000, 4000, 4000, 4000), next_n=1, h=64, d=128, block_kv=64, seed=12)
    case.ctx.copy_(torch.tensor((4000, 100, 0, 2500), dtype=torch.int32))
    cfg = _config(1, 64, 128, 64)
    out = torch.empty(4, case.max_context_len, device=DEVICE)
    case.run(clean=True, config=cfg, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(clean=True, config=cfg, out=out)
    for lens in ((10, 4000, 3000, 0), (1, 1, 1, 1), (4000, 4000, 4000, 4000)):
        case.ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        case.check(out, True, own_out=False)


@pytest.mark.gpu
@on_hopper
def test_unaligned_queries_take_the_other_kernel(ws_launches):
    case = Case("fp8", lens=(300, 70), next_n=1, h=64, d=128, block_kv=64, seed=3)
    q = case.qq[0]
    flat = torch.empty(q.numel() + 1, dtype=torch.uint8, device=DEVICE)
    shifted = flat[1:].view(q.dtype).view(q.shape)
    shifted.copy_(q)
    out = tilefuse.fp8_fp4_paged_mqa_logits((shifted, None), case.cache, case.w, case.ctx, case.table, case.meta,
                                            case.max_context_len, True, config=_config(1, 64, 128, 64))
    assert not ws_launches
    case.check(out, True)
