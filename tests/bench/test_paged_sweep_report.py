"""``benchmarks/paged_sweep_report.py``: the targets read from a sweep's rows, unsteady rows marked."""

from .scripts import load_script


def _script():
    return load_script("paged_sweep_report")


def _row(impl, batch, next_n, median, p10=None, p90=None, ratio=None, copy=0.95):
    params = {"batch": batch, "next_n": next_n, "mean_context": 8192, "heads": 64, "block_kv": 64,
              "logits_dtype": "float32"}
    row = {"case": f"B{batch} n{next_n}", "impl": impl, "status": "ok", "params": params, "tbps": 3.0,
           "ratio_to_ceiling": copy,
           "stats": {"median_us": median, "p10_us": p10 or median, "p90_us": p90 or median}}
    if ratio is not None:
        row["peer_ratio"] = {"deep_gemm": ratio}
    return row


def test_targets_and_unsteady_rows():
    rep = _script()
    rows = [
        _row("tilefuse", 64, 1, 10.0, ratio=1.2), _row("deep_gemm", 64, 1, 12.0),
        # tilefuse steady, DeepGEMM's samples spread: the row's verdict is marked unsteady
        _row("tilefuse", 64, 2, 12.0, ratio=0.9), _row("deep_gemm", 64, 2, 10.8, p10=9.0, p90=14.0),
        _row("tilefuse", 128, 1, 20.0, p10=19.0, p90=21.0, copy=0.5),
    ]
    entries = {e["case"]: e for e in rep.table(rows)}
    one, two, alone = entries["B64 n1"], entries["B64 n2"], entries["B128 n1"]
    assert one["misses"] == [] and not one["unsteady"]
    assert "slower than DeepGEMM" in two["misses"] and two["unsteady"]
    assert two["next_n_growth"] == 1.2 and any("next_n 2 over" in m for m in two["misses"])
    assert alone["speed"] is None and not alone["unsteady"]
    assert any("copy bandwidth" in m for m in alone["misses"])
    lines = rep.summary(list(entries.values()))
    assert any(line.startswith("unsteady") and ": 1 rows" in line for line in lines)
    # B64 x 8192 = 2^19 cached tokens: both rows beside DeepGEMM fall in the middle range
    assert "  cached tokens 2^14 to under 2^20: 2 rows, 0.90-1.20x, median 1.05x, ahead at 1" in lines
    assert not any("2^20 and over" in line for line in lines)
