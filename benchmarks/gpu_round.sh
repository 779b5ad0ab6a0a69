#!/usr/bin/env bash
# One GPU round in one command: the test suite at full size, the prefill config sweep, and the
# tilefuse benchmark suites. Logs and JSON go under ${OUT:-out}/; a short table is printed last.
#   TESTS="tests/indexer ..."   test paths (empty: skip)
#   SWEEP=1                     run benchmarks/prefill_sweep.py
#   PAGED_SWEEP=1               run benchmarks/paged_sweep.py
#   BENCH="paged reproduce indexer"  tilefuse bench suites to run
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(0), torch.cuda.device_count())" | tee "$OUT/env.txt"
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 benchmarks/prefill_sweep.py ${SWEEP_ARGS:-} \
    --output "$OUT/prefill-sweep.json" > "$OUT/sweep.log" 2>&1
fi
if [ "${PAGED_SWEEP:-0}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 benchmarks/paged_sweep.py --output "$OUT/paged-sweep.json" \
    > "$OUT/paged-sweep.log" 2>&1
fi
for suite in ${BENCH:-}; do
  case $suite in
    reproduce) args="indexer --reproduce" ;;
    indexer) args="indexer --plot $OUT/indexer.png" ;;
    *) args="$suite" ;;
  esac
  timeout "${BENCH_TIMEOUT:-300}" python3 -m tilefuse.cli bench $args -o "$OUT/$suite.json" > "$OUT/bench-$suite.log" 2>&1
  echo "bench $suite rc=$?" >> "$OUT/bench-$suite.log"
done
for f in "$OUT"/tests.log "$OUT"/sweep.log "$OUT"/paged-sweep.log "$OUT"/bench-*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -n "${TAIL:-40}" "$f"; }
done
