"""The tilefuse measurement harness: timing modes, environment, ceilings, clocks, reports.

Use it from Python::

    from tilefuse.bench import measure
    stats = measure({"mine": lambda: op(x), "theirs": lambda: peer(x)}, mode="graph")
    stats["mine"].median_us

or from the command line (``tilefuse bench indexer``, ``tilefuse compare``, ``tilefuse plot``).
See ``docs/benchmarking.md`` for the rules behind the numbers.
"""

from tilefuse.bench.env import environment, gpu_slug
from tilefuse.bench.timing import (
    MODES,
    Stats,
    measure,
    summarize,
    time_batch,
    time_graph,
    time_periter,
    variant_order,
)

__all__ = [
    "MODES",
    "Stats",
    "environment",
    "gpu_slug",
    "measure",
    "summarize",
    "time_batch",
    "time_graph",
    "time_periter",
    "variant_order",
]
