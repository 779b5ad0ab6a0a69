"""Numerics fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``).

The interpreter stores bf16 as raw uint16 and fp8 as raw uint8 and then does arithmetic on
the raw bits; its float casts truncate instead of rounding and do not saturate fp8. Kernels
that are correct on a GPU therefore give garbage there. ``patch_interpreter_numerics`` routes
float casts through torch (round to nearest even, fp8 saturating at its max) and computes bf16
arithmetic and bf16 ``tl.dot`` in fp32, rounding the result back to bf16. It also gives xor
reductions (``tl.xor_sum``, and ``tl.flip``, which is built of them) numpy's reduction instead of
the interpreter's element-by-element Python loop (a ``[1, 256]`` flip took ~4 s).

It touches interpreter internals: the tests check it after every triton bump
(``tests/test_interpreter_patch.py``). It is a no-op when the interpreter is not in use.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

_PATCHED = False


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter_numerics() -> None:
    """Apply the fixes once; safe to call many times."""
    global _PATCHED
    if _PATCHED or not interpreter_enabled():
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    torch_dtypes = {
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    storage = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
    saturate = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
    handle = interp.TensorHandle
    builder = interp.InterpreterBuilder

    def to_torch(data: np.ndarray, tt) -> torch.Tensor:
        td = torch_dtypes[tt]
        t = torch.from_numpy(np.ascontiguousarray(data))
        return t.view(td) if td in storage else t

    def to_numpy(t: torch.Tensor, tt) -> np.ndarray:
        td = torch_dtypes[tt]
        if td in storage:
            arr = t.contiguous().view(storage[td]).numpy()
            return arr.view(np.uint16) if td == torch.bfloat16 else arr
        return t.numpy()

    def float_cast(src, dst_tt):
        x = to_torch(src.data, src.dtype.scalar)
        td = torch_dtypes[dst_tt]
        if td in saturate:
            x = x.float()
            x = torch.where(x.isnan(), x, x.clamp(-saturate[td], saturate[td]))
        return handle(to_numpy(x.to(td), dst_tt), dst_tt)

    def is_float(tt) -> bool:
        return tt in torch_dtypes

    orig_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if is_float(s) and is_float(d):
            return float_cast(src, d)
        if s == tl.bfloat16:  # bf16 -> int, through fp32
            return orig_cast(self, float_cast(src, tl.float32), d)
        if d == tl.bfloat16:  # int -> bf16, through fp32
            return float_cast(orig_cast(self, src, tl.float32), d)
        return orig_cast(self, src, dst_type)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        return float_cast(src, dst_type.scalar)

    def bf16_as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return float_cast(h, tl.float32)
        return h

    def via_f32(fn):
        @functools.wraps(fn)
        def wrapped(self, *args):
            if not any(getattr(a, "dtype", None) is not None and a.dtype.scalar == tl.bfloat16 for a in args):
                return fn(self, *args)
            out = fn(self, *[bf16_as_f32(a) for a in args])
            if out.data.dtype == np.float32:
                return float_cast(handle(out.data, tl.float32), tl.bfloat16)
            return handle(out.data, tl.bfloat16)

        return wrapped

    names = [n for n in dir(builder) if n.startswith(("create_f", "create_minimumf", "create_maximumf",
                                                        "create_minnumf", "create_maxnumf"))]
    skip = {"create_fp_to_fp", "create_fp_ext", "create_fp_trunc", "create_fp_to_si", "create_fp_to_ui",
            "create_fabs"}
    for name in names:
        if name not in skip and callable(getattr(builder, name)):
            setattr(builder, name, via_f32(getattr(builder, name)))

    orig_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a, b = bf16_as_f32(a), bf16_as_f32(b)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    xor_combine = getattr(tl.standard, "_xor_combine", None)
    orig_reduce = interp.ReduceOps.apply_impl

    def reduce_impl(self, input):
        if xor_combine is not None and self.combine_fn is xor_combine:
            x = input[0]
            return self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims),
                                  x.dtype)
        return orig_reduce(self, input)

    interp.ReduceOps.apply_impl = reduce_impl
    builder.cast_impl = cast_impl
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui",
                 "create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder.create_fp_to_fp = fp_to_fp
    builder.create_dot = create_dot
    _PATCHED = True
