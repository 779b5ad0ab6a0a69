"""Correctness sweep of the fused top-k contract, every case bit for bit against the unfused pair.

Prefill (``fp8_fp4_mqa_topk``): format x H {4, 32, 64} x D {32, 64, 128} x weights / logits
dtype x topk {1, 7, 64, 512, 2048} x windows (causal, random with empty rows and ends past S_k,
the whole row). Decode (``fp8_fp4_paged_mqa_topk``): format x block_kv {32, 64} x next_n {1, 2,
4} x H {8, 64} x D {64, 128} x dtypes x 1-D / 2-D lengths x topk. Each case gets random sizes
(S_q, S_k, lengths) that are and are not multiples of the chunk, every other case a small
``chunk_k`` (many chunks a row) and the others the default; the indices and values must equal
the unfused logits op's ranked by ``tilefuse.reference.topk_of_logits``, into a poisoned ``out``.

On a GPU (a seeded sample that fits the time budget, a new seed each round)::

    python -m tests.indexer.topk_gpu_sweep --budget-s 300 --seed 3
    python -m tests.indexer.topk_gpu_sweep --all

On CPU the interpreter runs a few sampled cases at tiny sizes (``tests/indexer/test_topk.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys

import torch

FORMATS = ("fp8", "mxfp8", "mxfp4")
TOPK = (1, 7, 64, 512, 2048)
DTYPES = ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16))
PREFILL_WINDOWS = ("causal", "random", "full")


@dataclasses.dataclass(frozen=True)
class TopkCase:
    api: str  # "prefill" or "decode"
    fmt: str
    heads: int
    head_dim: int
    weights_dtype: torch.dtype
    logits_dtype: torch.dtype
    topk: int
    windows: str = "causal"  # prefill only
    block_kv: int = 64  # decode only
    next_n: int = 1  # decode only
    ctx_2d: bool = False  # decode only

    def name(self) -> str:
        w, o = (str(t).removeprefix("torch.") for t in (self.weights_dtype, self.logits_dtype))
        shape = (f"{self.windows}" if self.api == "prefill" else
                 f"kv{self.block_kv} next_n{self.next_n}{' ctx2d' if self.ctx_2d else ''}")
        return f"{self.api} {self.fmt} H{self.heads} D{self.head_dim} w={w} out={o} topk{self.topk} {shape}"


def contract_cases() -> list[TopkCase]:
    """Every combination above (MXFP4: D 64 and 128)."""
    out = []
    for fmt, h, d, (wd, ld), k, win in itertools.product(FORMATS, (4, 32, 64), (32, 64, 128), DTYPES, TOPK,
                                                         PREFILL_WINDOWS):
        if not (fmt == "mxfp4" and d == 32):
            out.append(TopkCase("prefill", fmt, h, d, wd, ld, k, windows=win))
    for fmt, bkv, nn, h, d, (wd, ld), ctx_2d, k in itertools.product(FORMATS, (32, 64), (1, 2, 4), (8, 64), (64, 128),
                                                                     DTYPES, (False, True), TOPK):
        out.append(TopkCase("decode", fmt, h, d, wd, ld, k, block_kv=bkv, next_n=nn, ctx_2d=ctx_2d))
    return out


def run_case(case: TopkCase, seed: int, small_chunk: bool, max_keys: int) -> None:
    """Build the inputs (keys up to about ``max_keys`` a row), run the fused op and check it
    against the unfused pair; raises AssertionError on a difference."""
    from tilefuse.indexer import windows as W

    from . import test_topk as T

    g = random.Random(seed)
    device = T.DEVICE
    if case.api == "prefill":
        s_q = g.choice((1, 3, g.randint(2, 40), g.randint(100, 300)))
        s_k = g.randint(1, max_keys)
        if case.windows == "causal":
            s_k = max(s_k, s_q)
        qq, kk, w = T.prefill_inputs(s_q, s_k, case.heads, case.head_dim, case.fmt, seed,
                                     weights_dtype=case.weights_dtype)
        if case.windows == "causal":  # (S_k >= S_q: its rows end at i + S_k - S_q)
            ks, ke = W.causal_tail(s_q, s_k, device)
        elif case.windows == "full":
            ks, ke = W.full(s_q, s_k, device)
        else:
            ks, ke = W.random_windows(s_q, s_k, torch.Generator().manual_seed(seed), device, empty_fraction=0.15,
                                      overhang=g.randint(0, 300))
        T.check_prefill(qq, kk, w, ks, ke, case.topk, chunk_k=256 if small_chunk else None,
                        logits_dtype=case.logits_dtype)
    else:
        batch = g.choice((1, 2, g.randint(3, 9)))
        lens = tuple(g.choice((0, g.randint(1, case.block_kv), g.randint(1, max_keys))) for _ in range(batch))
        lens = (max(lens[0], case.next_n),) + lens[1:]  # at least one request with keys for every row
        c = T.PagedCase(case.fmt, lens=lens, next_n=case.next_n, h=case.heads, d=case.head_dim,
                        block_kv=case.block_kv, ctx_2d=case.ctx_2d, seed=seed, extra_cols=g.randint(0, 200))
        c.w = c.w.to(case.weights_dtype)
        c.check(case.topk, chunk_k=2 * case.block_kv if small_chunk else None, logits_dtype=case.logits_dtype)


def main(argv=None) -> int:
    from .gpu_sweep import add_sweep_arguments, sweep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(ap, budget_s=300.0)
    ap.add_argument("--max-keys", type=int, default=20000, help="keys a row at most (default 20000)")
    args = ap.parse_args(argv)
    return sweep(args, contract_cases(), lambda i, case: run_case(
        case, seed=args.seed * 100_003 + i, small_chunk=i % 2 == 0, max_keys=args.max_keys),
        name="topk_gpu_sweep", cpu_run="tests/indexer/test_topk.py", what="top-k contract")


if __name__ == "__main__":
    sys.exit(main())
