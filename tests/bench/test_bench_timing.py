"""Timing modes with a fake backend: what runs, in which order, and what the stats say."""

import pytest

from tilefuse.bench import timing
from tilefuse.bench.timing import Stats, measure, summarize, variant_order


class FakeBackend:
    """A fake device: a clock that the timed functions advance, and a log of every step."""

    timer = "fake"

    def __init__(self):
        self.now = 0.0
        self.log: list[tuple] = []
        self.marks = 0

    def advance(self, us: float) -> None:
        self.now += us

    def synchronize(self):
        self.log.append(("sync",))

    def mark(self):
        self.marks += 1
        self.log.append(("mark",))
        return self.now

    def elapsed_us(self, start, end):
        return end - start

    def capture(self, fn, calls):
        self.log.append(("capture", calls))
        outputs = [fn() for _ in range(calls)]  # capture runs each call once, outputs retained

        def replay():
            self.log.append(("replay",))
            for _ in range(calls):
                fn()

        replay.outputs = outputs
        return replay

    def flush_l2(self):
        self.log.append(("flush",))


def make_fns(be, costs):
    """Variants that advance the fake clock by their cost and log their name."""

    def make(name, cost):
        def fn():
            be.log.append(("call", name))
            be.advance(cost)
            return object()

        return fn

    return {name: make(name, cost) for name, cost in costs.items()}


def timed_segments(log):
    """The log entries between each pair of marks."""
    segs, cur = [], None
    for entry in log:
        if entry == ("mark",):
            if cur is None:
                cur = []
            else:
                segs.append(cur)
                cur = None
        elif cur is not None:
            cur.append(entry)
    return segs


# ---------------------------------------------------------------------------------------
def test_summarize_statistics():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0], timer="t", mode="graph")
    assert s.median_us == 3.0
    assert s.min_us == 1.0
    assert s.mean_us == 3.0
    assert s.p10_us == pytest.approx(1.4)
    assert s.p90_us == pytest.approx(4.6)
    assert s.samples_us == [5.0, 1.0, 3.0, 2.0, 4.0]  # every sample, in the order measured
    d = s.to_dict()
    assert set(d) >= {"median_us", "p10_us", "p90_us", "min_us", "mean_us", "samples_us", "timer", "mode"}
    assert Stats.from_dict(d) == s
    one = summarize([7.0])
    assert one.median_us == one.p10_us == one.p90_us == one.min_us == 7.0
    with pytest.raises(ValueError, match="samples_us"):
        summarize([])


def test_variant_order_spreads_positions():
    names = ["a", "b"]
    orders = [variant_order(names, s) for s in range(4)]
    assert orders == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]
    names3 = ["a", "b", "c"]
    orders3 = [tuple(variant_order(names3, s)) for s in range(6)]
    assert len(set(orders3)) == 6  # all permutations of three variants in six samples
    for pos in range(3):
        assert sorted(o[pos] for o in orders3) == ["a", "a", "b", "b", "c", "c"]


def test_graph_mode_call_order_and_per_call_time():
    be = FakeBackend()
    fns = make_fns(be, {"a": 10.0, "b": 30.0})
    resets = []
    stats = timing.time_graph(
        fns, calls=4, samples=6, reset=lambda: (resets.append(1), be.log.append(("reset",))), backend=be
    )
    assert stats["a"].median_us == pytest.approx(10.0)
    assert stats["b"].median_us == pytest.approx(30.0)
    assert len(stats["a"].samples_us) == 6
    assert stats["a"].mode == "graph" and stats["a"].timer == "fake"
    # Captured once per variant, before any timing.
    assert [e for e in be.log if e[0] == "capture"] == [("capture", 4), ("capture", 4)]
    # Each timed region holds exactly one replay: no reset, flush or extra call in it.
    segs = timed_segments(be.log)
    assert len(segs) == 12
    for seg in segs:
        assert seg[0] == ("replay",)
        assert all(e[0] == "call" for e in seg[1:]) and len(seg) == 5
        assert ("reset",) not in seg
    # Per sample and variant: reset, untimed replay, reset, mark, timed replay, mark.
    after_capture = be.log[max(i for i, e in enumerate(be.log) if e[0] == "capture") + 1 :]
    after_capture = [e for e in after_capture if e[0] != "call" and e != ("sync",)]
    unit = [("reset",), ("replay",), ("reset",), ("mark",), ("replay",), ("mark",)]
    assert after_capture == unit * 12
    # Variant order per sample follows variant_order (rotation and reversal).
    first_calls = [seg[1][1] for seg in segs]
    expected = [n for s in range(6) for n in variant_order(["a", "b"], s)]
    assert first_calls == expected


def test_graph_mode_l2_flush_outside_timed_region():
    be = FakeBackend()
    fns = make_fns(be, {"a": 2.0})
    timing.time_graph(fns, calls=2, samples=3, l2_flush=True, backend=be)
    segs = timed_segments(be.log)
    assert all(("flush",) not in seg for seg in segs)
    # A flush right before every start mark.
    starts = [i for i, e in enumerate(be.log) if e == ("mark",)][::2]
    assert all(be.log[i - 1] == ("flush",) for i in starts)


def test_batch_mode_back_to_back():
    be = FakeBackend()
    fns = make_fns(be, {"a": 3.0, "b": 5.0})
    resets = []

    def reset():
        be.log.append(("reset",))
        resets.append(1)

    stats = timing.time_batch(fns, iters=7, warmup=2, samples=4, reset=reset, backend=be)
    assert stats["a"].median_us == pytest.approx(3.0)
    assert stats["b"].median_us == pytest.approx(5.0)
    assert stats["a"].mode == "batch"
    segs = timed_segments(be.log)
    assert len(segs) == 8
    for seg in segs:
        # iters launches of one variant, nothing else between the marks.
        assert len(seg) == 7 and len({e for e in seg}) == 1 and seg[0][0] == "call"
    # Warm-up: 2 calls per variant before the first mark.
    first_mark = be.log.index(("mark",))
    assert sum(1 for e in be.log[:first_mark] if e[0] == "call") == 4
    # One reset per sample and variant, plus one per variant before its warm-up.
    assert len(resets) == 8 + 2


def test_periter_mode_one_launch_per_pair_with_reset_between():
    be = FakeBackend()
    fns = make_fns(be, {"a": 4.0, "b": 1.0})
    stats = timing.time_periter(
        fns, samples=5, warmup=1, reset=lambda: be.log.append(("reset",)), l2_flush=True, backend=be
    )
    assert stats["a"].median_us == pytest.approx(4.0)
    assert stats["b"].min_us == pytest.approx(1.0)
    assert stats["b"].mode == "periter"
    segs = timed_segments(be.log)
    assert len(segs) == 10
    assert all(len(seg) == 1 and seg[0][0] == "call" for seg in segs)
    starts = [i for i, e in enumerate(be.log) if e == ("mark",)][::2]
    assert all(be.log[i - 2 : i] == [("reset",), ("flush",)] for i in starts)


def test_measure_dispatch_and_errors():
    be = FakeBackend()
    fns = make_fns(be, {"a": 1.0})
    assert measure(fns, "graph", samples=2, calls=1, backend=be)["a"].mode == "graph"
    assert measure(fns, "batch", samples=2, iters=2, warmup=0, backend=be)["a"].mode == "batch"
    assert measure(fns, "periter", samples=2, backend=be)["a"].mode == "periter"
    with pytest.raises(ValueError, match="mode"):
        measure(fns, "bogus")
    with pytest.raises(TypeError):
        measure(fns, "batch", calls=3, backend=be)
    with pytest.raises(ValueError, match="fns"):
        measure({}, "graph", backend=be)
    with pytest.raises(TypeError, match="fns"):
        measure({"x": 3}, "graph", backend=be)
    with pytest.raises(ValueError, match="samples"):
        measure(fns, "graph", samples=0, backend=be)


def test_host_backend_labels_results():
    be = timing.HostBackend()
    calls = []
    stats = timing.time_graph({"x": lambda: calls.append(1)}, calls=3, samples=2, backend=be)
    assert stats["x"].timer == timing.HOST_TIMER
    assert "not a performance number" in stats["x"].timer
    assert len(calls) == 2 * 2 * 3  # untimed + timed replay per sample, 3 calls each
    assert stats["x"].min_us >= 0.0


def test_slowest_rank():
    a, b = summarize([1.0, 2.0]), summarize([3.0, 4.0])
    assert timing.slowest_rank([a, b]) is b
    with pytest.raises(ValueError):
        timing.slowest_rank([])
