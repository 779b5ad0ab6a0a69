"""Tensor-parallel fused communication + GEMM on the GPUs of one node.

* :func:`ag_gemm` — ``all_gather(a_shard, dim 0) @ b`` (column-parallel layer);
* :func:`gemm_rs` — ``reduce_scatter(a @ b, dim 0, sum)`` (row-parallel layer);
* :func:`gemm` — the persistent Triton GEMM both are built on, alone;
* tuning: :class:`AgGemmOptions`, :class:`GemmRsOptions` (``options=`` per call), process-level
  :func:`set_options` / :func:`use_options`;
* policy: :func:`decide` (what a call would run, and why), :func:`set_override` /
  :func:`override`, :func:`policy_table`, :func:`load_policy_table`;
* errors: :class:`CommTimeoutError`, :func:`check_errors`, :func:`reset_group`;
* :class:`Trace` — per-program activity, exported to Chrome/Perfetto JSON; :func:`chrome_trace`
  merges several ranks' events on one time axis with :func:`clock_offsets`.

Under ``torch.compile`` call ``torch.ops.tilefuse.ag_gemm`` / ``torch.ops.tilefuse.gemm_rs``
(custom ops with fake implementations; the group named by its ``group_name``).

Run under ``torchrun`` with one process per GPU and an NCCL process group; symmetric memory
comes from ``torch.distributed._symmetric_memory``; NVLink multicast is never used.
See ``docs/tp.md``.
"""

from tilefuse.tp import _library  # noqa: F401  (registers torch.ops.tilefuse.ag_gemm / gemm_rs)
from tilefuse.tp._ag_gemm import ag_gemm
from tilefuse.tp._gemm_core import GemmConfig, default_config, gemm
from tilefuse.tp._gemm_rs import gemm_rs
from tilefuse.tp._options import AgGemmOptions, GemmRsOptions, get_options, set_options, use_options
from tilefuse.tp.policy import Decision, decide, override, set_override
from tilefuse.tp.policy import load_table as load_policy_table
from tilefuse.tp.policy import table as policy_table
from tilefuse.tp.symm import CommTimeoutError, check_errors, reset_group
from tilefuse.tp.trace import Trace, chrome_trace, clock_offsets

__all__ = [
    "AgGemmOptions",
    "CommTimeoutError",
    "Decision",
    "GemmConfig",
    "GemmRsOptions",
    "Trace",
    "ag_gemm",
    "check_errors",
    "chrome_trace",
    "clock_offsets",
    "decide",
    "default_config",
    "gemm",
    "gemm_rs",
    "get_options",
    "load_policy_table",
    "override",
    "policy_table",
    "reset_group",
    "set_options",
    "set_override",
    "use_options",
]
