#!/usr/bin/env bash
# Lint the whole tree (the configuration is in pyproject.toml) with the ruff of $PY, else the
# one on PATH. Without ruff: a note and exit 0, except in CI (CI=true), where lint is required.
# PY defaults to python3; scripts/test.sh passes the Python it picked.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
if "$PY" -c "import ruff" 2>/dev/null; then
  exec "$PY" -m ruff check .
elif command -v ruff >/dev/null 2>&1; then
  exec ruff check .
elif [ "${CI:-}" = true ]; then
  echo "lint: ruff is not installed, and CI lints every change (pip install ruff)" >&2
  exit 1
else
  echo "lint: skipped, ruff is not installed (pip install ruff; CI always lints)" >&2
fi
