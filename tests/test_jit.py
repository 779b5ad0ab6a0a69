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
