"""Symmetric-memory workspaces of the fused TP ops: allocation, reuse, errors, flag protocol.

One workspace per (process group, op): a byte buffer from
``torch.distributed._symmetric_memory`` that every rank of the group can address, laid out as

    [control words | barrier slots (written by peers) | flags (flag_words) | data]

The flag region has a fixed size per workspace, chosen when it is allocated, and no call ever
uses its bytes as data: whatever shapes run on the workspace, and in whatever order eager
calls, graph captures and replays come, one call's data never lands in another call's flag
words. Every flag a call's kernels wait on starts at zero: a workspace is allocated zeroed,
and the last program of each call's GEMM zeroes every flag word of that call after all of them
have been seen (``_primitives.finish_program``), so the next call on the stream starts clean;
the host never clears flags (a graph replay never reaches the host). Peers raise a rank's
flags only after that rank has entered the call's start barrier. Calls of one op on one group
must therefore be stream-ordered on each rank (as NCCL calls are).

The workspace is allocated on first use, reused by every later call, and grown (collectively:
every rank asks for the same size) only outside CUDA-graph capture; the workspace it replaces
stays allocated (graphs captured on it still address it) until ``reset_group``. NVLink
multicast is never used.

A wait that times out in a kernel writes an error record into pinned host memory (the device
writes it through the same address); every later call on the workspace, and
``check_errors()``, turns it into :class:`CommTimeoutError` naming the rank, the op, the role
and the chunk. After such an error the group's workspaces are marked broken until
``reset_group()`` (their flags may be half-set).

For CPU tests, ``emulated_workspaces`` gives W workspaces in one process whose peer addresses
point at each other, so the kernels' data path runs through Triton's interpreter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from triton import next_power_of_2

from tilefuse.tp import _primitives as P
from tilefuse.tp._common import align

_DATA_QUANTUM = 1 << 20  # data regions grow in MiB
MIN_FLAG_WORDS = 1 << 14  # 64 KiB of flags at least; a larger call grows it (powers of two)


class CommTimeoutError(RuntimeError):
    """A cross-GPU wait of a fused op timed out (a peer did not arrive or did not deliver)."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


@dataclass
class Workspace:
    """One rank's view of a symmetric workspace."""

    rank: int
    world: int
    flag_words: int  # int32 flags from FLAGS_OFFSET on; data from ``data_off``
    local: torch.Tensor  # uint8 [nbytes]
    bases: list[int]  # every rank's base address
    bases_dev: torch.Tensor  # the same, int64 on the workspace's device
    err: torch.Tensor  # int32 error record (pinned host memory on a GPU)
    handle: object = None  # torch symmetric-memory handle (None when emulated)
    peers: list[Workspace] | None = field(default=None, repr=False)  # emulation only

    @property
    def nbytes(self) -> int:
        return self.local.numel()

    @property
    def data_off(self) -> int:
        """Byte offset of the data region (the same on every rank)."""
        return data_offset(self.flag_words)

    @property
    def data_bytes(self) -> int:
        return self.nbytes - self.data_off

    def fits(self, n_flags: int, data_bytes: int) -> bool:
        return n_flags <= self.flag_words and data_bytes <= self.data_bytes

    def flags(self) -> torch.Tensor:
        """The whole flag region (int32)."""
        return self.view(P.FLAGS_OFFSET, (self.flag_words,), torch.int32)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view of this rank's bytes ``[offset, offset + numel * itemsize)``."""
        return _typed(self.local, offset, shape, dtype)

    def peer_view(self, peer: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The same region of rank ``peer``'s workspace, as a tensor (for copy-engine transfers)."""
        if self.peers is not None:
            return self.peers[peer].view(offset, shape, dtype)
        item = dtype.itemsize
        if offset % item:
            raise ValueError(f"offset {offset} is not a multiple of {dtype}'s size")
        numel = 1
        for s in shape:
            numel *= s
        return self.handle.get_buffer(peer, (numel,), dtype, offset // item).view(shape)

    def ctl(self) -> torch.Tensor:
        return self.view(0, (P.CTL_WORDS,), torch.int32)


def _typed(buf: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
    item = dtype.itemsize
    numel = 1
    for s in shape:
        numel *= s
    if offset % max(item, 1) or offset + numel * item > buf.numel():
        raise ValueError(f"region [{offset}, {offset + numel * item}) does not fit a {buf.numel()}-byte workspace")
    return buf[offset : offset + numel * item].view(dtype).view(shape)


def data_offset(flag_words: int) -> int:
    return align(P.FLAGS_OFFSET + 4 * flag_words)


def _error_record(device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.zeros(P.ERR_WORDS, dtype=torch.int32, pin_memory=pin)


def emulated_workspaces(world: int, flag_words: int, data_bytes: int,
                        device: str | torch.device = "cpu") -> list[Workspace]:
    """``world`` workspaces in one process, each able to address the others (CPU tests)."""
    device = torch.device(device)
    nbytes = data_offset(flag_words) + data_bytes
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = [b.data_ptr() for b in bufs]
    wss = [
        Workspace(r, world, flag_words, bufs[r], bases, torch.tensor(bases, dtype=torch.int64, device=device),
                  _error_record(device))
        for r in range(world)
    ]
    for w in wss:
        w.peers = wss
    return wss


def _round_up(n: int, quantum: int = _DATA_QUANTUM) -> int:
    return max(quantum, -(-n // quantum) * quantum)


def _device_barrier(group, device: torch.device) -> None:
    """All ranks' prior device work done (used only when a workspace is (re)allocated)."""
    import torch.distributed as dist

    torch.cuda.synchronize(device)
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(device)


def allocate_workspace(group, flag_words: int, data_bytes: int, device: torch.device) -> Workspace:
    """Allocate and rendezvous a zeroed symmetric workspace (collective)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(data_offset(flag_words) + data_bytes, dtype=torch.uint8, device=device)
    buf.zero_()
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(buf, group)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    # The tensor may start inside its allocation; the offset is the same on every rank.
    delta = buf.data_ptr() - handle.buffer_ptrs[rank]
    bases = [int(p) + delta for p in handle.buffer_ptrs]
    _device_barrier(group, device)
    return Workspace(rank, world, flag_words, buf, bases, torch.tensor(bases, dtype=torch.int64, device=device),
                     _error_record(device), handle)


class FusedState:
    """Workspace, side streams and events of one op on one group (reused across calls)."""

    def __init__(self, group, op: str, device: torch.device):
        self.group = group
        self.op = op
        self.device = device
        self.ws: Workspace | None = None
        self.retired: list[Workspace] = []  # replaced workspaces that captured graphs may still address
        self.broken: str | None = None
        cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device=device, priority=-1) if cuda else None
        self.copy = torch.cuda.Stream(device=device) if cuda else None  # copy-engine staging beside side
        self.start_event = torch.cuda.Event() if cuda else None
        self.end_event = torch.cuda.Event() if cuda else None
        self.copy_event = torch.cuda.Event() if cuda else None

    def ensure(self, n_flags: int, data_bytes: int) -> Workspace:
        """The workspace, grown to hold ``n_flags`` flags and ``data_bytes`` of data if needed
        (never inside graph capture). Every rank asks for the same sizes (the shapes agree)."""
        self.check()
        if self.ws is not None and self.ws.fits(n_flags, data_bytes):
            return self.ws
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = "no workspace" if self.ws is None else (
                f"a workspace of {self.ws.flag_words} flags and {self.ws.data_bytes} data bytes")
            raise RuntimeError(
                f"tilefuse.tp.{self.op}: this call needs {n_flags} flags and {data_bytes} data bytes, there is "
                f"{have}; it cannot grow inside CUDA-graph capture: run the op once with this shape (or a "
                "larger one) before capturing"
            )
        flag_words, data = max(MIN_FLAG_WORDS, next_power_of_2(n_flags)), _round_up(data_bytes)
        if self.ws is not None:  # peers may still read the old one: everyone idle first
            _device_barrier(self.group, self.device)
            flag_words, data = max(flag_words, self.ws.flag_words), max(data, self.ws.data_bytes)
            self.retired.append(self.ws)
        self.ws = allocate_workspace(self.group, flag_words, data, self.device)
        return self.ws

    def check(self) -> None:
        """Raise CommTimeoutError for a timeout recorded by an earlier call (no device sync)."""
        if self.broken is not None:
            raise CommTimeoutError(self.broken, {})
        if self.ws is not None:
            raise_recorded(self.ws, self.op, self)


def describe(record: list[int], op_hint: str | None = None) -> str:
    """Human message for an error record (see ``_primitives``)."""
    _, rank, op, role, chunk, index, observed, expected = record
    ops = {v: k for k, v in P.OP_CODES.items()}
    op_name = ops.get(op, op_hint or f"op {op}")
    role_name = P.ROLE_NAMES.get(role, f"role {role}")
    if role_name == "barrier":
        what = f"waiting in the start/end barrier for rank {chunk}"
    elif role_name == "go":
        what = f"waiting for its own start barrier (before sending to chunk {chunk})"
    else:
        what = f"{role_name} waiting on chunk {chunk} (flag {index}: saw {observed}, expected >= {expected})"
    return (
        f"tilefuse.tp.{op_name}: rank {rank} timed out {what}; a peer did not arrive or did not "
        "deliver. The group's fused state is now broken: call tilefuse.tp.reset_group(group) on "
        "every rank, or use path='nccl'."
    )


def raise_recorded(ws: Workspace, op: str, state: FusedState | None = None) -> None:
    rec = [int(x) for x in ws.err.tolist()]
    if rec[0] == 0:
        return
    msg = describe(rec, op)
    if state is not None:
        state.broken = msg
    keys = ("code", "rank", "op", "role", "chunk", "index", "observed", "expected")
    raise CommTimeoutError(msg, dict(zip(keys, rec)))


_STATES: dict[tuple, FusedState] = {}
_LOCK = threading.Lock()


def _group_key(group) -> str:
    import torch.distributed as dist

    g = group if group is not None else dist.group.WORLD
    return g.group_name


def get_state(group, op: str, device: torch.device) -> FusedState:
    key = (_group_key(group), op, str(device))
    with _LOCK:
        st = _STATES.get(key)
        if st is None:
            st = FusedState(group, op, device)
            _STATES[key] = st
        return st


def check_errors(group=None, synchronize: bool = True) -> None:
    """Raise :class:`CommTimeoutError` if a fused op on ``group`` recorded a timeout.

    With ``synchronize`` the current stream is synchronized first, so that every launched
    fused call has finished (a stalled peer costs at most the ops' ``timeout_s``)."""
    key = _group_key(group)
    states = [st for (g, _, _), st in list(_STATES.items()) if g == key]
    if synchronize and torch.cuda.is_available():
        for st in states:
            if st.device.type == "cuda":
                torch.cuda.current_stream(st.device).synchronize()
    for st in states:
        st.check()


def reset_group(group=None) -> None:
    """Collective (every rank of ``group`` calls it): after a :class:`CommTimeoutError`, wait
    until every rank is idle and drop the group's workspaces (their flags and barrier slots may
    be half-set); the next call allocates fresh, zeroed ones."""
    import torch.distributed as dist

    g = group if group is not None else dist.group.WORLD
    key = _group_key(g)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier(group=g)
    for (k, _, _), st in list(_STATES.items()):
        if k == key:
            st.ws = None
            st.retired.clear()
            st.broken = None
    dist.barrier(group=g)
