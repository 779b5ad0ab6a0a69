"""Benchmark suites: each module exposes ``cases(...)`` returning runner cases and
``parse_shapes(items)`` for its ``--shapes`` option.

* ``indexer``: prefill logits at the contract's reference shapes (``tilefuse bench indexer``);
* ``paged``: paged decode logits (``tilefuse bench paged``);
* ``serving``: the indexer in an engine's step loop (``tilefuse bench serving``; its own step
  loop and command line, ``serving.main``).
* ``topk``: logits + top-k, fused and unfused, prefill and decode (``tilefuse bench topk``).
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def no_window_validation():
    """Turn off the paged op's host-side value checks on lengths while a suite runs: they sync
    the host, which batch and periter modes would time (graph capture skips them anyway). The
    suites' own correctness checks cover the same ground. (Prefill checks its windows on the
    device and never syncs; see ``tilefuse.set_checked``.)"""
    old = os.environ.get("TILEFUSE_CHECK_WINDOWS")
    os.environ["TILEFUSE_CHECK_WINDOWS"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TILEFUSE_CHECK_WINDOWS", None)
        else:
            os.environ["TILEFUSE_CHECK_WINDOWS"] = old
