"""Triton JIT compilations: counting them, and computing the specialisation key of a launch.

A kernel compiles once per distinct key: the types of its runtime arguments with what Triton
specialises on their values (an int equal to 1 becomes a constant, ints and pointers divisible
by 16 are marked so), the constexpr values and the launch options. Sizes that change every
call (sequence lengths, strides, batch) must therefore be ``do_not_specialize`` parameters
(``do_not_specialize_on_alignment`` for pointers into caller-owned buffers that may be sliced
anywhere), or every new value class is a new compile on the hot path.

* :func:`count_compiles`: a context manager counting the compilations that happen inside it
  (``triton.knobs.runtime.jit_post_compile_hook``), for GPU tests and benchmarks.
* :func:`specialization_key`: the key a launch with given arguments would compile under,
  computed on any machine (no GPU, also under ``TRITON_INTERPRET=1``), as the CUDA launcher
  computes it.
* :func:`host_descriptor`: a host tensor descriptor without its constructor's checks, for
  launch paths whose arguments were validated already.
* :func:`cdiv`, :func:`next_power_of_2`: host-side integer helpers (Triton's are
  ``ConstexprFunction`` wrappers costing microseconds per call on a launch path).
* :class:`Launcher`: launches a kernel by a key its caller computes, calling the compiled
  kernel's launcher directly once that key has been launched through ``kernel[grid](...)``:
  Triton's binder and cache lookup cost more host time than the launch itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import threading

import torch
import triton

_lock = threading.Lock()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0, as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclasses.dataclass
class CompileLog:
    """Compilations seen: one ``(kernel name, key repr)`` per compile, in order."""

    compiles: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.compiles)

    def kernels(self) -> list[str]:
        """Names of the kernels compiled, each once, in order of first compile."""
        return list(dict.fromkeys(name for name, _ in self.compiles))


def _hooks():
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        raise RuntimeError("count_compiles needs triton.knobs.runtime.jit_post_compile_hook "
                           f"(triton {triton.__version__})")
    return runtime


@contextlib.contextmanager
def count_compiles():
    """Count the JIT compilations (of every kernel) inside the block; yields a :class:`CompileLog`.

    Chains to a hook that was installed before and restores it on exit. The interpreter never
    compiles, so under ``TRITON_INTERPRET=1`` the log stays empty.
    """
    runtime = _hooks()
    log = CompileLog()
    with _lock:
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(getattr(fn, "fn", fn), "__qualname__", None) or getattr(fn, "name", "?")
            log.compiles.append((str(name), str(kwargs.get("repr", ""))))
            if previous is not None:
                return previous(*args, **kwargs)
            return None

        runtime.jit_post_compile_hook = hook
    try:
        yield log
    finally:
        with _lock:
            runtime.jit_post_compile_hook = previous


@functools.cache
def _binder(fn):
    """Triton's own argument binder for the Python function behind ``fn`` (a ``@triton.jit``
    object, an interpreted one, or a Gluon one), with the same ``do_not_specialize`` lists."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if isinstance(fn, JITFunction):
        jit = fn
    else:  # InterpretedFunction: the decorator's arguments are kept in .kwargs
        kwargs = getattr(fn, "kwargs", {})
        jit = JITFunction(fn.fn, do_not_specialize=kwargs.get("do_not_specialize"),
                          do_not_specialize_on_alignment=kwargs.get("do_not_specialize_on_alignment"))
    return create_function_from_signature(jit.signature, jit.params, CUDABackend)


def specialization_key(fn, arguments: dict, options: dict | None = None) -> tuple:
    """The key a CUDA launch of ``fn`` with these arguments (parameter name -> value, as
    :class:`tilefuse.kernelcheck.variants.Launch` records them) compiles under: per argument
    its type and value specialisation (constexprs: their value), then the launch options.
    Two launches with equal keys share one compile."""
    binder = _binder(fn)
    _, specialization, _ = binder(**arguments)
    opts = tuple(sorted((options or {}).items()))
    return tuple((kind, value) for kind, value in specialization) + opts


_templates: dict[tuple, object] = {}


def host_descriptor(cls, base, shape, strides, block_shape, **fields):
    """``cls(base, shape, strides, block_shape, **fields)`` (Triton's or Gluon's host
    ``TensorDescriptor``) without running its ``__post_init__`` checks, which cost more than
    the rest of an op's host work: the caller has checked what they check (16-byte aligned
    base and strides, unit last stride, positive sizes). One descriptor per (class, block,
    fields) is built the checked way as a template; the others copy its fields, so fields a
    Triton version adds keep their defaults."""
    key = (cls, tuple(block_shape), *fields.items())
    template = _templates.get(key)
    if template is None:
        template = cls(base, list(shape), list(strides), list(block_shape), **fields)
        template.base = None  # the template keeps no tensor alive
        _templates[key] = template
    desc = object.__new__(cls)
    desc.__dict__.update(template.__dict__)
    desc.base, desc.shape, desc.strides = base, shape, strides
    return desc


# ---------------------------------------------------------------------------------------
# Direct launches
# ---------------------------------------------------------------------------------------
_audit = os.environ.get("TILEFUSE_AUDIT_LAUNCH_KEYS", "0") not in ("", "0")


def set_launch_audit(on: bool) -> None:
    """Audit mode: every :class:`Launcher` launch also computes Triton's own specialisation key
    (``specialization_key``) and raises if one caller key ever stands for two of them. The
    CPU tests run in this mode, so each interpreted launch checks its call site's key. Also on
    at import with ``TILEFUSE_AUDIT_LAUNCH_KEYS=1``."""
    global _audit
    _audit = bool(on)


_launchers: list = []


def launchers() -> list:
    """Every :class:`Launcher` made so far (tests redirect the ones of a kernel they spy on)."""
    return list(_launchers)


@contextlib.contextmanager
def redirected(real, replacement):
    """Launches of the kernel ``real`` through any :class:`Launcher` go to ``replacement``
    (``replacement[grid](*args, **options)``, every launch) inside the block."""
    saved = [(lr, lr.fn, lr._direct) for lr in _launchers if lr.kernel is real]
    try:
        for lr, _, _ in saved:
            lr.fn, lr._direct = replacement, False
        yield
    finally:
        for lr, fn, direct in saved:
            lr.fn, lr._direct = fn, direct


def _hooks_idle(hook) -> bool:
    """No launch hook is installed (None, or an empty ``HookChain`` as triton 3.6 keeps it)."""
    return hook is None or not getattr(hook, "calls", True)


class Launcher:
    """Launches one ``@triton.jit`` (or Gluon) kernel by a key its caller computes.

    ``launcher(key, grid, args, options)``: ``args`` are every parameter of the kernel in
    signature order, constexprs and defaulted ones included; ``options`` the launch options
    (``num_warps``, ``num_stages``). ``key`` must determine the compile: the constexpr values
    and options, the dtype of every tensor, which arguments are None, and anything else Triton
    specialises on (the alignment of pointers that are not ``do_not_specialize_on_alignment``,
    the value classes of ints that are not ``do_not_specialize``, ints past int32). The first
    launch of a key on a device goes through ``kernel[grid](...)`` (compiling if needed); the
    next ones call the compiled kernel's launcher with the same arguments, as Triton's own
    ``run`` ends. Launch hooks installed in ``triton.knobs`` (profilers) and the interpreter
    take the ordinary path every time. :func:`set_launch_audit` checks the keys.
    """

    __slots__ = ("fn", "kernel", "name", "arg_names", "_direct", "_compiled", "_audited")

    def __init__(self, fn):
        from triton.runtime.jit import JITFunction

        self.fn = self.kernel = fn  # fn: what launches (tests may redirect it); kernel: the kernel
        self.name = getattr(getattr(fn, "fn", fn), "__name__", "kernel")
        self.arg_names = tuple(fn.arg_names)
        self._direct = isinstance(fn, JITFunction)  # not the interpreter's InterpretedFunction
        self._compiled: dict = {}
        self._audited: dict = {}
        _launchers.append(self)

    def __call__(self, key, grid, args: tuple, options: dict | None = None) -> None:
        if _audit:
            self._audit(key, args, options)
        if self._direct:
            hit = self._compiled.get(key)
            if hit is not None:
                device, current_device, stream_of, run, function, metadata, runtime = hit
                if _hooks_idle(runtime.launch_enter_hook) and current_device() == device:
                    n = len(grid)
                    if run.__class__ is _UnprovenLaunch:
                        run = self._prove(key, run.run, args)
                    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream_of(device), function,
                        metadata, None, None, None, *args)
                    return
            compiled = self.fn[grid](**self._by_name(args), **(options or {}))
            if compiled is not None and hit is None:
                self._remember(key, compiled, args)
        else:
            self.fn[grid](**self._by_name(args), **(options or {}))

    def _by_name(self, args: tuple) -> dict:
        # By keyword: a parameter named like a launch option (a Gluon kernel's ``num_warps``)
        # is then also taken as that option, which triton 3.6 does only for keywords.
        return dict(zip(self.arg_names, args))

    def _remember(self, key, compiled, args: tuple) -> None:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active
        run = compiled.run  # the launcher (its handles were loaded by the launch that just ran)
        if any(_is_host_descriptor(a) for a in args):
            run = _UnprovenLaunch(run)  # the next launch may prove a faster descriptor expansion
        self._compiled[key] = (active.get_current_device(), active.get_current_device, active.get_current_stream,
                               run, compiled.function, compiled.packed_metadata, knobs.runtime)

    def _prove(self, key, run, args: tuple):
        """A launch that also decides ``key``'s launcher from now on: the compiled launcher
        with :class:`_DescriptorExpansion`'s expansion where, on this launch, it hands Triton's
        launcher exactly what Triton's own expansion does; else Triton's."""
        entry = self._compiled[key]
        self._compiled[key] = (*entry[:3], run, *entry[4:])
        expansion = _DescriptorExpansion.of(run, args)
        if expansion is None:
            return run

        def proving(*launch_args):
            if expansion.proven_on(launch_args):
                self._compiled[key] = (*entry[:3], expansion.fast_run, *entry[4:])

        return proving

    def _audit(self, key, args: tuple, options: dict | None) -> None:
        names = self.arg_names
        if len(args) != len(names):
            raise AssertionError(f"{self.name}: {len(args)} arguments for {len(names)} parameters")
        triton_key = specialization_key(self.kernel, dict(zip(names, args)), options)
        seen = self._audited.setdefault(key, triton_key)
        if seen != triton_key:
            raise AssertionError(f"{self.name}: launch key {key!r} stands for two compiles:\n{seen}\n{triton_key}")


# ---------------------------------------------------------------------------------------
# Host tensor descriptors without Triton's per-call argument walk
# ---------------------------------------------------------------------------------------
# Triton 3.6 expands host descriptors in Python: a loop over every kernel argument (constexprs
# included, 30-45 for these kernels) rebuilding the argument list, about 10 us a launch on an
# H200 host. The expansion below slices the argument tuple around the descriptors' positions
# and expands each with Triton's own function. It is only used for a compiled kernel after one
# launch has shown that it hands Triton's launcher exactly what Triton's own expansion does;
# any other Triton (3.8 walks the arguments in C++) keeps Triton's path.


def _is_host_descriptor(a) -> bool:
    fields = getattr(a.__class__, "__dataclass_fields__", None)
    return fields is not None and "block_shape" in fields and "base" in fields


class _UnprovenLaunch:
    """A remembered launcher whose next launch proves (or not) the faster expansion."""

    __slots__ = ("run",)

    def __init__(self, run):
        self.run = run


class _DescriptorExpansion:
    """A compiled kernel's host descriptors expanded by slicing the argument tuple around their
    positions, each by Triton's own ``make_tensordesc_arg``; ``fast_run``: a copy of the
    compiled launcher with this expansion in place of Triton's loop."""

    def __init__(self, run, launcher_cell, base_len: int, make, positions: tuple, meta: list):
        self.run, self.cell, self.raw = run, launcher_cell, launcher_cell.cell_contents
        self.base_len, self.make, self.positions, self.meta = base_len, make, positions, meta
        self.fast_run = copy.copy(run)
        self.fast_run.launch = self._launch

    @classmethod
    def of(cls, run, args: tuple):
        """For Triton 3.6's ``CudaLauncher`` (its wrapper a Python loop over the arguments from
        ``_BASE_ARGS_FORMAT_LEN`` on); None for any other wrapper."""
        inner = getattr(run, "launch", None)
        code = getattr(inner, "__code__", None)
        if code is None or not inner.__closure__ or "launcher" not in code.co_freevars:
            return None
        free = dict(zip(code.co_freevars, inner.__closure__))
        base_len = inner.__globals__.get("_BASE_ARGS_FORMAT_LEN")
        make = inner.__globals__.get("make_tensordesc_arg")
        if not isinstance(base_len, int) or make is None or "tensordesc_meta" not in free:
            return None
        positions = tuple(i for i, a in enumerate(args) if _is_host_descriptor(a))
        meta = free["tensordesc_meta"].cell_contents
        if meta and len(meta) != len(positions):
            return None
        return cls(run, free["launcher"], base_len, make, positions, list(meta) if meta else [None] * len(positions))

    def expand(self, kernel_args: tuple) -> list:
        out, prev, make, meta = [], 0, self.make, self.meta
        for j, p in enumerate(self.positions):
            out += kernel_args[prev:p]
            out += make(kernel_args[p], meta[j])
            prev = p + 1
        out += kernel_args[prev:]
        return out

    def _launch(self, *launch_args):
        n = self.base_len
        return self.raw(*launch_args[:n], *self.expand(launch_args[n:]))

    def proven_on(self, launch_args: tuple) -> bool:
        """Launch once through Triton's expansion (recording what goes in and what reaches its
        launcher); True if this expansion gives the same from the same input."""
        seen = {}
        raw, run = self.raw, self.run
        inner = run.launch

        def recording_launcher(*flat):
            seen["out"] = flat
            return raw(*flat)

        def recording_inner(*a):
            seen["in"] = a
            return inner(*a)

        probe = copy.copy(run)
        probe.launch = recording_inner
        with _lock:
            self.cell.cell_contents = recording_launcher
            try:
                probe(*launch_args)
            finally:
                self.cell.cell_contents = raw
        if "in" not in seen or "out" not in seen or len(seen["in"]) < self.base_len:
            return False
        try:
            ours = (*seen["in"][:self.base_len], *self.expand(seen["in"][self.base_len:]))
        except Exception:  # a wrapper of another shape: Triton's path stays
            return False
        return len(ours) == len(seen["out"]) and all(_same_argument(a, b) for a, b in zip(ours, seen["out"]))


def _same_argument(a, b) -> bool:
    """Equal launcher arguments: the same object, equal scalars, or two fresh expansions of one
    descriptor (objects of the same class, like the two tensor maps one descriptor gives; never
    two different tensors)."""
    if a is b:
        return True
    if a.__class__ is not b.__class__ or isinstance(a, torch.Tensor):
        return False
    return a == b if isinstance(a, (int, float, str)) else True
