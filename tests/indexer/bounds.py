"""A bounds checker for Triton's CPU interpreter (test helper).

The interpreter reads and writes host memory through raw addresses and checks nothing, so a
kernel whose logic strays out of its tensors passes on CPU and faults on the GPU. Inside
:func:`checked_bounds`, every interpreted launch records the byte ranges of its tensor
arguments (tensor views: from the first to one past the last element they address), and every
load, store and atomic asserts that each enabled lane's element lies inside one of them;
``tl.gather`` asserts its indices lie inside the source. A violation raises
:class:`OutOfBounds` (wrapped by the interpreter in an ``InterpreterError``) naming the
kernel, the program, the access and the nearest argument.

``speculate=True`` also runs what Triton's software pipeliner runs that the interpreter does
not: every ``tl.range`` loop goes on for ``num_stages - 1`` iterations past its end, with
memory access suppressed (loads return their ``other``, stores and atomics do nothing, as the
pipeliner predicates them) but every pure op evaluated, so a gather whose index leaves its
source at a tile past the end is caught. The outputs of such a run are not meaningful (loop-
carried values see the extra iterations): check values in a run without it.

It patches interpreter internals, like ``tilefuse._interpreter``; a no-op without the
interpreter would hide faults, so entering it without ``TRITON_INTERPRET=1`` raises.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tilefuse._interpreter import interpreter_enabled


class OutOfBounds(AssertionError):
    """An interpreted kernel addressed memory outside its tensor arguments."""


class _State:
    def __init__(self):
        self.kernel = "?"
        self.names: list[str] = []
        self.lo = np.zeros(0, dtype=np.uint64)  # merged, sorted byte ranges [lo, hi)
        self.hi = np.zeros(0, dtype=np.uint64)
        self.spans: list[tuple[str, int, int]] = []  # per argument, for messages
        self.accesses = 0
        self.speculating = False
        self.speculated = 0  # extra iterations run


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + (last + 1) * t.element_size()


def _collect(state: _State, fn_name: str, names, args_hst, kwargs_hst) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    spans = []

    def visit(name, arg):
        if isinstance(arg, TensorDescriptor):
            arg = arg.base
        if isinstance(arg, tuple):
            for i, a in enumerate(arg):
                visit(f"{name}[{i}]", a)
        elif isinstance(arg, torch.Tensor):
            ext = _extent(arg)
            if ext is not None:
                spans.append((name, *ext))

    for name, arg in zip(names, args_hst):
        visit(name, arg)
    for name, arg in kwargs_hst.items():
        visit(name, arg)
    merged: list[list[int]] = []
    for _, lo, hi in sorted(spans, key=lambda s: s[1]):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    state.kernel = fn_name
    state.spans = spans
    state.lo = np.array([m[0] for m in merged], dtype=np.uint64)
    state.hi = np.array([m[1] for m in merged], dtype=np.uint64)


def _check(state: _State, builder, what: str, ptrs, mask) -> None:
    if state.speculating:
        return
    addr = np.asarray(ptrs.data, dtype=np.uint64)
    # A tensor-descriptor load passes its mask as a numpy array, the others as a TensorHandle.
    mask = mask if mask is None or isinstance(mask, np.ndarray) else mask.data
    on = np.ones(addr.shape, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool),
                                                                             addr.shape)
    addr = addr[on]
    if addr.size == 0:
        return
    state.accesses += int(addr.size)
    size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    idx = np.searchsorted(state.lo, addr, side="right").astype(np.int64) - 1
    inside = idx >= 0
    end = np.where(inside, state.hi[np.maximum(idx, 0)], 0)
    inside &= addr + np.uint64(size) <= end
    if inside.all():
        return
    bad = int(addr[~inside][0])
    near = min(state.spans, key=lambda s: min(abs(bad - s[1]), abs(bad - s[2])), default=("?", 0, 0))
    where = "before" if bad < near[1] else "past the end of"
    off = near[1] - bad if bad < near[1] else bad + size - near[2]
    raise OutOfBounds(
        f"{state.kernel}: program {tuple(builder.grid_idx)} {what} {int((~inside).sum())} of {addr.size} lanes "
        f"outside every argument; first at {off} bytes {where} {near[0]!r} ({near[2] - near[1]} bytes)")


@contextlib.contextmanager
def checked_bounds(speculate: bool = False):
    """Check every memory access of the kernels interpreted inside the block; yields the state
    (``state.accesses`` counts the checked lanes, ``state.speculated`` the extra iterations,
    so a test can see the checker ran)."""
    if not interpreter_enabled():
        raise RuntimeError("checked_bounds needs Triton's interpreter (TRITON_INTERPRET=1)")
    from triton.runtime import interpreter as interp

    state = _State()
    builder_cls = interp.InterpreterBuilder
    executor = interp.GridExecutor
    saved = {name: getattr(builder_cls, name) for name in
             ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas", "create_gather")}
    saved_init = executor._init_args_hst

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = saved_init(self, args_dev, kwargs)
        _collect(state, getattr(self.fn, "__name__", "?"), self.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    def masked_load(self, ptrs, mask, other, *rest, **kw):  # tensor-descriptor loads come with keywords
        if state.speculating:
            off = np.zeros(np.shape(ptrs.data), dtype=bool)
            if not isinstance(mask, np.ndarray):
                off = interp.TensorHandle(off, mask.dtype)
            return saved["create_masked_load"](self, ptrs, off, other, *rest, **kw)
        _check(state, self, "loads", ptrs, mask)
        return saved["create_masked_load"](self, ptrs, mask, other, *rest, **kw)

    def masked_store(self, ptrs, value, mask, *rest):
        if state.speculating:
            return None
        _check(state, self, "stores", ptrs, mask)
        return saved["create_masked_store"](self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptr, val, mask, *rest):
        if state.speculating:
            return interp.TensorHandle(np.zeros_like(val.data), val.dtype.scalar)
        _check(state, self, "atomically updates", ptr, mask)
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, *rest)

    def atomic_cas(self, ptr, cmp, val, *rest):
        if state.speculating:
            return interp.TensorHandle(np.zeros_like(cmp.data), cmp.dtype.scalar)
        _check(state, self, "compares-and-swaps", ptr, None)
        return saved["create_atomic_cas"](self, ptr, cmp, val, *rest)

    def gather(self, src, indices, axis):
        idx = np.asarray(indices.data)
        n = src.data.shape[axis]
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise OutOfBounds(f"{state.kernel}: program {tuple(self.grid_idx)} gathers index "
                              f"{int(idx.min() if idx.min() < 0 else idx.max())} from {n} elements")
        return saved["create_gather"](self, src, indices, axis)

    saved_patch_lang = interp._patch_lang

    def patch_lang(fn):
        import triton.language as tl

        scope = saved_patch_lang(fn)
        interpreted_range = tl.range
        if getattr(interpreted_range, "speculative", False):  # a nested call: already in place
            return scope

        def speculative_range(arg1, arg2=None, step=None, num_stages=None, **kwargs):
            loop = interpreted_range(arg1, arg2, step)
            yield from loop
            state.speculating = True
            try:
                for k in range(max(0, (3 if num_stages is None else int(num_stages)) - 1)):
                    state.speculated += 1
                    yield loop.start + (len(loop) + k) * loop.step
            finally:
                state.speculating = False

        speculative_range.speculative = True
        scope.set_attr(tl, "range", speculative_range)
        return scope

    patches = {"create_masked_load": masked_load, "create_masked_store": masked_store,
               "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas, "create_gather": gather}
    try:
        for name, fn in patches.items():
            setattr(builder_cls, name, fn)
        executor._init_args_hst = init_args
        if speculate:
            interp._patch_lang = patch_lang
        yield state
    finally:
        for name, fn in saved.items():
            setattr(builder_cls, name, fn)
        executor._init_args_hst = saved_init
        interp._patch_lang = saved_patch_lang
