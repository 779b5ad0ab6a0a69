#!/usr/bin/env bash
# The kernels that are new to the GPU image compiled with its Triton (3.6) on any machine: the
# compile tests use the CPU pin (3.8), and 3.6 has compiler passes of its own (one never
# finished on a top-k merge variant). Only a compile that fails or does not finish fails here;
# spills are that Triton's own, and the test suite checks them with the pinned one.
#   bash scripts/compile_check_triton36.sh [KERNEL...]   (default: the top-k kernels and the
#   persistent decode kernel, whose warp specialisation 3.6 lowers its own way)
source "$(dirname "$0")/_env.sh"
site="${TMPDIR:-/tmp}/tilefuse-triton-3.6"
if [ ! -f "$site/triton/__init__.py" ]; then
  "$PY" -m pip install -q --no-deps --target "$site" triton==3.6.0
fi
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(indexer.topk_merge indexer.topk_rows_pass indexer.paged_persistent)
for kernel in "${kernels[@]}"; do
  PYTHONPATH="$site:$PWD/src" "$PY" -m tilefuse.cli kernels --kernel "$kernel" --target sm_90a --no-sass \
    --compile-timeout 120 --compile-only --failures-only -q
done
