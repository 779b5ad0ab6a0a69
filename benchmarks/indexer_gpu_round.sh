#!/usr/bin/env bash
# One H200 round of the indexer's GPU checks and serving-path measurements, DeepGEMM in the same run.
#   PART=checks bash benchmarks/indexer_gpu_round.sh   # GPU tests, DeepGEMM's own tests, host cost, sweep
#   PART=timing bash benchmarks/indexer_gpu_round.sh   # bench paged / indexer / serving / topk, TP core
#   PART=verify bash benchmarks/indexer_gpu_round.sh   # GPU tests, prefill A/B vs $AB_BASE, host cost
#   PART=ab-peer / PART=final: A/B over $AB_TREES while DeepGEMM builds, then host cost and peer rows
#   PART=tests: the README's test command, then the whole suite split over processes
#   PART=suite: the README's test command on the whole suite (xdist where the image has it, else
#     split over processes), the two contract sweeps beside it, then top-k speed
#   PART=decode: the decode schedule grid beside DeepGEMM; PART=topk: top-k speed
#   PART=persistent: the persistent decode kernel's GPU tests, then it beside the default and DeepGEMM;
#     PART=persistent-contract: the decode contract sample and DeepGEMM's paged tests with it asked for
#   PART=decode-ab: after a decode kernel change: its GPU tests, a contract sample, the A/B against
#     $AB_PREV, the schedule grid beside DeepGEMM; PART=decode-profile: the decode GPU tests over
#     processes, then Nsight Compute on the decode kernels (tilefuse's, DeepGEMM's) at $PROFILE_ROWS
#   PART=table: bench paged at the decode table's rows beside DeepGEMM; PART=paged-sweep: the whole
#     decode sweep beside DeepGEMM, read against the targets; PART=prefill-rows: bench indexer's rows
#   PART=closing: the README's two commands side by side (test suite, demo), then top-k speed and
#     the top-k A/B over $AB_TREES
#   PART=eager: the eager cost per call (launch cost taken apart, decode and prefill) beside DeepGEMM,
#     then the serving loop
#   PART=small: small prefill calls under each launch configuration; PART=host-calls: decode and
#     prefill eager cost beside DeepGEMM; PART=dgtests: DeepGEMM's own tests, 200 cases each ($DG_SHARD);
#     PART=pick: the GPU tests named in $PICK; PART=probe: the warp-specialised decode key-loop probe; PART=bf16: the prefill bf16-logits and D 64 rows, Triton and Gluon loops, beside DeepGEMM
#   PART=sweeps: the decode and top-k contract sweeps, then DeepGEMM's own tests (new sample: $SEED)
#   PART=topk-decode-ab: the decode top-k of $AB_PREV against this tree (after a last-step change);
#   PART=topk-parts: the top-k merge kernel's time taken apart (and the select's pieces); PART=topk-sweep: the top-k contract sweep;
#   PART=topk-profile: Nsight Compute on the merge kernel's launches (stall reasons, hottest lines);
#   PART=topk-open: the top-k GPU tests (DeepGEMM building meanwhile), the eager cost, then top-k
#     speed beside DeepGEMM (the README's table);
#   PART=topk-verify: round (22)'s top-k changes on a GPU (tests, eager cost, two A/Bs, top-k speed)
#   PART=topk-check: the top-k GPU tests, warm-up count and contract sweep side by side (DeepGEMM builds meanwhile);
#     PART=topk-across: the top-k of few rows across programs against torch.topk
#   PART=prefill-sweep: the whole prefill contract product, $SWEEP_PROCS processes
#   PART=sweep-all: round $SWEEP_ROUND (0..$SWEEP_ROUNDS-1) of the whole decode contract product, $SWEEP_PROCS processes
#   PART=host: host cost of $AB_PREV and this tree alternately on one machine
#   PART=launch: after a launch-path change: its GPU tests, the launch cost taken apart (TP GEMM core
#     beside cuBLAS), the decode and prefill host cost, then tests/tp and the indexer tests split over processes
#     (LAUNCH_TESTS=0 leaves those to a later PART=tests)
#   PART=serving: after a serving-path change: its tests (jit, TP, indexer) split over processes
#     while DeepGEMM builds (then PART=eager times the calls)
#   PART="tests decode": several parts, in order
# DeepGEMM comes from an ignored copy of shared/peers/deepgemm at $PEERS (default .peers/deepgemm),
# built once per machine. Result files go to $OUT (default out/), the step logs to $OUT/logs.tgz.
# A tree shipped without its .git (or with a stale one) names its commit in the result files only
# when the caller passes it: TILEFUSE_COMMIT=<git rev-parse HEAD of the checkout> PART=... bash ...
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${TILEFUSE_COMMIT:-}" ] || echo "TILEFUSE_COMMIT not set: result files name the commit git finds here, if any"
OUT="${OUT:-out}"; LOGS="$OUT/logs"; mkdir -p "$LOGS"
PEERS="${PEERS:-.peers/deepgemm}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# DEADLINE (seconds from the start, default 570): no step runs past it, so the logs get archived
DEADLINE="${DEADLINE:-570}"
budget() {  # budget LIMIT: LIMIT cut to the time left before DEADLINE (0: none left)
  local left=$((DEADLINE - SECONDS - 10))
  ((left < 15)) && left=0
  echo $(($1 < left ? $1 : left))
}
within() {  # within LIMIT MARGIN: a command's own time budget, MARGIN seconds under the limit that
  # step gives it (LIMIT cut by budget), so that it reports what it ran before the cut
  local limit; limit=$(budget "$1")
  echo $((limit > $2 + 20 ? limit - $2 : 20))
}
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, one summary line
  local name=$1 limit; limit=$(budget "$2"); shift 2
  local t0=$SECONDS
  if ((limit == 0)); then echo "$name: skipped (deadline)" | tee -a "$OUT/summary.txt"; return; fi
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$LOGS/$name.log" | cut -c1-150)" \
    | tee -a "$OUT/summary.txt"
}
shards() {  # shards NAME SECONDS N PYTEST_ARGS...: the selected tests split over N pytest processes
  local name=$1 limit n=$3; limit=$(budget "$2"); shift 3
  local t0=$SECONDS ids="$LOGS/$name.ids" i
  if ((limit == 0)); then echo "$name: skipped (deadline)" | tee -a "$OUT/summary.txt"; return; fi
  python3 -m pytest -q -p no:cacheprovider --collect-only "$@" 2>/dev/null | grep '::' >"$ids"
  local pids=()
  for ((i = 0; i < n; i++)); do
    awk -v n="$n" -v i="$i" 'NR % n == i' "$ids" >"$ids.$i"
    [ -s "$ids.$i" ] && TILEFUSE_TEST_COMPILE_JOBS=2 TILEFUSE_TEST_INSTAFAIL=1 timeout -k 5 "$limit" xargs -d "\n" -a "$ids.$i" python3 -m pytest -q -p no:cacheprovider \
      >"$LOGS/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  printf '%-22s %4ss  %s tests: %s\n' "$name" "$((SECONDS - t0))" "$(wc -l <"$ids")" \
    "$(tail -q -n 1 "$LOGS/$name".*.log | tr '\n' ';' | cut -c1-200)" | tee -a "$OUT/summary.txt"
}
first_failed() {  # first_failed STEP: the first test STEP's log names as failed, again under
  # compute-sanitizer's memcheck when the machine has it (where a kernel faulted, which access)
  local id sanitizer
  id=$(grep -m 1 -oE "^FAILED [^ ]+|^[^ ]+::[^ ]+ FAILED" "$LOGS/$1.log" | sed -E 's/^FAILED //; s/ FAILED$//')
  [ -n "$id" ] || return 0
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
  [ -n "$sanitizer" ] || { echo "$1: first failure $id (no compute-sanitizer)" | tee -a "$OUT/summary.txt"; return 0; }
  step "$1-memcheck" "${MEMCHECK_S:-120}" "$sanitizer" --tool memcheck --print-limit 20 \
    python3 -m pytest -x -q -p no:cacheprovider "$id"
}
host_steps() {  # the eager cost per call: prefill (wrapper alone, then whole calls), paged, a profile, TP core
    step host-prefill-stub 20 python3 benchmarks/prefill_host_cost.py --stub --calls 1000
    step host-prefill 30 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
    step host-paged 35 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    step host-profile 60 python3 benchmarks/host_profile.py --calls 300
    step tp-host 30 python3 -m tilefuse.bench.suites.tp host --m 4096 --n 4096 --k 1024 --json "$OUT/tp-host.jsonl"
    step tp-host-m64 20 python3 -m tilefuse.bench.suites.tp host --m 64 --n 4096 --k 1024 --json "$OUT/tp-host.jsonl"
}
host_calls() {  # the decode and prefill eager cost per call, DeepGEMM beside when it imports
    step host-paged 45 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    step host-prefill 60 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
}
passed() {  # passed STEP: STEP's pytest log has passes and no failure or error (a kernel that
  # failed its tests, or hung in them, is not timed)
  grep -q " passed" "$LOGS/$1.log" && ! grep -qE "[0-9]+ (failed|error)" "$LOGS/$1.log"
}
persistent_tests() {  # the persistent decode kernel's GPU tests and the Hopper bad-value tests
  # (-v and the fault handler's timeout: a test that hangs is named, with its stack, in the log)
  step tests-persistent "${TESTS_S:-240}" python3 -m pytest -v -p no:cacheprovider -x -o faulthandler_timeout=60 \
    tests/indexer/test_paged_persistent.py tests/indexer/test_paged_gluon.py -k "persistent or hopper"
}
persistent_sweep() {  # persistent_sweep SECONDS SAMPLES: where its tests passed, the persistent kernel
  # beside the default and DeepGEMM at the decode rows, captured calls cycling through $LAYERS
  # caches (default 5: out of L2, as an engine's layers)
  passed tests-persistent || return 0
  step paged-sweep "${SWEEP_S:-$1}" python3 benchmarks/paged_sweep.py --grid persistent --samples "$2" \
    --layers "${LAYERS:-5}" --output "$OUT/paged-sweep-persistent.json" --rows ${DECODE_ROWS:-1x1x8192 \
    1x1x131072 8x1x32768 32x1x4096 64x1x8192 128x1x32768 256x1x8192 64x2x8192 256x2x8192 64x2x32768 \
    256x4x8192 64x1x8192/32}
}
across_tests() {  # across_tests SECONDS: the top-k GPU tests of the rows across programs and whole rows
  step tests-topk-across "$1" python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_topk.py \
    -k "across or whole_rows"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/summary.txt"
TMA_SHAPES="${TMA_SHAPES:-64x1x8192 256x1x8192 256x2x8192 32x1x4096}"
# the rows of the decode table in the paged issue (H64 block 64 fp32 logits)
DECODE_SHAPES="${DECODE_SHAPES:-1x1x65536 32x1x4096 64x1x8192 128x1x16384 256x1x8192 256x1x65536 64x2x32768 256x2x8192}"
wait_deepgemm() {  # the background build's result, then its environment in this shell
  # (waits for the background job itself: a check for its compiler process alone raced with
  # the archive's extraction, and two builds in one folder failed both)
  while [ -f "$LOGS/.deepgemm-building" ]; do sleep 2; done
  # shellcheck disable=SC1091
  source "$PEERS/build.sh" >>"$LOGS/deepgemm-build.log" 2>&1 || echo "DeepGEMM build failed" | tee -a "$OUT/summary.txt"
  python3 -c "import deep_gemm" 2>/dev/null && echo "deep_gemm imports" | tee -a "$OUT/summary.txt"
}
if [[ " ${PART:-checks} " =~ \ (verify|ab-peer|final|tests|suite|closing|decode|decode-ab|decode-profile|persistent|persistent-contract|table|host|topk|topk-check|topk-open|topk-verify|eager|serving|host-calls|dgtests|paged-sweep|prefill-rows|small|bf16|pick)\  ]]; then
  # the first steps need no DeepGEMM: it builds meanwhile (wait_deepgemm)
  if [ -f "$PEERS/build.sh" ]; then
    touch "$LOGS/.deepgemm-building"
    (source "$PEERS/build.sh" >"$LOGS/deepgemm-build.log" 2>&1; rm -f "$LOGS/.deepgemm-building") &
  fi
elif [ -f "$PEERS/build.sh" ] && [[ ! "${PART:-checks}" =~ ^(sweep-all|prefill-sweep|topk-sweep)$ ]]; then
  # (the contract sweeps alone need no DeepGEMM)
  # shellcheck disable=SC1091
  source "$PEERS/build.sh" >"$LOGS/deepgemm-build.log" 2>&1 || echo "DeepGEMM build failed" | tee -a "$OUT/summary.txt"
fi
python3 -c "import deep_gemm" 2>/dev/null && echo "deep_gemm imports" | tee -a "$OUT/summary.txt"
for part in ${PART:-checks}; do
case "$part" in
  verify)  # after a host-path change: the GPU tests, the prefill A/B against $AB_BASE, host cost
    step tests-errors 25 python3 -m pytest -q -p no:cacheprovider tests/test_errors.py tests/test_jit.py
    step tests-prefill 170 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_prefill.py
    step tests-paged 110 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_paged.py \
      tests/indexer/test_paged_bounds.py
    step tests-warmup 45 python3 -m pytest -q -p no:cacheprovider tests/indexer/test_warmup.py
    step prefill-ab 100 python3 benchmarks/prefill_ab.py "${AB_BASE:-.ab/c0}" . --rounds 3 \
      --output "$OUT/prefill-ab.json"
    step host-prefill 40 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
    step host-paged 40 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    ;;
  ab-peer)  # prefill A/B over $AB_TREES while DeepGEMM builds, then host profile, DeepGEMM's tests, TMA decode
    step prefill-ab 200 python3 benchmarks/prefill_ab.py ${AB_TREES:-.ab/c0 .} --rounds 3 \
      --output "$OUT/prefill-ab.json"
    wait_deepgemm
    step host-profile 60 python3 benchmarks/host_profile.py --calls 300
    step tests-gluon 60 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_prefill.py -k gluon
    step deepgemm-tests 200 python3 benchmarks/deepgemm_tests.py --cases "${DG_CASES:-200}"
    step bench-paged 60 python3 -m tilefuse.cli bench paged -o "$OUT/paged.json" -q --shapes $TMA_SHAPES
    TILEFUSE_PAGED_CONFIG=tma=1 step bench-paged-tma 60 python3 -m tilefuse.cli bench paged \
      -o "$OUT/paged-tma.json" -q --shapes $TMA_SHAPES
    ;;
  tests)  # the README's test command on this image (no dev tools), then the whole suite split over processes
    step readme-tests 60 bash scripts/test.sh tests/test_config.py tests/test_skip_summary.py
    shards tests-all "${TESTS_S:-330}" "${TEST_PROCS:-12}" tests ${TESTS_K:+-k "$TESTS_K"}
    ;;
  suite)  # the README's test command on the whole suite, the contract sweeps beside it
    python3 -c "import xdist" 2>/dev/null && echo "pytest-xdist: installed" | tee -a "$OUT/summary.txt" \
      || echo "pytest-xdist: not installed" | tee -a "$OUT/summary.txt"
    (step gpu-sweep "${SWEEP_S:-120}" python3 -m tests.indexer.gpu_sweep --budget-s "$(within "${SWEEP_S:-120}" 20)" \
      --seed "${SEED:-1}" --large
     step topk-sweep "${TOPK_SWEEP_S:-120}" python3 -m tests.indexer.topk_gpu_sweep \
      --budget-s "$(within "${TOPK_SWEEP_S:-120}" 20)" --seed "${SEED:-1}") &
    if python3 -c "import xdist" 2>/dev/null; then
      step readme-tests "${TESTS_S:-400}" bash scripts/test.sh
    else
      shards tests-all "${TESTS_S:-400}" "${TEST_PROCS:-12}" tests
    fi
    wait
    ;;
  closing)  # the README's two commands side by side, then top-k speed and its A/B (timed alone)
    step readme-tests "${TESTS_S:-380}" bash scripts/test.sh &
    PLOT="$OUT/indexer.png" step readme-demo "${DEMO_S:-300}" bash scripts/demo.sh -o "$OUT/indexer.json" &
    wait
    wait_deepgemm
    step bench-topk "${TOPK_S:-100}" python3 -m tilefuse.cli bench topk -o "$OUT/topk.json" --samples 10 \
      --shapes ${TOPK_SHAPES:-2048x32768 2048x131072 64x1x32768 256x2x65536}
    step topk-ab "${AB_S:-90}" python3 benchmarks/prefill_ab.py ${AB_TREES:-.ab/now .} --op topk --rounds 1 \
      --output "$OUT/topk-ab.json"
    ;;
  sweeps)  # the contract sweeps (decode logits, fused top-k), a new sample each round ($SEED), and DeepGEMM's tests
    step gpu-sweep "${SWEEP_S:-150}" python3 -m tests.indexer.gpu_sweep --budget-s "$(within "${SWEEP_S:-150}" 20)" \
      --seed "${SEED:-1}" --large
    step topk-sweep "${TOPK_SWEEP_S:-150}" python3 -m tests.indexer.topk_gpu_sweep \
      --budget-s "$(within "${TOPK_SWEEP_S:-150}" 20)" --seed "${SEED:-1}"
    wait_deepgemm
    step deepgemm-tests "${DG_S:-150}" python3 benchmarks/deepgemm_tests.py --cases "${DG_CASES:-200}" \
      --seed "${SEED:-1}"
    ;;
  decode)  # the decode kernel's schedule grid beside DeepGEMM at the rows furthest behind it
    wait_deepgemm
    step paged-sweep "${SWEEP_S:-220}" python3 benchmarks/paged_sweep.py --grid schedule --samples 15 \
      --output "$OUT/paged-sweep-schedule.json" --rows ${DECODE_ROWS:-1x1x131072 1x1x8192 8x1x32768 \
      8x1x32768/32 32x1x8192 32x1x4096 64x1x8192 64x2x8192 128x1x32768 256x2x8192 1024x1x1024}
    ;;
  decode-ab)  # after a decode kernel change: its GPU tests and a contract sample while DeepGEMM
    # builds, the default config against $AB_PREV (a src tree), then the schedule grid beside DeepGEMM
    step tests-paged 150 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_paged.py \
      tests/indexer/test_paged_bounds.py tests/indexer/test_paged_gluon.py
    step gpu-sweep 70 python3 -m tests.indexer.gpu_sweep --budget-s "$(within 70 20)" --seed "${SEED:-1}" --large
    step paged-ab 120 python3 benchmarks/prefill_ab.py "${AB_PREV:-.ab/prev}" . --op paged --rounds 2 \
      --output "$OUT/paged-ab.json"
    wait_deepgemm
    step paged-sweep "${SWEEP_S:-200}" python3 benchmarks/paged_sweep.py --grid schedule --samples 15 \
      --output "$OUT/paged-sweep-schedule.json" --rows ${DECODE_ROWS:-1x1x8192 1x1x131072 8x1x32768 \
      32x1x4096 32x1x8192 64x1x8192 64x2x8192 256x2x8192}
    ;;
  persistent)  # the persistent decode kernel: its GPU tests (and the bad-value tests of both
    # Hopper decode kernels) while DeepGEMM builds, then, if they passed, it beside the default and
    # DeepGEMM at the decode rows
    persistent_tests
    first_failed tests-persistent
    wait_deepgemm
    persistent_sweep 300 10
    ;;
  persistent-contract)  # the decode contract (a sample, the large cases) with the persistent kernel
    # asked for everywhere it applies, and DeepGEMM's paged tests under it
    step gpu-sweep-persistent "${SWEEP_S:-300}" env TILEFUSE_PAGED_CONFIG=persistent=1,num_stages=4 \
      python3 -m tests.indexer.gpu_sweep --budget-s "$(within "${SWEEP_S:-300}" 30)" --seed "${SEED:-1}" --large
    wait_deepgemm
    step deepgemm-paged-persistent "${DG_S:-250}" env TILEFUSE_PAGED_CONFIG=persistent=1,num_stages=4 \
      python3 benchmarks/deepgemm_tests.py --tests paged --cases "${DG_CASES:-200}" --seed "${SEED:-1}"
    ;;
  decode-profile)  # the decode GPU tests over processes while DeepGEMM builds, then Nsight Compute
    # on tilefuse's and DeepGEMM's decode kernels at $PROFILE_ROWS
    shards tests-paged "${TESTS_S:-200}" "${TEST_PROCS:-6}" tests/indexer/test_paged.py \
      tests/indexer/test_paged_bounds.py tests/indexer/test_paged_gluon.py
    wait_deepgemm
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    step ncu "${NCU_S:-150}" "$NCU" --clock-control none -k "regex:paged_logits|paged_mqa_logits" \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/paged_profile.py ${PROFILE_ROWS:-8x1x32768 256x2x8192}
    ;;
  table)  # the decode rows of the paged issue's table beside DeepGEMM (bench paged)
    wait_deepgemm
    step bench-paged 90 python3 -m tilefuse.cli bench paged -o "$OUT/paged.json" -q --shapes $DECODE_SHAPES
    ;;
  host)  # host cost of $AB_PREV (a src tree) and this tree alternately on one machine
    wait_deepgemm
    for round in 1 2; do for tree in "${AB_PREV:-.ab/prev}" .; do
      tag=$( [ "$tree" = . ] && echo now || echo prev )$round
      PYTHONPATH="$PWD/$tree/src" step "host-stub-$tag" 15 python3 benchmarks/prefill_host_cost.py --stub --calls 1000
      PYTHONPATH="$PWD/$tree/src" step "host-paged-$tag" 25 python3 benchmarks/paged_host_cost.py \
        --output "$OUT/paged-host-cost-$tag.json"
      PYTHONPATH="$PWD/$tree/src" step "tp-host-$tag" 15 python3 -m tilefuse.bench.suites.tp host --m 64 --n 4096 \
        --k 1024 --json "$OUT/tp-host-$tag.jsonl"
    done; done
    step host-prefill 25 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
    ;;
  launch)  # after a launch-path change: timing alone first, then the tests side by side
    step tests-jit 40 python3 -m pytest -q -p no:cacheprovider tests/test_jit.py
    step launch-cost 45 python3 benchmarks/launch_cost.py --calls 2000 --tp-m 64 4096 --output "$OUT/launch-cost.json"
    step host-paged 35 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    step host-prefill 35 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
    [ "${LAUNCH_TESTS:-1}" = 1 ] && shards tests-launch "${TESTS_S:-120}" "${TEST_PROCS:-12}" tests/tp tests/indexer/test_paged.py \
      tests/indexer/test_topk.py tests/indexer/test_warmup.py tests/indexer/test_prefill.py ${TESTS_K:+-k "$TESTS_K"}
    ;;
  serving)  # a serving-path change's tests, split over processes (DeepGEMM builds meanwhile)
    shards tests-serving "${TESTS_S:-150}" "${TEST_PROCS:-12}" tests/test_jit.py tests/tp tests/indexer/test_paged.py \
      tests/indexer/test_topk.py tests/indexer/test_warmup.py tests/indexer/test_prefill.py ${TESTS_K:+-k "$TESTS_K"}
    ;;
  sweep-all)  # round $SWEEP_ROUND of $SWEEP_ROUNDS (default 4) of the whole decode contract product:
    # cases i with i % (P x rounds) in this round's P = $SWEEP_PROCS (default 8) shards, one process
    # each (compile-bound: ~9.7 cases/s with 8 processes, 13.2-13.8 with 16 on 16 cores, so a round
    # of two at 16 processes leaves 400-750 of its 7776 cases past a 535 s budget: SWEEP_FIRSTS="K0
    # K1 ...", shard i from its Ki-th case, runs the rest, about two minutes)
    rounds=${SWEEP_ROUNDS:-4}; r=${SWEEP_ROUND:-0}; procs=${SWEEP_PROCS:-8}; limit=$(budget "${SWEEP_S:-560}")
    read -r -a firsts <<<"${SWEEP_FIRSTS:-}"
    for ((i = 0; i < procs; i++)); do
      first=${firsts[$i]:-0}
      step "sweep-all-$r-$i" "$limit" python3 -m tests.indexer.gpu_sweep --all --budget-s "$(within "$limit" 40)" \
        --shard $((r * procs + i))/$((rounds * procs)) --first "$first" $([ "$r$i$first" = 000 ] && echo --large) &
    done
    wait
    ;;
  prefill-sweep)  # the whole prefill contract product (3456 cases) over $SWEEP_PROCS (default 16) processes;
    # SWEEP_FIRST=K: each shard from its K-th case (the rest of a cut run; no large cases then)
    procs=${SWEEP_PROCS:-16}; first=${SWEEP_FIRST:-0}; limit=$(budget "${SWEEP_S:-560}")
    for ((i = 0; i < procs; i++)); do
      step "prefill-sweep-$i" "$limit" python3 -m tests.indexer.prefill_gpu_sweep --all --first "$first" \
        --budget-s "$(within "$limit" 40)" --shard "$i/$procs" $([ "$i$first" = 00 ] && echo --large) &
    done
    wait
    ;;
  topk-across)  # the radix select across a row's programs beside torch.topk and one program a row
    step topk-across "${ACROSS_S:-120}" python3 benchmarks/topk_across_programs.py ${ACROSS_ARGS:-} \
      --output "$OUT/topk-across-programs.json"
    ;;
  topk-decode-ab)  # after a change to the decode top-k's last steps: the top-k GPU tests of the rows
    # across programs, then the fused decode top-k of $AB_PREV (a src tree) and this tree, alternating
    across_tests "${TESTS_S:-150}"
    first_failed tests-topk-across
    passed tests-topk-across && step topk-decode-ab "${AB_S:-240}" python3 benchmarks/prefill_ab.py \
      "${AB_PREV:-.ab/prev}" . --op paged-topk --rounds "${AB_ROUNDS:-2}" --output "$OUT/topk-decode-ab.json"
    ;;
  topk-check)  # after a top-k change, side by side: its GPU tests ($TOPK_TESTS), the warm-up's
    # no-compile test, its contract sweep (a new sample: $SEED) and the prefill sweep cases in
    # $SWEEP_CASES (SHARD:CASE of 16 shards, one case each); DeepGEMM builds meanwhile
    step topk-tests "${TOPK_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider \
      ${TOPK_TESTS:-tests/indexer/test_topk.py} &
    step topk-warmup "${TOPK_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/indexer/test_warmup.py -k topk &
    step topk-sweep "${TOPK_SWEEP_S:-150}" python3 -m tests.indexer.topk_gpu_sweep \
      --budget-s "$(within "${TOPK_SWEEP_S:-150}" 20)" --seed "${SEED:-1}" &
    for sc in ${SWEEP_CASES:-}; do
      step "prefill-case-${sc/:/-}" 90 python3 -m tests.indexer.prefill_gpu_sweep --all --shard "${sc%%:*}/16" \
        --first "${sc##*:}" --budget-s 1 &
    done
    wait
    ;;
  topk-sweep)  # the fused top-k's contract sweep alone, a new sample ($SEED)
    step topk-sweep "${TOPK_SWEEP_S:-150}" python3 -m tests.indexer.topk_gpu_sweep \
      --budget-s "$(within "${TOPK_SWEEP_S:-150}" 20)" --seed "${SEED:-1}"
    ;;
  probe)  # the decode key-loop probe: warp-specialised against one partition (compiles, checks, times)
    step ws-probe "${PROBE_S:-60}" python3 benchmarks/paged_ws_probe.py
    ;;
  pick)  # the GPU tests named in $PICK (pytest arguments), e.g. after fixing a test
    step tests-pick "${PICK_S:-60}" python3 -m pytest -q -p no:cacheprovider ${PICK:-tests/test_config.py}
    ;;
  small)  # small prefill calls under each launch configuration (host, wall and GPU time)
    step small-calls "${SMALL_S:-80}" python3 benchmarks/prefill_small_calls.py --output "$OUT/prefill-small-calls.json" \
      ${SMALL_ARGS:-}
    ;;
  bf16)  # the prefill rows with bf16 logits and D 64, Triton and Gluon loops, DeepGEMM in the same graphs
    wait_deepgemm
    step prefill-bf16-d64 "${BF16_S:-100}" python3 benchmarks/prefill_sweep.py --set bf16-d64 --peer --samples 10 \
      --output "$OUT/prefill-sweep-bf16-d64.json"
    ;;
  host-calls)  # the decode and prefill eager cost per call beside DeepGEMM (timed alone)
    wait_deepgemm
    host_calls
    ;;
  paged-sweep)  # the whole decode sweep beside DeepGEMM (bench paged --sweep), its report against
    # the targets and its plot (960 rows at 10 samples: 250-310 s on an H100, more than one call
    # leaves after DeepGEMM's build and other parts: the report reads the rows finished)
    wait_deepgemm
    step paged-sweep "${SWEEP_S:-420}" python3 -m tilefuse.cli bench paged --sweep --samples "${SWEEP_SAMPLES:-10}" \
      -q -o "$OUT/paged-sweep.json"
    step paged-sweep-report 30 python3 benchmarks/paged_sweep_report.py "$OUT/paged-sweep.json" \
      --output "$OUT/paged-sweep-report.json" --plot "$OUT/paged-sweep.png"
    ;;
  prefill-rows)  # the prefill rows of bench indexer beside DeepGEMM (the prefill targets' table)
    wait_deepgemm
    step bench-indexer "${INDEXER_S:-150}" python3 -m tilefuse.cli bench indexer --samples 20 -q -o "$OUT/indexer.json"
    ;;
  dgtests)  # DeepGEMM's own tests, a new sample of $DG_CASES cases each, one process after another
    # (side by side, a paged process holding ~100 GiB left a prefill process out of memory: NOTES;
    # alone, 200 prefill cases took 160 s, 200 paged ~200 s); $DG_SHARD (i/n) splits the sample
    # over runs (the same $SEED in each); $DG_TESTS and $DG_SHARDS pick the processes, e.g.
    # DG_TESTS=paged DG_SHARDS="0/2 1/2"; DG_PER_CASE=1: each case alone, one out of GPU memory
    # skipped (an 80 GB GPU under the largest paged cases)
    wait_deepgemm
    for t in ${DG_TESTS:-prefill paged}; do for shard in ${DG_SHARDS:-${DG_SHARD:-0/1}}; do
      step "deepgemm-$t-${shard/\//of}" "${DG_S:-250}" python3 benchmarks/deepgemm_tests.py --tests "$t" \
        --cases "${DG_CASES:-200}" --seed "${SEED:-1}" --shard "$shard" ${DG_PER_CASE:+--per-case}
    done; done
    ;;
  eager)  # the eager cost per call beside DeepGEMM and cuBLAS (after the other parts: timed alone)
    wait_deepgemm
    step launch-cost 45 python3 benchmarks/launch_cost.py --calls 2000 --tp-m 64 4096 --output "$OUT/launch-cost.json"
    host_calls
    step bench-serving "${SERVING_S:-100}" python3 -m tilefuse.cli bench serving --steps 4 -o "$OUT/serving.json"
    ;;
  topk-parts)  # the merge kernel's launches taken apart (scan, selects, sort), 512 and 64 rows,
    # then the select's own pieces (a counting pass's cost, the compaction)
    step topk-parts "${TOPK_S:-90}" python3 benchmarks/topk_merge_parts.py --output "$OUT/topk-merge-parts.json"
    step topk-select-probe 60 python3 benchmarks/topk_select_probe.py --output "$OUT/topk-select-probe.json"
    ;;
  topk-open)  # the top-k and warm-up GPU tests (a cold compile cache takes ~200 s over 8
    # processes), the eager cost, top-k speed beside DeepGEMM
    step topk-tests "${TOPK_TESTS_S:-280}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/indexer/test_topk.py \
      tests/indexer/test_warmup.py
    wait_deepgemm
    step topk-host 60 python3 benchmarks/topk_host_cost.py --output "$OUT/topk-host-cost.json"
    step bench-topk "${TOPK_S:-150}" python3 -m tilefuse.cli bench topk -o "$OUT/topk.json" --samples 10 \
      --shapes ${TOPK_SHAPES:-2048x32768 4096x65536 2048x131072 64x1x32768 256x2x65536}
    ;;
  topk-verify)  # round (22)'s changes on a GPU: the top-k and warm-up tests (the no-compile test
    # after the warm-up's whole rows through the passes), the eager cost at the defaults beside
    # both pairs, top-k speed (the README's table), then the one-merge bound past 32768 keys and
    # the 128 MiB prefill workspace (~10 minutes: DEADLINE=590)
    step topk-tests "${TOPK_TESTS_S:-330}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/indexer/test_topk.py \
      tests/indexer/test_warmup.py
    wait_deepgemm
    step topk-host 45 python3 benchmarks/topk_host_cost.py --output "$OUT/topk-host-cost.json"
    step bench-topk "${TOPK_S:-150}" python3 -m tilefuse.cli bench topk -o "$OUT/topk.json" --samples 10 \
      --shapes 2048x32768 4096x65536 2048x131072 64x1x32768 256x2x65536 8x1x65536 128x1x16384
    step ab-one-merge 60 python3 benchmarks/topk_host_cost.py --no-prefill --decode 1x65536 8x65536 64x32768 \
      --setting _EAGER_ONE_MERGE_KEYS --values 0 65536 --output "$OUT/topk-host-one-merge-65536.json"
    step ab-workspace 80 python3 benchmarks/topk_setting_ab.py --samples 10 --setting _WORKSPACE_BYTES \
      --values 67108864 134217728 --shapes 2048x32768 4096x65536 --output "$OUT/topk-workspace-128.json"
    ;;
  topk-profile)  # Nsight Compute on the merge's launches (first, first + last, a middle chunk's
    # scan; 512 rows): where its warps stall, the issue rate, the hottest lines
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    step ncu-topk "${NCU_S:-180}" "$NCU" --clock-control none -k "regex:topk_merge" --launch-count 4 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section InstructionStats --section SourceCounters \
      python3 benchmarks/topk_merge_parts.py --rows 512 --samples 0
    ;;
  topk)  # the fused top-k's speed beside the unfused pairs (its tests are in PART=tests);
    # TOPK_SHAPES=grid: the whole default grid (the README's table)
    wait_deepgemm
    shapes=(--shapes ${TOPK_SHAPES:-2048x32768 4096x65536 2048x131072 64x1x32768 256x2x65536})
    [ "${TOPK_SHAPES:-}" = grid ] && shapes=()
    step bench-topk "${TOPK_S:-150}" python3 -m tilefuse.cli bench topk -o "$OUT/topk.json" --samples 10 "${shapes[@]}"
    ;;
  final)  # after kernel-default and host-path changes: their GPU tests, the A/B, host cost, decode beside DeepGEMM
    step tests-paged 150 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_paged.py \
      tests/indexer/test_paged_bounds.py
    step tests-gluon 100 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_prefill.py -k "gluon or checked"
    step prefill-ab 130 python3 benchmarks/prefill_ab.py ${AB_TREES:-.ab/c0 .} --rounds 3 \
      --output "$OUT/prefill-ab.json"
    wait_deepgemm
    step host-prefill 30 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
    step host-prefill-stub 20 python3 benchmarks/prefill_host_cost.py --stub --calls 1000
    step host-paged 35 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    step bench-paged 70 python3 -m tilefuse.cli bench paged -o "$OUT/paged.json" -q --shapes $DECODE_SHAPES
    ;;
  checks)
    step tests-errors 25 python3 -m pytest -q -p no:cacheprovider tests/test_errors.py tests/test_jit.py
    step tests-paged 100 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_paged.py \
      tests/indexer/test_paged_bounds.py
    step tests-prefill 70 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_prefill.py \
      -k "gluon or window or out or gpu or shapes"
    step tests-warmup 45 python3 -m pytest -q -p no:cacheprovider tests/indexer/test_warmup.py
    step host-prefill 35 python3 benchmarks/prefill_host_cost.py --output "$OUT/prefill-host-cost.json"
    step host-paged 35 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    step deepgemm-tests 90 python3 benchmarks/deepgemm_tests.py --cases "${DG_CASES:-50}"
    step gpu-sweep 50 python3 -m tests.indexer.gpu_sweep --budget-s "$(within 50 15)" --seed "${SEED:-1}"
    ;;
  timing)
    step host-paged 35 python3 benchmarks/paged_host_cost.py --output "$OUT/paged-host-cost.json"
    step bench-paged 120 python3 -m tilefuse.cli bench paged -o "$OUT/paged.json" -q
    step bench-indexer 110 python3 -m tilefuse.cli bench indexer -o "$OUT/indexer.json" -q
    step bench-serving 100 python3 -m tilefuse.cli bench serving --steps 4 -o "$OUT/serving.json"
    step tests-topk 60 python3 -m pytest -q -p no:cacheprovider -x tests/indexer/test_topk.py
    step tp-host 30 python3 -m tilefuse.bench.suites.tp host --m 4096 --n 4096 --k 1024 --json "$OUT/tp-host.jsonl"
    step tp-compiles 40 python3 -m pytest -q -p no:cacheprovider tests/tp/test_gpu.py -k compiles
    ;;
esac
done
# few files come back from some machines: the logs travel as one archive
tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null && rm -rf "$LOGS"
