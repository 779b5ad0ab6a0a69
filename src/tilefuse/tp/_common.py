"""What ag_gemm and gemm_rs share: constants, the plans' common fields, argument checks, the policy
call, the set-up of a fused call, the NCCL + GEMM path."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tilefuse._jit import host_descriptor

if TYPE_CHECKING:
    from tilefuse.tp._gemm_core import GemmConfig
    from tilefuse.tp._schedule import TileSchedule

# Data regions of a workspace start on this many bytes (TMA wants 16; 1 KiB keeps them apart
# from the flag words' cache lines).
ALIGN = 1024
# Keeps NCCL and PyTorch's symmetric memory off NVLink multicast (tilefuse never uses it); the
# environment of every process the benchmark and the GPU checks start.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 60.0  # bound of every cross-GPU wait unless the options say otherwise


@dataclass(frozen=True)
class FusedPlan:
    """What every fused op's plan holds: the call's shape and design, this rank's place in the
    group, the GEMM tile and the tile walk."""

    design: str
    m: int
    n: int
    k: int
    world: int
    rank: int
    dtype: torch.dtype
    config: GemmConfig
    schedule: TileSchedule

    @property
    def mc(self) -> int:
        """Rows of one rank's chunk."""
        return self.m // self.world


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def tensor_desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Host tensor descriptor (TMA on Hopper) of a row-major 2-D tensor whose rows are 16-byte
    multiples (what the callers check), without the constructor's per-call checks."""
    return host_descriptor(TensorDescriptor, t, list(t.shape), list(t.stride()), block)


def resolve_group(group):
    """``(group, rank, world)``; ``group=None`` is the default (world) group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tilefuse.tp ops need an initialised torch.distributed process group "
                           "(torchrun + dist.init_process_group)")
    g = group if group is not None else dist.group.WORLD
    if not isinstance(g, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return g, dist.get_rank(g), dist.get_world_size(g)


def check_out(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """``out`` validated (or allocated): contiguous, ``like``'s dtype and device, ``shape``."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be a {like.dtype} tensor of shape {shape} on {like.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("out must be contiguous and start on a 16-byte boundary")
    return out


def decide(op: str, group, world: int, m: int, n: int, k: int, x: torch.Tensor, path: str | None,
           design: str | None):
    """The policy's decision for one call of ``op`` on ``group`` (``x``: the activations, for the
    dtype and device)."""
    from tilefuse.tp import policy

    nodes = policy.group_nodes(group) if world > 1 else 1
    return policy.decide(op, m, n, k, world, x.dtype, device_type=x.device.type, nodes=nodes, path=path,
                         design=design)


def prepare_fused(op: str, make_plan, dec, opts, group, rank: int, world: int, m: int, n: int, k: int,
                  x: torch.Tensor):
    """``(state, plan, workspace, timeout)`` of a fused call of ``op``: the group's state, the
    plan of ``make_plan`` (with the options completed by the decision's measurements), the
    workspace grown to it, and the wait bound in the timer's units."""
    from tilefuse.tp import _primitives as P
    from tilefuse.tp.symm import get_state

    state = get_state(group, op, x.device)
    opts = opts.with_measured(dec.options)
    plan = make_plan(dec.design, m, n, k, world, rank, x.dtype, x.device, **opts.plan_kwargs())
    ws = state.ensure(plan.n_flags, plan.data_bytes)
    return state, plan, ws, P.timeout_units(opts.timeout(), x.device.type)


def matmul(x: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_layout: str, config=None) -> torch.Tensor:
    """The GEMM of the NCCL path: cuBLAS on a GPU, the tilefuse kernel (interpreter) on CPU."""
    from tilefuse.tp._gemm_core import gemm

    if x.device.type == "cuda":
        return torch.matmul(x, b if b_layout == "kn" else b.t(), out=out)
    return gemm(x, b, out, b_layout=b_layout, config=config)


def ag_gemm_nccl(a_shard, b, out, group, world, b_layout, config=None):
    import torch.distributed as dist

    gathered = torch.empty(a_shard.shape[0] * world, a_shard.shape[1], dtype=a_shard.dtype, device=a_shard.device)
    dist.all_gather_into_tensor(gathered, a_shard, group=group)
    return matmul(gathered, b, out, b_layout, config), gathered


def gemm_rs_nccl(a, b, out, group, b_layout, config=None):
    import torch.distributed as dist

    n = out.shape[1]
    full = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    matmul(a, b, full, b_layout, config)
    dist.reduce_scatter_tensor(out, full, group=group)
    return out


_CHECKED_SHAPES: set = set()
_CHECKED_LOCK = threading.Lock()


def check_same_shapes(group, world: int, op: str, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
    """ValueError naming the argument and every rank's shape when the ranks of ``group`` pass
    different shapes (a collective would otherwise hang or return a wrong-sized result on
    some ranks). Costs one collective per new (group, op, shapes) key on each rank, none after
    (cached); skipped inside CUDA-graph capture, where no host-synchronising collective may run.
    A rank that repeats a checked shape while a peer passes a new one is not caught."""
    import torch.distributed as dist

    if world < 2:
        return
    key = (group.group_name, op, tuple(shapes.items()))
    if key in _CHECKED_SHAPES:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    every: list = [None] * world
    dist.all_gather_object(every, shapes, group=group)
    for name in shapes:
        seen = [tuple(r[name]) for r in every]
        if len(set(seen)) > 1:
            sizes = ", ".join(f"rank {r} {s}" for r, s in enumerate(seen))
            raise ValueError(f"tilefuse.tp.{op}: {name} must have the same shape on every rank of the group, "
                             f"got {sizes}")
    with _CHECKED_LOCK:
        _CHECKED_SHAPES.add(key)
