"""tilefuse._jit: Triton's specialisation key computed on any machine, and the compile counter."""

import pytest
import torch
import triton
import triton.language as tl

from tilefuse import _jit


@triton.jit
def _plain_kernel(x_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs * stride, offs, mask=offs < n)


@triton.jit(do_not_specialize=["n", "stride"], do_not_specialize_on_alignment=["x_ptr"])
def _dynamic_kernel(x_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs * stride, offs, mask=offs < n)


def _key(fn, x, n, stride, block=16):
    return _jit.specialization_key(fn, {"x_ptr": x, "n": n, "stride": stride, "BLOCK": block}, {"num_warps": 4})


def test_plain_ints_and_pointers_are_specialised_as_triton_does():
    x = torch.zeros(64, dtype=torch.int32)
    keys = {_key(_plain_kernel, x, n, 1) for n in (1, 16, 37)}
    assert len(keys) == 3  # == 1 a constant, % 16 marked divisible, the rest plain
    assert _key(_plain_kernel, x, 37, 1)[1] == ("i32", "")
    assert _key(_plain_kernel, x, 32, 1)[1] == ("i32", "D")
    assert _key(_plain_kernel, x, 1, 1)[1][0] == "constexpr"
    assert _key(_plain_kernel, x, 37, 1) != _key(_plain_kernel, x[1:], 37, 1)  # alignment of the pointer


def test_do_not_specialize_keeps_one_key():
    x = torch.zeros(64, dtype=torch.int32)
    keys = {_key(_dynamic_kernel, x[off:], n, stride) for n in (1, 16, 37) for stride in (1, 2, 48) for off in (0, 1)}
    assert len(keys) == 1
    assert _key(_dynamic_kernel, x, 5, 1, block=32) not in keys  # constexprs are part of the key
    assert _key(_dynamic_kernel, x.float(), 5, 1) not in keys  # so are the argument types


def test_count_compiles_restores_the_previous_hook():
    runtime = triton.knobs.runtime
    before = runtime.jit_post_compile_hook
    with _jit.count_compiles() as log:
        assert runtime.jit_post_compile_hook is not before
    assert runtime.jit_post_compile_hook is before
    assert log.count == 0 and log.kernels() == []


@pytest.mark.gpu
def test_count_compiles_sees_a_compile_once():
    x = torch.zeros(64, dtype=torch.int32, device="cuda")
    with _jit.count_compiles() as log:
        _dynamic_kernel[(1,)](x, 5, 1, BLOCK=64)  # a new constexpr: one compile
        _dynamic_kernel[(1,)](x, 7, 2, BLOCK=64)
        _dynamic_kernel[(1,)](x[1:], 1, 3, BLOCK=64)
    assert log.count == 1 and log.kernels() == ["_dynamic_kernel"]


@triton.jit
def _desc_copy_kernel(src_desc, dst_ptr, stride_dst, scale, ROWS: tl.constexpr, COLS: tl.constexpr):
    """dst[row block] = src[row block] * scale, the source read through a host descriptor."""
    r0 = tl.program_id(0) * ROWS
    tile = src_desc.load([r0, 0])
    rows = r0 + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    tl.store(dst_ptr + rows * stride_dst + cols, tile * scale)


@pytest.mark.gpu
def test_launcher_with_host_descriptors_on_new_tensors_every_call():
    """Direct launches of a descriptor kernel: each call's new tensors and scalars are what the
    kernel sees (the direct C launch with its remembered descriptor encodings, where it is used,
    included), and a descriptor over a buffer seen before reads that buffer's new contents."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    launcher = _jit.Launcher(_desc_copy_kernel)
    rows, cols = 64, 32
    kept = torch.randn(rows * 2, cols, device="cuda")
    for i in range(8):
        n = rows * (i % 3 + 1)
        src = kept if i % 2 else torch.randn(n, cols, device="cuda")
        if i % 2:
            src.normal_()
            n = src.shape[0]
        dst = torch.full((n, cols), float("nan"), device="cuda")
        desc = _jit.host_descriptor(TensorDescriptor, src, [n, cols], [cols, 1], [rows, cols])
        launcher(("copy",), (n // rows,), (desc, dst, dst.stride(0), float(i + 1), rows, cols), {"num_warps": 4})
        assert torch.equal(dst, src * (i + 1)), i
    run = launcher._compiled[("copy",)][3]
    if triton.__version__.startswith("3.6"):  # the direct call is proven on the second launch
        assert isinstance(run, _jit._DirectLaunch) and run.maps


_FAKE_DRIVER_SRC = '''
_BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
_BASE_ARGS_FORMAT_LEN = len(_BASE_ARGS_FORMAT)
encodes = []

def make_tensordesc_arg(arg, meta):
    encodes.append(arg)
    if meta is None:
        return [arg.base, *arg.shape, *arg.strides]
    return [("map", arg.base.data_ptr(), meta["tag"], tuple(arg.shape), tuple(arg.strides)), *arg.shape, *arg.strides]

def wrap(launcher, signature, tensordesc_meta):
    indices = {i for i, sig in enumerate(signature) if sig.startswith("tensordesc")}
    if not indices:
        return launcher

    def inner(*args):
        final = list(args[:_BASE_ARGS_FORMAT_LEN])
        j = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in indices:
                final.extend(make_tensordesc_arg(arg, tensordesc_meta[j]))
                j += 1
            else:
                final.append(arg)
        return launcher(*final)
    return inner

class CLauncher:  # stands for the compiled C function: records what it is given
    def __init__(self):
        self.calls = []

    def __call__(self, *flat):
        self.calls.append(flat)

class CudaLauncher:
    def __init__(self, signature, meta, scratch=0):
        self.c = CLauncher()
        self.launch = wrap(self.c, signature, meta)
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)
'''


@pytest.fixture
def fake_driver():
    """A module shaped like triton 3.6's CUDA driver: ``CudaLauncher`` over a recording C
    launcher, with Triton's Python loop that expands host descriptors."""
    import sys
    import types

    module = types.ModuleType("fake_triton36_driver")
    sys.modules[module.__name__] = module
    try:
        exec(_FAKE_DRIVER_SRC, module.__dict__)  # noqa: S102 (the classes must belong to a real module)
        yield module
    finally:
        del sys.modules[module.__name__]


def _base(gx=2):
    return (gx, 1, 1, "stream", "function", ("meta",), None, None, None)


def test_direct_launch_gives_the_c_launcher_what_triton_does(fake_driver):
    """The direct call hands the C launcher Triton's arguments: tensors as their addresses,
    each host descriptor as Triton encodes it (encoded once per address, shape and strides:
    a new buffer, shape or stride encodes again, a descriptor seen before does not)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    signature = ["*fp32", "tensordesc<fp32[4, 8]>", "constexpr", "i32", "tensordesc<fp32[4, 8]>"]
    run = fake_driver.CudaLauncher(signature, [{"tag": "m0"}, {"tag": "m1"}])
    out = torch.zeros(16)
    weights = torch.zeros(64, 8)

    def desc(t, rows=None):
        rows = t.shape[0] if rows is None else rows
        return TensorDescriptor(t, [rows, 8], [8, 1], [4, 8])

    args = (out, desc(torch.zeros(12, 8)), 3, 7, desc(weights))
    direct = _jit._DirectLaunch.of(run, args)
    assert direct is not None and direct.descs == (1, 4) and direct.tensors == (0,)
    assert direct.proven_on((*_base(), *args))
    encoded = len(fake_driver.encodes)
    for step in range(4):
        x = torch.randn(8 + 4 * step, 8)
        call = (out, desc(x), 3, 7 + step, desc(weights, rows=64 if step < 3 else 32))
        run(*_base(step + 1), *call)
        direct(*_base(step + 1), *call)
        theirs, ours = run.c.calls[-2], run.c.calls[-1]
        assert len(ours) == len(theirs) and ours[13] == out.data_ptr() and theirs[13] is out
        assert ours[:13] == theirs[:13] and ours[14:] == theirs[14:], step
    # Triton encoded 4 + 4 descriptors; the direct call: the 4 new x's, weights once more at 32 rows
    assert len(fake_driver.encodes) - encoded == 8 + 5


def test_direct_launch_encodes_a_descriptor_passed_twice_once(fake_driver):
    from triton.tools.tensor_descriptor import TensorDescriptor

    signature = ["tensordesc<fp32[4, 8]>"] * 3
    run = fake_driver.CudaLauncher(signature, [{"tag": "a"}, {"tag": "a"}, {"tag": "b"}])
    x = torch.zeros(8, 8)
    d = TensorDescriptor(x, [8, 8], [8, 1], [4, 8])
    direct = _jit._DirectLaunch.of(run, (d, d, d))
    assert direct.proven_on((*_base(), d, d, d))
    fake_driver.encodes.clear()
    direct(*_base(), d, d, TensorDescriptor(x, [8, 8], [8, 1], [4, 8]))
    maps = [a for a in run.c.calls[-1] if isinstance(a, tuple) and a[0] == "map"]
    assert [m[2] for m in maps] == ["a", "a", "b"] and len(fake_driver.encodes) == 0  # all remembered
    y = torch.zeros(8, 8)
    e = TensorDescriptor(y, [8, 8], [8, 1], [4, 8])
    direct(*_base(), e, e, e)
    assert fake_driver.encodes == [e, e]  # once for the pair of tag a, once for tag b


def test_direct_launch_without_descriptors_and_declined_launchers(fake_driver):
    signature = ["*fp32", "i32", "constexpr"]
    run = fake_driver.CudaLauncher(signature, [])
    x = torch.zeros(4)
    direct = _jit._DirectLaunch.of(run, (x, 5, 2))
    assert direct is not None and direct.cell is None and direct.proven_on((*_base(), x, 5, 2))
    y = torch.zeros(8)
    direct(*_base(), y, 6, 2)
    assert run.c.calls[-1] == (*_base()[:5], False, True, None, None, *_base()[5:], y.data_ptr(), 6, 2)
    # scratch buffers to allocate, another base format, another launcher class: Triton's path
    assert _jit._DirectLaunch.of(fake_driver.CudaLauncher(signature, [], scratch=128), (x, 5, 2)) is None
    fake_driver._BASE_ARGS_FORMAT = "iiiKKpOOOOOO"
    assert _jit._DirectLaunch.of(run, (x, 5, 2)) is None

    class OtherLauncher:
        def launch(self, *args):
            pass

    assert _jit._DirectLaunch.of(OtherLauncher(), (x, 5, 2)) is None


def _launcher_over(direct, runtime, device):
    launcher = _jit.Launcher(_plain_kernel)
    streams = iter(range(100, 200))
    launcher._direct = True
    launcher._compiled[("k",)] = (0, lambda: device["now"], lambda d: next(streams), direct, "function", ("meta",),
                                  runtime)
    return launcher


def test_partial_launch_is_the_direct_call_with_the_live_arguments_replaced(fake_driver, monkeypatch):
    """``Launcher.partial``: a launch handing the C launcher what the direct call does for the
    bound arguments with the live ones replaced (tensors as addresses, a descriptor rebased on
    the tensor passed, encoded once per address, once for a pair), the stream read at each
    launch; it declines (False, nothing launched) under a launch hook, a redirect or another
    current device, and is not made before the key's direct call is proven."""
    from types import SimpleNamespace

    from triton.tools.tensor_descriptor import TensorDescriptor

    signature = ["tensordesc<fp32[4, 8]>", "tensordesc<fp32[4, 8]>", "*fp32", "i32", "*fp32",
                 "tensordesc<fp32[4, 8]>"]
    run = fake_driver.CudaLauncher(signature, [{"tag": "a"}, {"tag": "a"}, {"tag": "w"}])

    def desc(t):
        return TensorDescriptor(t, [8, 8], [8, 1], [4, 8])

    x, out, keep, w = torch.zeros(8, 8), torch.zeros(4), torch.zeros(2), torch.zeros(8, 8)
    args = (desc(x), desc(x), out, 5, keep, desc(w))
    direct = _jit._DirectLaunch.of(run, args)
    assert direct.proven_on((*_base(), *args))
    runtime = SimpleNamespace(launch_enter_hook=None)
    device = {"now": 0}
    launcher = _launcher_over(direct, runtime, device)
    audited = []
    monkeypatch.setattr(_jit, "_audit", True)
    monkeypatch.setattr(_jit.Launcher, "_audit", lambda self, key, a, options: audited.append(key))
    assert launcher.partial(("other",), (3, 2), args, live=((0, 1), 2)) is None
    launch = launcher.partial(("k",), (3, 2), args, live=((0, 1), 2))
    assert audited == [("other",), ("k",)] and launch.keeps == (keep,)
    fake_driver.encodes.clear()
    for step in range(3):
        y, o = torch.randn(8, 8), torch.zeros(4)
        assert launch(y, o)
        direct(3, 2, 1, 200 + step, "function", ("meta",), None, None, None, desc(y), desc(y), o, 5, keep, desc(w))
        ours, theirs = run.c.calls[-2:]
        assert ours[3] == 100 + step and ours[:3] == (3, 2, 1)
        assert ours[4:] == theirs[4:], step
    # each y once per caller (the pair encoded once), w never (bound, or remembered)
    assert len(fake_driver.encodes) == 3 + 3
    assert launch(y, torch.zeros(4))  # y's address seen: nothing encoded
    assert len(fake_driver.encodes) == 3 + 3
    calls = len(run.c.calls)
    for off in ({"hook": True}, {"device": 1}, {"redirect": True}):
        runtime.launch_enter_hook = SimpleNamespace(calls=[print]) if "hook" in off else None
        device["now"] = off.get("device", 0)
        launcher._direct = "redirect" not in off
        assert launch(y, o) is False, off
    assert len(run.c.calls) == calls
    launcher._direct = True
    # a runtime int and the grid live too: what the direct call of those values passes
    sized = launcher.partial(("k",), (3, 2), args, live=((0, 1), 2, 3), live_grid=(3, 4))
    for n, gx in ((7, 9), (11, 1)):
        assert sized(y, o, n, gx, 4)
        direct(gx, 4, 1, 300 + n, "function", ("meta",), None, None, None, desc(y), desc(y), o, n, keep, desc(w))
        ours, theirs = run.c.calls[-2:]
        assert ours[:3] == (gx, 4, 1) and ours[4:] == theirs[4:]
    with pytest.raises(ValueError, match="neither a tensor nor an int"):
        launcher.partial(("k",), (3, 2), (*args[:3], 2.5, *args[4:]), live=(3,))


def test_replay_passes_the_inputs_and_a_new_scratch_buffer(fake_driver, monkeypatch):
    """``replay``: the recorded launches with a later call's inputs put in and the scratch
    buffers made anew (one allocation; a descriptor over one encoded at its new address);
    NOT_REPLAYABLE for a tensor that is none of inputs, scratch or kept; None before the key's
    direct call is proven."""
    from types import SimpleNamespace

    from triton.tools.tensor_descriptor import TensorDescriptor

    signature = ["tensordesc<fp32[4, 8]>", "*fp32", "i32", "*fp32", "tensordesc<fp32[4, 8]>"]
    run = fake_driver.CudaLauncher(signature, [{"tag": "x"}, {"tag": "s"}])

    def desc(t):
        return TensorDescriptor(t, [8, 8], [8, 1], [4, 8])

    x, out, err = torch.zeros(8, 8), torch.zeros(4), torch.zeros(2)
    recording = _jit._Recording()
    buf = torch.zeros(8, 8)
    recording.scratch.append((buf, lambda: (8, 8)))
    args = (desc(x), out, 5, err, desc(buf))
    direct = _jit._DirectLaunch.of(run, args)
    assert direct.proven_on((*_base(), *args))
    launcher = _launcher_over(direct, SimpleNamespace(launch_enter_hook=None), {"now": 0})
    monkeypatch.setattr(_jit.Launcher, "_audit", lambda self, key, a, options: None)  # (a fake kernel's arguments)
    recording.launches.append((launcher, ("k",), (3,), args, None, (lambda: ((3,), (), ()), (), ())))
    assert _jit.replay(recording, (x, out)) is _jit.NOT_REPLAYABLE  # err is neither input nor kept
    entry = launcher._compiled.pop(("k",))
    assert _jit.replay(recording, (x, out), keep=(err,)) is None  # (no direct call for the key yet)
    # an op records again at its next calls, up to REPLAY_TRIES recordings, then gives up
    tries = [_jit.replay_or_try_again(recording, (x, out), (err,), n) for n in range(_jit.REPLAY_TRIES)]
    assert tries == [*range(1, _jit.REPLAY_TRIES), _jit.NOT_REPLAYABLE]
    launcher._compiled[("k",)] = entry
    assert callable(_jit.replay_or_try_again(recording, (x, out), (err,), 0))
    replayed = _jit.replay(recording, (x, out), keep=(err,))
    y, o = torch.randn(8, 8), torch.zeros(4)
    assert replayed((), y, o)
    call = run.c.calls[-1]
    maps = [a for a in call if isinstance(a, tuple) and a[0] == "map"]
    assert maps[0][1:3] == (y.data_ptr(), "x") and maps[1][2] == "s" and maps[1][1] != buf.data_ptr()
    assert o.data_ptr() in call and err.data_ptr() in call and 5 in call


def test_replay_follows_the_sizes_where_every_launch_says_how(fake_driver, monkeypatch):
    """A recording whose launches and scratch buffers all say how they follow the op's sizes
    (``sized``) replays calls of other sizes: the grid, the size argument and a descriptor's
    rows come from the call's sizes (each (address, rows) encoded once), the scratch buffer is
    sized for them. Without ``sized`` on one of them the recording is not replayable, nor is
    one with a launch around the Launchers."""
    from types import SimpleNamespace

    from triton.tools.tensor_descriptor import TensorDescriptor

    signature = ["tensordesc<fp32[4, 8]>", "*fp32", "i32", "*fp32", "tensordesc<fp32[4, 8]>"]
    run = fake_driver.CudaLauncher(signature, [{"tag": "x"}, {"tag": "s"}])

    def desc(t):
        return TensorDescriptor(t, [t.shape[0], 8], [8, 1], [4, 8])

    x, out, err = torch.zeros(8, 8), torch.zeros(4), torch.zeros(2)
    buf = torch.zeros(8, 8)
    args = (desc(x), out, 8, err, desc(buf))
    direct = _jit._DirectLaunch.of(run, args)
    assert direct.proven_on((*_base(), *args))
    launcher = _launcher_over(direct, SimpleNamespace(launch_enter_hook=None), {"now": 0})
    monkeypatch.setattr(_jit.Launcher, "_audit", lambda self, key, a, options: None)

    def sized(rows):
        return (-(-rows // 4),), (rows,), (rows, rows)

    def recording_with(launch_sized, scratch_sized, opaque=False):
        recording = _jit._Recording()
        recording.scratch.append((buf, scratch_sized))
        recording.launches.append((launcher, ("k",), (2,), args, None, launch_sized))
        recording.opaque = opaque
        return recording

    replayed = _jit.replay(recording_with((sized, (2,), (0, 4)), lambda rows: (rows, 8)), (x, out), keep=(err,))
    for rows in (12, 5, 12):
        y, o = torch.randn(rows, 8), torch.zeros(4)
        encodes = len(fake_driver.encodes)
        assert replayed((rows,), y, o)
        call = run.c.calls[-1]
        maps = [a for a in call if isinstance(a, tuple) and a[0] == "map"]
        assert call[:3] == (-(-rows // 4), 1, 1) and rows in call[13:]
        assert maps[0][1:4] == (y.data_ptr(), "x", (rows, 8)) and maps[1][2:4] == ("s", (rows, 8))
        assert len(fake_driver.encodes) - encodes <= 2
    for launch_sized, scratch_sized in (((sized, (2,), (0, 4)), None), (None, lambda rows: (rows, 8))):
        assert _jit.replay(recording_with(launch_sized, scratch_sized), (x, out), keep=(err,)) is _jit.NOT_REPLAYABLE
    assert _jit.replay(recording_with(None, None, opaque=True), (x, out), keep=(err,)) is _jit.NOT_REPLAYABLE
