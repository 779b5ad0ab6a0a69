"""The registry: every production Triton kernel of tilefuse, in the configurations its launch
code and heuristics pick.

A :class:`Variant` is one compile: the kernel, the type of each runtime argument, the
``tl.constexpr`` values, and ``num_warps``/``num_stages``. Variants are not written by hand:
each builder runs the public op (or the kernel's launcher) on small CPU inputs with the
kernel object replaced by a recorder, so what is compiled is exactly what the launch site
passes — argument types, tensor-descriptor blocks, constexprs and launch options — for the
tile the op's own config function picks. Argument values are turned into types the way
Triton's launcher specialises them: pointers to 16-byte aligned tensors and integers that
are multiples of 16 get ``tt.divisibility = 16``, an integer equal to 1 becomes a constant.
Sample sizes are chosen not to be multiples of 16 (S_q = 37, S_k = 300, ...), so only what is
aligned by construction (padded row strides, head strides) is compiled as aligned; a launch
with aligned sizes compiles a further specialisation that only adds facts.

What is covered, per kernel, is listed in each builder's docstring. A variant says where it
comes from (``origin``): ``"default"`` for what the heuristics pick, ``"option"`` for an
alternative a caller can ask for through the config (``PrefillConfig(clean_pass=True)`` and
the like), which must stay on the fast path too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from unittest import mock

from tilefuse import _config, _jit, _validate

TARGETS_ALL = ("sm_90a", "sm_100a")
TARGET_MAJOR = {"sm_90a": 9, "sm_100a": 10}
_TILE_FIELDS = ("block_q", "block_n", "num_warps", "num_stages")
# Fields of the Gluon kernel only: its registry (``prefill_gluon_variants``) varies them.
_GLUON_ONLY_FIELDS = ("gluon_refill",)
# A ``tl.dtype`` constant is stored as this prefix + its name ("tl.dtype:bf16").
TL_DTYPE_PREFIX = "tl.dtype:"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of one kernel.

    kernel: registry name (``"indexer.prefill"``); name: the configuration, unique within
    the kernel; function: ``"package.module:jit_function"``; signature: runtime argument ->
    Triton type (``"*fp32"``, ``"i32"``, ``"tensordesc<fp8e4nv[64, 128]>"``); constexprs:
    constant argument -> value; aligned: arguments compiled with 16-divisibility;
    targets: the targets it is compiled and checked for: those the kernel runs on, or a subset
    where a configuration differs from others checked for the missing target only in loads,
    widths or stores (the top-k merge on sm_100a); origin: ``"default"`` or ``"option"``.
    """

    kernel: str
    name: str
    function: str
    signature: Mapping[str, str]
    constexprs: Mapping[str, int | bool | str | None]
    num_warps: int
    num_stages: int
    aligned: tuple[str, ...] = ()
    targets: tuple[str, ...] = TARGETS_ALL
    origin: str = "default"
    maxnreg: int | None = None  # the launch's register cap, where it sets one

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["signature"], d["constexprs"] = dict(self.signature), dict(self.constexprs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Variant:
        return cls(**{**d, "aligned": tuple(d["aligned"]), "targets": tuple(d["targets"])})

    def compile_key(self) -> tuple:
        """Two variants with the same key compile to the same code."""
        return (self.function, tuple(sorted(self.signature.items())), tuple(sorted(self.constexprs.items())),
                self.num_warps, self.num_stages, tuple(sorted(self.aligned)), self.maxnreg)


# --------------------------------------------------------------------------------------
# Launch tracing
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel's path and its arguments as the launcher passed them."""

    function: str
    arguments: dict  # parameter name -> value
    options: dict  # num_warps, num_stages, ...


class _Recorder:
    """Stands in for a ``@triton.jit`` object: ``kernel[grid](*args, **kwargs)`` records."""

    def __init__(self, fn, path: str, sink: list[Launch]):
        self._names = list(fn.arg_names)
        self.arg_names = self._names
        self._path = path
        self._sink = sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            arguments = dict(zip(self._names, args))
            options = {k: kwargs.pop(k) for k in list(kwargs) if k not in self._names}
            arguments.update(kwargs)
            missing = [n for n in self._names if n not in arguments]
            if missing:
                raise TypeError(f"{self._path}: launch without arguments {missing}")
            self._sink.append(Launch(self._path, arguments, options))

        return launch


@contextlib.contextmanager
def tracing(*paths: str):
    """Replace the kernels ``"module:name"`` by recorders; yields the list of launches."""
    launches: list[Launch] = []
    # Config overrides are ignored while tracing: the registry checks the configs the code picks.
    saved = dict(_config._overrides)
    _config._overrides.clear()
    try:
        with contextlib.ExitStack() as stack:
            # Nothing runs: the ops' check that CPU tensors go to the interpreter does not apply.
            stack.enter_context(mock.patch.object(_validate, "interpreter_enabled", lambda: True))
            for path in paths:
                module, _, name = path.partition(":")
                mod = importlib.import_module(module)
                real = getattr(mod, name)
                rec = _Recorder(real, path, launches)
                stack.enter_context(mock.patch.object(mod, name, rec))
                stack.enter_context(_jit.redirected(real, rec))
            yield launches
    finally:
        _config._overrides.update(saved)


def _constexpr_params(fn) -> set[str]:
    """Names of the ``tl.constexpr`` parameters of a JIT or interpreted kernel."""
    if hasattr(fn, "params"):
        return {p.name for p in fn.params if p.is_constexpr}
    out = set()
    for p in inspect.signature(fn.fn).parameters.values():
        ann = p.annotation
        text = ann if isinstance(ann, str) else getattr(ann, "__name__", "")
        if text.split(".")[-1] == "constexpr":
            out.add(p.name)
    return out


def _dtype_name(dtype) -> str:
    import torch

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
             torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
             torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
    if dtype not in names:
        raise TypeError(f"no Triton type known for {dtype}")
    return names[dtype]


def _unspecialised_params(fn) -> set[str]:
    """Names of the parameters a JIT or interpreted kernel declares ``do_not_specialize``."""
    if hasattr(fn, "params"):
        return {p.name for p in fn.params if p.do_not_specialize}
    names = list(inspect.signature(fn.fn).parameters)
    declared = getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    return {names[i] if isinstance(i, int) else i for i in declared}


def _specialise(name: str, value, constexpr: bool, specialised: bool = True):
    """(kind, type-or-value, aligned) of one argument, as Triton's launcher specialises it
    (``specialised=False``: declared ``do_not_specialize``, an int keeps its type only, a
    pointer drops its alignment)."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if constexpr or value is None:
        if hasattr(value, "primitive_bitwidth"):  # a tl.dtype passed as a constant
            return "const", TL_DTYPE_PREFIX + value.name, False
        return "const", value, False
    if isinstance(value, bool):
        return "arg", "u1", False
    if isinstance(value, int) and name.endswith("_addr"):
        # A device address passed as an int: 64 bits on any GPU whatever the traced value (the
        # TP builders trace on emulated workspaces, whose addresses can be small).
        return "arg", "i64", specialised and value % 16 == 0
    if isinstance(value, int) and not specialised:
        return "arg", "i32" if -(2**31) <= value < 2**31 else "i64", False
    if isinstance(value, int):
        if value == 1:
            return "const", 1, False
        return "arg", "i32" if -(2**31) <= value < 2**31 else "i64", value % 16 == 0
    if isinstance(value, float):
        return "arg", "fp32", False
    if isinstance(value, torch.Tensor):
        return "arg", "*" + _dtype_name(value.dtype), specialised and value.data_ptr() % 16 == 0
    if isinstance(value, TensorDescriptor):
        return "arg", f"tensordesc<{_dtype_name(value.base.dtype)}{list(value.block_shape)}>", False
    if hasattr(value, "__mangle__") and hasattr(value, "layout"):  # a Gluon descriptor: its type names the layout
        return "arg", value.__mangle__(), False
    if hasattr(value, "layout") and hasattr(value, "block_shape"):  # the same before triton 3.8 (no __mangle__)
        block = ",".join(str(v) for v in value.block_shape)
        return "arg", f"tensordesc<{_dtype_name(value.base.dtype)}[{block}],{value.layout!r}>", False
    raise TypeError(f"argument {name}: cannot specialise a {type(value).__name__}")


def variant_of(launch: Launch, kernel: str, name: str, origin: str = "default",
               targets: tuple[str, ...] = TARGETS_ALL) -> Variant:
    """The compile a recorded launch needs."""
    module, _, attr = launch.function.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    constexpr, unspecialised = _constexpr_params(fn), _unspecialised_params(fn)
    sig, const, aligned = {}, {}, []
    for arg, value in launch.arguments.items():
        kind, ty, align = _specialise(arg, value, arg in constexpr, arg not in unspecialised)
        if kind == "const":
            const[arg] = ty
        else:
            sig[arg] = ty
            if align:
                aligned.append(arg)
    # Gluon kernels take num_warps as a parameter as well as a launch option.
    warps = launch.options.get("num_warps", const.get("num_warps", 4))
    return Variant(kernel, name, launch.function, sig, const, int(warps),
                   int(launch.options.get("num_stages", 3)), tuple(aligned), targets, origin,
                   launch.options.get("maxnreg"))


# --------------------------------------------------------------------------------------
# Indexer prefill
# --------------------------------------------------------------------------------------
_FMT_D = (("fp8", 32), ("fp8", 64), ("fp8", 128), ("mxfp8", 32), ("mxfp8", 64), ("mxfp8", 128),
          ("mxfp4", 64), ("mxfp4", 128))
_HEADS = tuple(range(4, 129, 4))
_Q_ROWS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)
# (clean_logits, compressed): clean full layout, raw full layout, compressed, compressed + -inf tail.
_LAYOUTS = ((True, False), (False, False), (False, True), (True, True))
# Integer PrefillConfig fields other than the tile, and the values callers may set.
_PREFILL_INT_OPTIONS = {"head_unroll": (1, 2), "relu_via_abs": (0, 2), "mx_inline": (0, 1, 2, 3)}
_S_Q, _S_K, _MAX_SEQLEN_K = 37, 300, 45


def _layout_name(clean: bool, compressed: bool) -> str:
    return ("compressed" if compressed else "full") + ("+clean" if clean else "")


def _short(dtype) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16"}.get(str(dtype), str(dtype))


def _values(shape, fmt: str):
    """Zero-filled operand values in the dtype of ``fmt`` (the registry needs types, not data)."""
    import torch

    from tilefuse.formats import FP8_DTYPE

    if fmt == "mxfp4":
        return torch.zeros(*shape[:-1], shape[-1] // 2, dtype=torch.int8)
    return torch.zeros(shape, dtype=torch.uint8).view(FP8_DTYPE)


def _scales(shape, fmt: str):
    import torch

    if fmt == "fp8":
        return torch.ones(shape, dtype=torch.float32)
    return torch.full(shape, 0x7F7F7F7F, dtype=torch.int32)  # UE8M0 1.0 in every byte


@functools.cache
def _prefill_inputs(fmt: str, d: int, h: int):
    import torch

    q = (_values((_S_Q, h, d), fmt), None if fmt == "fp8" else _scales((_S_Q, h), fmt))
    k = (_values((_S_K, d), fmt), _scales((_S_K,), fmt))
    ks = torch.zeros(_S_Q, dtype=torch.int32)
    ke = torch.full((_S_Q,), _MAX_SEQLEN_K, dtype=torch.int32)
    return q, k, ks, ke


def prefill_option_configs(base) -> list:
    """One config per non-default option of ``PrefillConfig``: every boolean field set, every
    other non-tile field at the values of ``_PREFILL_INT_OPTIONS``.

    Raises:
        ValueError: a field the registry does not know how to vary (add it to the table).
    """
    out = []
    for f in dataclasses.fields(base):
        if f.name in _TILE_FIELDS or f.name in _GLUON_ONLY_FIELDS:
            continue
        value = getattr(base, f.name)
        if isinstance(value, bool):
            out.append(dataclasses.replace(base, **{f.name: not value}))
        elif f.name in _PREFILL_INT_OPTIONS:
            out += [dataclasses.replace(base, **{f.name: v}) for v in _PREFILL_INT_OPTIONS[f.name] if v != value]
        else:
            raise ValueError(f"PrefillConfig.{f.name}: no option values in the kernel registry")
    return out


def _config_label(cfg, base) -> str:
    tile = f"{cfg.block_q}x{cfg.block_n} w{cfg.num_warps}s{cfg.num_stages}"
    changed = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
               if f.name not in _TILE_FIELDS and getattr(cfg, f.name) != getattr(base, f.name)]
    return " ".join([tile, *changed])


def _prefill_points():
    """(fmt, d, h, config, clean, compressed, weights dtype, logits dtype, origin) to trace."""
    import torch

    from tilefuse.indexer import prefill

    f32, bf16 = torch.float32, torch.bfloat16
    for fmt, d in _FMT_D:
        # config -> the head counts that get it; many rows first, so a launch that a few-row
        # config shares with the many-row one (the MX recompute) keeps the many-row name
        picks: dict = {}
        for h in _HEADS:
            for s_q in reversed(_Q_ROWS):
                picks.setdefault(prefill.default_config(fmt, h, d, s_q), set()).add(h)
        for cfg, hs in picks.items():
            h = 64 if 64 in hs else sorted(hs)[len(hs) // 2]
            for clean, compressed in _LAYOUTS:
                yield fmt, d, h, cfg, clean, compressed, f32, f32, "default"
            if d == 128:
                rows = cfg.block_q if cfg.heads_on_n else 4096
                bf16_cfg = prefill.default_config(fmt, h, d, rows, bf16)
                yield fmt, d, h, bf16_cfg, True, False, bf16, bf16, "default"
                yield fmt, d, h, bf16_cfg, True, True, bf16, bf16, "default"
        base = prefill.default_config(fmt, 64, d, 4096)
        for opt in prefill_option_configs(base):
            if (opt.heads_on_n and fmt != "fp8") or opt.gluon or (opt.relu_via_abs and fmt == "mxfp8") or opt.mx_inline:
                continue  # heads_on_n: FP8 only; the Gluon kernel has its own builder (GPU-only launch);
                # relu_via_abs runs E4M3 operands (MXFP8 goes through f16); mx_inline: below
            if d == 128:  # options at D = 128
                yield fmt, d, 64, opt, True, False, f32, f32, "option"
        if fmt != "fp8":  # the few-row MX kernels, Hopper's defaults, every layout: at most 32 rows
            # (mx_inline=1), and few-row calls up to MX_INLINE_CALL pairs (mx_inline=3: the query
            # rows renormalised by producer programs of the launch)
            for inline in (prefill.default_config(fmt, 64, d, 16, arch=9),
                           prefill.default_config(fmt, 64, d, 64, arch=9, num_keys=4096)):
                for clean, compressed in _LAYOUTS:
                    yield fmt, d, 64, inline, clean, compressed, f32, f32, "default"
            if d == 128:  # the same rows by a first launch (mx_inline=2)
                yield fmt, d, 64, dataclasses.replace(inline, mx_inline=2), True, False, f32, f32, "option"


@functools.lru_cache(maxsize=1)
def _trace_prefill() -> tuple[Variant, ...]:
    from tilefuse.indexer import _dispatch, prefill

    main = f"{prefill.kern.__name__}:prefill_logits_kernel"
    heads_on_n = f"{prefill.kern.__name__}:prefill_heads_on_n_kernel"
    tail = f"{prefill.kern.__name__}:fill_outside_windows_kernel"
    renormalise = f"{prefill.kern.__name__}:mx_rows_renormalise_kernel"
    linear = f"{prefill.kern.__name__}:linear_term_parts_kernel"
    mx_few = f"{prefill.kern.__name__}:prefill_mx_few_rows_kernel"
    out = []
    for fmt, d, h, cfg, clean, compressed, w_dtype, out_dtype, origin in _prefill_points():
        q, k, ks, ke = _prefill_inputs(fmt, d, h)
        base = prefill.default_config(fmt, h, d, 4096)
        with tracing(main, heads_on_n, tail, renormalise, linear, mx_few) as launches:
            prefill.fp8_fp4_mqa_logits(q, k, _weights(_S_Q, h, w_dtype), ks, ke, clean,
                                       _MAX_SEQLEN_K if compressed else 0, out_dtype, config=cfg)
        extras = "".join(f" {n}={_short(t)}" for n, t in (("w", w_dtype), ("out", out_dtype)) if _short(t) != "fp32")
        # The targets whose dispatch runs this kernel for this format.
        targets = tuple(t for t in TARGETS_ALL if _dispatch.KERNEL_OF_PATH[
            _dispatch.prefill_kernel_path(TARGET_MAJOR[t], fmt)] == main)
        for launch in launches:
            if launch.function in (heads_on_n, mx_few):
                name = f"{fmt} D{d} H{h} {_layout_name(clean, compressed)} {_config_label(cfg, base)}{extras}"
                out.append(variant_of(launch, "indexer.prefill", name, origin, targets))
            elif launch.function == main:
                # MX on renormalised rows launches the kernel twice: the pass over the renormalised
                # rows (FP8 or f16 MMA), then the bf16 recompute of wide-span tiles.
                role = (" bf16-recompute" if launch.arguments.get("FIXUP")
                        else " renormalised-pass" if fmt != "fp8" and launch.arguments.get("FMT") == 0 else "")
                name = f"{fmt} D{d} H{h} {_layout_name(clean, compressed)} {_config_label(cfg, base)}{extras}{role}"
                out.append(variant_of(launch, "indexer.prefill", name, origin, targets))
            elif launch.function == renormalise:
                # One launch for both operands; it reads the weights (fp32 or bf16).
                name = " ".join(f"{k}={v}" for k, v in launch.arguments.items() if k.isupper())
                name += "" if _short(w_dtype) == "fp32" else f" w={_short(w_dtype)}"
                out.append(variant_of(launch, "indexer.mx_renormalise", name, "default"))
            elif launch.function == linear:
                name = " ".join(f"{k}={v}" for k, v in launch.arguments.items() if k.isupper())
                out.append(variant_of(launch, "indexer.linear_parts", name, origin))
            else:
                name = f"out={_short(out_dtype)} " + " ".join(
                    f"{k}={v}" for k, v in launch.arguments.items() if k.isupper())
                out.append(variant_of(launch, "indexer.prefill_fill", name, "default"))
    return tuple(out)


def _error_record():
    from tilefuse._errors import error_record

    return error_record("cpu")


def _weights(rows: int, h: int, dtype):
    import torch

    return torch.randn(rows, h, generator=torch.Generator().manual_seed(1)).to(dtype)


def prefill_variants() -> list[Variant]:
    """``prefill_logits_kernel`` as ``fp8_fp4_mqa_logits`` launches it, for the targets whose
    dispatch runs it (``_dispatch.PREFILL_KERNELS``: both for FP8, sm_90a only for MX).

    Defaults: every config ``default_config`` returns over (format, D) x H in 4..128 x S_q
    in 1..65536, each in the four output layouts (full/compressed x clean/raw) with fp32
    weights and logits, at H = 64 (or a head count that gets the config: H is the trip count
    of a run-time loop, so the code does not depend on it otherwise); at D = 128 also bf16
    weights and logits. Options: each non-tile ``PrefillConfig`` field flipped, at D = 128.
    """
    return _unique(v for v in _trace_prefill() if v.kernel == "indexer.prefill")


def prefill_gluon_variants() -> list[Variant]:
    """``prefill_logits_gluon_kernel`` (Hopper only) as its launcher builds it: E4M3 and f16
    operands (FP8; MXFP8 renormalised into f16) at D = 128, H = 64, in the four output layouts
    with fp32 logits and the clean layout with bf16 logits. Default: the tile ``default_config``
    picks on Hopper (64x128, 4 warps, 4 buffers; E4M3 with the head sum through |s| and a 2-part
    linear term, ``relu_via_abs``, refilled after every head, and for small calls
    (``SMALL_CALL``) with the plain head sum; f16 with the plain head sum, refilled
    two at a time); options: the other refills, the plain head sum (E4M3), 8 warps
    splitting the key tile (3 and 4 buffers). The launcher is
    called directly: the op only dispatches to it on an sm_90 GPU."""
    import torch

    from tilefuse.indexer import _prefill_kernel_gluon as gk
    from tilefuse.indexer import prefill

    path = f"{gk.__name__}:prefill_logits_gluon_kernel"
    h, d = 64, 128
    default = prefill.default_config("fp8", h, d, 4096, arch=9)
    mx_default = prefill.default_config("mxfp8", h, d, 4096, arch=9)
    w, nb = default.num_warps, default.num_stages
    # (warps, buffers, refill, linear-term parts, origin) per operand dtype
    small = prefill.default_config("fp8", h, d, 4096, arch=9, num_keys=prefill.SMALL_CALL // 4096)
    fp8_tiles = [(c.num_warps, c.num_stages, c.gluon_refill, c.relu_via_abs, "default")
                 for c in dict.fromkeys((default, small))]
    fp8_tiles += [t for t in [(w, nb, r, p, "option") for r in (1, 2) for p in (0, 2)] + [
        (8, 3, 1, 0, "option"), (8, 4, 1, 0, "option")] if t[:4] not in [d[:4] for d in fp8_tiles]]
    f16_tiles = [(mx_default.num_warps, mx_default.num_stages, mx_default.gluon_refill, 0, "default")]
    f16_tiles += [t for t in [(w, nb, 1, 0, "option"), (w, nb, 2, 0, "option"), (8, 3, 1, 0, "option"),
                              (8, 4, 1, 0, "option")] if t[:4] != f16_tiles[0][:4]]
    ks = torch.zeros(_S_Q, dtype=torch.int32)
    ke = torch.full((_S_Q,), _MAX_SEQLEN_K, dtype=torch.int32)
    out = []
    for dtype, tiles in ((torch.float8_e4m3fn, fp8_tiles), (torch.float16, f16_tiles)):
        q = torch.zeros(_S_Q, h, d, dtype=dtype)
        k = torch.zeros(_S_K, d, dtype=dtype)
        cases = [(clean, comp, torch.float32) for clean, comp in _LAYOUTS] + [(True, False, torch.bfloat16)]
        for num_warps, num_buf, refill, parts, origin in tiles:
            lin = torch.zeros(_S_Q, parts * d, dtype=dtype) if parts else None
            for clean, compressed, out_dtype in cases:
                cols = _MAX_SEQLEN_K if compressed else _S_K
                logits = torch.zeros(_S_Q, cols + (-cols) % 16, dtype=out_dtype)
                with tracing(path) as launches:
                    gk.launch(q, k, torch.ones(_S_K), _weights(_S_Q, h, torch.float32), ks, ke, logits, clean,
                              compressed, _error_record(), default.block_q, default.block_n, num_warps, num_buf,
                              refill_every=refill, lin_parts=lin, half_scale=torch.ones(_S_Q) if parts else None)
                name = (f"{_dtype_name(dtype)} D{d} H{h} {_layout_name(clean, compressed)} "
                        f"{default.block_q}x{default.block_n} w{num_warps} buf{num_buf}"
                        + (f" refill{refill}" if refill != 1 else "") + (f" abs{parts}" if parts else "")
                        + ("" if out_dtype == torch.float32 else f" out={_short(out_dtype)}"))
                out += [variant_of(launch, "indexer.prefill_gluon", name, origin, ("sm_90a",)) for launch in launches]
    return _unique(out)


def linear_parts_variants() -> list[Variant]:
    """``linear_term_parts_kernel`` (no dot), as ``relu_via_abs`` launches it."""
    return _unique(v for v in _trace_prefill() if v.kernel == "indexer.linear_parts")


def mx_renormalise_variants() -> list[Variant]:
    """``mx_rows_renormalise_kernel`` (no dot), as MX on renormalised rows launches it."""
    return _unique(v for v in _trace_prefill() if v.kernel == "indexer.mx_renormalise")


def prefill_fill_variants() -> list[Variant]:
    """``fill_outside_windows_kernel`` (no dot): the compressed tail and the separate clean pass."""
    return _unique(v for v in _trace_prefill() if v.kernel == "indexer.prefill_fill")


# --------------------------------------------------------------------------------------
# Indexer prefill, Blackwell MX kernel (sm_100 only)
# --------------------------------------------------------------------------------------
def prefill_sm100_variants() -> list[Variant]:
    """``prefill_logits_mx_kernel`` as its ``launch`` runs it, for the targets whose dispatch
    runs it (sm_100a): MXFP8 and MXFP4 at every D in the four layouts (H = 64, fp32); at
    D = 128 also bf16 weights + logits."""
    import torch

    from tilefuse.indexer import _dispatch
    from tilefuse.indexer import _prefill_kernel_sm100 as k100

    path = f"{k100.__name__}:prefill_logits_mx_kernel"
    f32, bf16 = torch.float32, torch.bfloat16
    points = []
    for fmt, d in _FMT_D:
        if fmt == "fp8":
            continue
        points += [(fmt, d, 64, clean, compressed, f32, f32) for clean, compressed in _LAYOUTS]
        if d == 128:
            points.append((fmt, d, 64, True, False, bf16, bf16))
    out = []
    for fmt, d, h, clean, compressed, w_dtype, out_dtype in points:
        (q, q_sf), (k, k_sf), ks, ke = _prefill_inputs(fmt, d, h)
        cols = _MAX_SEQLEN_K if compressed else _S_K
        logits = torch.empty_strided((_S_Q, cols), (-(-cols // 16) * 16, 1), dtype=out_dtype)  # rows padded as the op
        with tracing(path) as launches:
            k100.launch(q, q_sf, k, k_sf, _weights(_S_Q, h, w_dtype), ks, ke, logits, clean, compressed,
                        _error_record())
        extras = "".join(f" {n}={_short(t)}" for n, t in (("w", w_dtype), ("out", out_dtype)) if _short(t) != "fp32")
        (launch,) = launches
        c = launch.arguments
        name = (f"{fmt} D{d} H{h} {_layout_name(clean, compressed)} {c['BLOCK_Q']}x{c['BLOCK_N']} "
                f"w{launch.options['num_warps']}s{launch.options['num_stages']}{extras}")
        targets = tuple(t for t in TARGETS_ALL if _dispatch.KERNEL_OF_PATH[
            _dispatch.prefill_kernel_path(TARGET_MAJOR[t], fmt)] == path)
        out.append(variant_of(launch, "indexer.prefill_sm100", name, targets=targets))
    return _unique(out)


# --------------------------------------------------------------------------------------
# Indexer decode over a paged cache
# --------------------------------------------------------------------------------------
def paged_variants() -> list[Variant]:
    """``paged_logits_kernel`` as ``fp8_fp4_paged_mqa_logits`` launches it, with the config
    ``default_paged_config`` picks.

    Every (format, D) at next_n 1 and 2 (H = 64, 64-token pages, 1-D lengths, fp32, not
    cleaned: DeepGEMM's defaults); for FP8 at D = 128 also H = 8 and 128, next_n = 4 and 8,
    32- and 128-token pages, 2-D lengths, cleaning, bf16 weights + logits, varlen ``indices``,
    a page stride that is not a multiple of 16 bytes, and DeepGEMM's matrix case that faulted
    (32-token pages, next_n 6, bf16 weights + logits, 2-D lengths); for MXFP4 at D = 128
    H = 128, next_n = 4, 2-D lengths and cleaning; the tensor-core head sum (an option) for FP8
    D = 128 at next_n 1, 2 and 4; the TMA key loads (the FP8 default) also at next_n 4,
    128-token pages, 2-D lengths with bf16 weights + logits and cleaning, and as an option for
    MXFP8 and MXFP4 D = 128 at next_n 1 and 2.
    """
    import torch

    from tilefuse.indexer import paged

    path = f"{paged.kern.__name__}:paged_logits_kernel"
    f32, bf16 = torch.float32, torch.bfloat16
    batch, max_len = 3, 301
    out = []

    def one(fmt, d, h=64, next_n=1, block_kv=64, ctx_2d=False, clean=False, w_dtype=f32, out_dtype=f32,
            indices=False, page_pad=0, head_sum_mma=False, tma=False):
        lens = torch.tensor([37, max_len, 150], dtype=torch.int32)
        ctx = torch.stack([lens - next_n + 1 + t for t in range(next_n)], dim=1) if ctx_2d else lens
        pages = -(-max_len // block_kv)
        width = paged.paged_kv_cache_width(d, fmt)
        cache = paged.new_paged_kv_cache(batch * pages, block_kv, d, fmt,
                                         page_stride=block_kv * width + page_pad)
        table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        q = (_values((batch, next_n, h, d), fmt), None if fmt == "fp8" else _scales((batch, next_n, h), fmt))
        idx = torch.arange(batch, dtype=torch.int32) if indices else None
        meta = paged._schedule(ctx, block_kv, 5)  # the op reads its shape only
        default = paged.default_paged_config(fmt, next_n, h, d, block_kv)
        cfg = None
        if head_sum_mma or tma:
            cfg = dataclasses.replace(default, head_sum_mma=head_sum_mma, tma=tma)
        with tracing(path) as launches:
            paged.fp8_fp4_paged_mqa_logits(q, cache, _weights(batch * next_n, h, w_dtype), ctx, table, meta, max_len,
                                           clean, out_dtype, idx, config=cfg)
        (launch,) = launches
        c = launch.arguments
        extras = [x for x, on in (("ctx2d", ctx_2d), ("clean", clean), (f"w={_short(w_dtype)}", w_dtype != f32),
                                  (f"out={_short(out_dtype)}", out_dtype != f32), ("indices", indices),
                                  (f"page+{page_pad}", page_pad), ("head_sum_mma", head_sum_mma),
                                  ("tma", c["TMA"])) if on]
        name = (f"{fmt} D{d} H{h} next_n{next_n} kv{block_kv} rows{c['ROWS']}x{c['HEADS_P']} n{c['BLOCK_N']} "
                f"w{launch.options['num_warps']}s{launch.options['num_stages']}" + "".join(" " + x for x in extras))
        out.append(variant_of(launch, "indexer.paged", name, origin="default" if cfg in (None, default) else "option"))

    for fmt, d in _FMT_D:
        for next_n in (1, 2):
            one(fmt, d, next_n=next_n)
    for kw in ({"h": 8}, {"h": 128}, {"next_n": 4}, {"next_n": 8}, {"block_kv": 32}, {"block_kv": 128},
               {"ctx_2d": True}, {"ctx_2d": True, "next_n": 2}, {"clean": True}, {"w_dtype": bf16, "out_dtype": bf16},
               {"indices": True}, {"page_pad": 4},
               {"block_kv": 32, "next_n": 6, "ctx_2d": True, "w_dtype": bf16, "out_dtype": bf16}):
        one("fp8", 128, **kw)
    for kw in ({"h": 128}, {"next_n": 4}, {"ctx_2d": True, "next_n": 2}, {"clean": True}):
        one("mxfp4", 128, **kw)
    for next_n in (1, 2, 4):  # the tensor-core head sum (an option)
        one("fp8", 128, next_n=next_n, head_sum_mma=True)
    for kw in ({"next_n": 4}, {"block_kv": 128},  # TMA key loads (the FP8 default) beyond the defaults above
               {"ctx_2d": True, "next_n": 2, "w_dtype": bf16, "out_dtype": bf16, "clean": True}):
        one("fp8", 128, tma=True, **kw)
    for fmt in ("mxfp8", "mxfp4"):  # TMA key loads, an option for MX
        for next_n in (1, 2):
            one(fmt, 128, next_n=next_n, tma=True)
    return _unique(out)


def _traced_hopper_paged(path: str, h: int, next_n: int, block_kv: int, d: int, ctx_2d: bool, clean: bool, w_dtype,
                         out_dtype, indices: bool, cfg_fields: dict):
    """The one launch of kernel ``path`` by ``fp8_fp4_paged_mqa_logits`` on a small FP8 batch,
    with the config the op picks updated by ``cfg_fields`` and the dispatch's device test made
    to answer sm_90 (the Hopper decode kernels)."""
    import torch

    from tilefuse.indexer import paged

    batch, max_len = 3, 301
    lens = torch.tensor([37, max_len, 150], dtype=torch.int32)
    ctx = torch.stack([lens - next_n + 1 + t for t in range(next_n)], dim=1) if ctx_2d else lens
    pages = -(-max_len // block_kv)
    cache = paged.new_paged_kv_cache(batch * pages, block_kv, d, "fp8")
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    q = (_values((batch, next_n, h, d), "fp8"), None)
    idx = torch.arange(batch, dtype=torch.int32) if indices else None
    meta = paged._schedule(ctx, block_kv, 5)  # the op reads its shape only
    cfg = dataclasses.replace(paged.default_paged_config("fp8", next_n, h, d, block_kv), **cfg_fields)
    with tracing(path) as launches, mock.patch.object(paged, "_is_sm90", lambda device: True):
        paged._plans.clear()  # plans made without the GPU test would keep another kernel
        try:
            paged.fp8_fp4_paged_mqa_logits(q, cache, _weights(batch * next_n, h, w_dtype), ctx, table, meta, max_len,
                                           clean, out_dtype, idx, config=cfg)
        finally:
            paged._plans.clear()
    (launch,) = launches
    return launch


def paged_default(next_n: int, h: int, d: int, block_kv: int):
    """The FP8 decode config the op picks for this model."""
    from tilefuse.indexer import paged

    return paged.default_paged_config("fp8", next_n, h, d, block_kv)


def _extras(ctx_2d_name: str, ctx_on: bool, clean: bool, w_dtype, out_dtype, indices: bool) -> str:
    """The name's suffix of a decode variant's options."""
    import torch

    f32 = torch.float32
    on = ((ctx_2d_name, ctx_on), ("clean", clean), (f"w={_short(w_dtype)}", w_dtype != f32),
          (f"out={_short(out_dtype)}", out_dtype != f32), ("indices", indices))
    return "".join(" " + x for x, flag in on if flag)


def paged_gluon_variants() -> list[Variant]:
    """``paged_logits_gluon_kernel`` (Hopper only) as ``fp8_fp4_paged_mqa_logits`` launches it with
    ``PagedConfig(gluon=True)`` on an sm_90 GPU (the dispatch's device test made to say so): FP8
    D = 128, 64-key tiles, the ring as deep as the config's ``num_stages`` (3 or 4), 4 warps;
    H 16, 32 and 64 at next_n 1 and 2 (one and two query rows per dot: 16 to 128
    columns), 32-, 64- and 128-token pages (two boxes per tile, one, half a page), 1-D and 2-D
    lengths, cleaning, bf16 weights + logits, varlen ``indices``, four rows per dot (next_n 4,
    H 16), D = 64 and D = 32; as options 3 and 6 buffers, and 8 warps (two warpgroups, one per
    query row) at two and four rows."""
    import torch

    from tilefuse.indexer import _paged_kernel_gluon as gk

    path = f"{gk.__name__}:paged_logits_gluon_kernel"
    f32, bf16 = torch.float32, torch.bfloat16
    out = []

    def one(h, next_n, block_kv, d=128, ctx_2d=False, clean=False, w_dtype=f32, out_dtype=f32, indices=False,
            num_stages=None, num_warps=None, origin="default"):
        default = paged_default(next_n, h, d, block_kv)
        launch = _traced_hopper_paged(path, h, next_n, block_kv, d, ctx_2d, clean, w_dtype, out_dtype, indices,
                                      dict(block_n=64, gluon=True, num_stages=num_stages or default.num_stages,
                                           num_warps=num_warps or default.num_warps))
        c = launch.arguments
        name = (f"fp8 D{d} H{h} next_n{next_n} kv{block_kv} rows{c['ROWS']}x{c['HEADS_P']} n{c['BLOCK_N']} "
                f"w{c['num_warps']} buf{c['NUM_BUF']}" + _extras("ctx2d", ctx_2d, clean, w_dtype, out_dtype, indices))
        out.append(variant_of(launch, "indexer.paged_gluon", name, origin, ("sm_90a",)))

    for h in (16, 32, 64):
        for next_n in (1, 2):
            one(h, next_n, 64)
    one(64, 1, 32, clean=True)
    one(16, 2, 32, ctx_2d=True, clean=True)
    one(32, 2, 128, ctx_2d=True)
    one(64, 2, 64, ctx_2d=True, clean=True, w_dtype=bf16, out_dtype=bf16)
    one(64, 1, 64, indices=True)
    one(16, 4, 64, clean=True)
    one(32, 1, 64, d=64, ctx_2d=True)
    one(16, 2, 32, d=32, clean=True)
    one(64, 1, 64, num_stages=3, origin="option")
    one(64, 2, 32, num_stages=3, origin="option")
    # Two warpgroups, one query row's columns each (PagedConfig(num_warps=8)).
    one(64, 2, 64, num_warps=8, origin="option")
    one(32, 2, 32, ctx_2d=True, clean=True, num_warps=8, origin="option")
    one(16, 4, 64, clean=True, num_warps=8, origin="option")
    one(64, 2, 64, num_stages=6, num_warps=8, origin="option")
    return _unique(out)


def paged_persistent_variants() -> list[Variant]:
    """``paged_logits_ws_kernel`` (Hopper only) as ``fp8_fp4_paged_mqa_logits`` launches it with
    ``PagedConfig(persistent=True)`` on an sm_90 GPU (the dispatch's device test made to say
    so): FP8, H 64 at next_n 1, 2 and 4 (64 to 256 columns: three, two and one programs an SM),
    H 32 and 16, H 128; 32-, 64- and 128-token pages (two boxes per tile, one, half a page);
    1-D and 2-D lengths, cleaning, bf16 weights + logits, varlen ``indices``, D 64 and 32,
    next_n 3 (four rows' columns); as options 2 and 6 buffers, one or two programs an SM and the
    MMA split in halves of the query rows (next_n 2, 3, 4 and 8)."""
    import torch

    from tilefuse.indexer import _paged_kernel_ws as ws

    path = f"{ws.__name__}:paged_logits_ws_kernel"
    f32, bf16 = torch.float32, torch.bfloat16
    out = []

    def one(h, next_n, block_kv, d=128, ctx_2d=True, clean=False, w_dtype=f32, out_dtype=f32, indices=False,
            num_stages=None, ctas=0, split=False, origin="default"):
        default = paged_default(next_n, h, d, block_kv)
        launch = _traced_hopper_paged(path, h, next_n, block_kv, d, ctx_2d, clean, w_dtype, out_dtype, indices,
                                      dict(persistent=True, num_stages=num_stages or default.num_stages,
                                           ctas_per_sm=ctas, split_columns=split))
        name = (f"fp8 D{d} H{h} next_n{next_n} kv{block_kv} buf{launch.arguments['NUM_BUF']} "
                f"regs{launch.options['maxnreg']}" + (" split" if split else "")
                + _extras("ctx1d", not ctx_2d, clean, w_dtype, out_dtype, indices))
        out.append(variant_of(launch, "indexer.paged_persistent", name, origin, ("sm_90a",)))

    for next_n in (1, 2, 4):
        one(64, next_n, 64)
    one(32, 1, 64)
    one(32, 2, 64, ctx_2d=False, clean=True)
    one(16, 1, 64, d=64)
    one(128, 1, 64)
    one(64, 1, 32, clean=True)
    one(64, 2, 128, w_dtype=bf16, out_dtype=bf16)
    one(64, 1, 64, ctx_2d=False, indices=True)
    one(16, 8, 32, d=32, clean=True)
    one(64, 3, 64, clean=True)  # next_n not a power of two: a row of the box unused
    one(64, 2, 64, num_stages=6, origin="option")
    one(64, 2, 64, num_stages=2, origin="option")
    one(64, 1, 64, ctas=2, origin="option")
    one(64, 2, 64, ctas=1, origin="option")
    for next_n, kw in ((4, {}), (2, {}), (3, dict(clean=True, ctx_2d=False)), (2, dict(w_dtype=bf16, out_dtype=bf16))):
        one(64, next_n, 64, split=True, origin="option", **kw)  # the MMA in halves of the query rows
    one(16, 8, 32, d=32, clean=True, split=True, origin="option")
    return _unique(out)


def paged_schedule_variants() -> list[Variant]:
    """``paged_schedule_kernel`` as ``get_paged_mqa_logits_metadata`` launches it: 1-D and 2-D
    lengths."""
    import torch

    from tilefuse.indexer import paged

    out = []
    schedule = f"{paged.kern.__name__}:paged_schedule_kernel"
    for ctx in (torch.tensor([37, 301, 0], dtype=torch.int32), torch.tensor([[36, 37], [300, 301], [0, 0]],
                                                                             dtype=torch.int32)):
        with tracing(schedule) as launches:
            paged.get_paged_mqa_logits_metadata(ctx, 64, 132)
        (launch,) = launches
        out.append(variant_of(launch, "indexer.paged_schedule", f"schedule ctx{ctx.dim()}d"))
    return _unique(out)


def topk_merge_variants() -> list[Variant]:
    """``topk_merge_chunk_kernel`` as the top-k ops' chunk loop launches it (``topk._merge``):
    topk 2048 (DeepSeek-V3.2's) at the first, middle, last and only chunk of prefill windows,
    the first and only chunk of both decode windows, the last chunk with values from fp32 and
    bf16 logits; smaller top-k values (16, 40, 100, 512) at first/middle/last/only chunk. The
    rows a program holds are the GPU's (the interpreter's larger row blocks turned off). For
    sm_100a a subset (topk 2048 and 16 over prefill windows, the 1-D last steps from fp32 logits
    after each kind of pass: 8 warps after the passes over every key, 16, the default, after
    those over group maxima): the other configurations differ from those in their window loads, widths and
    values alone, compiled for sm_90a."""
    from unittest import mock

    import torch

    from tilefuse.indexer import topk

    path = f"{topk.kern.__name__}:topk_merge_chunk_kernel"
    modes = {topk.kern.WIN_PREFILL: "prefill", topk.kern.WIN_DECODE_1D: "decode1d",
             topk.kern.WIN_DECODE_2D: "decode2d"}
    chunks = ((True, False, "first"), (False, False, "middle"), (False, True, "last"), (True, True, "only"))
    out = []

    def one(k, rows, mode, first, final, chunk, logits_dtype=torch.float32, values=False):
        width, next_n = 301, 2 if mode != topk.kern.WIN_PREFILL else 1
        logits = torch.empty(rows, width, dtype=logits_dtype)
        bars, candidates, counts = topk._workspace(rows, k, 2, "cpu")
        win = torch.zeros((rows // next_n, next_n) if mode == topk.kern.WIN_DECODE_2D else rows, dtype=torch.int32)
        idx = torch.empty(rows, k, dtype=torch.int32)
        vals = torch.empty(rows, k, dtype=logits_dtype) if values else None
        with tracing(path) as launches, mock.patch.object(topk, "_INTERPRETER_KEYS_PER_PROGRAM", 0):
            topk._merge(logits, bars, candidates, counts, 37, width, win, win, 5000, 5000, next_n,
                        win.stride(0) if win.dim() == 2 else 1, 0, idx, vals, k, mode, first, final)
        (launch,) = launches
        c = launch.arguments
        extras = [x for x, on in ((f"logits={_short(logits_dtype)}", logits_dtype != torch.float32),
                                  ("values", values)) if on]
        name = (f"k{k} W{c['W']} rows{c['ROWS']} {modes[mode]} {chunk} w{launch.options['num_warps']}"
                + "".join(" " + x for x in extras))
        both = k in (16, 2048) and mode == topk.kern.WIN_PREFILL
        out.append(variant_of(launch, "indexer.topk_merge", name, targets=TARGETS_ALL if both else ("sm_90a",)))

    for first, final, chunk in chunks:
        one(2048, 64, topk.kern.WIN_PREFILL, first, final, chunk)
    for mode in (topk.kern.WIN_DECODE_1D, topk.kern.WIN_DECODE_2D):  # the window loads differ
        for first, final, chunk in (chunks[0], chunks[3]):
            one(2048, 64, mode, first, final, chunk)
    for dtype in (torch.float32, torch.bfloat16):  # the logits load and the values' store
        one(2048, 64, topk.kern.WIN_PREFILL, False, True, "last", logits_dtype=dtype, values=True)
    for k in (16, 40, 100, 512):
        for first, final, chunk in chunks:
            one(k, 300, topk.kern.WIN_PREFILL, first, final, chunk, values=final)

    # The last step after the passes across programs: the select starts from the passes'
    # histograms (RESET); at 8 and 16 warps (``_ACROSS_LAST_STEP_WARPS``).
    passes = f"{topk.kern.__name__}:topk_rows_pass_kernel"
    f32, f16 = torch.float32, torch.bfloat16
    for k, mode, dtype, values, maxima, warps in ((2048, topk.kern.WIN_DECODE_1D, f32, False, 0, 8),
                                                  (2048, topk.kern.WIN_DECODE_2D, f32, True, 0, 8),
                                                  (2048, topk.kern.WIN_DECODE_1D, f16, True, 0, 8),
                                                  (16, topk.kern.WIN_DECODE_1D, f32, False, 0, 8),
                                                  (2048, topk.kern.WIN_DECODE_1D, f32, False, 1, 8),
                                                  (2048, topk.kern.WIN_DECODE_2D, f32, True, 1, 8),
                                                  (2048, topk.kern.WIN_DECODE_1D, f32, False, 1, 16),
                                                  (2048, topk.kern.WIN_DECODE_2D, f32, True, 1, 16)):
        rows, next_n = 4, 2
        win = torch.zeros((rows // next_n, next_n) if mode == topk.kern.WIN_DECODE_2D else rows, dtype=torch.int32)
        logits = torch.empty(rows, 5000, dtype=dtype)
        with (tracing(path, passes) as launches, mock.patch.object(topk, "_INTERPRETER_KEYS_PER_PROGRAM", 0),
              mock.patch.object(topk, "_ACROSS_GROUP_MAXIMA", maxima),
              mock.patch.object(topk, "_ACROSS_LAST_STEP_WARPS", warps)):
            topk._topk_rows_across_programs(logits, win, win, k, mode, next_n,
                                            win.stride(0) if win.dim() == 2 else 1, values=values)
        (launch,) = [x for x in launches if x.function == path]
        c = launch.arguments
        extras = [x for x, on in ((f"logits={_short(dtype)}", dtype != torch.float32), ("values", values),
                                  ("maxima", maxima)) if on]
        name = (f"k{k} W{c['W']} rows{c['ROWS']} {modes[mode]} after-passes w{launch.options['num_warps']}"
                + "".join(" " + x for x in extras))
        # both targets at the default (16 warps after the passes over group maxima) and at 8
        # warps after the passes over every key
        both = k == 2048 and mode == topk.kern.WIN_DECODE_1D and dtype == f32 and warps == (16 if maxima else 8)
        out.append(variant_of(launch, "indexer.topk_merge", name, targets=TARGETS_ALL if both else ("sm_90a",)))
    return _unique(out)


def topk_rows_pass_variants() -> list[Variant]:
    """``topk_rows_pass_kernel`` as the decode top-k over whole rows launches it
    (``topk._topk_rows_across_programs``): its four passes over the keys (three digit
    histograms, the compaction) over 1-D decode lengths from fp32 logits, the compaction over
    2-D lengths (the window load differs), the first pass from bf16 logits (the logits load
    differs), the three passes over group maxima (``_ACROSS_GROUP_MAXIMA``: two digit
    histograms, the compaction), and the second digit pass of rows too short to hold the
    maxima between the passes."""
    from unittest import mock

    import torch

    from tilefuse.indexer import topk

    path = f"{topk.kern.__name__}:topk_rows_pass_kernel"
    merge = f"{topk.kern.__name__}:topk_merge_chunk_kernel"  # its variants are topk_merge's
    last = topk.kern.RADIX_LEVELS
    out = []
    one_d, f32 = topk.kern.WIN_DECODE_1D, torch.float32
    # (rows of 5000 keys hold their 4 programs' 4096 maxima between the passes, of 3000 not)
    for mode, dtype, passes, maxima, width in ((one_d, f32, range(last + 1), 0, 5000),
                                               (topk.kern.WIN_DECODE_2D, f32, (last,), 0, 5000),
                                               (one_d, torch.bfloat16, (0,), 0, 5000),
                                               (one_d, f32, range(last + 1), 1, 5000),
                                               (one_d, f32, (0, 1), 1, 3000)):
        rows, next_n = 4, 2
        win = torch.zeros((rows // next_n, next_n) if mode == topk.kern.WIN_DECODE_2D else rows, dtype=torch.int32)
        logits = torch.empty(rows, width, dtype=dtype)
        # traced launches are recorded, not run
        with tracing(path, merge) as launches, mock.patch.object(topk, "_ACROSS_GROUP_MAXIMA", maxima):
            topk._topk_rows_across_programs(logits, win, win, 2048, mode, next_n,
                                            win.stride(0) if win.dim() == 2 else 1)
        for launch in (x for x in launches if x.function == path and x.arguments["PASS"] in passes):
            name = "decode2d" if mode == topk.kern.WIN_DECODE_2D else "decode1d"
            extras = [x for x, on in (("maxima", maxima), ("unkept", maxima and not launch.arguments["KEEP"]))
                      if on]
            out.append(variant_of(launch, "indexer.topk_rows_pass",
                                  f"pass{launch.arguments['PASS']} {name} logits={_short(dtype)}"
                                  + "".join(" " + x for x in extras)))
    return _unique(out)


# --------------------------------------------------------------------------------------
# Tensor-parallel GEMMs (persistent GEMM core and communication kernels)
# --------------------------------------------------------------------------------------
_SMS = 132  # H200: the programs of a persistent launch (a constexpr; only the loop stride)
_FUSED_K = 2112  # ag_gemm pieces of 1024 columns: 3


def _gemm_configs(core) -> list:
    """Every tile ``default_config`` picks over a range of shapes."""
    picks = []
    for m in (128, 1024, 4096, 16384, 65536):
        for n in (512, 1024, 4096, 8192, 28672):
            cfg = core.default_config(m, n, 4096, _SMS)
            if cfg not in picks:
                picks.append(cfg)
    return picks


def _tp_variants() -> list[Variant]:
    import torch

    from tilefuse.tp import _ag_gemm as ag
    from tilefuse.tp import _gemm_core as core
    from tilefuse.tp import _gemm_rs as rs
    from tilefuse.tp import _primitives as P
    from tilefuse.tp._common import DEFAULT_TIMEOUT_S
    from tilefuse.tp.symm import emulated_workspaces

    paths = {f"{core.__name__}:_persistent_gemm": "tp.gemm", f"{ag.__name__}:_ag_push_kernel": "tp.comm",
             f"{ag.__name__}:_barrier_kernel": "tp.comm"}
    timeout = int(DEFAULT_TIMEOUT_S * 1e9)  # ns, as on a GPU
    bf16, fp16 = torch.bfloat16, torch.float16
    cfgs = _gemm_configs(core)
    out: list[Variant] = []

    def record(label: str, launches: list[Launch]) -> None:
        for launch in launches:
            kernel = paths[launch.function]
            c, o = launch.arguments, launch.options
            if kernel == "tp.gemm":
                epi = {0: "local", 1: "rs-push"}[c["EPI"]]
                name = (f"{label} {c['BM']}x{c['BN']}x{c['BK']} w{o['num_warps']}s{o.get('num_stages', 3)} "
                        f"epi={epi}{' wait_a' if c['WAIT_A'] else ''}{'' if c['ALIGNED'] else ' unaligned'}"
                        f"{' barrier' if c['BARRIER'] else ''}{' recv_tma' if c.get('RECV_TMA') else ''}"
                        f"{' local_a' if c.get('LOCAL_A') else ''}"
                        f"{' trace' if c.get('TRACE') else ''}")
                out.append(variant_of(launch, kernel, name))
            else:
                v = variant_of(launch, kernel, "")
                consts = " ".join(f"{k}={str(x).removeprefix(TL_DTYPE_PREFIX)}" for k, x in v.constexprs.items()
                                  if k.isupper() and k not in ("NUM_PROGRAMS", "MAX_EVENTS", "USE_TIMER", "TRACE"))
                traced = " trace" if v.constexprs.get("TRACE") else ""
                out.append(dataclasses.replace(v, name=f"{launch.function.partition(':')[2]} {consts}{traced}"))

    def tensors(m, n, k, dtype, b_layout):
        a = torch.zeros(m, k, dtype=dtype)
        b = torch.zeros((k, n) if b_layout == "kn" else (n, k), dtype=dtype)
        return a, b

    # Kernels read %globaltimer on a GPU: trace with the GPU's choice, not the interpreter's.
    with mock.patch.object(P, "use_timer", lambda device_type: True):
        # The GEMM alone: both tiles x B layouts x aligned or not (bf16), and fp16.
        for cfg in cfgs:
            for b_layout in ("kn", "nk"):
                for m in (2 * cfg.block_m, 200) if b_layout == "kn" else (2 * cfg.block_m,):
                    a, b = tensors(m, 264, 64, bf16, b_layout)
                    with tracing(*paths) as launches:
                        core.gemm(a, b, b_layout=b_layout, config=cfg, num_programs=_SMS)
                    record(f"gemm bf16 {b_layout}", launches)
        a, b = tensors(2 * cfgs[0].block_m, 264, 64, fp16, "kn")
        with tracing(*paths) as launches:
            core.gemm(a, b, config=cfgs[0], num_programs=_SMS)
        record("gemm fp16 kn", launches)

        # The activity trace (bench --trace) is compiled once per design, on the first tile.
        from tilefuse.tp.trace import TRACE_FIELDS

        def trace_buf(programs, traced):
            return torch.full((programs, 4, TRACE_FIELDS), -1, dtype=torch.int64) if traced else None

        # ag_gemm (8 ranks): both designs, every tile; the GEMM waits on the gathered rows.
        # Shapes with several tile rows per chunk and several K pieces, so that no count the
        # launch passes is 1 (Triton would compile that as a constant).
        world, k = 8, _FUSED_K
        for cfg in cfgs:
            for design, local, traced in (("ce", None, False), ("push", None, False), ("push", "sm", False),
                                          ("push", "ce", False), ("ce", None, True), ("push", None, True)):
                if (local == "ce" or traced) and cfg != cfgs[0]:  # only the push kernel changes / the trace
                    continue
                m = world * 8 * cfg.block_m
                plan = ag.make_plan(design, m, 264, k, world, 0, bf16, "cpu", config=cfg, num_programs=_SMS,
                                    local_copy=local)
                ws = emulated_workspaces(world, plan.n_flags, plan.data_bytes)[0]
                a_shard, b = tensors(m // world, 264, k, bf16, "kn")
                out_t = torch.empty(m, 264, dtype=bf16)
                with tracing(*paths) as launches:
                    if design == "push":
                        ag.launch_push(plan, ws, a_shard, timeout, trace=trace_buf(plan.comm_programs, traced))
                    else:
                        ag.launch_barrier(ws, timeout, "ag_gemm")
                    ag.launch_gemm_part(plan, ws, a_shard, b, out_t, "kn", timeout, trace=trace_buf(_SMS, traced))
                record(f"ag_gemm[{design}{'' if local is None else '/' + local}] W{world} bf16 kn", launches)

        # gemm_rs push at 2 and 8 ranks, every tile; unaligned chunks once; the owner's partials
        # by TMA on the wide tile; traced at 8 with the plan's own choices (None).
        for cfg in cfgs:
            for design in rs.DESIGNS:
                for world, rows, tma, traced in (
                        (2, 2 * cfg.block_m, False, False), (8, 2 * cfg.block_m, False, False),
                        (8, 200, False, False), (2, 2 * cfg.block_m, True, False), (8, 2 * cfg.block_m, None, True)):
                    if (rows == 200 or world == 2) and (design != "push" or cfg != cfgs[0]):
                        continue
                    if traced and cfg != cfgs[0]:
                        continue
                    m = world * rows
                    plan = rs.make_plan(design, m, 264, 64, world, 0, bf16, "cpu", config=cfg, num_programs=_SMS,
                                        recv_tma=tma)
                    ws = emulated_workspaces(world, plan.n_flags, plan.data_bytes)[0]
                    a, b = tensors(m, 264, 64, bf16, "kn")
                    out_t = torch.empty(rows, 264, dtype=bf16)
                    with tracing(*paths) as launches:
                        rs.launch_gemm_part(plan, ws, a, b, out_t, "kn", timeout, trace=trace_buf(_SMS, traced))
                    record(f"gemm_rs[{design}] W{world} bf16 kn", launches)
    return out


def tp_rs_gluon_variants() -> list[Variant]:
    """gemm_rs push's Gluon kernel (``send_tma``, W = 2, Hopper only) as the op launches it
    (``launch_gemm_part`` on emulated workspaces, the plan made as on an sm_90 GPU): every tile
    ``default_config`` picks with B as [K, N] and [N, K]; traced on the first tile."""
    import torch

    from tilefuse.tp import _gemm_core as core
    from tilefuse.tp import _gemm_rs as rs
    from tilefuse.tp import _gemm_rs_gluon as gk
    from tilefuse.tp import _primitives as P
    from tilefuse.tp._common import DEFAULT_TIMEOUT_S
    from tilefuse.tp.symm import emulated_workspaces
    from tilefuse.tp.trace import TRACE_FIELDS

    path = f"{gk.__name__}:rs_push_gluon_kernel"
    timeout = int(DEFAULT_TIMEOUT_S * 1e9)  # ns, as on a GPU
    bf16 = torch.bfloat16
    cfgs = _gemm_configs(core)
    out = []
    with mock.patch.object(P, "use_timer", lambda device_type: True), \
            mock.patch.object(rs, "capability_major", lambda device: 9):
        for cfg in cfgs:
            for b_layout, traced in (("kn", False), ("nk", False), ("kn", True)):
                if traced and cfg != cfgs[0]:
                    continue
                rows, n, k = 2 * cfg.block_m, 264, 4 * cfg.block_k
                plan = rs.make_plan("push", 2 * rows, n, k, 2, 0, bf16, "cpu", config=cfg, num_programs=_SMS)
                assert plan.send_tma
                ws = emulated_workspaces(2, plan.n_flags, plan.data_bytes)[0]
                a = torch.zeros(2 * rows, k, dtype=bf16)
                b = torch.zeros((k, n) if b_layout == "kn" else (n, k), dtype=bf16)
                trace = torch.full((_SMS, 4, TRACE_FIELDS), -1, dtype=torch.int64) if traced else None
                with tracing(path) as launches:
                    rs.launch_gemm_part(plan, ws, a, b, torch.zeros(rows, n, dtype=bf16), b_layout, timeout,
                                        trace=trace)
                name = (f"gemm_rs[push/x1] W2 bf16 {b_layout} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} "
                        f"w{cfg.num_warps}s{cfg.num_stages}" + (" trace" if traced else ""))
                out += [variant_of(launch, "tp.rs_gluon", name, "default", ("sm_90a",)) for launch in launches]
    return _unique(out)


@functools.cache
def _tp_all() -> tuple[Variant, ...]:
    return tuple(_tp_variants())


def tp_gemm_variants() -> list[Variant]:
    """``_persistent_gemm`` as ``gemm``, ``ag_gemm`` and ``gemm_rs`` launch it (their launch
    functions, on emulated workspaces, with the GPU's timer and timeout): every tile
    ``default_config`` picks; the GEMM alone in bf16 with B as [K, N] (chunks aligned to the
    tile or not) and [N, K], and in fp16; ag_gemm's two designs at 8 ranks; gemm_rs's push
    epilogue at 8 and 2 ranks (the reduction is unrolled over the ranks) and with unaligned
    chunks."""
    return _unique(v for v in _tp_all() if v.kernel == "tp.gemm")


def tp_comm_variants() -> list[Variant]:
    """The communication kernels (no dot) launched beside those GEMMs: ag_gemm's push and
    barrier kernels."""
    return _unique(v for v in _tp_all() if v.kernel == "tp.comm")


# --------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------
def _unique(variants) -> list[Variant]:
    """Drop variants that compile to the same code as an earlier one (same name: an error)."""
    seen: dict[tuple, Variant] = {}
    names: set[str] = set()
    for v in variants:
        key = v.compile_key()
        if key in seen:
            continue
        if v.name in names:
            raise ValueError(f"{v.kernel}: two different compiles named {v.name!r}")
        seen[key] = v
        names.add(v.name)
    return list(seen.values())


# kernel name -> (builder, module the kernel lives in)
KERNELS: dict[str, tuple[Callable[[], list[Variant]], str]] = {
    "indexer.prefill": (prefill_variants, "tilefuse.indexer._prefill_kernel"),
    "indexer.prefill_fill": (prefill_fill_variants, "tilefuse.indexer._prefill_kernel"),
    "indexer.mx_renormalise": (mx_renormalise_variants, "tilefuse.indexer._prefill_kernel"),
    "indexer.linear_parts": (linear_parts_variants, "tilefuse.indexer._prefill_kernel"),
    "indexer.prefill_sm100": (prefill_sm100_variants, "tilefuse.indexer._prefill_kernel_sm100"),
    "indexer.prefill_gluon": (prefill_gluon_variants, "tilefuse.indexer._prefill_kernel_gluon"),
    "indexer.paged": (paged_variants, "tilefuse.indexer._paged_kernel"),
    "indexer.paged_gluon": (paged_gluon_variants, "tilefuse.indexer._paged_kernel_gluon"),
    "indexer.paged_persistent": (paged_persistent_variants, "tilefuse.indexer._paged_kernel_ws"),
    "indexer.paged_schedule": (paged_schedule_variants, "tilefuse.indexer._paged_kernel"),
    "indexer.topk_merge": (topk_merge_variants, "tilefuse.indexer._topk_kernel"),
    "indexer.topk_rows_pass": (topk_rows_pass_variants, "tilefuse.indexer._topk_kernel"),
    "tp.gemm": (tp_gemm_variants, "tilefuse.tp._gemm_core"),
    "tp.comm": (tp_comm_variants, "tilefuse.tp._comm_kernels"),
    "tp.rs_gluon": (tp_rs_gluon_variants, "tilefuse.tp._gemm_rs_gluon"),
}


def kernel_names() -> list[str]:
    """Registered kernels whose module is part of this installation."""
    return [name for name, (_, module) in KERNELS.items() if importlib.util.find_spec(module) is not None]


def variants(kernel: str | None = None, target: str | None = None) -> list[Variant]:
    """Variants of one kernel (or of all), optionally only those built for ``target``.

    Raises:
        ValueError: unknown kernel or target.
    """
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel: unknown {kernel!r}; registered: {sorted(KERNELS)}")
    if target is not None and target not in TARGETS_ALL:
        raise ValueError(f"target: expected one of {TARGETS_ALL}, got {target!r}")
    names = [kernel] if kernel is not None else kernel_names()
    out = [v for name in names for v in KERNELS[name][0]()]
    return [v for v in out if target is None or target in v.targets]
