"""``ag_gemm`` and ``gemm_rs`` as ``torch.library`` custom ops, for ``torch.compile``.

``torch.ops.tilefuse.ag_gemm(a_shard, b, group_name, b_layout)`` and
``torch.ops.tilefuse.gemm_rs(a, b, group_name, b_layout)`` run the eager ops (the policy, the
process-level options of ``set_options`` and ``set_override`` apply); the group is named by its
``group_name`` (a string, which a traced graph can hold). Their fake implementations give the
output's shape, dtype and device without a collective, so a compiled tensor-parallel layer
traces through them without a graph break.
"""

from __future__ import annotations

import torch

_B_LAYOUTS = ("kn", "nk")


def _group(group_name: str):
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(group_name)


def _n(b: torch.Tensor, b_layout: str) -> int:
    if b_layout not in _B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {_B_LAYOUTS}, got {b_layout!r}")
    return b.shape[1] if b_layout == "kn" else b.shape[0]


def _fake(x: torch.Tensor, b: torch.Tensor, group_name: str, b_layout: str, gathers: bool) -> torch.Tensor:
    """The output's shape: the rows of all ranks (``gathers``) or of one rank's chunk."""
    world = _group(group_name).size()
    rows = x.shape[0] * world if gathers else x.shape[0] // world
    return x.new_empty((rows, _n(b, b_layout)))


@torch.library.custom_op("tilefuse::ag_gemm", mutates_args=())
def ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, b_layout: str = "kn") -> torch.Tensor:
    """``all_gather(a_shard, dim 0) @ b`` over the group named ``group_name``."""
    from tilefuse.tp._ag_gemm import ag_gemm

    return ag_gemm(a_shard, b, group=_group(group_name), b_layout=b_layout)


ag_gemm_op.register_fake(lambda a_shard, b, group_name, b_layout="kn": _fake(a_shard, b, group_name, b_layout, True))


@torch.library.custom_op("tilefuse::gemm_rs", mutates_args=())
def gemm_rs_op(a: torch.Tensor, b: torch.Tensor, group_name: str, b_layout: str = "kn") -> torch.Tensor:
    """``reduce_scatter(a @ b, dim 0, sum)`` over the group named ``group_name``."""
    from tilefuse.tp._gemm_rs import gemm_rs

    return gemm_rs(a, b, group=_group(group_name), b_layout=b_layout)


gemm_rs_op.register_fake(lambda a, b, group_name, b_layout="kn": _fake(a, b, group_name, b_layout, False))
