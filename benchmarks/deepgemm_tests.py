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
    python benchmarks/deepgemm_tests.py --cases 200 --jobs 6 --time-limit 300  # one sample, 6 processes

With ``--jobs N`` the round's sample is split over N processes sharing the GPU (``--shard i/N``
each, the same seed), so that one round covers its 200 cases in a few minutes; every process
stops at ``--time-limit`` seconds, and the summary counts the cases each test passed.
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
    """The sampled cases, the allocator's cached blocks released before each: processes sharing
    the GPU then hold only their current case's memory (a process keeps ~40 GiB cached else)."""

    def __iter__(self):
        import torch

        for case in super().__iter__():
            torch.cuda.empty_cache()
            yield case


def install_sampler(module, seed: int, num_cases: int, shard: tuple[int, int] = (0, 1)) -> None:
    """DeepGEMM samples with fixed seeds (0 and 100000); each round here draws its own, and a
    shard ``(i, n)`` runs every n-th case of it from the i-th."""

    def sample(name, cases):
        rng = random.Random(f"{seed}:{name}")
        selected = _Released(rng.sample(cases, min(num_cases, len(cases)))[shard[0]::shard[1]])
        print(f" > {name}: running {len(selected)}/{len(cases)} cases (seed {seed}, shard {shard[0]}/{shard[1]})",
              flush=True)
        return selected

    module.sample_mqa_cases = sample


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepgemm-root", default=os.environ.get("DEEPGEMM_BUILD_DIR", "/tmp/deepgemm"))
    ap.add_argument("--tests", default="prefill,paged", help="comma-separated: prefill, paged")
    ap.add_argument("--cases", type=int, default=200, help="sampled cases per test and round (DG_MQA_NUM_CASES)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, help="seed of the first round (default: from the clock)")
    ap.add_argument("--arch-cases", type=int, choices=(9, 10), default=10,
                    help="whose case matrix: 10 = Blackwell's (default), 9 = DeepGEMM's SM90 list")
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th sampled case from the i-th")
    ap.add_argument("--jobs", type=int, default=1, help="split each round's sample over this many processes")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds each process may run (with --jobs)")
    args = ap.parse_args(argv)
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    if not tests or any(t not in TESTS for t in tests):
        ap.error(f"--tests: expected some of {sorted(TESTS)}, got {args.tests!r}")
    shard = tuple(int(v) for v in args.shard.split("/"))
    if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
        ap.error(f"--shard: expected i/n with 0 <= i < n, got {args.shard!r}")
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    if args.jobs > 1:
        return run_sharded(argv if argv is not None else sys.argv[1:], args, seed, tests)
    os.environ["DG_USE_NVIDIA_TOOLS"] = "1"
    import torch

    if not torch.cuda.is_available():
        print("deepgemm_tests: needs a CUDA GPU", file=sys.stderr)
        return 2
    module = load_test_module(args.deepgemm_root)
    module.get_arch_major = lambda: args.arch_cases  # the case lists branch on it
    failures = []
    for r in range(args.rounds):
        install_sampler(module, seed + r, args.cases, shard)
        for t in tests:
            torch.manual_seed(seed + r)
            print(f"round {r} (seed {seed + r}): {TESTS[t]}", flush=True)
            try:
                getattr(module, TESTS[t])()
            except Exception:  # report the round and go on with the others
                traceback.print_exc()
                failures.append((seed + r, t))
    for s, t in failures:
        print(f"FAILED: {t} with --seed {s} --cases {args.cases} --arch-cases {args.arch_cases}", file=sys.stderr)
    print(f"{len(failures)} failed of {args.rounds * len(tests)} test runs")
    return 1 if failures else 0


def _strip(argv: list, names: tuple) -> list:
    """``argv`` without the options ``names`` (``--x v`` and ``--x=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(n + "=" for n in names)):
            out.append(a)
    return out


def count_cases(text: str) -> dict:
    """Cases each test printed (DeepGEMM prints a case's line after its checks passed)."""
    counts, test = {}, None
    for line in text.splitlines():
        if line.startswith("round "):
            test = next((t for t, name in TESTS.items() if line.rstrip().endswith(name)), None)
        elif test is not None and line.startswith(" > ") and "running" not in line:
            counts[test] = counts.get(test, 0) + 1
    return counts


def run_sharded(argv: list, args, seed: int, tests: list) -> int:
    """This script in ``args.jobs`` processes, one shard each, then their outputs and a summary."""
    import subprocess

    base = [sys.executable, os.path.abspath(__file__), *_strip(argv, ("--jobs", "--shard", "--seed", "--time-limit"))]
    # a process stopped at the limit keeps what it printed; freed blocks go back to the GPU
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    procs = [subprocess.Popen([*base, "--seed", str(seed), "--shard", f"{i}/{args.jobs}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for i in range(args.jobs)]
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    totals, timed_out, failed = {}, [], []
    for i, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            timed_out.append(i)
        print(f"===== shard {i}/{args.jobs} (exit {p.returncode})\n{text}", flush=True)
        if p.returncode not in (0, None) and i not in timed_out:
            failed.append(i)
        for t, n in count_cases(text).items():
            totals[t] = totals.get(t, 0) + n
    per_test = args.rounds * args.cases
    for t in tests:
        print(f"{TESTS[t]}: {totals.get(t, 0)} of {per_test} sampled cases passed (seed {seed}, "
              f"{args.jobs} processes)")
    if timed_out:
        print(f"shards stopped at the time limit ({args.time_limit} s): {timed_out}")
    print(f"shards with a failure: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
