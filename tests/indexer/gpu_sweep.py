"""Correctness sweep of the paged decode contract, every case against the reference.

The cross product of the decode contract at small sizes: format x block_kv {32, 64, 128} x
next_n 1..8 x H {4, 8, 16, 32, 64, 128} x D {32, 64, 128} x weights / logits dtype x 1-D / 2-D
lengths x clean x indices (varlen, next_n = 1), each with random lengths that cross chunk and
page boundaries, a shuffled block table whose unused entries point at a NaN page, and poisoned
outputs; plus the large-offset cases: a cache over 4 GiB read at its top pages, and logits
over 2^31 elements written at their last rows (int64 offsets).

On a GPU (the whole product, or a seeded sample that fits the time budget)::

    python -m tests.indexer.gpu_sweep --budget-s 540            # sample to fit 9 minutes
    python -m tests.indexer.gpu_sweep --all                     # every case
    python -m tests.indexer.gpu_sweep --all --shard 3/8         # an eighth of them (8 processes)
    python -m tests.indexer.gpu_sweep --sample 300 --seed 7 --large

On CPU the interpreter runs a handful of cases (``tests/indexer/test_paged_bounds.py``) with
the bounds checker around them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys
import time

import torch

FORMATS = ("fp8", "mxfp8", "mxfp4")
BLOCK_KV = (32, 64, 128)
NEXT_N = tuple(range(1, 9))
HEADS = (4, 8, 16, 32, 64, 128)
HEAD_DIMS = (32, 64, 128)
DTYPES = ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16))


@dataclasses.dataclass(frozen=True)
class SweepCase:
    fmt: str
    block_kv: int
    next_n: int
    heads: int
    head_dim: int
    weights_dtype: torch.dtype
    logits_dtype: torch.dtype
    ctx_2d: bool
    clean: bool
    indices: bool

    def name(self) -> str:
        w, o = (str(t).removeprefix("torch.") for t in (self.weights_dtype, self.logits_dtype))
        return (f"{self.fmt} kv{self.block_kv} next_n{self.next_n} H{self.heads} D{self.head_dim} w={w} out={o}"
                f"{' ctx2d' if self.ctx_2d else ''}{' clean' if self.clean else ''}"
                f"{' indices' if self.indices else ''}")


def contract_cases() -> list[SweepCase]:
    """Every supported combination (MXFP4: D 64 and 128; indices: next_n 1)."""
    out = []
    for fmt, bkv, nn, h, d, (wd, ld), ctx_2d, clean, idx in itertools.product(
            FORMATS, BLOCK_KV, NEXT_N, HEADS, HEAD_DIMS, DTYPES, (False, True), (False, True), (False, True)):
        if fmt == "mxfp4" and d == 32 or idx and nn != 1:
            continue
        out.append(SweepCase(fmt, bkv, nn, h, d, wd, ld, ctx_2d, clean, idx))
    return out


def add_sweep_arguments(ap: argparse.ArgumentParser, budget_s: float) -> None:
    """The options every contract sweep takes: --all, --sample, --budget-s, --seed, --shard."""
    ap.add_argument("--all", action="store_true", help="every case of the contract")
    ap.add_argument("--shard", default="0/1", help="I/N: every N-th case from the I-th of those picked (processes "
                    "side by side, or rounds that cover --all between them)")
    ap.add_argument("--sample", type=int, default=None, help="cases to sample (default: fit --budget-s)")
    ap.add_argument("--budget-s", type=float, default=budget_s, help="stop sampling after this many seconds")
    ap.add_argument("--seed", type=int, default=0, help="sample seed (a new one each round)")
    ap.add_argument("--first", type=int, default=0, help="start at the shard's K-th case (the rest of a run "
                    "that its budget cut: the same cases and case seeds)")


def pick_cases(cases: list, args) -> tuple[list, float | None]:
    """The cases to run and the time budget: all of them in order (--all, stopping at --budget-s
    like the others, so that a cut round still reports what it ran), a seeded sample
    (--sample N), or all of them shuffled by the seed until --budget-s has passed; then the
    shard's share of those (``--shard I/N``: cases I, I + N, ...)."""
    index, count = (int(v) for v in args.shard.split("/"))
    if not 0 <= index < count:
        raise SystemExit(f"--shard: expected I/N with 0 <= I < N, got {args.shard}")
    if args.all:
        return cases[index::count], args.budget_s
    if args.sample is not None:
        picked = cases if args.sample >= len(cases) else random.Random(args.seed).sample(cases, args.sample)
        return picked[index::count], None
    cases = list(cases)
    random.Random(args.seed).shuffle(cases)
    return cases[index::count], args.budget_s


# seconds between the progress lines of a sweep
PROGRESS_S = 60.0


def run_cases(cases: list, run_one, budget_s: float | None, first: int = 0) -> tuple[int, list[str]]:
    """``run_one(i, case)`` for each case from the ``first``-th until the budget has passed, then
    ``tilefuse.check_errors()``; every failure is printed and named in the result, and a CUDA
    error ends the sweep (the context is gone). Returns (cases run, names of those that failed)."""
    import tilefuse

    t0 = last_note = time.perf_counter()
    failed, done = [], 0
    for i, case in enumerate(cases):
        if i < first:
            continue
        now = time.perf_counter()
        if budget_s is not None and now - t0 > budget_s:
            break
        if now - last_note > PROGRESS_S:  # a run killed from outside still says how far it got
            print(f"... {done} cases run, {len(failed)} failed, {now - t0:.0f} s (the rest: --first {i})", flush=True)
            last_note = now
        try:
            run_one(i, case)
            tilefuse.check_errors()
        except Exception as e:  # report every failure, then exit nonzero
            failed.append(case.name())
            print(f"FAIL  {case.name()}: {type(e).__name__}: {str(e)[:500]}", flush=True)
            if "illegal memory access" in str(e) or "CUDA error" in str(e):
                break
        done += 1
    return done, failed


def sweep(args, cases: list, run_one, large=(), name: str = "gpu_sweep",
          cpu_run: str = "tests/indexer/test_paged_bounds.py", what: str = "contract") -> int:
    """A sweep's main: the picked ``cases`` (:func:`pick_cases`) after the ``large`` cases
    (:func:`run_large`), each ``run_one(i, case)`` (:func:`run_cases`); prints what ran and
    returns the exit status (2 without a GPU, 1 when a case failed)."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU (the CPU run is in {cpu_run})", file=sys.stderr)
        return 2
    cases, budget_s = pick_cases(cases, args)
    t0 = time.perf_counter()
    failed = run_large(large) if large else []
    done, failed_cases = run_cases(cases, run_one, budget_s, args.first)
    failed += failed_cases
    since = f" (from case {args.first})" if args.first else ""
    print(f"{done} of {max(len(cases) - args.first, 0)} {what} cases{since} run in {time.perf_counter() - t0:.0f} s, "
          f"{len(failed)} failed")
    return 1 if failed else 0


def run_large(fns) -> list[str]:
    """Each large-offset case ``fn()`` (one at a time, memory freed after each): the names of
    those that failed, every failure printed."""
    failed = []
    for fn in fns:
        try:
            fn()
            torch.cuda.synchronize()
            print(f"ok    {fn.__name__}", flush=True)
        except Exception as e:  # report every failure, then exit nonzero
            failed.append(fn.__name__)
            print(f"FAIL  {fn.__name__}: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()
    return failed


def run_case(case: SweepCase, seed: int, lens=None, chunk: int | None = None) -> None:
    """Build the inputs, run the op (poisoned output) and check it against the reference."""
    from tilefuse.indexer import paged

    from .test_paged import Case

    g = random.Random(seed)
    if lens is None:
        # Three requests: one empty or short, two crossing pages and (with a small chunk) chunks.
        lens = (g.randint(0, case.block_kv), g.randint(case.block_kv, 3 * case.block_kv) + 1,
                g.randint(2 * case.block_kv, 5 * case.block_kv))
    c = Case(case.fmt, lens=lens, next_n=case.next_n, h=case.heads, d=case.head_dim, block_kv=case.block_kv,
             ctx_2d=case.ctx_2d, seed=seed, weights_dtype=case.weights_dtype)
    cfg = None
    if chunk is not None:
        base = paged.resolve_paged_config(case.fmt, case.next_n, case.heads, case.head_dim, case.block_kv)
        cfg = dataclasses.replace(base, chunk=chunk)
    b = c.ctx.shape[0]
    out = torch.full((b * case.next_n, c.max_context_len), float("nan"), dtype=case.logits_dtype,
                     device=c.ctx.device)
    kw = {}
    if case.indices:
        kw["indices"] = torch.arange(b, dtype=torch.int32, device=c.ctx.device)
    got = c.run(clean=case.clean, logits_dtype=case.logits_dtype, out=out, config=cfg, **kw)
    c.check(got, case.clean, case.logits_dtype, own_out=False)


def run_large_cache(min_bytes: int = 4 * 2**30 + 2**20, device: str = "cuda", fmt: str = "fp8",
                    block_kv: int = 64, head_dim: int = 128) -> None:
    """A cache over ``min_bytes`` (4 GiB): the request's pages are the last ones, in reverse
    (byte offsets past 2^32)."""
    from tilefuse import formats as F
    from tilefuse import reference as R
    from tilefuse.indexer import paged

    width = paged.paged_kv_cache_width(head_dim, fmt)
    num_blocks = -(-min_bytes // (block_kv * width))
    cache = paged.new_paged_kv_cache(num_blocks, block_kv, head_dim, fmt, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    length = 5 * block_kv + 7
    pages = -(-length // block_kv)
    table = torch.arange(num_blocks - pages, num_blocks, dtype=torch.int32, device=device).flip(0)[None]
    keys = torch.randn(length, head_dim, generator=g, device=device).to(torch.bfloat16)
    tok = torch.arange(length, device=device)
    paged.write_paged_kv_cache(cache, keys, table[0, tok // block_kv].long() * block_kv + tok % block_kv, fmt)
    q = torch.randn(1, 2, 16, head_dim, generator=g, device=device).to(torch.bfloat16)
    qq = F.quantize_q(q, fmt)
    w = torch.randn(2, 16, generator=g, device=device)
    ctx = torch.tensor([length], dtype=torch.int32, device=device)
    meta = paged.get_paged_mqa_logits_metadata(ctx, block_kv, 132)
    out = paged.fp8_fp4_paged_mqa_logits(qq, cache, w, ctx, table, meta, length, True)
    ref = R.fp8_fp4_paged_mqa_logits_ref(qq, cache, w, ctx, table, length)
    assert cache.shape[0] * cache.stride(0) >= min_bytes
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "large cache: -inf mask"
    diff = R.calc_diff(out, ref)
    assert diff < 5e-6, f"large cache: diff {diff}"


def run_large_logits(min_elements: int = 2**31 + 2**20, device: str = "cuda", width: int = 131_072 + 64,
                     logits_dtype: torch.dtype = torch.bfloat16) -> None:
    """Logits over ``min_elements`` (2^31) elements: the last request's rows start past it,
    every other request is empty (its rows all ``-inf``)."""
    from tilefuse import formats as F
    from tilefuse import reference as R
    from tilefuse.indexer import paged

    block_kv, d, h, next_n = 64, 128, 16, 8
    batch = -(-min_elements // (next_n * width)) + 1
    length = 3 * block_kv + 5
    g = torch.Generator(device=device).manual_seed(1)
    keys = torch.randn(1, length, d, generator=g, device=device).to(torch.bfloat16)
    ctx_one = torch.tensor([length], dtype=torch.int32, device=device)
    cache, table_one = paged.make_paged_kv_cache(keys, ctx_one, block_kv, "fp8")
    ctx = torch.zeros(batch, dtype=torch.int32, device=device)
    ctx[-1] = length
    table = table_one.expand(batch, -1).contiguous()
    q = torch.randn(batch, next_n, h, d, generator=g, device=device).to(torch.bfloat16)
    qq = F.quantize_q(q, "fp8")
    w = torch.randn(batch * next_n, h, generator=g, device=device)
    meta = paged.get_paged_mqa_logits_metadata(ctx, block_kv, 132)
    out = paged.fp8_fp4_paged_mqa_logits(qq, cache, w, ctx, table, meta, width, True, logits_dtype)
    assert (batch - 1) * next_n * out.stride(0) >= min_elements  # the last request's first row
    last = out[-next_n:].float()
    ref = R.fp8_fp4_paged_mqa_logits_ref((qq[0][-1:], None), cache, w[-next_n:], ctx[-1:], table[-1:], width)
    assert torch.equal(torch.isneginf(last), torch.isneginf(ref)), "large logits: -inf mask"
    assert R.calc_diff(last, ref) < 3e-5, "large logits: values"
    assert torch.isneginf(out[:-next_n]).all(), "large logits: empty rows not cleaned"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(ap, budget_s=540.0)
    ap.add_argument("--large", action="store_true", help="also the >4 GiB cache and >2^31-element logits")
    args = ap.parse_args(argv)
    # Every other case with a small chunk, so that requests cross chunk ends.
    return sweep(args, contract_cases(), lambda i, case: run_case(
        case, seed=args.seed * 100_003 + i, chunk=None if i % 2 else 2 * max(64, case.block_kv)),
        (run_large_cache, run_large_logits) if args.large else ())


if __name__ == "__main__":
    sys.exit(main())
