"""Symmetric-memory workspaces of the fused TP ops: allocation, reuse, errors.

One workspace per (process group, op): a byte buffer from
``torch.distributed._symmetric_memory`` that every rank of the group can address, laid out as

    [control words | barrier slots (written by peers) | flags | data regions]

(offsets in ``_primitives``; the data layout is the op's). It is allocated on first use, reused
by every later call, grown (collectively: every rank asks for the same size) only outside
CUDA-graph capture, and size-checked on every call. NVLink multicast is never used.

A wait that times out in a kernel writes an error record into pinned host memory (the device
writes it through the same address); every later call on the workspace, and
``check_errors()``, turns it into :class:`CommTimeoutError` naming the rank, the op, the role
and the chunk. After such an error the group's workspaces are marked broken until
``reset_group()``.

For CPU tests, ``emulated_workspaces`` gives W workspaces in one process whose peer addresses
point at each other, so the kernels' data path runs through Triton's interpreter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from tilefuse.tp import _primitives as P

_MIN_BYTES = 1 << 20


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
    local: torch.Tensor  # uint8 [nbytes]
    bases: list[int]  # every rank's base address
    bases_dev: torch.Tensor  # the same, int64 on the workspace's device
    err: torch.Tensor  # int32 error record (pinned host memory on a GPU)
    handle: object = None  # torch symmetric-memory handle (None when emulated)
    peers: list[Workspace] | None = field(default=None, repr=False)  # emulation only

    @property
    def nbytes(self) -> int:
        return self.local.numel()

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view of this rank's bytes ``[offset, offset + numel * itemsize)``."""
        return _typed(self.local, offset, shape, dtype)

    def peer_view(self, peer: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The same region of rank ``peer``'s workspace, as a tensor (for copy-engine transfers)."""
        if self.peers is not None:
            return self.peers[peer].view(offset, shape, dtype)
        item = torch.empty((), dtype=dtype).element_size()
        if offset % item:
            raise ValueError(f"offset {offset} is not a multiple of {dtype}'s size")
        numel = 1
        for s in shape:
            numel *= s
        return self.handle.get_buffer(peer, (numel,), dtype, offset // item).view(shape)

    def ctl(self) -> torch.Tensor:
        return self.view(0, (P.CTL_WORDS,), torch.int32)


def _typed(buf: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
    item = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    if offset % max(item, 1) or offset + numel * item > buf.numel():
        raise ValueError(f"region [{offset}, {offset + numel * item}) does not fit a {buf.numel()}-byte workspace")
    return buf[offset : offset + numel * item].view(dtype).view(shape)


def _error_record(device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.zeros(P.ERR_WORDS, dtype=torch.int32, pin_memory=pin)


def emulated_workspaces(world: int, nbytes: int, device: str | torch.device = "cpu") -> list[Workspace]:
    """``world`` workspaces in one process, each able to address the others (CPU tests)."""
    device = torch.device(device)
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = [b.data_ptr() for b in bufs]
    wss = [
        Workspace(r, world, bufs[r], bases, torch.tensor(bases, dtype=torch.int64, device=device),
                  _error_record(device))
        for r in range(world)
    ]
    for w in wss:
        w.peers = wss
    return wss


def _round_up(n: int, quantum: int = 1 << 20) -> int:
    return max(_MIN_BYTES, -(-n // quantum) * quantum)


def _device_barrier(group, device: torch.device) -> None:
    """All ranks' prior device work done (used only when a workspace is (re)allocated)."""
    import torch.distributed as dist

    torch.cuda.synchronize(device)
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(device)


def allocate_workspace(group, nbytes: int, device: torch.device) -> Workspace:
    """Allocate and rendezvous a zeroed symmetric workspace of ``nbytes`` (collective)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(buf, group)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    # The tensor may start inside its allocation; the offset is the same on every rank.
    delta = buf.data_ptr() - handle.buffer_ptrs[rank]
    bases = [int(p) + delta for p in handle.buffer_ptrs]
    _device_barrier(group, device)
    return Workspace(rank, world, buf, bases, torch.tensor(bases, dtype=torch.int64, device=device),
                     _error_record(device), handle)


class FusedState:
    """Workspace, side streams and events of one op on one group (reused across calls)."""

    def __init__(self, group, op: str, device: torch.device):
        self.group = group
        self.op = op
        self.device = device
        self.ws: Workspace | None = None
        self.broken: str | None = None
        # Flag bytes [FLAGS_OFFSET, clean_end) are known to be zero: every call resets the flags
        # it used, but a later call with more flags would read an earlier call's data as flags.
        self.clean_end = 0
        cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device=device, priority=-1) if cuda else None
        self.copy = torch.cuda.Stream(device=device) if cuda else None  # copy-engine staging beside side
        self.start_event = torch.cuda.Event() if cuda else None
        self.end_event = torch.cuda.Event() if cuda else None
        self.copy_event = torch.cuda.Event() if cuda else None

    def ensure(self, nbytes: int) -> Workspace:
        """The workspace, grown to at least ``nbytes`` if needed (never inside graph capture)."""
        self.check()
        if self.ws is not None and self.ws.nbytes >= nbytes:
            return self.ws
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = 0 if self.ws is None else self.ws.nbytes
            raise RuntimeError(
                f"tilefuse.tp.{self.op}: the symmetric workspace holds {have} bytes, this call needs "
                f"{nbytes}; it cannot grow inside CUDA-graph capture: run the op once with this shape "
                "(or a larger one) before capturing"
            )
        if self.ws is not None:  # peers may still read the old one: everyone idle first
            _device_barrier(self.group, self.device)
        self.ws = allocate_workspace(self.group, _round_up(nbytes), self.device)
        self.clean_end = self.ws.nbytes
        return self.ws

    def clear_flags(self, flags_end: int) -> None:
        """Make the flag bytes ``[FLAGS_OFFSET, flags_end)`` of this call zero, on the current
        stream before the call's kernels. Only the part an earlier call may have used as data
        is cleared; peers write this rank's flags only after the call's start barrier, so the
        clearing cannot race with them. Inside graph capture the whole range is cleared (the
        replays may follow calls of any shape)."""
        if self.ws is None:
            raise RuntimeError("clear_flags before the workspace exists")
        start = P.FLAGS_OFFSET
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self.ws.local[start:flags_end].zero_()
            self.clean_end = min(self.clean_end, flags_end)
            return
        if flags_end > self.clean_end:
            self.ws.local[max(start, self.clean_end):flags_end].zero_()
        self.clean_end = flags_end  # this call's data regions start after its flags

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
            st.broken = None
    dist.barrier(group=g)
