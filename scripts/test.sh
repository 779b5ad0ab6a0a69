#!/usr/bin/env bash
# The test suite: lint (where ruff is installed; always in CI), then pytest. Without a GPU the
# kernels run through Triton's interpreter on CPU tensors (two worker processes); with one,
# the GPU-marked full-size tests run too, over up to 8 worker processes where pytest-xdist is
# installed (the compile checks use every core either way). Skipped tests are counted by
# reason at the end, the slowest listed.
source "$(dirname "$0")/_env.sh"
PY="$PY" bash scripts/lint.sh
workers=()
if has xdist; then
  if [ "$PY" != python3 ]; then
    workers=(-n 2)
  else
    n=$(($(nproc) / 2)); ((n > 8)) && n=8; ((n < 1)) && n=1
    workers=(-n "$n")
  fi
fi
exec "$PY" -m pytest -q --durations=15 ${workers[@]+"${workers[@]}"} "$@"
