"""``tilefuse bench indexer``: the prefill logits at the reference shapes of the contract.

Rows (GPU): H=64, D=128, causal-tail windows, fp32 weights and logits, clean on, at
(S_q, S_k) in (2048, 32768), (8192, 65536), (4096, 8192), (128, 32768), (16, 65536), for FP8,
MXFP8 and MXFP4; at 2048 / 32768 also clean off, H=32, bf16 logits, the compressed layout
without clean (``max_seqlen_k``: rows as long as the longest window) and D=64. Each case times
tilefuse beside DeepGEMM (when ``import deep_gemm`` works, FP8 only: its SM90 kernels have no
MX formats) and the eager torch implementation. On a CPU machine the same rows run at tiny
shapes through the Triton interpreter and are labelled as such.

FLOPs = ``2 * valid_pairs * H * D``; FP8 rows are compared with the FP8 matmul ceiling, MX rows
with the BF16 one (Hopper has no MX tensor cores).

``--reproduce``: on one shape, checks the complete output of an all-zero workload with unit
scales (exactly 0 inside every window, exactly ``-inf`` outside), then times clean on/off x
schedule metadata on/off for FP8/MXFP8/MXFP4, one graph per variant, in one rotation, on
random inputs; outputs with and without metadata must be bitwise identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tilefuse import formats
from tilefuse.bench import ceilings as ceil
from tilefuse.bench.runner import Case, Impl

# Reference shapes of the contract (indexer.md §5) and their interpreter-sized stand-ins.
GPU_SHAPES = [(2048, 32768), (8192, 65536), (4096, 8192), (128, 32768), (16, 65536)]
CPU_SHAPES = [(16, 256), (64, 512)]
GPU_HEADS, GPU_ALT_HEADS = 64, 32
CPU_HEADS, CPU_ALT_HEADS = 8, 4
HEAD_DIM = 128
FORMATS = ("fp8", "mxfp8", "mxfp4")
# Accuracy rules (indexer.md §5).
DEQUANT_LIMIT_FP32 = 5e-6
DEQUANT_LIMIT_BF16 = 3e-5
ORIGINAL_LIMIT = {"fp8": 1e-3, "mxfp8": 0.02, "mxfp4": 0.02}
# The eager row materialises [S_q, H, S_k] bf16 scores; larger cases are skipped.
EAGER_BYTES_LIMIT = 24 << 30
EAGER_SAMPLES = 10
NO_MX_ON_SM90 = "skipped: DeepGEMM has no MX formats on SM90"


@dataclass(frozen=True)
class Spec:
    """One indexer case."""

    fmt: str
    s_q: int
    s_k: int
    heads: int
    head_dim: int = HEAD_DIM
    clean: bool = True
    logits_dtype: torch.dtype = torch.float32
    window: str = "causal"
    compressed: bool = False  # [S_q, max window] logits (max_seqlen_k), not [S_q, S_k]

    @property
    def shape(self) -> str:
        return f"{self.s_q}/{self.s_k}"

    @property
    def variant(self) -> str:
        parts = [] if self.clean else ["no-clean"]
        if self.logits_dtype == torch.bfloat16:
            parts.append("bf16-logits")
        if self.compressed:
            parts.append("compressed")
        return " ".join(parts)

    @property
    def name(self) -> str:
        return f"{self.fmt} H{self.heads} D{self.head_dim} {self.shape} {self.window} {self.variant}".strip()

    def params(self) -> dict:
        return {
            "format": self.fmt,
            "s_q": self.s_q,
            "s_k": self.s_k,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "clean_logits": self.clean,
            "logits_dtype": str(self.logits_dtype).removeprefix("torch."),
            "weights_dtype": "float32",
            "window": self.window,
            "compressed": self.compressed,
        }


def parse_shapes(items: list[str] | None) -> list[tuple[int, int]] | None:
    """``["2048x32768", "16/65536"]`` -> ``[(2048, 32768), (16, 65536)]``."""
    if not items:
        return None
    out = []
    for item in items:
        for part in item.split(","):
            a, sep, b = part.strip().replace("/", "x").partition("x")
            if not sep or not a.isdigit() or not b.isdigit() or int(a) < 1 or int(b) < 1:
                raise ValueError(f"--shapes: expected S_QxS_K such as 2048x32768, got {part!r}")
            out.append((int(a), int(b)))
    return out


def default_specs(on_gpu: bool, shapes=None, fmts=FORMATS) -> list[Spec]:
    """The suite's cases: every shape in every format, then the extra rows on the first shape."""
    shapes = shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES)
    heads, alt = (GPU_HEADS, GPU_ALT_HEADS) if on_gpu else (CPU_HEADS, CPU_ALT_HEADS)
    specs = [Spec(f, s_q, s_k, heads) for f in fmts for s_q, s_k in shapes]
    s_q, s_k = shapes[0]
    if "fp8" in fmts:
        specs += [
            Spec("fp8", s_q, s_k, heads, clean=False),
            Spec("fp8", s_q, s_k, alt),
            Spec("fp8", s_q, s_k, heads, logits_dtype=torch.bfloat16),
            # Compressed without clean, as engines call it (DeepGEMM leaves a row's columns past its
            # window unspecified in this layout).
            Spec("fp8", s_q, s_k, heads, clean=False, compressed=True),
            Spec("fp8", s_q, s_k, heads, head_dim=HEAD_DIM // 2),
        ]
    return specs


# ---------------------------------------------------------------------------------------
# Inputs, implementations, checks
# ---------------------------------------------------------------------------------------
@dataclass
class Inputs:
    q: torch.Tensor  # unquantised bf16 [S_q, H, D]
    k: torch.Tensor  # unquantised bf16 [S_k, D]
    qq: tuple[torch.Tensor, torch.Tensor | None]
    kv: tuple[torch.Tensor, torch.Tensor]
    weights: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor


def make_inputs(spec: Spec, device: str, seed: int = 0) -> Inputs:
    from tilefuse.indexer import windows

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(spec.s_q, spec.heads, spec.head_dim, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(spec.s_k, spec.head_dim, device=device, generator=g).to(torch.bfloat16)
    weights = torch.randn(spec.s_q, spec.heads, device=device, generator=g)
    ks, ke = windows.GENERATORS[spec.window](spec.s_q, spec.s_k, device=device)
    return Inputs(q, k, formats.quantize_q(q, spec.fmt), formats.quantize_k(k, spec.fmt), weights, ks, ke)


def zero_inputs(spec: Spec, device: str) -> Inputs:
    """All-zero values with unit scales (fp32 1.0, or UE8M0 0x7f in every byte)."""
    from tilefuse.indexer import windows

    q = torch.zeros(spec.s_q, spec.heads, spec.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.zeros(spec.s_k, spec.head_dim, device=device, dtype=torch.bfloat16)
    qv, q_sf = formats.quantize_q(q, spec.fmt)
    kv, k_sf = formats.quantize_k(k, spec.fmt)
    unit = formats.pack_ue8m0(torch.full((1, 4), formats.UE8M0_ONE, device=device))[0]
    if q_sf is not None:
        q_sf = torch.full_like(q_sf, int(unit))
        k_sf = torch.full_like(k_sf, int(unit))
    else:
        k_sf = torch.ones_like(k_sf)
    weights = torch.randn(spec.s_q, spec.heads, device=device)
    ks, ke = windows.GENERATORS[spec.window](spec.s_q, spec.s_k, device=device)
    return Inputs(q, k, (qv, q_sf), (kv, k_sf), weights, ks, ke)


def eager_logits(qq, kv, weights, ks, ke) -> torch.Tensor:
    """The eager torch implementation: upcast to bf16, einsum, ReLU, weighted head sum, mask."""
    from tilefuse.reference import window_mask

    q = formats.dequantize_q(*qq).to(torch.bfloat16)
    k = formats.dequantize_k(*kv).to(torch.bfloat16)
    scores = torch.einsum("shd,td->sht", q, k).relu_()
    logits = torch.einsum("sht,sh->st", scores, weights.to(torch.bfloat16)).float()
    return logits.masked_fill_(~window_mask(ks, ke, k.shape[0]), float("-inf"))


def check_logits(out, ref: torch.Tensor, clean: bool, limit: float, ref_orig=None, limit_orig=None) -> dict:
    """The complete-output rules: shape, every element written, exact -inf mask, calc_diff."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"passed": False, "failed": f"output shape {got}, expected {tuple(ref.shape)}"}
    outside = torch.isneginf(ref)
    inside_finite = bool(torch.isfinite(out[~outside]).all())
    res = {"inside_finite": inside_finite}
    failures = [] if inside_finite else ["non-finite value inside a window"]
    if clean:
        res["mask_exact"] = bool(torch.equal(torch.isneginf(out), outside))
        res["nan_free"] = not bool(torch.isnan(out).any())
        if not res["mask_exact"]:
            failures.append("-inf mask differs from the reference")
        if not res["nan_free"]:
            failures.append("NaN in the output (unwritten element)")
    return finish_reference_checks(res, failures, out, ref, limit, ref_orig, limit_orig)


def finish_reference_checks(res: dict, failures: list[str], out: torch.Tensor, ref: torch.Tensor, limit: float,
                            ref_orig: torch.Tensor | None, limit_orig: float) -> dict:
    """Add both references' ``calc_diff`` (dequantised: ``limit``; unquantised, when given:
    ``limit_orig``) to a check record and close it: ``passed``, and ``failed`` with every reason."""
    from tilefuse.reference import calc_diff

    res["calc_diff"] = calc_diff(out.float(), ref.float())
    res["limit"] = limit
    if not res["calc_diff"] < limit:
        failures.append(f"calc_diff {res['calc_diff']:.3g} >= {limit:g}")
    if ref_orig is not None:
        res["calc_diff_original"] = calc_diff(out.float(), ref_orig)
        res["limit_original"] = limit_orig
        if not res["calc_diff_original"] < limit_orig:
            failures.append(f"calc_diff vs unquantised {res['calc_diff_original']:.3g} >= {limit_orig:g}")
    res["passed"] = not failures
    if failures:
        res["failed"] = "; ".join(failures)
    return res


def check_zero_workload(out, ks: torch.Tensor, ke: torch.Tensor, s_k: int, clean: bool) -> dict:
    """All-zero workload: exactly 0 inside each window; exactly -inf outside when clean."""
    from tilefuse.reference import window_mask

    inside = window_mask(ks, ke, s_k)
    zeros_exact = bool((out[inside] == 0).all())
    res = {"zeros_exact": zeros_exact}
    failures = [] if zeros_exact else ["non-zero logit inside a window on all-zero inputs"]
    if clean:
        res["mask_exact"] = bool(torch.isneginf(out[~inside]).all())
        if not res["mask_exact"]:
            failures.append("a column outside a window is not exactly -inf on all-zero inputs")
    res["passed"] = not failures
    if failures:
        res["failed"] = "; ".join(failures)
    return res


def bitwise_same(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, clean: bool) -> bool:
    """Bitwise equality over what the contract specifies: everything when clean, else the windows."""
    if clean:
        return bool(torch.equal(a, b))
    window = ~torch.isneginf(ref)
    return bool(torch.equal(a[window], b[window]))


def deep_gemm_module():
    """``(module, None)`` when DeepGEMM imports, else ``(None, reason)``."""
    try:
        import deep_gemm
    except ImportError:
        return None, "skipped: deep_gemm not installed"
    except Exception as e:  # an installed but broken peer is reported, not fatal
        return None, f"skipped: import deep_gemm failed ({type(e).__name__}: {e})"
    return deep_gemm, None


def skipped_peer(name: str, peer, peer_skip: str | None, fmt: str) -> Impl | None:
    """The DeepGEMM row ``name`` skipped: no peer (``peer_skip`` says why), or an MX ``fmt``,
    which DeepGEMM does not run on SM90. None where the peer runs ``fmt``."""
    if peer is None:
        return Impl(name, skipped=peer_skip)
    if fmt != "fp8":
        return Impl(name, skipped=NO_MX_ON_SM90)
    return None


def eager_impl(eager_bytes: int, call: Callable, check: Callable, of: str | None = None) -> Impl:
    """The torch eager row, skipped where its tensors (``of`` what, for the message) would take
    more than ``EAGER_BYTES_LIMIT`` bytes."""
    if eager_bytes > EAGER_BYTES_LIMIT:
        needs = f"{eager_bytes / 2**30:.0f} GiB" + (f" of {of}" if of else "")
        return Impl("torch eager", skipped=f"skipped: needs {needs}")
    return Impl("torch eager", call, check, group="eager", samples=EAGER_SAMPLES)


def _deep_gemm_fn(dg, spec: Spec, inp: Inputs, width: int) -> tuple[Callable | None, str | None]:
    """DeepGEMM's call for ``spec`` (``width``: its ``max_seqlen_k``), or why it has none."""
    if spec.fmt != "fp8":
        return None, NO_MX_ON_SM90
    if spec.logits_dtype == torch.float32:
        fn = lambda: dg.fp8_mqa_logits(inp.qq[0], inp.kv, inp.weights, inp.ks, inp.ke, clean_logits=spec.clean,
                                       max_seqlen_k=width)
        return fn, None
    if hasattr(dg, "fp8_fp4_mqa_logits"):
        return (
            lambda: dg.fp8_fp4_mqa_logits(
                inp.qq, inp.kv, inp.weights, inp.ks, inp.ke, clean_logits=spec.clean, max_seqlen_k=width,
                logits_dtype=spec.logits_dtype
            )
        ), None
    return None, "skipped: this DeepGEMM has no logits_dtype"


def max_seqlen_k(spec: Spec, inp: Inputs) -> int:
    """The ``max_seqlen_k`` argument: the longest window when compressed, else 0 (full rows)."""
    return int((inp.ke - inp.ks).max()) if spec.compressed else 0


def _output_bytes(spec: Spec, width: int = 0) -> int:
    row = -(-(width or spec.s_k) // 16) * 16  # rows padded to 16 elements
    return spec.s_q * row * torch.finfo(spec.logits_dtype).bits // 8


def make_case(spec: Spec, device: str, peer=None, peer_skip: str | None = None) -> Case:
    """A runner case for ``spec``: tilefuse, DeepGEMM (if any) and eager torch."""
    from tilefuse.indexer import windows

    ceiling = ceil.FP8_MATMUL if spec.fmt == "fp8" else ceil.BF16_MATMUL
    # FLOPs depend only on the windows, known without building the tensors.
    ks, ke = windows.GENERATORS[spec.window](spec.s_q, spec.s_k, device="cpu")
    n_flops = 2 * windows.valid_pairs(ks, ke, spec.s_k) * spec.heads * spec.head_dim

    def build() -> list[Impl]:
        import tilefuse
        from tilefuse.reference import compress_logits, fp8_fp4_mqa_logits_ref, mqa_logits_ref

        inp = make_inputs(spec, device)
        width = max_seqlen_k(spec, inp)
        ref = fp8_fp4_mqa_logits_ref(inp.qq, inp.kv, inp.weights, inp.ks, inp.ke, spec.clean, width, torch.float32)
        ref_orig = mqa_logits_ref(inp.q, inp.k, inp.weights, inp.ks, inp.ke)
        if width:
            ref_orig = compress_logits(ref_orig, inp.ks, inp.ke, width)
        bf16 = spec.logits_dtype == torch.bfloat16
        limit = DEQUANT_LIMIT_BF16 if bf16 else DEQUANT_LIMIT_FP32

        def check(out, limit=limit):
            return check_logits(out, ref, spec.clean, limit, ref_orig, ORIGINAL_LIMIT[spec.fmt])

        out_bytes = _output_bytes(spec, width)
        impls = [
            Impl(
                "tilefuse",
                lambda: tilefuse.fp8_fp4_mqa_logits(
                    inp.qq, inp.kv, inp.weights, inp.ks, inp.ke, clean_logits=spec.clean, max_seqlen_k=width,
                    logits_dtype=spec.logits_dtype
                ),
                check,
                out_bytes=out_bytes,
            )
        ]
        if peer is not None:
            fn, skip = _deep_gemm_fn(peer, spec, inp, width)
            impls.append(Impl("deep_gemm", fn, check, skipped=skip, out_bytes=out_bytes))
        else:
            impls.append(Impl("deep_gemm", skipped=peer_skip))
        if width:  # the eager row writes full rows: timed on the uncompressed rows only
            return impls
        eager_bytes = 2 * spec.s_q * spec.heads * spec.s_k * 2
        impls.append(
            eager_impl(
                eager_bytes,
                lambda: eager_logits(inp.qq, inp.kv, inp.weights, inp.ks, inp.ke),
                # bf16 arithmetic: held to the unquantised-input limits.
                lambda out: check_logits(out, ref, True, ORIGINAL_LIMIT[spec.fmt]),
                of="scores",
            )
        )
        return impls

    return Case(
        name=spec.name,
        build=build,
        x=spec.shape,
        series=" ".join(p for p in (spec.fmt, f"H{spec.heads}", spec.variant) if p),
        params=spec.params(),
        flops=n_flops,
        ceiling=ceiling,
    )


def reproduce_case(s_q: int, s_k: int, heads: int, device: str, fmts=FORMATS) -> Case:
    """One case, twelve variants: format x clean on/off x schedule metadata on/off."""
    from tilefuse.indexer import windows

    ks, ke = windows.causal_tail(s_q, s_k, device="cpu")
    n_flops = 2 * windows.valid_pairs(ks, ke, s_k) * heads * HEAD_DIM
    variants = [(f, clean, meta) for f in fmts for clean in (True, False) for meta in (False, True)]

    def build() -> list[Impl]:
        import tilefuse
        from tilefuse.reference import fp8_fp4_mqa_logits_ref

        impls = []
        plain: dict[tuple[str, bool], torch.Tensor] = {}
        for fmt, clean, meta in variants:
            spec = Spec(fmt, s_q, s_k, heads, clean=clean)
            inp = make_inputs(spec, device)
            zero = zero_inputs(spec, device)
            sched = tilefuse.get_mqa_logits_metadata(inp.ks, inp.ke, s_k, heads) if meta else None
            ref = fp8_fp4_mqa_logits_ref(inp.qq, inp.kv, inp.weights, inp.ks, inp.ke, clean, 0, torch.float32)

            def run(inp=inp, clean=clean, sched=sched):
                return tilefuse.fp8_fp4_mqa_logits(
                    inp.qq, inp.kv, inp.weights, inp.ks, inp.ke, clean_logits=clean, schedule_meta=sched
                )

            def check(out, spec=spec, inp=inp, zero=zero, ref=ref, sched=sched, key=(fmt, clean), meta=meta):
                res = check_logits(out, ref, spec.clean, DEQUANT_LIMIT_FP32)
                z_out = tilefuse.fp8_fp4_mqa_logits(
                    zero.qq, zero.kv, zero.weights, zero.ks, zero.ke, clean_logits=spec.clean, schedule_meta=sched
                )
                res["zero_workload"] = check_zero_workload(z_out, zero.ks, zero.ke, s_k, spec.clean)
                failures = [res["failed"]] if "failed" in res else []
                if not res["zero_workload"]["passed"]:
                    failures.append(res["zero_workload"]["failed"])
                if meta and key in plain:
                    same = bitwise_same(out, plain[key], ref, spec.clean)
                    res["bitwise_vs_no_metadata"] = same
                    if not same:
                        failures.append("output differs with schedule metadata")
                elif not meta:
                    plain[key] = out.clone()
                res["passed"] = not failures
                if failures:
                    res["failed"] = "; ".join(failures)
                return res

            name = f"{fmt} {'clean' if clean else 'no-clean'} {'meta' if meta else 'no-meta'}"
            ceiling = ceil.FP8_MATMUL if fmt == "fp8" else ceil.BF16_MATMUL
            impls.append(Impl(name, run, check, out_bytes=_output_bytes(spec), ceiling=ceiling))
        return impls

    return Case(
        name=f"reproduce H{heads} D{HEAD_DIM} {s_q}/{s_k} causal",
        build=build,
        x=f"{s_q}/{s_k}",
        series="reproduce",
        params={"s_q": s_q, "s_k": s_k, "heads": heads, "head_dim": HEAD_DIM, "window": "causal",
                "formats": list(fmts), "data": "random (checks also on all-zero inputs with unit scales)"},
        flops=n_flops,
        ceiling=ceil.FP8_MATMUL,
        compare_impls=False,
    )


def cases(*, on_gpu: bool, device: str, shapes=None, fmts=FORMATS, reproduce: bool = False) -> list[Case]:
    """The cases of ``tilefuse bench indexer`` (``reproduce`` gives the reproducer instead)."""
    for f in fmts:
        if f not in FORMATS:
            raise ValueError(f"--formats: expected some of {FORMATS}, got {f!r}")
    if reproduce:
        s_q, s_k = (shapes or ([(2048, 32768)] if on_gpu else [(64, 512)]))[0]
        heads = GPU_HEADS if on_gpu else CPU_HEADS
        return [reproduce_case(s_q, s_k, heads, device, fmts)]
    peer, skip = deep_gemm_module()
    return [make_case(s, device, peer, skip) for s in default_specs(on_gpu, shapes, fmts)]
