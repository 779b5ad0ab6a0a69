"""``benchmarks/topk_setting_ab.py``: each variant sets every setting that any variant names."""

from .scripts import load_script


def _script():
    return load_script("topk_setting_ab")


def test_a_setting_left_out_of_a_variant_keeps_its_value_before_the_run():
    ab = _script()
    variants = [{"_A": 1}, {"_A": 2, "_B": 4}, {"_A": 3}]
    full = ab.full_settings(variants, {"_A": 0, "_B": 32})
    assert full == [{"_A": 1, "_B": 32}, {"_A": 2, "_B": 4}, {"_A": 3, "_B": 32}]
    assert variants == [{"_A": 1}, {"_A": 2, "_B": 4}, {"_A": 3}]  # (the labels' settings unchanged)
