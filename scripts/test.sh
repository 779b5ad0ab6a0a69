#!/usr/bin/env bash
# The test suite: lint, then pytest. Without a GPU the kernels run through Triton's interpreter
# on CPU tensors (two worker processes); with one, the GPU-marked full-size tests run too.
source "$(dirname "$0")/_env.sh"
"$PY" -m ruff check src tests benchmarks
if [ "$PY" = python3 ]; then
  exec "$PY" -m pytest -q "$@"
fi
exec "$PY" -m pytest -q -n 2 "$@"
