#!/usr/bin/env bash
# The main job: the indexer benchmark suite with its correctness checks, ceilings and plot.
# On a GPU machine: full reference shapes; elsewhere: tiny shapes through Triton's interpreter.
# The plot needs matplotlib (pip install 'tilefuse[bench]'); without it the suite runs unplotted.
# Extra arguments go to `tilefuse bench indexer` (e.g. --shapes 2048x32768, --reproduce).
source "$(dirname "$0")/_env.sh"
plot=()
if has matplotlib; then
  plot=(--plot "${PLOT:-indexer.png}")
else
  echo "demo: matplotlib is not installed: no plot (pip install matplotlib)" >&2
fi
exec "$PY" -m tilefuse.cli bench indexer ${plot[@]+"${plot[@]}"} "$@"
