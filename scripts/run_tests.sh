#!/usr/bin/env bash
# The test command (README and .ci/run): set up .venv, then run the whole suite on the CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
