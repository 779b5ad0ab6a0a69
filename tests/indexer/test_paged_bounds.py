"""The paged decode kernel stays inside its tensors, compiles once per model configuration, and
its metadata kernel agrees with the torch split.

On CPU the interpreter runs under ``bounds.checked_bounds``: every load and store of an enabled
lane must hit one of the launch's tensors, and with ``speculate=True`` every ``tl.range`` loop
also runs the iterations past its end that Triton's software pipeliner evaluates (memory
access off, pure ops such as ``tl.gather`` on), which is where the H200 fault of DeepGEMM's
matrix case (FP8, block_kv 32, next_n 6, H 64, bf16 weights and logits) came from.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

import tilefuse
from tilefuse.indexer import _paged_kernel as kern
from tilefuse.indexer import paged
from tilefuse.kernelcheck import variants as V

from ..conftest import DEVICE, ON_GPU
from . import gpu_sweep
from .bounds import OutOfBounds, checked_bounds
from .test_paged import Case

pytestmark = pytest.mark.usefixtures("no_pending_errors")
needs_interpreter = pytest.mark.skipif(ON_GPU, reason="the bounds checker runs Triton's CPU interpreter")


# ---------------------------------------------------------------------------------------
# The checker itself
# ---------------------------------------------------------------------------------------
@triton.jit
def _store_one_past(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n + 1)


@triton.jit
def _descriptor_rows(desc, out_ptr, row):
    """Rows [row, row + 4) of a [*, 16] descriptor into out."""
    o = tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(out_ptr + o, desc.load([row, 0]))


@triton.jit
def _gather_per_tile(src_ptr, out_ptr, tiles, CLAMP: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The decode kernel's pattern: a vector read once, gathered per tile of a pipelined loop."""
    ids = tl.load(src_ptr + tl.arange(0, 8))
    for t in tl.range(0, tiles, num_stages=NUM_STAGES):
        idx = t * 2 + tl.arange(0, 4) // 2
        if CLAMP:
            idx = tl.minimum(idx, 7)
        v = tl.gather(ids, idx, 0)
        tl.store(out_ptr + t * 4 + tl.arange(0, 4), v)


@needs_interpreter
def test_checker_catches_a_store_past_the_end():
    x = torch.zeros(8)
    with checked_bounds(), pytest.raises(Exception, match="stores 1 of 9 lanes outside every argument") as err:
        _store_one_past[(1,)](x, 8, BLOCK=16)
    assert isinstance(err.value.__cause__, OutOfBounds)  # wrapped by the interpreter
    with checked_bounds() as state:
        _store_one_past[(1,)](x, 7, BLOCK=16)
    assert state.accesses == 7 + 8


@needs_interpreter
def test_checker_catches_a_descriptor_load_past_the_end():
    """A TMA box inside the descriptor's shape but past its base tensor (a shape that claims
    more rows than the tensor holds) is caught; one inside the tensor is not."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(8, 16)
    out = torch.zeros(4, 16)
    desc = TensorDescriptor(x, [12, 16], [16, 1], [4, 16])
    with checked_bounds() as state:
        _descriptor_rows[(1,)](desc, out, 4)
    assert state.accesses == 2 * 64
    with checked_bounds(), pytest.raises(Exception, match="loads 16 of 64 lanes outside every argument"):
        _descriptor_rows[(1,)](desc, out, 5)


@needs_interpreter
def test_speculation_catches_a_gather_past_the_loop_end():
    """Four tiles read all 8 ids; the pipeliner's tile 5 and 6 would gather ids 8..13."""
    src = torch.arange(8, dtype=torch.int32)
    out = torch.zeros(16, dtype=torch.int32)
    with checked_bounds():  # in order, as the interpreter runs it: fine
        _gather_per_tile[(1,)](src, out, 4, CLAMP=False, NUM_STAGES=3)
    with checked_bounds(speculate=True), pytest.raises(Exception, match="gathers index 9 from 8 elements"):
        _gather_per_tile[(1,)](src, out, 4, CLAMP=False, NUM_STAGES=3)
    out.zero_()
    with checked_bounds(speculate=True) as state:
        _gather_per_tile[(1,)](src, out, 4, CLAMP=True, NUM_STAGES=3)
    assert state.speculated == 2 and torch.equal(out, torch.arange(16, dtype=torch.int32) // 2)


# ---------------------------------------------------------------------------------------
# The decode kernel under the checker
# ---------------------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("ctx_2d", [True, False])
def test_deepgemm_fault_configuration_stays_in_bounds(ctx_2d, poisoned):
    """FP8, block_kv 32, next_n 6, H 64, D 128, bf16 weights and logits, with the default
    config: the requests run past the end of their first chunk (512 keys at this batch), so
    the pipelined loop reaches the chunk's last tile, where the gather used to leave its
    page vector."""
    case = Case("fp8", lens=(600, 70, 1030), next_n=6, h=64, d=128, block_kv=32, ctx_2d=ctx_2d, seed=31,
                weights_dtype=torch.bfloat16)
    with checked_bounds(speculate=True) as state:
        out = case.run(clean=False, logits_dtype=torch.bfloat16)
    assert state.accesses > 0 and state.speculated > 0
    case.check(out, False, torch.bfloat16)


# A fixed sample of the contract's cross product (the GPU sweep runs all of it).
CONTRACT_SAMPLE = random.Random(20).sample(gpu_sweep.contract_cases(), 6)


@needs_interpreter
@pytest.mark.parametrize("case", CONTRACT_SAMPLE, ids=lambda c: c.name())
def test_contract_sample_in_bounds(case, poisoned):
    with checked_bounds(speculate=True) as state:
        gpu_sweep.run_case(case, seed=5, chunk=2 * max(64, case.block_kv))
    assert state.accesses > 0


def test_sweep_resumes_a_cut_shard_with_the_same_case_seeds():
    """``--first K``: the shard's cases from the K-th on, each with the index (so the seed) it
    had in the full run; the cases before it are not run."""
    import argparse

    ap = argparse.ArgumentParser()
    gpu_sweep.add_sweep_arguments(ap, budget_s=60.0)
    cases = gpu_sweep.contract_cases()
    full, _ = gpu_sweep.pick_cases(cases, ap.parse_args(["--all", "--shard", "3/16"]))
    args = ap.parse_args(["--all", "--shard", "3/16", "--first", "5"])
    picked, budget = gpu_sweep.pick_cases(cases, args)
    seen = []
    done, failed = gpu_sweep.run_cases(picked[:9], lambda i, c: seen.append((i, c)), None, args.first)
    assert (done, failed, budget) == (4, [], 60.0)
    assert seen == [(i, full[i]) for i in range(5, 9)]


def test_sweep_progress_names_the_resume_point(monkeypatch, capsys):
    """A shard killed from outside has said how far it got: each progress line gives the count
    run so far and the ``--first`` that runs the rest."""
    monkeypatch.setattr(gpu_sweep, "PROGRESS_S", -1.0)  # a line before every case
    cases = gpu_sweep.contract_cases()[:4]
    done, failed = gpu_sweep.run_cases(cases, lambda i, c: None, None, first=1)
    assert (done, failed) == (3, [])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (the rest: ")[1] for line in lines] == ["--first 1)", "--first 2)", "--first 3)"]
    assert [line.split()[1] for line in lines] == ["0", "1", "2"]


@needs_interpreter
def test_large_offset_cases_at_small_sizes():
    """The sweep's >4 GiB cache and >2^31-element logits cases, scaled down to run here."""
    with checked_bounds() as state:
        gpu_sweep.run_large_cache(min_bytes=1 << 20, device=DEVICE)
        gpu_sweep.run_large_logits(min_elements=1 << 16, device=DEVICE, width=1024)
    assert state.accesses > 0


@needs_interpreter
def test_garbage_values_stay_in_bounds():
    """Negative and huge lengths, page ids and request ids: nothing outside the tensors."""
    case = Case("fp8", lens=(60, 100, 33), next_n=1, block_kv=32, seed=32)
    ctx = torch.tensor([-7, 2**30, 33], dtype=torch.int32)
    table = torch.tensor([[2**31 - 1, -2**31, 10_000_000, 0]] * 3, dtype=torch.int32)
    indices = torch.tensor([-1, 2**31 - 1, 2], dtype=torch.int32)
    with checked_bounds(speculate=True) as state:
        out = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, ctx, table, case.meta,
                                                case.max_context_len, True, torch.float32, indices)
    assert state.accesses > 0
    assert out[0].isneginf().all()  # a negative length: the whole row is outside its window
    with pytest.raises(tilefuse.DeviceValueError) as err:
        tilefuse.check_errors()
    for text in ("lengths must be >= 0", "smaller than the context", "longer than its block_table",
                 "is outside the cache", "request id"):
        assert text in str(err.value)


@needs_interpreter
@pytest.mark.parametrize("block_n", [128, 64])
def test_tma_key_loads_stay_in_bounds(block_n, poisoned):
    """``PagedConfig(tma=True)`` on 64-token pages (two boxes per 128-key tile, or one), with
    the pipeliner's iterations past the loop's end: garbage lengths and page ids (negative,
    huge, one past the cache) read nothing outside the tensors, and the errors are recorded."""
    case = Case("fp8", lens=(60, 300, 129), next_n=1, h=16, d=64, block_kv=64, seed=35)
    ctx = torch.tensor([-7, 2**30, 129], dtype=torch.int32)
    table = case.table.clone()
    table[1, :3] = torch.tensor([2**31 - 1, -2**31, case.cache.shape[0]], dtype=torch.int32)
    cfg = paged.PagedConfig(block_n=block_n, chunk=128, tma=True)
    assert paged._tma_view(case.cache, 64, block_n) is not None
    with checked_bounds(speculate=True) as state:
        out = tilefuse.fp8_fp4_paged_mqa_logits(case.qq, case.cache, case.w, ctx, table, case.meta,
                                                case.max_context_len, True, torch.float32, config=cfg)
    assert state.accesses > 0 and state.speculated > 0
    assert out[0].isneginf().all() and out[1, :192].isnan().all()
    with pytest.raises(tilefuse.DeviceValueError) as err:
        tilefuse.check_errors()
    for text in ("lengths must be >= 0", "smaller than the context", "is outside the cache"):
        assert text in str(err.value)


# ---------------------------------------------------------------------------------------
# The schedule kernel
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx_2d", [False, True])
def test_metadata_kernel_matches_the_torch_split(ctx_2d):
    g = torch.Generator().manual_seed(33)
    for batch, num_sms, block_kv in ((1, 1, 64), (37, 132, 32), (600, 40, 64), (300, 300, 128)):
        lens = torch.randint(0, 5000, (batch,), generator=g).to(torch.int32)
        lens[::7] = 0
        ctx = torch.stack([lens // 3, lens], 1) if ctx_2d else lens
        ctx = ctx.to(DEVICE)
        with checked_bounds() if not ON_GPU else _nothing():
            got = tilefuse.get_paged_mqa_logits_metadata(ctx, block_kv, num_sms)
        assert torch.equal(got, paged._schedule(ctx, block_kv, num_sms)), (batch, num_sms, block_kv)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------
# One compile per model configuration
# ---------------------------------------------------------------------------------------
def _traced_variant(batch, max_len, width_extra, q_pad, out_pad, page_pad=0, lens=None):
    """The registry's view of one decode launch at these shapes (no kernel runs)."""
    fmt, h, d, next_n, block_kv = "fp8", 64, 128, 2, 64
    lens = torch.full((batch,), max_len, dtype=torch.int32) if lens is None else lens
    pages = -(-max_len // block_kv) + width_extra
    width = paged.paged_kv_cache_width(d, fmt)
    cache = paged.new_paged_kv_cache(batch * pages + 1, block_kv, d, fmt, page_stride=block_kv * width + page_pad)
    # Slices of larger buffers at odd offsets, as an engine's preallocated ones: a row stride
    # wider than the width, a first row past the start.
    table = torch.zeros(batch + 1, pages + 3, dtype=torch.int32)[1:, :pages]
    big_q = torch.zeros(batch + q_pad, next_n, h, d, dtype=torch.float8_e4m3fn)
    q = big_q[q_pad:]
    w = torch.zeros(batch * next_n + 1, h)[1:]
    lens = torch.cat([lens.new_zeros(1), lens])[1:]
    out = torch.empty(batch * next_n, max_len + out_pad + 1)[:, 1:max_len + 1]
    meta = paged._schedule(lens, block_kv, 132)
    path = f"{kern.__name__}:paged_logits_kernel"
    with V.tracing(path) as launches:
        paged.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, meta, max_len, False, torch.float32,
                                       out=out)
    (launch,) = launches
    return V.variant_of(launch, "indexer.paged", "probe")


def test_specialisation_key_does_not_move_with_shapes():
    """Batch 1..1000, max_context_len 1..163840, table widths and strides, padded output rows:
    one compile key (the per-call chunk is a runtime value too)."""
    keys = set()
    for batch, max_len, width_extra, q_pad, out_pad in ((1, 1, 0, 0, 0), (3, 301, 0, 0, 16), (64, 8192, 5, 1, 0),
                                                        (1000, 4096, 1, 3, 7), (2, 163840, 0, 0, 1),
                                                        (17, 65, 2, 0, 3)):
        v = _traced_variant(batch, max_len, width_extra, q_pad, out_pad)
        keys.add(v.compile_key())
    assert len(keys) == 1, keys
    # The page stride selects one of three compiles, never by its value: a multiple of the value
    # bytes per token (128 here: the TMA key loads, as unpadded), else of 16 bytes (the aligned
    # gather), else the unaligned gather.
    tma = {_traced_variant(3, 301, 0, 0, 0, page_pad=p).compile_key() for p in (128, 384)}
    padded = {_traced_variant(3, 301, 0, 0, 0, page_pad=p).compile_key() for p in (16, 48, 160)}
    unaligned = {_traced_variant(3, 301, 0, 0, 0, page_pad=p).compile_key() for p in (4, 20, 36)}
    assert tma == keys and len(padded) == 1 and len(unaligned) == 1
    assert len(keys | padded | unaligned) == 3


def test_registry_compiles_ints_as_unspecialised():
    # Any TMA variant of the FP8 default: the tile shape and stages are tunables, not what is tested.
    v = next(v for v in V.variants("indexer.paged") if v.name.startswith("fp8 D128 H64 next_n1 kv64")
             and v.name.endswith(" tma"))
    for arg in kern.DYNAMIC_ARGS:
        assert arg in v.signature and arg not in v.aligned, arg


def _compiled_count(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in getattr(kernel, "cache", {}).values())


@pytest.mark.gpu
def test_no_compile_after_warmup_over_random_shapes():
    for call in paged.warmup_calls("fp8", 64, 128, 64, 2, torch.float32, torch.float32, False, DEVICE):
        call()
    before = _compiled_count(kern.paged_logits_kernel), _compiled_count(kern.paged_schedule_kernel)
    g = random.Random(34)
    for _ in range(12):
        batch = g.choice((1, 2, 3, 8, 31, 64, 200, 513))
        max_len = g.randint(1, 40000)
        lens = tuple(g.randint(0, max_len) for _ in range(batch))
        case = Case("fp8", lens=lens, next_n=2, h=64, d=128, block_kv=64, seed=g.randint(0, 99),
                    extra_cols=g.randint(0, 3000))
        case.run()
    torch.cuda.synchronize()
    after = _compiled_count(kern.paged_logits_kernel), _compiled_count(kern.paged_schedule_kernel)
    assert after == before, f"compiled after warm-up: {before} -> {after}"


def test_warmup_calls_run_every_variant(record_launches):
    launched = record_launches(kern, "paged_logits_kernel")
    calls = paged.warmup_calls("mxfp4", 8, 64, 32, 1, torch.bfloat16, torch.bfloat16, True, DEVICE)
    assert len(calls) == 3
    for call in calls:
        assert call() is None
    assert len(launched) == 3
    assert len(paged.warmup_calls("fp8", 64, 128, 64, 2, torch.float32, torch.float32, False, DEVICE)) == 2
    with pytest.raises(ValueError, match="head_dim"):
        paged.warmup_calls("mxfp4", 8, 32, 32, 1, torch.float32, torch.float32, False, DEVICE)
