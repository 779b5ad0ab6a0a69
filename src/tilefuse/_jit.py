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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import triton

_lock = threading.Lock()


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
