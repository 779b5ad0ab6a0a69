# Sourced by scripts/demo.sh and scripts/test.sh: picks the Python that runs tilefuse.
# A machine whose python3 already has torch + triton with a CUDA GPU uses them as they are
# (GPU images pin their own builds, and may have no dev tools and no network); anywhere else
# a local .venv gets the CPU pins of requirements-cpu.txt, and kernels run through Triton's
# interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if python3 -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=python3
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
  stamp=.venv/.tilefuse-installed
  if [ ! -f "$stamp" ] || [ requirements-cpu.txt -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-cpu.txt
    .venv/bin/python -m pip install -q --no-deps -e .
    touch "$stamp"
  fi
  PY=.venv/bin/python
fi

# has MODULE: whether $PY can import it.
has() {
  "$PY" -c "import $1" 2>/dev/null
}
