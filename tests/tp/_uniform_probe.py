"""Compile the bounded waits for sm_90a and print the PTX (run as a script, without the
interpreter): ``test_waits.py`` checks that every branch they take is uniform."""

import triton
import triton.language as tl

from tilefuse.tp import _primitives as P


@triton.jit
def wait_probe(flag_ptr, ctl_ptr, err_ptr, timeout, out_ptr):
    P.wait_geq(flag_ptr, 1, ctl_ptr, err_ptr, timeout, 0, 1, P.ROLE_GEMM, 0, 0, True)
    P.cas_bounded(flag_ptr + 1, 0, 1, ctl_ptr, err_ptr, timeout, 0, 1, P.ROLE_BARRIER, 1, True)
    dead = P.read_word(ctl_ptr + P.CTL_ABORT)
    if dead == 0:  # as the senders do after their start barrier
        tl.store(out_ptr + tl.arange(0, 256), tl.arange(0, 256))
        P.set_flag(flag_ptr + 2, 1)


if __name__ == "__main__":
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"flag_ptr": "*i32", "ctl_ptr": "*i32", "err_ptr": "*i32", "timeout": "i64", "out_ptr": "*i32"}
    compiled = triton.compile(ASTSource(wait_probe, sig, {}, {}), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    print(compiled.asm["ptx"])
