"""Benchmark suites: each module exposes ``cases(...)`` returning runner cases.

* ``indexer``: prefill logits at the contract's reference shapes (``tilefuse bench indexer``);
* ``paged``: paged decode logits (``tilefuse bench paged``).
"""
