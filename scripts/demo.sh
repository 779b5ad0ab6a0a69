#!/usr/bin/env bash
# The main job: the indexer benchmark suite with its correctness checks, ceilings and plot.
# On a GPU machine: full reference shapes; elsewhere: tiny shapes through Triton's interpreter.
# Extra arguments go to `tilefuse bench indexer` (e.g. --shapes 2048x32768, --reproduce).
source "$(dirname "$0")/_env.sh"
exec "$PY" -m tilefuse.cli bench indexer --plot "${PLOT:-indexer.png}" "$@"
