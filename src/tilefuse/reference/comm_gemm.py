"""Torch oracles for the fused tensor-parallel GEMMs (``tilefuse.tp``).

* ``ag_gemm_ref`` / ``gemm_rs_ref``: the sequential baselines inside a process group:
  ``all_gather_into_tensor`` then ``matmul``; ``matmul`` then ``reduce_scatter_tensor``.
* ``ag_gemm_emulated`` / ``gemm_rs_emulated``: the same results for W ranks' inputs held in one
  process (CPU tests), computed in fp32.
"""

from __future__ import annotations

import torch


def _rhs(b: torch.Tensor, b_layout: str) -> torch.Tensor:
    if b_layout not in ("kn", "nk"):
        raise ValueError(f"b_layout must be 'kn' or 'nk', got {b_layout!r}")
    return b if b_layout == "kn" else b.t()


def ag_gemm_ref(a_shard: torch.Tensor, b: torch.Tensor, group=None, b_layout: str = "kn") -> torch.Tensor:
    """``all_gather(a_shard, dim 0) @ b`` through torch.distributed and torch.matmul."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered = a_shard.new_empty(a_shard.shape[0] * world, a_shard.shape[1])
    dist.all_gather_into_tensor(gathered, a_shard.contiguous(), group=group)
    return gathered @ _rhs(b, b_layout)


def gemm_rs_ref(a: torch.Tensor, b: torch.Tensor, group=None, b_layout: str = "kn") -> torch.Tensor:
    """``reduce_scatter(a @ b, dim 0, sum)`` through torch.matmul and torch.distributed."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    full = (a @ _rhs(b, b_layout)).contiguous()
    out = full.new_empty(full.shape[0] // world, full.shape[1])
    dist.reduce_scatter_tensor(out, full, group=group)
    return out


def ag_gemm_emulated(shards: list[torch.Tensor], b: torch.Tensor, b_layout: str = "kn") -> torch.Tensor:
    """fp32 ``cat(shards) @ b``: what every rank's ag_gemm must return."""
    return torch.cat([s.float() for s in shards]) @ _rhs(b, b_layout).float()


def gemm_rs_emulated(
    a_list: list[torch.Tensor], b_list: list[torch.Tensor], b_layout: str = "kn"
) -> list[torch.Tensor]:
    """fp32 per-rank results of the reduce-scatter of ``sum_r a_r @ b_r`` (rank r: chunk r)."""
    world = len(a_list)
    total = sum(a.float() @ _rhs(b, b_layout).float() for a, b in zip(a_list, b_list))
    return list(total.chunk(world, dim=0))
