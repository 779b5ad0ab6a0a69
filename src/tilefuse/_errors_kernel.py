"""The kernels' side of :mod:`tilefuse._errors`: record a value error without a host sync."""

import triton
import triton.language as tl


@triton.jit
def report_error(err_ptr, CODE: tl.constexpr, bad, detail):
    """Where ``bad`` holds, mark error ``CODE`` and leave ``detail`` (a row, request or value).

    ``bad`` and ``detail`` are int/bool scalars or blocks of one shape; plain masked stores, so
    a block with no bad lane writes nothing.
    """
    zero = detail * 0
    tl.store(err_ptr + 2 * CODE + zero, zero + 1, mask=bad)
    tl.store(err_ptr + 2 * CODE + 1 + zero, detail, mask=bad)
