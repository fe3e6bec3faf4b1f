#!/usr/bin/env bash
# Create .venv (once) with everything the quickstart and the tests need; idempotent.
# CPU machines: torch 2.13.0 (CPU build), megatron-core 0.16.1 (Python 3.11). GPU images: see Dockerfile.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.megatron-moe-installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# Pin torch first: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
touch "$STAMP"
