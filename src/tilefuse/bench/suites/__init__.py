"""Benchmark suites: each module exposes ``cases(...)`` returning runner cases and
``parse_shapes(items)`` for its ``--shapes`` option.

* ``indexer``: prefill logits at the contract's reference shapes (``tilefuse bench indexer``);
* ``paged``: paged decode logits (``tilefuse bench paged``);
* ``serving``: the indexer in an engine's step loop (``tilefuse bench serving``; its own step
  loop and command line, ``serving.main``).
* ``topk``: logits + top-k, fused and unfused, prefill and decode (``tilefuse bench topk``).
"""

from __future__ import annotations

