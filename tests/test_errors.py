"""Device-side value errors: kernels record, the host raises at the next call or check_errors."""

import pytest
import torch
import triton
import triton.language as tl

from tilefuse import _errors
from tilefuse._errors_kernel import report_error


@triton.jit
def _negative_rows_kernel(x_ptr, n, err_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    report_error(err_ptr, 1, (x < 0) & (offs < n), offs)


def _run(values, device):
    x = torch.tensor(values, dtype=torch.int32, device=device)
    _negative_rows_kernel[(1,)](x, x.numel(), _errors.error_record(device), BLOCK=16)


def test_clean_values_record_nothing(device):
    _run([0, 1, 2, 3], device)
    _errors.raise_pending(device)
    _errors.check_errors(device)


def test_bad_value_raises_at_next_check_then_clears(device):
    _run([0, 5, -1, 3], device)
    with pytest.raises(_errors.DeviceValueError, match=r"ks <= ke \(row 2\)"):
        _errors.check_errors(device)
    _errors.check_errors(device)  # cleared


@pytest.mark.skipif(torch.cuda.is_available(), reason="a kernel on CPU tensors runs only through the interpreter")
def test_raise_pending_reads_host_record_without_sync():
    _run([-3], "cpu")
    with pytest.raises(ValueError, match="cu_seq_len_k_start/cu_seq_len_k_end"):
        _errors.raise_pending("cpu")
    _errors.raise_pending("cpu")


def test_record_is_one_tensor_per_device(device):
    assert _errors.error_record(device) is _errors.error_record(device)
    assert _errors.error_record(device).numel() == 2 * _errors.NUM_CODES
