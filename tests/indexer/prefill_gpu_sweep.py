"""Correctness sweep of the prefill contract, every case against the reference.

The cross product at small sizes: format x H {4, 8, 16, 32, 64, 128} x D {32, 64, 128} x
weights / logits dtype x clean x compressed x query rows {16, 100, 300} (one call of each size
class the heuristics pick from: at most 32 rows, few-row calls, the 2-D tile) x windows (causal,
or random with empty rows and windows past S_k), each with the default config, a poisoned
``out=`` and a bitwise rerun; plus the large-offset cases: keys over 4 GiB read at their top
rows (everything below them NaN), and logits over 2^31 elements written at their last rows.

On a GPU (the whole product, or a seeded sample that fits the time budget)::

    python -m tests.indexer.prefill_gpu_sweep --budget-s 540   # sample to fit 9 minutes
    python -m tests.indexer.prefill_gpu_sweep --all --shard 3/16 --large

On CPU the interpreter runs a handful of cases (``tests/indexer/test_prefill.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys

import torch

from .gpu_sweep import DTYPES, FORMATS, HEAD_DIMS, HEADS, add_sweep_arguments, sweep

QUERY_ROWS = (16, 100, 300)
WINDOWS = ("causal", "random")


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    fmt: str
    heads: int
    head_dim: int
    weights_dtype: torch.dtype
    logits_dtype: torch.dtype
    clean: bool
    compressed: bool
    rows: int
    windows: str

    def name(self) -> str:
        w, o = (str(t).removeprefix("torch.") for t in (self.weights_dtype, self.logits_dtype))
        return (f"{self.fmt} H{self.heads} D{self.head_dim} w={w} out={o} rows{self.rows} {self.windows}"
                f"{' clean' if self.clean else ''}{' compressed' if self.compressed else ''}")


def contract_cases() -> list[PrefillCase]:
    """Every supported combination (MXFP4: D 64 and 128)."""
    out = []
    for fmt, h, d, (wd, ld), clean, compressed, rows, win in itertools.product(
            FORMATS, HEADS, HEAD_DIMS, DTYPES, (False, True), (False, True), QUERY_ROWS, WINDOWS):
        if fmt == "mxfp4" and d == 32:
            continue
        out.append(PrefillCase(fmt, h, d, wd, ld, clean, compressed, rows, win))
    return out


def _windows(case: PrefillCase, s_k: int, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    from tilefuse.indexer import windows as W

    if case.windows == "causal":
        return W.causal_tail(case.rows, s_k, device=device)
    return W.random_windows(case.rows, s_k, generator=g, empty_fraction=0.2, overhang=s_k // 4, device=device)


def run_case(case: PrefillCase, seed: int, s_k: int | None = None) -> None:
    """Build the inputs, run the op twice into poisoned buffers (same bits) and check it against
    the reference."""
    import tilefuse

    from .test_prefill import check_logits, make_inputs

    g = random.Random(seed)
    s_k = s_k or g.randint(600, 1100)  # several key tiles, the last one partial
    q, k, w, qq, kk = make_inputs(case.rows, s_k, case.heads, case.head_dim, case.fmt, seed,
                                  weights_dtype=case.weights_dtype)
    ks, ke = _windows(case, s_k, torch.Generator().manual_seed(seed), q.device)
    max_seqlen_k = max(1, int((ke.clamp(max=s_k) - ks).clamp(min=0).max())) if case.compressed else 0
    cols = max_seqlen_k or s_k
    row = -(-cols // 8) * 8  # (a row stride of 16-byte multiples: a TMA store's rule)
    outs = []
    for _ in range(2):
        out = torch.full((case.rows, row), float("nan"), dtype=case.logits_dtype, device=q.device)[:, :cols]
        outs.append(tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, case.clean, max_seqlen_k, case.logits_dtype,
                                                out=out))
    # (NaN where a row's window leaves the unclean output unwritten, in both runs)
    assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num()), "a rerun gave other bits"
    check_logits(outs[0], qq, kk, q, k, w, ks, ke, case.fmt, clean=case.clean, max_seqlen_k=max_seqlen_k,
                 logits_dtype=case.logits_dtype)


def run_large_keys(min_bytes: int = 4 * 2**30 + 2**20, device: str = "cuda", rows: int = 8, span: int = 3000) -> None:
    """FP8 keys over ``min_bytes`` (4 GiB): every row's window lies in the top ``span`` keys
    (byte offsets past 2^32), every key below them is NaN (values and scales), full and
    compressed layouts."""
    import tilefuse
    from tilefuse import formats as F
    from tilefuse import reference as R

    d, h = 128, 16
    s_k = -(-min_bytes // d)
    base = s_k - span
    g = torch.Generator(device=device).manual_seed(2)
    k = torch.full((s_k, d), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)  # NaN
    k_sf = torch.full((s_k,), float("nan"), dtype=torch.float32, device=device)
    top = F.quantize_k(torch.randn(span, d, generator=g, device=device).to(torch.bfloat16), "fp8")
    k[base:].copy_(top[0])
    k_sf[base:].copy_(top[1])
    qq = F.quantize_q(torch.randn(rows, h, d, generator=g, device=device).to(torch.bfloat16), "fp8")
    w = torch.randn(rows, h, generator=g, device=device)
    a = torch.randint(0, span + 1, (rows,), generator=g, device=device)
    b = torch.randint(0, span + 1, (rows,), generator=g, device=device)
    ks, ke = (base + torch.minimum(a, b)).int(), (base + torch.maximum(a, b)).int()
    ks_top, ke_top = ks - base, ke - base
    assert k.numel() * k.element_size() >= min_bytes
    full = tilefuse.fp8_fp4_mqa_logits(qq, (k, k_sf), w, ks, ke, True)
    ref = R.fp8_fp4_mqa_logits_ref(qq, top, w, ks_top, ke_top, True, 0, torch.float32)
    assert torch.isneginf(full[:, :base]).all(), "large keys: -inf below the windows"
    assert torch.equal(torch.isneginf(full[:, base:]), torch.isneginf(ref)), "large keys: -inf mask"
    assert R.calc_diff(full[:, base:], ref) < 5e-6, "large keys: values"
    cols = max(1, int((ke - ks).max()))
    packed = tilefuse.fp8_fp4_mqa_logits(qq, (k, k_sf), w, ks, ke, True, cols)
    ref = R.fp8_fp4_mqa_logits_ref(qq, top, w, ks_top, ke_top, True, cols, torch.float32)
    assert torch.equal(torch.isneginf(packed), torch.isneginf(ref)), "large keys, compressed: -inf mask"
    assert R.calc_diff(packed, ref) < 5e-6, "large keys, compressed: values"


def run_large_logits(min_elements: int = 2**31 + 2**20, device: str = "cuda", s_k: int = 131_072 + 64,
                     logits_dtype: torch.dtype = torch.bfloat16, live: int = 4) -> None:
    """Logits over ``min_elements`` (2^31) elements: the last ``live`` rows (past that offset)
    have windows, every other row is empty (all ``-inf``)."""
    import tilefuse
    from tilefuse import formats as F
    from tilefuse import reference as R

    d, h = 128, 8
    s_q = -(-min_elements // s_k) + live
    g = torch.Generator(device=device).manual_seed(3)
    kk = F.quantize_k(torch.randn(s_k, d, generator=g, device=device).to(torch.bfloat16), "fp8")
    qq = F.quantize_q(torch.randn(s_q, h, d, generator=g, device=device).to(torch.bfloat16), "fp8")
    w = torch.randn(s_q, h, generator=g, device=device)
    ks = torch.zeros(s_q, dtype=torch.int32, device=device)
    ke = torch.zeros(s_q, dtype=torch.int32, device=device)
    ks[-live:] = torch.randint(0, s_k // 2, (live,), generator=g, device=device).int()
    ke[-live:] = s_k - torch.randint(0, s_k // 4, (live,), generator=g, device=device).int()
    out = tilefuse.fp8_fp4_mqa_logits(qq, kk, w, ks, ke, True, 0, logits_dtype)
    assert (s_q - live) * out.stride(0) >= min_elements  # the first live row's offset
    last = out[-live:].float()
    ref = R.fp8_fp4_mqa_logits_ref((qq[0][-live:], None), kk, w[-live:], ks[-live:], ke[-live:], True, 0,
                                   torch.float32)
    assert torch.equal(torch.isneginf(last), torch.isneginf(ref)), "large logits: -inf mask"
    assert R.calc_diff(last, ref) < 3e-5, "large logits: values"
    assert torch.isneginf(out[:-live]).all(), "large logits: empty rows not cleaned"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(ap, budget_s=540.0)
    ap.add_argument("--large", action="store_true", help="also the >4 GiB keys and >2^31-element logits")
    args = ap.parse_args(argv)
    return sweep(args, contract_cases(), lambda i, case: run_case(case, seed=args.seed * 100_003 + i),
                 (run_large_keys, run_large_logits) if args.large else (), "prefill_gpu_sweep",
                 "tests/indexer/test_prefill.py")


if __name__ == "__main__":
    sys.exit(main())
