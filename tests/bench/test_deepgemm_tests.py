"""``benchmarks/deepgemm_tests.py --per-case``: each sampled case alone, out of memory skipped."""

import types

import torch

from .scripts import load_script


def _fake_test_module(ran: list):
    """A stand-in for DeepGEMM's test file: its paged test runs the sampled cases in order; a
    case 'big' runs out of GPU memory and a case 'wrong' fails its check."""
    module = types.SimpleNamespace()

    def test_paged_mqa_logits():
        for case in module.sample_mqa_cases("paged", [f"c{i}" for i in range(6)] + ["big", "wrong"]):
            if case == "big":
                raise torch.OutOfMemoryError("CUDA out of memory")
            if case == "wrong":
                raise AssertionError("Diff: 1.0")
            ran.append(case)

    module.test_paged_mqa_logits = test_paged_mqa_logits
    module.sample_mqa_cases = lambda name, cases: cases
    return module


def test_sample_is_the_rounds_sample_and_runs_no_case():
    script = load_script("deepgemm_tests")
    ran = []
    module = _fake_test_module(ran)
    drawn = script.sampled_cases(module, "paged", seed=5, num_cases=8, shard=(0, 1))
    assert ran == [] and sorted(drawn) == sorted([f"c{i}" for i in range(6)] + ["big", "wrong"])
    # the same seed draws the same sample (in order) as a whole-run round's sampler does
    script.install_sampler(module, 5, 8, (0, 1))
    assert list(module.sample_mqa_cases("paged", [f"c{i}" for i in range(6)] + ["big", "wrong"])) == drawn
    assert script.sampled_cases(module, "paged", seed=5, num_cases=8, shard=(1, 2)) == drawn[1::2]


def test_per_case_counts_memory_skips_apart_from_failures(capsys):
    script = load_script("deepgemm_tests")
    ran = []
    module = _fake_test_module(ran)
    passed, skipped, failed = script.run_per_case(module, "paged", seed=3, num_cases=8, shard=(0, 1))
    assert (passed, skipped, failed) == (6, 1, 1)
    assert sorted(ran) == [f"c{i}" for i in range(6)]  # every case after the two bad ones ran too
    out = capsys.readouterr().out
    assert "out of GPU memory, skipped" in out and "FAILED" in out
    assert "paged: 6 passed, 1 skipped (out of GPU memory), 1 failed" in out
