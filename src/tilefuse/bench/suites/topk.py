"""``tilefuse bench topk``: the indexer's selection step, logits + top-k per row, fused or not.

Rows (GPU): prefill H=64, D=128, causal-tail windows, (S_q, S_k) in (2048, 32768),
(4096, 65536), (8192, 65536), (2048, 131072), (8192, 131072); decode B in {1, 64, 256} x
next_n in {1, 2} x mean context in {8K, 32K, 128K} (uniform 0.7-1.3 of the mean, pages of 64
tokens, 1-D lengths so that the peers' logits can be cleaned); FP8, fp32 weights and logits,
top-k 2048. Each row times, in one rotation:

* ``tilefuse`` — :func:`tilefuse.fp8_fp4_mqa_topk` / :func:`tilefuse.fp8_fp4_paged_mqa_topk`
  (the subject; ``peer_ratio`` is its speedup over each pair);
* ``tilefuse+torch.topk`` — the tilefuse logits op (clean) then ``torch.topk``;
* ``tilefuse+torch.topk unsorted`` — the same with ``sorted=False`` (the fastest top-k that
  runs here: no sort of the ``topk`` results, so a weaker result than the contract's, and the
  pair to beat);
* ``tilefuse logits`` — the tilefuse logits op alone (unclean, as the fused op's chunks run
  it): the fused op less this row is what the chunked merge costs;
* ``deep_gemm+torch.topk`` — DeepGEMM's logits (clean) then ``torch.topk``, when
  ``import deep_gemm`` works (FP8 only).

Checks, outside the timed region, on 64 rows spread over the output: the fused indices are
bitwise the unfused tilefuse logits ranked by the contract (:func:`tilefuse.reference.topk_of_logits`);
a pair's selection must hold at least 99.9% of those positions (``torch.topk`` breaks ties
its own way, and DeepGEMM's logits round differently). FLOPs are the logits' (``2 * pairs * H
* D``), against the FP8 matmul ceiling; ``params`` records the bytes each design moves
(:func:`tilefuse.indexer.topk.topk_bytes_moved`). On a CPU machine the rows run at tiny
shapes (top-k 64, small chunks so the merge path runs) through the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilefuse import formats
from tilefuse.bench import ceilings as ceil
from tilefuse.bench.runner import Case, Impl
from tilefuse.bench.suites.indexer import deep_gemm_module, skipped_peer
from tilefuse.reference import paged_row_ends

GPU_PREFILL = [(2048, 32768), (4096, 65536), (8192, 65536), (2048, 131072), (8192, 131072)]
CPU_PREFILL = [(16, 512), (64, 768)]
GPU_DECODE = [(b, n, c) for b in (1, 64, 256) for n in (1, 2) for c in (8192, 32768, 131072)]
CPU_DECODE = [(2, 1, 512), (4, 2, 300)]
GPU_HEADS, CPU_HEADS = 64, 8
HEAD_DIM = 128
BLOCK_KV = 64
SPREAD = (0.7, 1.3)
GPU_TOPK, CPU_TOPK = 2048, 64
CPU_CHUNK = 256  # forces several chunks at the interpreter's shapes
CHECK_ROWS = 64
PAIR_RECALL = 0.999
CPU_WORKERS = 8


@dataclass(frozen=True)
class Spec:
    api: str  # "prefill" or "decode"
    fmt: str
    rows_a: int  # S_q, or B
    rows_b: int  # S_k, or mean context
    next_n: int
    heads: int
    topk: int
    chunk_k: int | None
    chunk_q: int | None = None

    @property
    def shape(self) -> str:
        if self.api == "prefill":
            return f"{self.rows_a}/{self.rows_b}"
        return f"B{self.rows_a} n{self.next_n} ctx{self.rows_b}"

    @property
    def name(self) -> str:
        tiles = "".join(f" {n}{v}" for n, v in (("chunk_k", self.chunk_k), ("chunk_q", self.chunk_q)) if v)
        return f"{self.api} {self.fmt} H{self.heads} D{HEAD_DIM} {self.shape} top{self.topk}{tiles}"

    def params(self) -> dict:
        p = {"api": self.api, "format": self.fmt, "heads": self.heads, "head_dim": HEAD_DIM, "topk": self.topk,
             "chunk_k": self.chunk_k, "chunk_q": self.chunk_q, "logits_dtype": "float32", "weights_dtype": "float32"}
        if self.api == "prefill":
            p.update(s_q=self.rows_a, s_k=self.rows_b, window="causal")
        else:
            p.update(batch=self.rows_a, next_n=self.next_n, mean_context=self.rows_b, context_spread=list(SPREAD),
                     block_kv=BLOCK_KV, context_lens="1-D")
        return p


def parse_shapes(items: list[str] | None) -> tuple[list, list] | None:
    """``["2048x32768", "64x2x8192"]`` -> prefill ``[(2048, 32768)]`` and decode ``[(64, 2, 8192)]``
    (S_QxS_K or BxNEXT_NxCTX)."""
    if not items:
        return None
    prefill, decode = [], []
    for item in items:
        for part in item.split(","):
            fields = part.strip().split("x")
            if len(fields) not in (2, 3) or not all(f.isdigit() and int(f) >= 1 for f in fields):
                raise ValueError(f"--shapes: expected S_QxS_K or BxNEXT_NxCTX, got {part!r}")
            (prefill if len(fields) == 2 else decode).append(tuple(int(f) for f in fields))
    return prefill, decode


def check_rows(n_rows: int) -> torch.Tensor:
    """Up to CHECK_ROWS rows spread over the output, first and last included."""
    if n_rows <= CHECK_ROWS:
        return torch.arange(n_rows)
    return torch.linspace(0, n_rows - 1, CHECK_ROWS).round().long().unique()


def make_checks(logits: torch.Tensor, valid: torch.Tensor, topk: int, rows: torch.Tensor, n_rows: int):
    """``(check_fused, check_pair)`` of an output of ``n_rows`` rows against the unfused tilefuse
    logits ranked by the contract; ``logits`` and ``valid`` hold the checked ``rows`` only."""
    from tilefuse.reference import topk_of_logits

    ref_idx, _ = topk_of_logits(logits, valid, topk)
    n_ref = int((ref_idx >= 0).sum())

    def check_fused(out) -> dict:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n_rows, topk):
            return {"passed": False, "failed": f"output {getattr(out, 'shape', type(out).__name__)}"}
        got = out[rows.to(out.device)]
        mismatched = int((got != ref_idx).any(dim=1).sum())
        res = {"passed": mismatched == 0, "rows_checked": int(rows.numel()), "rows_mismatched": mismatched}
        if mismatched:
            res["failed"] = f"{mismatched} of {rows.numel()} rows differ from the unfused logits' top-k"
        return res

    def check_pair(out) -> dict:
        values, indices = out
        got = indices[rows.to(indices.device)].long()
        kept = ~values[rows.to(values.device)].isneginf()  # -inf: an invalid position torch.topk took
        hits = 0
        for r in range(ref_idx.shape[0]):
            want = ref_idx[r][ref_idx[r] >= 0].long()
            have = got[r][kept[r]]
            hits += int(torch.isin(want, have).sum())
        recall = hits / max(1, n_ref)
        res = {"passed": recall >= PAIR_RECALL, "recall": recall}
        if recall < PAIR_RECALL:
            res["failed"] = f"recall {recall:.4f} of the contract's positions (limit {PAIR_RECALL})"
        return res

    return check_fused, check_pair


def check_shape(out, shape: tuple[int, int]) -> dict:
    """The logits-only row's check: its output's shape (its values are the logits op's tests')."""
    got = tuple(getattr(out, "shape", ()))
    res = {"passed": got == shape}
    if got != shape:
        res["failed"] = f"output {got}, expected {shape}"
    return res


def _pairs_flops(spec: Spec, valid_pairs: int) -> int:
    return 2 * valid_pairs * spec.heads * HEAD_DIM


def prefill_case(spec: Spec, device: str, peer=None, peer_skip: str | None = None) -> Case:
    from tilefuse.indexer import windows
    from tilefuse.indexer.topk import default_chunk_q, default_prefill_chunk_k, topk_bytes_moved

    s_q, s_k = spec.rows_a, spec.rows_b
    ks_cpu, ke_cpu = windows.causal_tail(s_q, s_k)
    chunk = spec.chunk_k or default_prefill_chunk_k(spec.topk)
    chunk_q = spec.chunk_q or default_chunk_q(chunk, torch.float32)

    def build() -> list[Impl]:
        import tilefuse
        from tilefuse.reference import window_mask

        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(s_q, spec.heads, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
        k = torch.randn(s_k, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(s_q, spec.heads, device=device, generator=g)
        qq, kv = formats.quantize_q(q, spec.fmt), formats.quantize_k(k, spec.fmt)
        ks, ke = ks_cpu.to(device), ke_cpu.to(device)
        del q, k
        logits = tilefuse.fp8_fp4_mqa_logits(qq, kv, w, ks, ke)
        rows = check_rows(s_q)
        sub = rows.to(device)
        check_fused, check_pair = make_checks(logits[sub].cpu(), window_mask(ks[sub], ke[sub], s_k).cpu(),
                                              spec.topk, rows, s_q)
        del logits

        impls = [
            Impl("tilefuse", lambda: tilefuse.fp8_fp4_mqa_topk(qq, kv, w, ks, ke, spec.topk, chunk_k=spec.chunk_k,
                                                               chunk_q=spec.chunk_q),
                 lambda out: check_fused(out.cpu())),
            Impl("tilefuse+torch.topk",
                 lambda: torch.topk(tilefuse.fp8_fp4_mqa_logits(qq, kv, w, ks, ke), spec.topk, dim=1),
                 lambda out: check_pair(tuple(t.cpu() for t in out))),
            Impl("tilefuse+torch.topk unsorted",
                 lambda: torch.topk(tilefuse.fp8_fp4_mqa_logits(qq, kv, w, ks, ke), spec.topk, dim=1, sorted=False),
                 lambda out: check_pair(tuple(t.cpu() for t in out))),
            Impl("tilefuse logits", lambda: tilefuse.fp8_fp4_mqa_logits(qq, kv, w, ks, ke, clean_logits=False),
                 lambda out: check_shape(out, (s_q, s_k))),
        ]
        skipped = skipped_peer("deep_gemm+torch.topk", peer, peer_skip, spec.fmt)
        if skipped is not None:
            impls.append(skipped)
        else:
            impls.append(Impl(
                "deep_gemm+torch.topk",
                lambda: torch.topk(peer.fp8_mqa_logits(qq[0], kv, w, ks, ke, clean_logits=True), spec.topk, dim=1),
                lambda out: check_pair(tuple(t.cpu() for t in out))))
        return impls

    params = spec.params()
    params["chunk_k_used"] = chunk
    params["chunk_q_used"] = chunk_q
    params["bytes_moved"] = topk_bytes_moved(s_q, s_k, spec.topk, chunk, chunk_q=chunk_q)
    return Case(name=spec.name, build=build, x=spec.shape, series=f"prefill {spec.fmt} H{spec.heads}",
                params=params, flops=_pairs_flops(spec, windows.valid_pairs(ks_cpu, ke_cpu, s_k)),
                ceiling=ceil.FP8_MATMUL if spec.fmt == "fp8" else ceil.BF16_MATMUL)


def _num_workers(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return CPU_WORKERS


def decode_lengths(spec: Spec, seed: int = 0) -> torch.Tensor:
    """Per-request lengths ``[B]``, uniform in the spread around the mean, at least next_n (CPU)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = SPREAD
    u = torch.rand(spec.rows_a, generator=g)
    return (spec.rows_b * (lo + (hi - lo) * u)).long().clamp(min=spec.next_n).to(torch.int32)


def decode_case(spec: Spec, device: str, peer=None, peer_skip: str | None = None) -> Case:
    from tilefuse.indexer.topk import decode_whole_rows, default_chunk_k, topk_bytes_moved

    lens = decode_lengths(spec)
    max_len = int(lens.max())
    rows_total = spec.rows_a * spec.next_n
    chunk = spec.chunk_k or default_chunk_k(spec.topk, BLOCK_KV)
    whole = spec.chunk_k is None and decode_whole_rows(rows_total, max_len, torch.float32)
    valid_pairs = int(paged_row_ends(lens, spec.next_n).sum())

    def build() -> list[Impl]:
        import tilefuse
        from tilefuse.indexer import paged
        from tilefuse.reference import paged_valid_mask

        g = torch.Generator(device=device).manual_seed(1)
        keys = torch.randn(spec.rows_a, max_len, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
        q = torch.randn(spec.rows_a, spec.next_n, spec.heads, HEAD_DIM, device=device, generator=g)
        w = torch.randn(rows_total, spec.heads, device=device, generator=g)
        ctx = lens.to(device)
        cache, table = paged.make_paged_kv_cache(keys, ctx, BLOCK_KV, spec.fmt,
                                                 generator=torch.Generator().manual_seed(2))
        del keys
        qq = formats.quantize_q(q.to(torch.bfloat16), spec.fmt)
        meta = tilefuse.get_paged_mqa_logits_metadata(ctx, BLOCK_KV, _num_workers(device))
        logits = tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, ctx, table, meta, max_len, True)
        rows = check_rows(rows_total)
        sub = rows.to(device)
        check_fused, check_pair = make_checks(logits[sub].cpu(), paged_valid_mask(ctx, spec.next_n, max_len)[sub].cpu(),
                                              spec.topk, rows, rows_total)
        del logits

        impls = [
            Impl("tilefuse",
                 lambda: tilefuse.fp8_fp4_paged_mqa_topk(qq, cache, w, ctx, table, meta, max_len, spec.topk,
                                                         chunk_k=spec.chunk_k),
                 lambda out: check_fused(out.cpu())),
            Impl("tilefuse+torch.topk",
                 lambda: torch.topk(tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, ctx, table, meta, max_len, True),
                                    min(spec.topk, max_len), dim=1),
                 lambda out: check_pair(tuple(t.cpu() for t in out))),
            Impl("tilefuse+torch.topk unsorted",
                 lambda: torch.topk(tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, ctx, table, meta, max_len, True),
                                    min(spec.topk, max_len), dim=1, sorted=False),
                 lambda out: check_pair(tuple(t.cpu() for t in out))),
            Impl("tilefuse logits",
                 lambda: tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, w, ctx, table, meta, max_len, False),
                 lambda out: check_shape(out, (rows_total, max_len))),
        ]
        skipped = skipped_peer("deep_gemm+torch.topk", peer, peer_skip, spec.fmt)
        if skipped is not None:
            impls.append(skipped)
        else:
            dg_ctx = paged_row_ends(ctx, spec.next_n)  # the 1-D lengths' rows, as DeepGEMM takes them
            dg_meta = peer.get_paged_mqa_logits_metadata(dg_ctx, BLOCK_KV, _num_workers(device))
            # DeepGEMM's SM90 kernel cleans only with 1-D lengths: its unclean logits, the rows'
            # windows masked to -inf (part of the pair's cost), then the top-k.
            outside = ~paged_valid_mask(ctx, spec.next_n, max_len)

            def deep_gemm_pair():
                logits = peer.fp8_paged_mqa_logits(qq[0], cache, w, dg_ctx, table, dg_meta, max_len, False)
                return torch.topk(logits.masked_fill_(outside, float("-inf")), min(spec.topk, max_len), dim=1)

            impls.append(Impl("deep_gemm+torch.topk", deep_gemm_pair,
                              lambda out: check_pair(tuple(t.cpu() for t in out))))
        return impls

    params = spec.params()
    params["chunk_k_used"] = "whole rows" if whole else chunk
    params["max_context_len"] = max_len
    params["bytes_moved"] = topk_bytes_moved(rows_total, max_len, spec.topk, chunk)
    return Case(name=spec.name, build=build, x=spec.shape, series=f"decode {spec.fmt} H{spec.heads}",
                params=params, flops=_pairs_flops(spec, valid_pairs),
                ceiling=ceil.FP8_MATMUL if spec.fmt == "fp8" else ceil.BF16_MATMUL)


def cases(*, on_gpu: bool, device: str, shapes=None, fmts=("fp8",), chunk_k=(None,), chunk_q=(None,)) -> list[Case]:
    """The cases of ``tilefuse bench topk``: the prefill rows, then the decode rows; one row per
    ``chunk_k`` (both APIs) and ``chunk_q`` (prefill) given (None: the op's default)."""
    for f in fmts:
        if f not in formats.FORMATS:
            raise ValueError(f"--formats: expected some of {formats.FORMATS}, got {f!r}")
    prefill, decode = shapes or ((GPU_PREFILL, GPU_DECODE) if on_gpu else (CPU_PREFILL, CPU_DECODE))
    heads, k_top = (GPU_HEADS, GPU_TOPK) if on_gpu else (CPU_HEADS, CPU_TOPK)
    if not on_gpu and chunk_k == (None,):
        chunk_k = (CPU_CHUNK,)
    peer, skip = deep_gemm_module()
    out = [prefill_case(Spec("prefill", f, s_q, s_k, 1, heads, k_top, ck, cq), device, peer, skip)
           for f in fmts for s_q, s_k in prefill for ck in chunk_k for cq in chunk_q]
    decode_chunks = chunk_k if on_gpu or chunk_k != (CPU_CHUNK,) else (2 * BLOCK_KV,)
    out += [decode_case(Spec("decode", f, b, c, n, heads, k_top, ck), device, peer, skip)
            for f in fmts for b, n, c in decode for ck in decode_chunks]
    return out


def parse_chunks(text: str | None, name: str) -> tuple[int | None, ...]:
    """``"8192,16384"`` -> ``(8192, 16384)``; empty -> ``(None,)`` (the op's default)."""
    if not text:
        return (None,)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--{name}: expected comma-separated positive ints, got {text!r}")
    return tuple(int(p) for p in parts)
