#!/usr/bin/env bash
# The test command (README and .ci/run): set up the venv, then run the whole suite on the CPU.
#   PYTHON= / VENV= as for scripts/setup_env.sh (default: python3, .venv). Arguments go to pytest;
#   without a test path among them the whole tests/ directory runs.
#   PYTHON=python3.12 VENV=.venv312 bash scripts/run_tests.sh      # Python 3.12, newest megatron-core
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$VENV/bin/python" -c 'import sys, torch, megatron.core as m
print(f"== tests on Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}")' \
  2>/dev/null
paths=(tests)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then paths=(); break; fi
done
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" "${paths[@]}" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests (exit code 5): a selection that matches nothing is a failure" >&2
fi
exit "$rc"
