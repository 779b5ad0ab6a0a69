"""Value errors found on the device, reported without a host synchronisation.

Checks that need device data (window bounds, context lengths, page ids, stale metadata) run
inside the kernels. A kernel that finds a bad value computes nothing from it (no access out of
bounds whatever the values) and records the error in a small per-device record; the host
raises it at the next call of any tilefuse op on that device, or at :func:`check_errors`.

The record is pinned host memory mapped into the GPU's address space, so a kernel's store
reaches it without a copy and the host reads it without a sync; its address never changes,
so kernels captured in a CUDA graph keep reporting into it. Where pinned memory is not
available (CPU tensors, the interpreter) the record is an ordinary tensor on the op's device.

Record layout: int32 ``[2 * NUM_CODES]``; slot ``2 * code`` is nonzero once an error of that
code was seen, slot ``2 * code + 1`` holds a detail (the first offending row or value seen).
Kernels write with plain masked stores (no atomics: host memory over PCIe need not support
them); several writers of one code leave one of their details, which is all the message needs.
"""

from __future__ import annotations

import contextlib
import threading

import torch

# Error codes: (argument named in the message, what is wrong; ``{detail}`` is the slot's detail).
WINDOW_START_NEGATIVE = 0
WINDOW_INVERTED = 1
WINDOW_LONGER_THAN_MAX_SEQLEN = 2
CONTEXT_LEN_NEGATIVE = 3
CONTEXT_LEN_PAST_TABLE = 4
PAGE_ID_OUT_OF_RANGE = 5
STALE_METADATA = 6
INDEX_OUT_OF_RANGE = 7
CONTEXT_LEN_PAST_WIDTH = 8
NUM_CODES = 16

MESSAGES = {
    WINDOW_START_NEGATIVE: ("cu_seq_len_k_start", "window starts must be >= 0 (row {detail})"),
    WINDOW_INVERTED: ("cu_seq_len_k_start/cu_seq_len_k_end", "every window needs ks <= ke (row {detail})"),
    WINDOW_LONGER_THAN_MAX_SEQLEN: ("max_seqlen_k", "smaller than the window of row {detail}"),
    CONTEXT_LEN_NEGATIVE: ("context_lens", "lengths must be >= 0 (request {detail})"),
    CONTEXT_LEN_PAST_TABLE: ("context_lens", "request {detail} is longer than its block_table row holds"),
    PAGE_ID_OUT_OF_RANGE: ("block_table", "page id {detail} is outside the cache"),
    STALE_METADATA: ("schedule_meta", "made for other context lengths (worker {detail})"),
    INDEX_OUT_OF_RANGE: ("indices", "request id {detail} is outside the batch"),
    CONTEXT_LEN_PAST_WIDTH: ("max_context_len", "smaller than the context of request {detail}"),
}


class DeviceValueError(ValueError):
    """A value error found by a kernel; raised at the next op call or by :func:`check_errors`."""


_lock = threading.Lock()
_records: dict[torch.device, torch.Tensor] = {}


def _new_record(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        try:
            return torch.zeros(2 * NUM_CODES, dtype=torch.int32, pin_memory=True)
        except RuntimeError:  # no pinned memory: a device record, read by check_errors
            return torch.zeros(2 * NUM_CODES, dtype=torch.int32, device=device)
    return torch.zeros(2 * NUM_CODES, dtype=torch.int32, device=device)


def _key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def error_record(device: torch.device | str) -> torch.Tensor:
    """The record kernels on ``device`` write into (same tensor for the process's lifetime)."""
    device = _key(device)
    record = _records.get(device)
    if record is None:
        with _lock:
            record = _records.get(device)
            if record is None:
                record = _records[device] = _new_record(device)
    return record


def _message(code: int, detail: int) -> str:
    arg, what = MESSAGES.get(code, ("argument", "invalid value ({detail})"))
    return f"{arg}: {what.format(detail=detail)}"


def _raise_from(record: torch.Tensor) -> None:
    flags = record.tolist()
    found = [(c, flags[2 * c + 1]) for c in range(NUM_CODES) if flags[2 * c]]
    if not found:
        return
    record.zero_()
    raise DeviceValueError("; ".join(_message(c, d) for c, d in found)
                           + " (found on the device by an earlier call; its outputs for those rows are not valid)")


# Nonzero while an op runs other ops as its parts (:func:`deferred`).
_deferring = 0


@contextlib.contextmanager
def deferred():
    """Inside: the ops called as parts of a composite op raise nothing pending, so what one
    part recorded surfaces at the composite op's next call or :func:`check_errors`, as for any op."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def raise_pending(device: torch.device | str) -> None:
    """Raise what kernels on ``device`` have recorded so far; never synchronises.

    A host-visible record is read as it stands (a kernel still running may report later); a
    record in device memory is left to :func:`check_errors`. Inside CUDA-graph capture,
    torch.compile tracing and :func:`deferred` nothing is read.
    """
    if _deferring:
        return
    record = _records.get(_key(device))
    if record is None or record.device.type == "cuda":
        return
    if torch.compiler.is_compiling():
        return
    _raise_from(record)


def check_errors(device: torch.device | str | None = None) -> None:
    """Wait for the device and raise any value error its kernels recorded (then clear it).

    Call it where a host sync is acceptable (after a step, in tests, in a checked mode); it
    is the only way to see errors from graph replays before the next eager call.
    """
    devices = [_key(device)] if device is not None else list(_records)
    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        record = _records.get(dev)
        if record is not None:
            _raise_from(record)


# Checked mode: the ops also validate device values on the host before launching (one host
# sync per call) and raise at once, instead of at the next call. For debugging and tests.
_checked = False


def set_checked(on: bool = True) -> None:
    """Turn checked mode on or off for the process (off by default: no host sync on any op).

    In checked mode each op reads the values it depends on (windows, lengths) before launching,
    raises a ``ValueError`` naming the argument at once, and waits for its kernels to raise
    anything they found (:func:`check_errors`). Skipped inside CUDA-graph capture and
    torch.compile tracing, where a host read is not possible.
    """
    global _checked
    _checked = bool(on)


def checked() -> bool:
    """Whether checked mode is on (:func:`set_checked`)."""
    return _checked


@contextlib.contextmanager
def checked_mode(on: bool = True):
    """:func:`set_checked` for the duration of a ``with`` block."""
    global _checked
    old = _checked
    _checked = bool(on)
    try:
        yield
    finally:
        _checked = old


def host_reads_possible(device: torch.device) -> bool:
    """Whether a checked op may read device values now (not while tracing or capturing)."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


# The ops' hot path: a byte view of each host-visible record, so that a clean record costs one
# memory comparison (a torch read of it costs microseconds per call).
_byte_views: dict[torch.device, memoryview | None] = {}
_CLEAN = bytes(2 * NUM_CODES * 4)


def raise_pending_fast(device: torch.device) -> None:
    """:func:`raise_pending` for a tensor's own device (``tensor.device``, index included):
    the same errors raised, at the cost of one comparison while nothing is recorded."""
    if _deferring:
        return
    view = _byte_views.get(device, False)
    if view is False:
        record = error_record(device)
        view = None if record.device.type == "cuda" else memoryview(record.numpy()).cast("B")
        _byte_views[device] = view
    if view is not None and view != _CLEAN:
        raise_pending(device)
