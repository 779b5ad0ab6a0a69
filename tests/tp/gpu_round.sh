#!/usr/bin/env bash
# One round on a multi-GPU machine (NPROC ranks, default every visible GPU): environment, the multi-GPU checks, and the ag-gemm / gemm-rs
# benchmarks with their same-run baselines. Each step runs in its own process under a time
# limit, so one failing step does not stop the others; everything goes to $OUT/log, results
# to $OUT/*.json (Perfetto traces: $OUT/*.trace.json). From the repository root:
#     OUT=/tmp/round STEPS="env checks bench-ag bench-rs" bash tests/tp/gpu_round.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/tilefuse-dist}
mkdir -p "$OUT"
LOG="$OUT/log"
STEPS=${STEPS:-"env checks bench-ag bench-rs"}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
BENCH=(--samples "${SAMPLES:-8}" --sample-ms "${SAMPLE_MS:-15}" --timeout 3 ${BENCH_ARGS:-})

run() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}

for step in $STEPS; do
    case $step in
    env) run env 60 bash -c 'nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv;
            nvidia-smi topo -m; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())"' ;;
    checks) run checks "${CHECKS_S:-150}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
            tests/tp/gpu_checks.py ${CHECKS_ARGS:-} ;;
    bench-ag) run bench-ag "${BENCH_S:-110}" python3 -m tilefuse.bench.suites.tp ag-gemm --world "$NPROC" --shapes "${AG_SHAPES:-seed,llm}" \
            --designs "${AG_DESIGNS:-auto,ce,push}" --json "$OUT/ag_gemm.json" --trace "$OUT" \
            --trace-shapes "${AG_TRACE:-8192x1024x8192}" "${BENCH[@]}" ;;
    bench-rs) run bench-rs "${BENCH_S:-110}" python3 -m tilefuse.bench.suites.tp gemm-rs --world "$NPROC" --shapes "${RS_SHAPES:-seed,llm}" \
            --designs "${RS_DESIGNS:-auto,push}" --json "$OUT/gemm_rs.json" --trace "$OUT" \
            --trace-shapes "${RS_TRACE:-8192x8192x1024}" "${BENCH[@]}" ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
    esac
done
echo "--- checks that failed"
grep -E "FAIL|failed checks|Error" "$LOG" | grep -v "^\s*File" | head -40
echo "--- results"
grep -E "^wrote|^=== " "$LOG"
awk '/^shape MxNxK/{p=1} p&&/^$/{p=0} p' "$LOG"
