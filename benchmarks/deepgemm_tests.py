"""DeepGEMM's own indexer tests (``tests/test_attention.py``) run against tilefuse.

DeepGEMM's ``test_mqa_logits`` (prefill) and ``test_paged_mqa_logits`` (decode) are run with
its indexer functions replaced by ``tilefuse.compat.deep_gemm``'s: its references, inputs,
tolerances, bitwise-rerun and -inf-mask checks stay DeepGEMM's. By default the Blackwell case
matrix is used (``get_arch_major() == 10``: MXFP4, bf16 weights, H 8-64, D 32-128, block_kv
32/64, next_n 1/6, varlen), which is what tilefuse offers on Hopper. Each round samples
``--cases`` cases of each test (DeepGEMM's ``DG_MQA_NUM_CASES``) with a new seed, printed so
a failing round can be rerun with ``--seed``. Kernel profiling is off (``DG_USE_NVIDIA_TOOLS=1``:
DeepGEMM's profiler looks for its own kernel names).

Needs a CUDA machine with DeepGEMM built from ``shared/peers/deepgemm`` (its ``build.sh``
leaves the tree in ``$DEEPGEMM_BUILD_DIR``, default ``/tmp/deepgemm``)::

    source .peers/deepgemm/build.sh
    python benchmarks/deepgemm_tests.py --cases 200 --rounds 2            # both tests
    python benchmarks/deepgemm_tests.py --tests paged --cases 50 --seed 7  # rerun one round
    python benchmarks/deepgemm_tests.py --cases 200 --seed 7 --shard 0/2   # one sample over two runs

``--shard i/n`` runs every n-th case of the round's sample from the i-th, so that one sample of
200 cases can be split over runs that each fit a machine's time (its larger paged cases take
up to ~90 GiB of GPU memory, so processes that share one GPU run out of it; the allocator's
cache is released before every case, so one prefill process fits beside one paged process).
On a GPU with less memory than its largest cases, ``--per-case`` runs each sampled case in a
call of its own and counts a case that runs out of GPU memory as skipped, not failed::

    python benchmarks/deepgemm_tests.py --tests paged --cases 200 --per-case   # an 80 GB GPU
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys
import time
import traceback

SWAPPED = ("fp8_mqa_logits", "fp8_fp4_mqa_logits", "get_mqa_logits_metadata", "fp8_paged_mqa_logits",
           "fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata")
TESTS = {"prefill": "test_mqa_logits", "paged": "test_paged_mqa_logits"}


def load_test_module(root: str):
    """DeepGEMM's ``tests/test_attention.py`` with tilefuse's indexer functions swapped in."""
    tests = os.path.join(root, "tests")
    if not os.path.isfile(os.path.join(tests, "test_attention.py")):
        raise FileNotFoundError(f"--deepgemm-root: no tests/test_attention.py under {root!r} "
                                "(source shared/peers/deepgemm/build.sh first)")
    sys.path[:0] = [root, tests]
    import deep_gemm

    import tilefuse.compat.deep_gemm as compat

    for name in SWAPPED:
        setattr(deep_gemm, name, getattr(compat, name))
    return importlib.import_module("test_attention")


class _Released(list):
    """The sampled cases, the allocator's cached blocks released before each."""

    def __iter__(self):
        import torch

        for case in super().__iter__():
            torch.cuda.empty_cache()
            yield case


def draw_sample(seed: int, name: str, cases: list, num_cases: int, shard: tuple[int, int]) -> list:
    """The cases of DeepGEMM's list ``cases`` for test ``name`` that a round of ``seed`` runs:
    ``num_cases`` of them, every n-th from the i-th for a shard ``(i, n)``."""
    rng = random.Random(f"{seed}:{name}")
    return rng.sample(cases, min(num_cases, len(cases)))[shard[0]::shard[1]]


def install_sampler(module, seed: int, num_cases: int, shard: tuple[int, int] = (0, 1)) -> None:
    """DeepGEMM samples with fixed seeds (0 and 100000); each round here draws its own, and a
    shard ``(i, n)`` runs every n-th case of it from the i-th."""

    def sample(name, cases):
        selected = _Released(draw_sample(seed, name, cases, num_cases, shard))
        print(f" > {name}: running {len(selected)}/{len(cases)} cases (seed {seed}, shard {shard[0]}/{shard[1]})",
              flush=True)
        return selected

    module.sample_mqa_cases = sample


class _Sampled(Exception):
    """Raised by the sampler of :func:`sampled_cases`: the sample is drawn, no case is run."""


def sampled_cases(module, test: str, seed: int, num_cases: int, shard: tuple[int, int]) -> list:
    """The cases one round's sampler would run for ``test`` (drawn by calling the test with a
    sampler that stops it before its first case)."""
    drawn = []

    def draw(name, cases):
        drawn.extend(draw_sample(seed, name, cases, num_cases, shard))
        raise _Sampled

    module.sample_mqa_cases = draw
    try:
        getattr(module, TESTS[test])()
    except _Sampled:
        pass
    return drawn


def run_per_case(module, test: str, seed: int, num_cases: int, shard: tuple[int, int]) -> tuple[int, int, int]:
    """Each sampled case of ``test`` in a call of its own: (passed, skipped for memory, failed)."""
    import torch

    cases = sampled_cases(module, test, seed, num_cases, shard)
    print(f" > {test}: running {len(cases)} cases one at a time (seed {seed}, shard {shard[0]}/{shard[1]})",
          flush=True)
    passed = skipped = failed = 0
    for i, case in enumerate(cases):
        module.sample_mqa_cases = lambda name, _cases, case=case: [case]
        torch.cuda.empty_cache()
        torch.manual_seed(seed * 1000 + i)
        try:
            getattr(module, TESTS[test])()
            passed += 1
        except torch.OutOfMemoryError:
            skipped += 1
            print(f"case {i} {case}: out of GPU memory, skipped", flush=True)
        except Exception:
            failed += 1
            print(f"case {i} {case}: FAILED", flush=True)
            traceback.print_exc()
    print(f"{test}: {passed} passed, {skipped} skipped (out of GPU memory), {failed} failed", flush=True)
    return passed, skipped, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepgemm-root", default=os.environ.get("DEEPGEMM_BUILD_DIR", "/tmp/deepgemm"))
    ap.add_argument("--tests", default="prefill,paged", help="comma-separated: prefill, paged")
    ap.add_argument("--cases", type=int, default=200, help="sampled cases per test and round (DG_MQA_NUM_CASES)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, help="seed of the first round (default: from the clock)")
    ap.add_argument("--arch-cases", type=int, choices=(9, 10), default=10,
                    help="whose case matrix: 10 = Blackwell's (default), 9 = DeepGEMM's SM90 list")
    ap.add_argument("--shard", default="0/1", help="i/n: every n-th case of each round's sample from the i-th")
    ap.add_argument("--per-case", action="store_true",
                    help="each case in a call of its own; one that runs out of GPU memory is skipped, not failed")
    args = ap.parse_args(argv)
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    if not tests or any(t not in TESTS for t in tests):
        ap.error(f"--tests: expected some of {sorted(TESTS)}, got {args.tests!r}")
    try:
        shard = tuple(int(v) for v in args.shard.split("/"))
    except ValueError:
        shard = ()
    if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
        ap.error(f"--shard: expected i/n with 0 <= i < n, got {args.shard!r}")
    os.environ["DG_USE_NVIDIA_TOOLS"] = "1"
    import torch

    if not torch.cuda.is_available():
        print("deepgemm_tests: needs a CUDA GPU", file=sys.stderr)
        return 2
    module = load_test_module(args.deepgemm_root)
    module.get_arch_major = lambda: args.arch_cases  # the case lists branch on it
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    failures = []
    for r in range(args.rounds):
        install_sampler(module, seed + r, args.cases, shard)
        for t in tests:
            torch.manual_seed(seed + r)
            print(f"round {r} (seed {seed + r}): {TESTS[t]}", flush=True)
            if args.per_case:
                if run_per_case(module, t, seed + r, args.cases, shard)[2]:
                    failures.append((seed + r, t))
                continue
            try:
                getattr(module, TESTS[t])()
            except Exception:  # report the round and go on with the others
                traceback.print_exc()
                failures.append((seed + r, t))
    for s, t in failures:
        print(f"FAILED: {t} with --seed {s} --cases {args.cases} --arch-cases {args.arch_cases}"
              f"{' --per-case' if args.per_case else ''}", file=sys.stderr)
    print(f"{len(failures)} failed of {args.rounds * len(tests)} test runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
