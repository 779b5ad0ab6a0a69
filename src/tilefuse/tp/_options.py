"""Tuning options of the fused TP ops: one frozen object per op, per call or per process.

A field left None is taken, in this order, from the process-level options (``set_options`` /
``use_options``), from the policy's measurements of the call's exact shape
(``Decision.options``), and from the plan's defaults. Nothing is read from the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

from tilefuse.tp._common import DEFAULT_TIMEOUT_S
from tilefuse.tp._gemm_core import GemmConfig

LOCAL_COPIES = ("sm", "ce")


def _positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def check_bool(name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool or None, got {value!r}")


def check_local_copy(value) -> None:
    if value is not None and value not in LOCAL_COPIES:
        raise ValueError(f"local_copy must be one of {LOCAL_COPIES} or None, got {value!r}")


def _common_checks(opts) -> None:
    if opts.config is not None and not isinstance(opts.config, GemmConfig):
        raise TypeError(f"config must be a tilefuse.tp.GemmConfig or None, got {type(opts.config).__name__}")
    t = opts.timeout_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {t!r}")


class _Options:
    """What both options classes do (dataclass mixin)."""

    def timeout(self) -> float:
        """The bound of every cross-GPU wait, in seconds."""
        return DEFAULT_TIMEOUT_S if self.timeout_s is None else float(self.timeout_s)

    def set_fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def over(self, base):
        """These options, with the fields left None taken from ``base``."""
        return dataclasses.replace(base, **self.set_fields())

    def with_measured(self, measured: dict):
        """Fields still None taken from the policy's measured options of this shape (options
        this op does not take are ignored: a row measured with another design's options)."""
        names = {f.name for f in dataclasses.fields(self)}
        fill = {k: v for k, v in measured.items() if k in names and getattr(self, k) is None}
        return dataclasses.replace(self, **fill) if fill else self

    def plan_kwargs(self) -> dict:
        """The keyword arguments of the op's ``make_plan``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeout_s"}


@dataclass(frozen=True)
class AgGemmOptions(_Options):
    """Tuning of :func:`tilefuse.tp.ag_gemm` (None: see the module docstring).

    * ``config``: the GEMM tile (:class:`GemmConfig`);
    * ``comm_programs``: programs of the push kernel (push; default 32);
    * ``splits``: bands per chunk of the copy-engine design, or pieces of push's copy-engine
      staging of the local shard (default 4);
    * ``piece_cols``: columns per pushed piece (push; default 1024);
    * ``local_copy``: who stages push's local shard, ``"sm"`` (the push programs) or ``"ce"``
      (copy engines); default by shard size (``default_local_copy``), or nothing where the
      GEMM reads the own rows from ``a_shard``;
    * ``read_local``: the GEMM reads the own rows from ``a_shard`` in a launch of their own
      (default ``default_read_local``; never for push with an explicit ``local_copy``);
    * ``timeout_s``: bound of every cross-GPU wait (default 60 s).
    """

    config: GemmConfig | None = None
    comm_programs: int | None = None
    splits: int | None = None
    piece_cols: int | None = None
    local_copy: str | None = None
    read_local: bool | None = None
    timeout_s: float | None = None

    def __post_init__(self):
        _common_checks(self)
        for name in ("comm_programs", "splits", "piece_cols"):
            _positive_int(name, getattr(self, name))
        check_local_copy(self.local_copy)
        check_bool("read_local", self.read_local)


@dataclass(frozen=True)
class GemmRsOptions(_Options):
    """Tuning of :func:`tilefuse.tp.gemm_rs` (None: see the module docstring).

    * ``config``: the GEMM tile (:class:`GemmConfig`);
    * ``lag``: the tile order, own tiles this many tiles behind the peer stream (0: all peer
      tiles first; default ``default_lag``);
    * ``gemm_programs``: persistent programs, at most one per SM (default one per SM);
    * ``recv_tma``: the owner's epilogue loads peer partials by TMA (default: where the walk
      is not interleaved);
    * ``send_tma``: at W = 2 on Hopper, the Gluon kernel, whose pushed tiles' TMA stores drain
      under the next tile's main loop (default on there);
    * ``timeout_s``: bound of every cross-GPU wait (default 60 s).
    """

    config: GemmConfig | None = None
    lag: int | None = None
    gemm_programs: int | None = None
    recv_tma: bool | None = None
    send_tma: bool | None = None
    timeout_s: float | None = None

    def __post_init__(self):
        _common_checks(self)
        if self.lag is not None and (isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0):
            raise ValueError(f"lag must be a non-negative int or None, got {self.lag!r}")
        _positive_int("gemm_programs", self.gemm_programs)
        check_bool("recv_tma", self.recv_tma)
        check_bool("send_tma", self.send_tma)


_KINDS = (AgGemmOptions, GemmRsOptions)
_process: dict[type, _Options] = {cls: cls() for cls in _KINDS}
_LOCK = threading.Lock()


def _check_kind(opts) -> None:
    if not isinstance(opts, _KINDS):
        raise TypeError(f"options must be tilefuse.tp.AgGemmOptions or GemmRsOptions, got {type(opts).__name__}")


def set_options(*options: AgGemmOptions | GemmRsOptions) -> None:
    """Make each of ``options`` the process-level options of its op (replacing the previous
    ones; ``AgGemmOptions()`` clears ag_gemm's)."""
    for opts in options:
        _check_kind(opts)
    with _LOCK:
        for opts in options:
            _process[type(opts)] = opts


def get_options(kind: type) -> AgGemmOptions | GemmRsOptions:
    """The process-level options of ``AgGemmOptions`` or ``GemmRsOptions``."""
    if kind not in _KINDS:
        raise TypeError(f"kind must be tilefuse.tp.AgGemmOptions or GemmRsOptions, got {kind!r}")
    return _process[kind]


@contextlib.contextmanager
def use_options(*options: AgGemmOptions | GemmRsOptions):
    """:func:`set_options` for the ``with`` block (the previous options come back after it)."""
    for opts in options:
        _check_kind(opts)
    saved = dict(_process)
    set_options(*options)
    try:
        yield
    finally:
        with _LOCK:
            _process.clear()
            _process.update(saved)


def resolve(options, kind: type):
    """A call's ``options=`` checked and laid over the process-level options."""
    if options is None:
        return _process[kind]
    if not isinstance(options, kind):
        raise TypeError(f"options must be a tilefuse.tp.{kind.__name__} or None, got {type(options).__name__}")
    return options.over(_process[kind])
