#!/usr/bin/env bash
# Create a venv (once) with everything the quickstart and the tests need; idempotent.
#   PYTHON=  the interpreter to build it with (default python3); python3.12 is found under pyenv
#            when it is not on PATH (scripts/find_python.sh).
#   VENV=    the venv directory (default .venv; a relative path is taken from the repository root).
#            One venv per Python, e.g. VENV=.venv312 PYTHON=python3.12.
#   TORCH_VERSION=  torch pin (default 2.13.0).
# pip resolves megatron-core from pyproject's range: 0.16.1 on Python 3.11, the newest 0.19.x on 3.12.
# GPU images: see Dockerfile.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
STAMP="$VENV/.megatron-moe-installed"
pyver() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

if [ -x "$VENV/bin/python" ]; then
  if [ -n "${PYTHON:-}" ]; then  # a venv is tied to its Python: refuse a silent mismatch
    want="$(pyver "$(bash "$ROOT/scripts/find_python.sh" "$PYTHON")")"
    have="$(pyver "$VENV/bin/python")"
    if [ "$want" != "$have" ]; then
      echo "error: $VENV was built with Python $have but PYTHON=$PYTHON is Python $want;" \
           "pick another venv directory (e.g. VENV=.venv${want/./}) or remove $VENV" >&2
      exit 1
    fi
  fi
  if [ -f "$STAMP" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ] \
     && [ "$STAMP" -nt "$ROOT/megatron_moe/gpucheck/wheels.py" ]; then
    exit 0
  fi
else
  PY="$(bash "$ROOT/scripts/find_python.sh" "${PYTHON:-python3}")"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# Pin torch first: an unpinned torch would pull whatever is newest (and untested).
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
# lm-evaluation-harness without its metric-only dependencies (pyproject's `eval` extra has the rest)
"$VENV/bin/python" -m pip install -q --no-deps "lm-eval==0.4.13"
# the performance section's torchtitan row (tests/test_gpu_check.py runs it): the kit's pinned
# PERF_WHEELS, without their own requirements (torchtitan's name its data stack, unused)
perf="$(cd "$ROOT" && "$VENV/bin/python" -c 'from megatron_moe.gpucheck.wheels import PERF_WHEELS
print(" ".join(PERF_WHEELS))')"
# shellcheck disable=SC2086  # one word per requirement
"$VENV/bin/python" -m pip install -q --no-deps $perf
"$VENV/bin/python" -W ignore -c 'import sys, torch, megatron.core as m
print(f"{sys.argv[1]}: Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}")' "$VENV"
touch "$STAMP"
