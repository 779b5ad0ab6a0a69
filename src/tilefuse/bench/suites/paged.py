"""``tilefuse bench paged``: indexer decode logits over a paged KV cache.

Rows (GPU): B in {1, 64, 256} x next_n in {1, 2} x mean context in {8K, 32K, 64K}; per request
a length drawn uniformly in 0.7-1.3 of the mean; pages of 64 tokens handed out in shuffled
order; H=64, D=128; 2-D context lengths (``[B, next_n]``, row ``t`` of request ``b`` sees
``len_b - next_n + 1 + t`` keys); fp32 weights and logits; no clean. Each row times tilefuse
beside DeepGEMM (when ``import deep_gemm`` works, FP8) and an eager torch implementation. On
a CPU machine the rows run at tiny shapes through the Triton interpreter, labelled.

``--sweep`` (GPU): the decode sweep grid, tilefuse beside DeepGEMM in the same run on the same
inputs: B in {1, 8, 32, 64, 128, 256, 1024} x mean context in {1K, 4K, 8K, 32K, 64K, 128K}
(rows up to 32M cached tokens, DeepGEMM's own test pool) x next_n in {1, 2, 4} x H in {32, 64}
x pages of 64 and 32 tokens x fp32 and bf16 logits; no torch eager row, and the torch
references only where they fit (``SWEEP_REFERENCE_KEYS``; past it each output is checked
against the other implementation's).

Bytes = the KV pages read (whole pages of ``block_kv * (D + 4)`` bytes; MXFP4 ``D/2 + 4``)
plus the logits written (the valid entries of each row); the ratio is to the device copy
bandwidth (read + written) measured in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilefuse import formats
from tilefuse._device import capability_major
from tilefuse.bench import ceilings as ceil
from tilefuse.bench.runner import Case, Impl
from tilefuse.bench.suites.indexer import (
    DEQUANT_LIMIT_BF16,
    DEQUANT_LIMIT_FP32,
    ORIGINAL_LIMIT,
    deep_gemm_module,
    eager_impl,
    finish_reference_checks,
    skipped_peer,
)
from tilefuse.reference import paged_row_ends

GPU_ROWS = [(b, n, c) for b in (1, 64, 256) for n in (1, 2) for c in (8192, 32768, 65536)]
CPU_ROWS = [(1, 1, 512), (4, 1, 256), (4, 2, 256)]
SWEEP_BATCH = (1, 8, 32, 64, 128, 256, 1024)
SWEEP_CTX = (1024, 4096, 8192, 32768, 65536, 131072)
SWEEP_NEXT_N = (1, 2, 4)
SWEEP_HEADS = (32, 64)
SWEEP_BLOCK_KV = (64, 32)
SWEEP_LOGITS = ("float32", "bfloat16")
SWEEP_MAX_TOKENS = 32 << 20
# Keys x heads x rows past which the sweep does not run the torch references.
SWEEP_REFERENCE_KEYS = 1 << 31
GPU_HEADS, CPU_HEADS = 64, 16
HEAD_DIM = 128
BLOCK_KV = 64
SPREAD = (0.7, 1.3)
CPU_WORKERS = 8  # metadata workers when there is no GPU to size them by
# FP8 against the unquantised reference: DeepGEMM's 1e-3 sits near the mean of its estimate
# (0.8-1.0e-3 at B >= 8), and with fewer query rows than this one row's quantisation draws
# decide it (B1 next_n 1 rows read 0.99-1.15e-3 for both implementations alike), so those
# checks take FEW_ROWS_ORIGINAL_LIMIT; a misread scale is off by orders of magnitude.
FEW_QUERY_ROWS = 8
FEW_ROWS_ORIGINAL_LIMIT = {"fp8": 1.5e-3}


@dataclass(frozen=True)
class Spec:
    fmt: str
    batch: int
    next_n: int
    mean_ctx: int
    heads: int
    head_dim: int = HEAD_DIM
    block_kv: int = BLOCK_KV
    logits_dtype: str = "float32"
    references: bool = True
    eager: bool = True  # the torch eager row (where the references fit)

    @property
    def shape(self) -> str:
        return f"B{self.batch} n{self.next_n} ctx{self.mean_ctx}"

    @property
    def name(self) -> str:
        tail = "" if self.logits_dtype == "float32" else f" {self.logits_dtype}"
        return f"{self.fmt} H{self.heads} D{self.head_dim} {self.shape} block{self.block_kv}{tail}"

    def params(self) -> dict:
        return {
            "format": self.fmt,
            "batch": self.batch,
            "next_n": self.next_n,
            "mean_context": self.mean_ctx,
            "context_spread": list(SPREAD),
            "heads": self.heads,
            "head_dim": self.head_dim,
            "block_kv": self.block_kv,
            "context_lens": "2-D",
            "clean_logits": False,
            "logits_dtype": self.logits_dtype,
        }


def parse_shapes(items: list[str] | None) -> list[tuple[int, int, int]] | None:
    """``["64x1x8192", "256x2x32768"]`` -> ``[(64, 1, 8192), (256, 2, 32768)]`` (B x next_n x ctx)."""
    if not items:
        return None
    out = []
    for item in items:
        for part in item.split(","):
            fields = part.strip().split("x")
            if len(fields) != 3 or not all(f.isdigit() and int(f) >= 1 for f in fields):
                raise ValueError(f"--shapes: expected BxNEXT_NxCTX such as 64x1x8192, got {part!r}")
            out.append(tuple(int(f) for f in fields))
    return out


def context_lengths(spec: Spec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request lengths ``[B]`` (uniform in the spread around the mean, at least next_n) and the
    2-D lengths ``[B, next_n]`` the op takes, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = SPREAD
    u = torch.rand(spec.batch, generator=g)
    lens = (spec.mean_ctx * (lo + (hi - lo) * u)).long().clamp(min=spec.next_n)
    return lens.to(torch.int32), paged_row_ends(lens, spec.next_n)


def bytes_moved(spec: Spec, lens: torch.Tensor, lens2d: torch.Tensor) -> int:
    width = spec.head_dim // 2 if spec.fmt == "mxfp4" else spec.head_dim
    pages = (lens.long() + spec.block_kv - 1) // spec.block_kv
    kv = int(pages.sum()) * spec.block_kv * (width + 4)
    logits = int(lens2d.long().sum()) * (2 if spec.logits_dtype == "bfloat16" else 4)
    return kv + logits


def eager_paged_logits(qq, kv_cache, weights, lens2d, block_table, max_context_len, fmt, head_dim):
    """The eager torch implementation: gather every request's pages through the block table,
    dequantise to bf16, einsum, ReLU, weighted head sum, mask."""
    from tilefuse.reference import paged_valid_mask

    nb, bkv, _, width = kv_cache.shape
    value_bytes = width - 4
    b, next_n = qq[0].shape[:2]
    pages = kv_cache.as_strided((nb, bkv * width), (kv_cache.stride(0), 1), kv_cache.storage_offset())
    raw = pages[block_table.long()]  # [B, max_pages, page bytes]
    tokens = raw.shape[1] * bkv
    values = raw[..., : bkv * value_bytes].reshape(b, tokens, value_bytes)
    scales = raw[..., bkv * value_bytes :].contiguous().view(torch.float32 if fmt == "fp8" else torch.int32)
    values = values.view(torch.int8) if fmt == "mxfp4" else values.view(formats.FP8_DTYPE)
    k = formats.dequantize_k(values, scales.reshape(b, tokens)).to(torch.bfloat16)
    q = formats.dequantize_q(*qq).to(torch.bfloat16)
    scores = torch.einsum("bthd,bjd->bthj", q, k).relu_()
    w = weights.view(b, next_n, -1).to(torch.bfloat16)
    logits = torch.einsum("bthj,bth->btj", scores, w).float().reshape(b * next_n, tokens)
    out = torch.full((b * next_n, max_context_len), float("-inf"), device=q.device)
    n = min(tokens, max_context_len)
    out[:, :n] = logits[:, :n]
    return out.masked_fill_(~paged_valid_mask(lens2d, next_n, max_context_len), float("-inf"))


def check_paged(out, ref: torch.Tensor, limit: float, ref_orig=None, limit_orig=None) -> dict:
    """Without clean only the valid entries are specified: they must be finite and match."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"passed": False, "failed": f"output shape {got}, expected {tuple(ref.shape)}"}
    valid = ~torch.isneginf(ref)
    res = {"inside_finite": bool(torch.isfinite(out[valid]).all())}
    failures = [] if res["inside_finite"] else ["non-finite value at a valid entry (unwritten?)"]
    return finish_reference_checks(res, failures, out, ref, limit, ref_orig, limit_orig)


def _num_workers(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return CPU_WORKERS


def original_limit(spec: Spec) -> float:
    """The unquantised reference's ``calc_diff`` limit for ``spec``'s format and query rows."""
    if spec.batch * spec.next_n < FEW_QUERY_ROWS:
        return FEW_ROWS_ORIGINAL_LIMIT.get(spec.fmt, ORIGINAL_LIMIT[spec.fmt])
    return ORIGINAL_LIMIT[spec.fmt]


def sm90_peer_skip(spec: Spec, device: str) -> Impl | None:
    """DeepGEMM's row skipped where its SM90 kernel does not run ``spec``: pages of 64 tokens and
    next_n 1 or 2 only (it asserts on the rest)."""
    if capability_major(device) != 9:
        return None
    if spec.block_kv != 64:
        return Impl("deep_gemm", skipped=f"skipped: DeepGEMM runs block_kv 64 only on SM90, not {spec.block_kv}")
    if spec.next_n > 2:
        return Impl("deep_gemm", skipped=f"skipped: DeepGEMM runs next_n 1 or 2 only on SM90, not {spec.next_n}")
    return None


def make_case(spec: Spec, device: str, peer=None, peer_skip: str | None = None) -> Case:
    lens, lens2d = context_lengths(spec)

    def build() -> list[Impl]:
        import tilefuse
        from tilefuse.indexer import paged
        from tilefuse.reference import fp8_fp4_paged_mqa_logits_ref, paged_mqa_logits_ref, paged_valid_mask

        g = torch.Generator(device=device).manual_seed(1)
        longest = int(lens.max())
        max_len = longest
        keys = torch.randn(spec.batch, longest, spec.head_dim, device=device, generator=g).to(torch.bfloat16)
        q = torch.randn(spec.batch, spec.next_n, spec.heads, spec.head_dim, device=device, generator=g)
        q = q.to(torch.bfloat16)
        weights = torch.randn(spec.batch * spec.next_n, spec.heads, device=device, generator=g)
        ctx = lens2d.to(device)
        cache, table = paged.make_paged_kv_cache(keys, ctx, spec.block_kv, spec.fmt,
                                                 generator=torch.Generator().manual_seed(2))
        qq = formats.quantize_q(q, spec.fmt)
        meta = tilefuse.get_paged_mqa_logits_metadata(ctx, spec.block_kv, _num_workers(device))
        logits_dtype = getattr(torch, spec.logits_dtype)
        limit = DEQUANT_LIMIT_FP32 if logits_dtype == torch.float32 else DEQUANT_LIMIT_BF16
        if spec.references:
            ref = fp8_fp4_paged_mqa_logits_ref(qq, cache, weights, ctx, table, max_len)
            ref_orig = paged_mqa_logits_ref(q, keys, weights, ctx, max_len)
        del keys

        def tilefuse_call():
            return tilefuse.fp8_fp4_paged_mqa_logits(qq, cache, weights, ctx, table, meta, max_len, False,
                                                     logits_dtype)

        if spec.references:
            def check(out):
                return check_paged(out, ref, limit, ref_orig, original_limit(spec))
        else:  # too large for the torch references: against DeepGEMM's output, or tilefuse's
            other = {}

            def check(out):
                if "ref" not in other:
                    other["ref"] = (peer_call() if peer_call is not None else tilefuse_call()).float()
                    other["ref"].masked_fill_(~paged_valid_mask(ctx, spec.next_n, max_len), float("-inf"))
                return check_paged(out, other["ref"], 4 * limit)

        out_bytes = spec.batch * spec.next_n * (-(-max_len // 16) * 16) * logits_dtype.itemsize
        peer_call = None
        impls = [Impl("tilefuse", tilefuse_call, check, out_bytes=out_bytes)]
        skipped = skipped_peer("deep_gemm", peer, peer_skip, spec.fmt) or sm90_peer_skip(spec, device)
        if skipped is not None:
            impls.append(skipped)
        else:
            dg_meta = peer.get_paged_mqa_logits_metadata(ctx, spec.block_kv, _num_workers(device))

            def peer_call():
                if logits_dtype == torch.float32:
                    return peer.fp8_paged_mqa_logits(qq[0], cache, weights, ctx, table, dg_meta, max_len, False)
                return peer.fp8_fp4_paged_mqa_logits((qq[0], None), cache, weights, ctx, table, dg_meta, max_len,
                                                     False, logits_dtype)

            impls.append(Impl("deep_gemm", peer_call, check, out_bytes=out_bytes))
        if not (spec.references and spec.eager):
            return impls
        pages_bytes = spec.batch * table.shape[1] * spec.block_kv
        eager_bytes = pages_bytes * spec.head_dim * 6 + pages_bytes * spec.next_n * spec.heads * 2
        impls.append(
            eager_impl(
                eager_bytes,
                lambda: eager_paged_logits(qq, cache, weights, ctx, table, max_len, spec.fmt, spec.head_dim),
                lambda out: check_paged(out, ref, original_limit(spec)),
            )
        )
        return impls

    return Case(
        name=spec.name,
        build=build,
        x=spec.shape,
        series=f"{spec.fmt} H{spec.heads}",
        params=spec.params(),
        bytes=bytes_moved(spec, lens, lens2d),
        ceiling=ceil.COPY,
    )


def sweep_specs(fmts=("fp8",), shapes=None) -> list[Spec]:
    """The ``--sweep`` grid (``shapes``: only these (B, next_n, mean ctx) of it)."""
    out = []
    for f in fmts:
        for b in SWEEP_BATCH:
            for c in SWEEP_CTX:
                if b * c > SWEEP_MAX_TOKENS:
                    continue
                for n in SWEEP_NEXT_N:
                    if shapes and (b, n, c) not in shapes:
                        continue
                    for h in SWEEP_HEADS:
                        for bkv in SWEEP_BLOCK_KV:
                            for dt in SWEEP_LOGITS:
                                refs = b * int(c * SPREAD[1]) * h * n <= SWEEP_REFERENCE_KEYS
                                out.append(Spec(f, b, n, c, h, block_kv=bkv, logits_dtype=dt, references=refs,
                                                eager=False))
    return out


def cases(*, on_gpu: bool, device: str, shapes=None, fmts=("fp8",), sweep: bool = False) -> list[Case]:
    """The cases of ``tilefuse bench paged`` (``sweep``: the sweep grid; on CPU its tiny rows
    with both page sizes and logits dtypes)."""
    for f in fmts:
        if f not in formats.FORMATS:
            raise ValueError(f"--formats: expected some of {formats.FORMATS}, got {f!r}")
    peer, skip = deep_gemm_module()
    if sweep and on_gpu:
        specs = sweep_specs(fmts, shapes)
    elif sweep:
        specs = [Spec(f, b, n, c, CPU_HEADS, block_kv=bkv, logits_dtype=dt, eager=False) for f in fmts
                 for b, n, c in (shapes or CPU_ROWS[1:]) for bkv in SWEEP_BLOCK_KV for dt in SWEEP_LOGITS]
    else:
        rows = shapes or (GPU_ROWS if on_gpu else CPU_ROWS)
        heads = GPU_HEADS if on_gpu else CPU_HEADS
        specs = [Spec(f, b, n, c, heads) for f in fmts for b, n, c in rows]
    return [make_case(spec, device, peer, skip) for spec in specs]
