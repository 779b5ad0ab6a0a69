"""``benchmarks/paged_chunk_rule.py``: each threshold's pick timed from a schedule grid's fixed chunks."""

import json

from .scripts import load_script


def _row(batch, next_n, max_len, config, median):
    return {"batch": batch, "next_n": next_n, "mean_context": 8192, "heads": 64, "config": config,
            "max_context_len": max_len, "stats": {"median_us": median}}


_PARAMS = {"format": "fp8", "next_n": 1, "heads": 64, "head_dim": 128, "block_kv": 64}


def _sweep_file(path, times: dict, shapes: dict) -> str:
    """A decode sweep result of tilefuse rows named by ``times``' keys, ``shapes[case]`` its
    (B, mean ctx)."""
    from .results_factory import result, row

    rows = []
    for case, us in times.items():
        r = row(f"{case} | tilefuse", [us] * 3)
        r["params"] = {**_PARAMS, "batch": shapes[case][0], "mean_context": shapes[case][1]}
        rows.append(r)
    path.write_text(json.dumps(result(rows)))
    return str(path)


def test_picks_are_timed_from_the_fixed_chunks(tmp_path):
    rule = load_script("paged_chunk_rule")
    rows = [_row(8, 1, 10140, f"n64 r1 chunk{c} w4 st4", t)
            for c, t in ((0, 6.7), (512, 6.8), (256, 5.9), (128, 5.4), (1024, 7.5))]
    rows += [_row(8, 1, 10140, "n64 r1 chunk256 w4 st2", 1.0)]  # another pipeline: not read
    rows += [_row(32, 2, 5300, f"n64 r2 chunk{c} w4 st4", t) for c, t in ((0, 10.6), (512, 10.6), (256, 11.2))]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"environment": {"sm_count": 132}, "layers": 1, "rows": rows}))
    table, summary = rule.weigh([str(path)])
    by_batch = {e["batch"]: e for e in table}
    eight, wide = by_batch[8], by_batch[32]
    # every pick timed by its fixed-chunk row, against the wave's rule alone (512 keys here)
    assert eight["picks"]["few 0"] == 512 and eight["few 0"]["us"] == 6.8
    assert eight["few 4"] == eight["current"] == {"chunk": 256, "us": 5.9, "vs_wave_rule": 5.9 / 6.8}
    assert eight["few 6"]["chunk"] == 128 and eight["best_fixed"]["chunk"] == 128
    # B32 next_n 2: 331 programs of 512 keys; at 6 an SM the pick halves, and is slower
    assert wide["few 4"]["chunk"] == 512 and wide["few 6"]["vs_wave_rule"] > 1
    assert summary["few 4"]["rows_moved"] == 1 and summary["few 6"]["worst_vs_wave_rule"] == 11.2 / 10.6


def test_sweep_ab_splits_one_request_and_moved_picks(tmp_path):
    rule = load_script("paged_chunk_rule")
    # B8 ctx 8K: 512 keys at the wave's rule, 256 at 4 an SM; B256 ctx 8K: unmoved; B1: its own class
    shapes = {"B8": (8, 8192), "B256": (256, 8192), "B1": (1, 65536)}

    def sweep(name, times):
        return _sweep_file(tmp_path / name, times, shapes)

    files = [sweep("a.json", {"B8": 8.0, "B256": 100.0, "B1": 5.0}),
             sweep("b.json", {"B8": 8.0, "B256": 100.0, "B1": 5.0}),
             sweep("few.json", {"B8": 6.0, "B256": 101.0, "B1": 5.5})]
    out = rule.sweep_ab(files, 4)
    assert out["two or more, pick moved"]["rows"] == 1
    assert abs(out["two or more, pick moved"]["median"] - 0.75) < 1e-9
    worst = out["two or more, pick unmoved"]["worst"]
    assert worst[1] == "B256" and abs(worst[0] - 1.01) < 1e-9
    assert out["one request"]["over_1.02"] == 1


def test_a_sweep_run_at_another_threshold_records_it(tmp_path):
    from tilefuse.bench.report import load_result

    from .results_factory import result, row

    rule = load_script("paged_chunk_rule")
    path = tmp_path / "few6.json"
    path.write_text(json.dumps(result([row("B8 | tilefuse", [1.0, 1.1])])))
    rule.record_threshold(str(path), 6)
    assert "few=6 programs an SM" in load_result(path)["settings"]["chunk_rule"]


def test_sweep_ab_against_another_trees_rule(tmp_path):
    rule = load_script("paged_chunk_rule")
    # A stand-in for the baselines' tree: its rule gives 1024 keys (16 pages of 64) everywhere.
    pkg = tmp_path / "src" / "tilefuse" / "indexer"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "paged.py").write_text("def chunk_pages_for(*args):\n    return 16\n")
    shapes = {"B8": (8, 8192), "B256": (256, 8192), "B1": (1, 65536)}  # here 256, 1024, 512 keys

    def sweep(name, times):
        return _sweep_file(tmp_path / name, times, shapes)

    files = [sweep("base1.json", {"B8": 8.0, "B256": 100.0, "B1": 5.0}),
             sweep("new1.json", {"B8": 6.0, "B256": 101.0, "B1": 5.0}),
             sweep("base2.json", {"B8": 8.0, "B256": 102.0, "B1": 5.0}),
             sweep("new2.json", {"B8": 6.0, "B256": 101.0, "B1": 5.0})]
    out = rule.sweep_ab([files[0], files[2], files[1], files[3]], 4, base_src=str(tmp_path / "src"), variants=2)
    moved = out["chunk moved"]
    assert moved["rows"] == 2 and {r["case"] for r in moved["per_row"]} == {"B8", "B1"}
    assert {r["chunk_keys_base"] for r in moved["per_row"]} == {1024}
    assert abs(moved["best"][0] - 0.75) < 1e-9
    unmoved = out["chunk unmoved"]
    assert unmoved["rows"] == 1 and abs(unmoved["median"] - 101.0 / (100.0 * 102.0) ** 0.5) < 1e-9
    assert abs(out["bases agree"][1] - 1.0) < 1e-9
    assert len(out["commits"]) == 4
