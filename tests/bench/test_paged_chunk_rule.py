"""``benchmarks/paged_chunk_rule.py``: each threshold's pick timed from a schedule grid's fixed chunks."""

import json

from .scripts import load_script


def _row(batch, next_n, max_len, config, median):
    return {"batch": batch, "next_n": next_n, "mean_context": 8192, "heads": 64, "config": config,
            "max_context_len": max_len, "stats": {"median_us": median}}


def test_picks_are_timed_from_the_fixed_chunks(tmp_path):
    rule = load_script("paged_chunk_rule")
    rows = [_row(8, 1, 10140, f"n64 r1 chunk{c} w4 st4", t)
            for c, t in ((0, 6.7), (512, 6.8), (256, 5.9), (128, 5.4), (1024, 7.5))]
    rows += [_row(8, 1, 10140, "n64 r1 chunk256 w4 st2", 1.0)]  # another pipeline: not read
    rows += [_row(32, 2, 5300, f"n64 r2 chunk{c} w4 st4", t) for c, t in ((0, 10.6), (256, 11.2))]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"environment": {"sm_count": 132}, "layers": 1, "rows": rows}))
    table, summary = rule.weigh([str(path)])
    by_batch = {e["batch"]: e for e in table}
    eight, wide = by_batch[8], by_batch[32]
    assert eight["picks"]["current"] == 512 and eight["current"]["us"] == 6.7
    assert eight["few 4"] == {"chunk": 256, "us": 5.9, "vs_current": 5.9 / 6.7}
    assert eight["few 6"]["chunk"] == 128 and eight["best_fixed"]["chunk"] == 128
    # B32 next_n 2: 331 programs of 512 keys; at 6 an SM the pick halves, and is slower
    assert wide["few 4"]["chunk"] == 512 and wide["few 6"]["vs_current"] > 1
    assert summary["few 4"]["rows_moved"] == 1 and summary["few 6"]["worst_vs_current"] == 11.2 / 10.6
