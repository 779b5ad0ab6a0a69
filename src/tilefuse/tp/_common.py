"""Argument checks and the NCCL + GEMM path shared by ag_gemm and gemm_rs."""

from __future__ import annotations

import torch

from tilefuse.tp._gemm_core import GemmConfig, gemm


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


def check_options(config, comm_programs, timeout_s) -> None:
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a tilefuse.tp.GemmConfig or None, got {type(config).__name__}")
    if comm_programs is not None and (not isinstance(comm_programs, int) or comm_programs < 1):
        raise ValueError(f"comm_programs must be a positive int or None, got {comm_programs!r}")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")


def matmul(x: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_layout: str, config=None) -> torch.Tensor:
    """The GEMM of the NCCL path: cuBLAS on a GPU, the tilefuse kernel (interpreter) on CPU."""
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


def with_measured_options(given: dict, measured: dict) -> dict:
    """The call's options: what the caller passed, else what the policy measured fastest for
    this exact shape (``Decision.options``), else None (the plan's defaults). Options the op
    does not take are ignored (a row measured with another design's options)."""
    out = dict(given)
    for key, value in measured.items():
        if key in out and out[key] is None:
            out[key] = value
    return out
