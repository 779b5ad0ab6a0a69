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
  launch paths whose arguments were validated already; :func:`rebased_descriptor`, a copy
  over another tensor of the same layout.
* :func:`cdiv`, :func:`next_power_of_2`: host-side integer helpers (Triton's are
  ``ConstexprFunction`` wrappers costing microseconds per call on a launch path).
* :class:`Launcher`: launches a kernel by a key its caller computes, calling the compiled
  kernel's launcher directly once that key has been launched through ``kernel[grid](...)``:
  Triton's binder and cache lookup cost more host time than the launch itself. On triton 3.6
  the launches after that call its C launcher directly (:class:`_DirectLaunch`);
  :meth:`Launcher.partial` binds every argument of such a launch but the tensors a caller
  passes per call.
* :func:`recorded_launches`, :func:`scratch`, :func:`replay`: an op's launches recorded once
  per argument layout and replayed for the next calls with their tensors (new scratch buffers).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import sys
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
    desc = rebased_descriptor(template, base)
    desc.shape, desc.strides = shape, strides
    return desc


def rebased_descriptor(desc, base):
    """A copy of the host descriptor ``desc`` over ``base``, a tensor of the same dtype, shape
    and strides (what the caller's cached plan knows); ``rebased_descriptor(desc, None)`` is a
    template that keeps no tensor alive."""
    copy_ = object.__new__(desc.__class__)
    copy_.__dict__.update(desc.__dict__)
    copy_.base = base
    return copy_


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


class _Recording:
    __slots__ = ("thread", "launches", "scratch", "opaque")

    def __init__(self):
        self.thread = threading.get_ident()
        self.launches: list = []  # (launcher, key, grid, args, options, sized)
        self.scratch: list = []  # (tensor, sized) of each scratch() buffer
        self.opaque = False  # a launch went around the Launchers: the call cannot be replayed


_recording: _Recording | None = None  # one at a time, of one thread's calls


@contextlib.contextmanager
def recorded_launches():
    """Inside the block, every :class:`Launcher` launch of this thread is also recorded as
    ``(launcher, key, grid, args, options, sized)``, and every :func:`scratch` buffer, for
    :func:`replay`. Yields the recording, or None while another one is in progress (then
    nothing is recorded)."""
    global _recording
    with _lock:
        if _recording is not None:
            recording = None
        else:
            _recording = recording = _Recording()
    try:
        yield recording
    finally:
        if recording is not None:
            _recording = None


def _recording_here() -> _Recording | None:
    recording = _recording
    return recording if recording is not None and recording.thread == threading.get_ident() else None


def scratch(*size: int, dtype: torch.dtype, device, sized=None) -> torch.Tensor:
    """``torch.empty(*size, dtype=dtype, device=device)`` for a buffer an op writes and reads
    within one call (its kernels only: never returned, never read on the host); a replay of
    the call (:func:`replay`) gives each later call a new one. ``sized(*sizes)``: its size
    for a replayed call of other sizes (see :func:`replay`)."""
    t = torch.empty(*size, dtype=dtype, device=device)
    if _recording is not None:
        recording = _recording_here()
        if recording is not None:
            recording.scratch.append((t, sized))
    return t


def opaque_launch() -> None:
    """Say that the op launched a kernel around the :class:`Launcher` s (where a recording is
    in progress, it is then not replayable)."""
    recording = _recording_here() if _recording is not None else None
    if recording is not None:
        recording.opaque = True


NOT_REPLAYABLE = "not replayable"
_SCRATCH_ALIGN = 256


class _Address:
    """An address standing for a tensor where only its address is read (a TMA encoding)."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def _aligned_bytes(shape, itemsize: int) -> int:
    return -(-math.prod(shape) * itemsize // _SCRATCH_ALIGN) * _SCRATCH_ALIGN


def replay(recording: _Recording, inputs: tuple, keep: tuple = ()):
    """The recorded launches as one ``run(sizes, *inputs) -> bool`` for a later call of any
    sizes: every tensor argument, and every host descriptor's base, that is one of ``inputs``
    (by identity) is that call's, each :func:`scratch` buffer is a new one (one allocation for
    all), the other arguments are bound (:meth:`Launcher.partial`). ``sizes`` (a tuple of ints
    the op defines) is passed to each launch's ``sized = (fn, int_positions, desc_positions)``,
    whose ``fn(*sizes)`` gives ``(grid, ints, rows)``: the grid, the ints at ``int_positions``
    and the first dimension of the host descriptors at ``desc_positions``; and to each scratch
    buffer's ``sized(*sizes)``, its shape. ``run`` returns False where a launch declined
    (nothing launched after it: make the call the ordinary way).

    :data:`NOT_REPLAYABLE` where a launch or scratch buffer was made without ``sized``, an
    argument is a tensor that is none of those nor one of ``keep``, the op launched around the
    Launchers (:func:`opaque_launch`), or launched nothing; None where a launch has no proven
    direct call yet (try again later)."""
    if (recording.opaque or not recording.launches or any(entry[5] is None for entry in recording.launches)
            or any(f is None for _, f in recording.scratch)):
        return NOT_REPLAYABLE
    n_in = len(inputs)
    scratch_ = [t for t, _ in recording.scratch]
    n_fixed = n_in + len(scratch_)
    where = {id(t): i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
    where.update((id(t), n_in + j) for j, t in enumerate(scratch_))
    kept = {id(t) for t in keep}
    direct = all(launcher._direct for launcher, *_ in recording.launches)
    addresses = tuple(range(n_in, n_fixed)) if direct else ()
    partials = []
    for launcher, key, grid, args, options, (fn, int_positions, desc_positions) in recording.launches:
        live = [[] for _ in range(n_fixed)]
        for p, a in enumerate(args):
            tensor = a.base if _is_host_descriptor(a) else a
            if not isinstance(tensor, torch.Tensor):
                continue
            i = where.get(id(tensor))
            if i is not None:
                live[i].append(p)
            elif id(tensor) not in kept:
                return NOT_REPLAYABLE
        live = [tuple(ps) for ps in live] + [(p,) for p in int_positions]
        first_row = len(live) + len(grid)
        launch = launcher.partial(key, grid, args, options, live=tuple(live), addresses=addresses,
                                  live_grid=tuple(range(len(live), first_row)),
                                  live_rows={p: first_row + j for j, p in enumerate(desc_positions)})
        if launch is None:
            return None
        partials.append((launch, fn))

    carve = None  # sizes -> (buffer, the scratch values a replayed call passes)
    if scratch_:
        device = scratch_[0].device
        specs = [(f, t.dtype, t.element_size()) for t, f in recording.scratch]

        def layout(sizes):
            offsets, nbytes, shapes, end = [], [], [], 0
            for f, _, itemsize in specs:
                shape = f(*sizes)
                offsets.append(end)
                shapes.append(shape)
                nbytes.append(_aligned_bytes(shape, itemsize))
                end += nbytes[-1]
            return offsets, nbytes, shapes, end

        if direct:
            def carve(sizes):
                offsets, _, _, end = layout(sizes)
                base = torch.empty(end, dtype=torch.uint8, device=device)
                return base, [base.data_ptr() + o for o in offsets]
        else:
            def carve(sizes):
                offsets, nbytes, shapes, end = layout(sizes)
                base = torch.empty(end, dtype=torch.uint8, device=device)
                return base, [base[o:o + n].view(spec[1])[:math.prod(shape)].view(shape)
                              for o, n, shape, spec in zip(offsets, nbytes, shapes, specs)]

    def run(sizes, *values) -> bool:
        if carve is not None:
            buffer, scratch_values = carve(sizes)  # (the buffer alive until the launches are queued)
            values = (*values, *scratch_values)
        for launch, fn in partials:
            grid, ints, rows = fn(*sizes)
            if not launch(*values, *ints, *grid, *rows):
                return False
        return True

    return run


# Recordings a replaying op tries per layout before it gives up: a launch is direct from its
# key's second launch on a GPU, so a first recording may come too early.
REPLAY_TRIES = 4


def replay_or_try_again(recording: _Recording, inputs: tuple, keep: tuple, tries: int):
    """:func:`replay` for an op that records a layout's launches up to :data:`REPLAY_TRIES`
    times: its ``run``, :data:`NOT_REPLAYABLE`, or (no direct call yet) the tries so far as an
    int, to record again at the next call."""
    replayed = replay(recording, inputs, keep)
    if replayed is None:
        return tries + 1 if tries + 1 < REPLAY_TRIES else NOT_REPLAYABLE
    return replayed


def _live_slots(live: tuple) -> list:
    """``(position, value index)`` of each position :meth:`Launcher.partial`'s ``live`` names."""
    return [(p, i) for i, ps in enumerate(live) for p in (ps if isinstance(ps, tuple) else (ps,))]


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
    ``run`` ends (on triton 3.6, from the third launch of a key, its C launcher). Launch hooks
    installed in ``triton.knobs`` (profilers) and the interpreter take the ordinary path every
    time. :func:`set_launch_audit` checks the keys.
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

    def __call__(self, key, grid, args: tuple, options: dict | None = None, sized=None) -> None:
        """Launch; ``sized``: how the grid and the size arguments follow the op's sizes, for a
        recording in progress (:func:`replay`)."""
        if _recording is not None:
            recording = _recording_here()
            if recording is not None:
                recording.launches.append((self, key, grid, args, options, sized))
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

    def partial(self, key, grid, args: tuple, options: dict | None = None, live: tuple = (),
                addresses: tuple = (), live_grid: tuple = (), live_rows: dict | None = None):
        """``self(key, grid, args, options)`` as a launch of the same arguments except at the
        positions ``live`` names, flattened once, for a caller whose next calls differ only
        there: ``launch(*values)`` passes ``values[i]`` at position ``live[i]`` (a tuple of
        positions: at each of them), a tensor where ``args`` has a tensor, an int where it has
        a runtime int (one the kernel does not specialise: the key stays the caller's promise),
        and where it has a host descriptor, a tensor with the address of the descriptor's base
        (the descriptor is that one rebased, its encoding remembered per address). With
        ``live_grid`` the grid is ``values[live_grid[0]], values[live_grid[1]], ...`` (the
        dimensions not named are 1). ``live_rows`` maps the position of a live host descriptor
        to the index of the value that is its first dimension (then encoded per address and
        rows). Everything else (shapes, strides, scalars, the grid) is the caller's promise;
        tensors left constant are kept alive by the launch (``launch.keeps``). The values
        whose indices are in ``addresses`` are passed as addresses (ints) instead of tensors
        (direct launches only). None where the key has no proven direct launch yet. The launch
        returns False and launches nothing where this launcher would not call directly now (a
        launch hook, a redirect, another current device): call it then. Where launches are never direct (the
        interpreter, a redirect) it launches ``kernel[grid](...)`` with the values put in. In
        audit mode the key is audited here, once for all the launches."""
        if _audit:
            self._audit(key, args, options)
        if not self._direct:  # the interpreter, or a redirect: the ordinary launch with the values put in
            return self._substituting(grid, args, options, live, live_grid, live_rows)
        hit = self._compiled.get(key)
        if hit is None or hit[3].__class__ is not _DirectLaunch or None in hit[3].meta:
            return None  # (an encoding Triton leaves to the launcher would hold a tensor alive)
        device, current_device, stream_of, run, function, metadata, runtime = hit
        n = len(grid)
        scope = {"raw": run.raw, "stream_of": stream_of, "current_device": current_device, "device": device,
                 "runtime": runtime, "idle": _hooks_idle, "launcher": self}
        # Before the stream (read per launch): the grid; after it, the launch objects.
        scope["head"] = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        head = ", ".join([f"v{g}" for g in live_grid] + ["1"] * (3 - len(live_grid))) if live_grid else "*head"
        scope["mid"] = (function, run.coop, run.pdl, None, None, metadata, None, None, None)
        where = dict(_live_slots(live))
        descs = dict(zip(run.descs, range(len(run.descs))))
        parts, pending, encoders = [], [], {}

        def constants(values):
            pending.extend(values)

        def flush():
            if pending:
                name = f"c{len(scope)}"
                scope[name] = tuple(pending)
                parts.append(f"*{name}")
                pending.clear()

        for p, a in enumerate(args):
            i = where.get(p)
            if p in descs:
                if i is None:
                    constants(run._encoded(descs[p], a))
                    continue
                flush()
                j = descs[p]
                r = live_rows.get(p) if live_rows else None
                layout = (i, r, run.meta_keys[j], *(a.shape if r is None else a.shape[1:]), *a.strides, a.padding)
                same = encoders.get(layout)
                if same is not None:  # one descriptor passed twice: encoded once per launch
                    parts.append(f"*{same}")
                    continue
                scope[f"e{p}"] = _remembered_encoding(run, j, a, i in addresses)
                encoders[layout] = f"x{p}"
                parts.append(f"*(x{p} := e{p}(v{i}))" if r is None else f"*(x{p} := e{p}(v{i}, v{r}))")
            elif i is not None:
                flush()
                if p in run.tensors:
                    parts.append(f"v{i}" if i in addresses else f"v{i}.data_ptr()")
                elif a.__class__ is int:
                    parts.append(f"v{i}")
                else:
                    raise ValueError(f"{self.name}: live argument {self.arg_names[p]} is neither a tensor nor an int")
            elif p in run.tensors and a is not None and a.__class__ is not int:
                constants((a.data_ptr(),))
            else:
                constants((a,))
        flush()
        n_values = max([len(live), *(g + 1 for g in live_grid), *(r + 1 for r in (live_rows or {}).values())])
        params = ", ".join(f"v{i}" for i in range(n_values))
        src = (f"def launch({params}):\n"
               "    if not launcher._direct or not idle(runtime.launch_enter_hook) or current_device() != device:\n"
               "        return False\n"
               f"    raw({head}, stream_of(device), *mid, {', '.join(parts)})\n"
               "    return True\n")
        exec(src, scope)  # noqa: S102 (generated from positions, no outside text)
        launch = scope["launch"]
        launch.keeps = tuple(a for p, a in enumerate(args) if p in run.tensors and p not in where)
        return launch

    def _substituting(self, grid, args: tuple, options: dict | None, live: tuple, live_grid: tuple = (),
                      live_rows: dict | None = None):
        """What :meth:`partial` gives where launches are not direct: ``kernel[grid](...)`` of
        ``args`` with the values put in (a descriptor rebased on its value, viewed as its base's
        dtype, with its rows where ``live_rows`` names them), so the interpreter runs what the
        direct launch would."""
        live_rows = live_rows or {}
        slots = [(p, i, _is_host_descriptor(args[p]), live_rows.get(p)) for p, i in _live_slots(live)]
        bound = list(args)

        def launch(*values) -> bool:
            grid_ = tuple(values[g] for g in live_grid) if live_grid else grid
            call = list(bound)
            for p, i, desc, r in slots:
                v = values[i]
                if desc:
                    base = bound[p].base
                    call[p] = rebased_descriptor(bound[p], v if v.dtype == base.dtype else v.view(base.dtype))
                    if r is not None:
                        call[p].shape = [values[r], *bound[p].shape[1:]]
                else:
                    call[p] = v
            self.fn[grid_](**self._by_name(call), **(options or {}))
            return True

        launch.keeps = ()
        return launch

    def _by_name(self, args: tuple) -> dict:
        # By keyword: a parameter named like a launch option (a Gluon kernel's ``num_warps``)
        # is then also taken as that option, which triton 3.6 does only for keywords.
        return dict(zip(self.arg_names, args))

    def _remember(self, key, compiled, args: tuple) -> None:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active
        run = _UnprovenLaunch(compiled.run)  # the next launch may prove the direct call (_DirectLaunch)
        self._compiled[key] = (active.get_current_device(), active.get_current_device, active.get_current_stream,
                               run, compiled.function, compiled.packed_metadata, knobs.runtime)

    def _prove(self, key, run, args: tuple):
        """A launch that also decides ``key``'s launcher from now on: :class:`_DirectLaunch`
        where, on this launch, it hands Triton's C launcher exactly what Triton's own Python
        layers do; else Triton's launcher."""
        entry = self._compiled[key]
        self._compiled[key] = (*entry[:3], run, *entry[4:])
        direct = _DirectLaunch.of(run, args)
        if direct is None:
            return run

        def proving(*launch_args):
            if direct.proven_on(launch_args):
                self._compiled[key] = (*entry[:3], direct, *entry[4:])

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
# Triton 3.6's launcher without its Python layers
# ---------------------------------------------------------------------------------------
# Between a compiled kernel's ``run`` and its C launcher, triton 3.6 runs Python: a scratch
# allocation check, then (for host descriptors) a loop over every kernel argument, constexprs
# included (30-45 for these kernels), that rebuilds the list and encodes a TMA descriptor per
# host descriptor. The C launcher then asks the driver for the attributes of every tensor
# argument (``cuPointerGetAttribute``, skipped for plain ints). ``_DirectLaunch`` calls the C
# launcher itself with tensors as their addresses and each host descriptor's encoded map
# remembered by (address, shape, strides): an engine's weights, caches and reused buffers
# then encode nothing. It is only used for a compiled kernel after one launch has shown that
# it hands the C launcher what Triton's own path does; any other Triton keeps Triton's path.


def _is_host_descriptor(a) -> bool:
    fields = getattr(a.__class__, "__dataclass_fields__", None)
    return fields is not None and "block_shape" in fields and "base" in fields


class _UnprovenLaunch:
    """A remembered launcher whose next launch proves (or not) the direct call."""

    __slots__ = ("run",)

    def __init__(self, run):
        self.run = run


_TRITON36_BASE_FORMAT = "iiiKKppOOOOOO"  # grid x3, stream, function, cooperative, pdl, 2 scratch, 4 launch objects
_MAX_MAPS = 512  # encoded descriptors kept per compiled kernel (an entry is ~200 bytes)


class _DirectLaunch:
    """Calls a compiled kernel's C launcher as ``CudaLauncher.__call__`` (triton 3.6) would,
    with the same calling convention: ``(gx, gy, gz, stream, function, metadata,
    launch_metadata, enter_hook, exit_hook, *kernel_args)``."""

    __slots__ = ("run", "raw", "cell", "make", "coop", "pdl", "tensors", "descs", "meta", "meta_keys", "maps")

    def __init__(self, run, raw, cell, make, tensors: tuple, descs: tuple, meta: list):
        self.run, self.raw, self.cell, self.make = run, raw, cell, make
        self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
        self.tensors, self.descs, self.meta = tensors, descs, meta
        self.meta_keys = [None if m is None else repr(sorted(m.items())) for m in meta]
        self.maps: dict = {}

    @classmethod
    def of(cls, run, args: tuple):
        """For triton 3.6's ``CudaLauncher`` with no scratch buffers (its ``launch`` the C
        launcher, or the Python wrapper that expands host descriptors around it); None for any
        other launcher."""
        module = sys.modules.get(type(run).__module__)
        if (type(run).__name__ != "CudaLauncher" or getattr(module, "_BASE_ARGS_FORMAT", None) != _TRITON36_BASE_FORMAT
                or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
                or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
            return None
        make = getattr(module, "make_tensordesc_arg", None)
        descs = tuple(i for i, a in enumerate(args) if _is_host_descriptor(a))
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        inner = run.launch
        code = getattr(inner, "__code__", None)
        if not descs:  # Triton wraps the C launcher only for kernels with descriptors
            return None if code is not None else cls(run, inner, None, make, tensors, (), [])
        if code is None or make is None or not inner.__closure__ or "launcher" not in code.co_freevars:
            return None
        free = dict(zip(code.co_freevars, inner.__closure__))
        if "tensordesc_meta" not in free:
            return None
        meta = free["tensordesc_meta"].cell_contents
        if meta and len(meta) != len(descs):
            return None
        cell = free["launcher"]
        return cls(run, cell.cell_contents, cell, make, tensors, descs, list(meta) if meta else [None] * len(descs))

    def flatten(self, kernel_args: tuple) -> list:
        """The kernel arguments as the C launcher takes them."""
        flat = list(kernel_args)
        for i in self.tensors:
            t = flat[i]
            if t is not None and t.__class__ is not int:  # (an address passed as an int stays one)
                flat[i] = t.data_ptr()
        descs = self.descs
        last = encoded = None
        meta_keys = self.meta_keys
        for j in range(len(descs) - 1, -1, -1):  # from the back: earlier positions stay put
            p = descs[j]
            desc = flat[p]
            # one descriptor passed twice in a row, with the same encoding, is encoded once
            if desc is not last or meta_keys[j] != meta_keys[j + 1] or meta_keys[j] is None:
                last, encoded = desc, self._encoded(j, desc)
            flat[p:p + 1] = encoded
        return flat

    def _encoded(self, j: int, desc) -> list:
        meta = self.meta[j]
        if meta is None:  # Triton's decomposition holds the tensor itself: nothing to remember
            return self.make(desc, None)
        key = (self.meta_keys[j], desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
        maps = self.maps
        hit = maps.get(key)
        if hit is None:
            hit = self.make(desc, meta)
            if len(maps) >= _MAX_MAPS:
                maps.clear()
            maps[key] = hit
        return hit

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *kernel_args):
        return self.raw(gx, gy, gz, stream, function, self.coop, self.pdl, None, None, metadata, launch_metadata,
                        enter_hook, exit_hook, *self.flatten(kernel_args))

    def proven_on(self, launch_args: tuple) -> bool:
        """Launch once through Triton's path (recording what reaches its C launcher); True if
        the direct call gives the C launcher the same from the same arguments."""
        seen = {}
        raw, run = self.raw, self.run

        def recording_launcher(*flat):
            seen["out"] = flat
            return raw(*flat)

        if self.cell is None:
            probe = copy.copy(run)
            probe.launch = recording_launcher
            probe(*launch_args)
        else:
            with _lock:
                self.cell.cell_contents = recording_launcher
                try:
                    run(*launch_args)
                finally:
                    self.cell.cell_contents = raw
        if "out" not in seen or len(launch_args) < 9:
            return False
        gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_ = launch_args[:9]
        try:
            ours = (gx, gy, gz, stream, function, self.coop, self.pdl, None, None, metadata, launch_metadata, enter,
                    exit_, *self.flatten(launch_args[9:]))
        except Exception:  # arguments of another shape: Triton's path stays
            return False
        theirs = seen["out"]
        return len(ours) == len(theirs) and all(_same_argument(a, b) for a, b in zip(ours, theirs))


def _remembered_encoding(run: _DirectLaunch, j: int, template, by_address: bool = False):
    """``encode(base)``: the encoded host descriptor ``template`` rebased onto ``base`` (a
    tensor, or with ``by_address`` its address), remembered per base address (the shape and
    strides are the template's); ``encode(base, rows)``: also with ``rows`` as its first
    dimension, remembered per (address, rows)."""
    maps: dict = {}
    meta, make = run.meta[j], run.make
    template = rebased_descriptor(template, None)
    rest = list(template.shape[1:])

    def encode(base, rows=None) -> list:
        address = base if by_address else base.data_ptr()
        key = address if rows is None else (address, rows)
        hit = maps.get(key)
        if hit is None:
            desc = rebased_descriptor(template, _Address(address) if by_address else base)
            if rows is not None:
                desc.shape = [rows, *rest]
            hit = make(desc, meta)
            if len(maps) >= _MAX_MAPS:
                maps.clear()
            maps[key] = hit
        return hit

    return encode


def _same_argument(a, b) -> bool:
    """Equal launcher arguments: the same object, equal scalars, a tensor's address for the
    tensor (the C launcher reads the same pointer), or two encodings of one descriptor (objects
    of the same class, like the two tensor maps one descriptor gives; never two tensors)."""
    if a is b:
        return True
    if isinstance(b, torch.Tensor):
        return a.__class__ is int and a == b.data_ptr()
    if a.__class__ is not b.__class__ or isinstance(a, torch.Tensor):
        return False
    return a == b if isinstance(a, (int, float, str)) else True
