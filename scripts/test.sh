#!/usr/bin/env bash
# The test suite: lint (where ruff is installed; always in CI), then pytest. Without a GPU the
# kernels run through Triton's interpreter on CPU tensors (two worker processes); with one,
# the GPU-marked full-size tests run too. Skipped tests are counted by reason at the end.
source "$(dirname "$0")/_env.sh"
PY="$PY" bash scripts/lint.sh
workers=()
if [ "$PY" != python3 ] && has xdist; then
  workers=(-n 2)
fi
exec "$PY" -m pytest -q ${workers[@]+"${workers[@]}"} "$@"
