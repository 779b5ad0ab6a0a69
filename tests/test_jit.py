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
    kernel sees (the descriptor expansion of the direct path, where it is used, included)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    launcher = _jit.Launcher(_desc_copy_kernel)
    rows, cols = 64, 32
    for i in range(5):
        n = rows * (i % 3 + 1)
        src = torch.randn(n, cols, device="cuda")
        dst = torch.full((n, cols), float("nan"), device="cuda")
        desc = _jit.host_descriptor(TensorDescriptor, src, [n, cols], [cols, 1], [rows, cols])
        launcher(("copy",), (n // rows,), (desc, dst, dst.stride(0), float(i + 1), rows, cols), {"num_warps": 4})
        assert torch.equal(dst, src * (i + 1)), i
    run = launcher._compiled[("copy",)][3]
    if triton.__version__.startswith("3.6"):  # the expansion is proven on the first direct launch
        assert getattr(run.launch, "__func__", None) is _jit._DescriptorExpansion._launch


_WRAPPER_SRC = '''
_BASE_ARGS_FORMAT_LEN = 3

def make_tensordesc_arg(arg, meta):
    return [("map", arg.base, meta), *arg.shape, *arg.strides]

def wrap(launcher, signature, tensordesc_meta):
    indices = {i for i, sig in enumerate(signature) if sig.startswith("tensordesc")}

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
'''


def test_descriptor_expansion_matches_a_python_wrapper_and_declines_others():
    """On a launcher shaped like triton 3.6's (a Python loop over the arguments), the sliced
    expansion hands the launcher what the loop does, for new descriptors every call; a wrapper
    of another shape keeps its own path."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    namespace: dict = {}
    exec(_WRAPPER_SRC, namespace)  # noqa: S102 (a module-like namespace for the wrapper's globals)
    calls = []

    class FakeCudaLauncher:
        def __init__(self, signature):
            self.launch = namespace["wrap"](lambda *flat: calls.append(flat), signature, ["m0", "m1"])

        def __call__(self, grid, stream, *args):
            self.launch(grid, stream, "scratch", *args)

    def descs(n):
        return [TensorDescriptor(torch.zeros(n, 8), [n, 8], [8, 1], [4, 8]) for _ in range(2)]

    signature = ["i32", "tensordesc<fp32[4, 8]>", "constexpr", "tensordesc<fp32[4, 8]>", "i32"]
    run = FakeCudaLauncher(signature)
    d0, d1 = descs(4)
    args = (7, d0, 3, d1, 9)
    expansion = _jit._DescriptorExpansion.of(run, args)
    assert expansion is not None and expansion.positions == (1, 3)
    assert expansion.proven_on((1, "s", *args))
    triton_way = calls.pop()
    e0, e1 = descs(12)
    for launch in (run, expansion.fast_run):
        launch(1, "s", 7, e0, 3, e1, 9)
    assert calls[0] == calls[1] and len(calls[1]) == len(triton_way)
    # (grid, stream, scratch, 7, map, 12, 8, 8, 1, 3, map, ...)
    assert calls[1][4] == ("map", e0.base, "m0") and calls[1][10] == ("map", e1.base, "m1")

    class OtherLauncher:
        def launch(self, *args):
            calls.append(args)

    assert _jit._DescriptorExpansion.of(OtherLauncher(), args) is None
