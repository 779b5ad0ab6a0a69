#!/usr/bin/env bash
# One GPU round: tests at full size, then the prefill config sweep. Writes logs and JSON
# under ${OUT:-out}/ and prints a short table last.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count())
PY
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/indexer tests/test_interpreter_patch.py} \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/tests.log"
tail -n 25 "$OUT/tests.log"
timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/prefill_sweep.py ${SWEEP_ARGS:-} --output "$OUT/prefill-sweep.json" \
  2>&1 | tee "$OUT/sweep.log" | tail -n 80
