#!/usr/bin/env bash
# One command on the GPU machine (docs/gpu.md): bash scripts/gpu_check.sh OUTDIR
#   installs the wheels of .gpu-wheels/ (scripts/gpu_wheels.sh) offline into a temporary target
#   (never into site-packages; nothing pulls torch), then runs every check, prints
#   "gpu-check NAME: PASS|FAIL <figures>" per check, writes OUTDIR/gpu_report.{json,md}, the log and
#   a loss plot; exit 1 if any check failed (all of them run).
#   --cpu: the same checks at toy sizes on the CPU with the running environment's packages
#   (the suite runs it: tests/test_gpu_check.py). PYTHON= interpreter (default python3).
#   GPU_WHEELS= wheel folder (default .gpu-wheels); GPU_CHECK_INSTALL_WHEELS=1 installs them with
#   --cpu too.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-$ROOT/.gpu-wheels}"
cpu=0
for a in "$@"; do [ "$a" = "--cpu" ] && cpu=1; done
SITE=""
if [ "$cpu" = 0 ] || [ "${GPU_CHECK_INSTALL_WHEELS:-0}" = 1 ]; then
  shopt -s nullglob
  whl=("$WHEELS"/*.whl)
  if [ "${#whl[@]}" -gt 0 ]; then
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
    trap 'rm -rf "$SITE"' EXIT
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$SITE" "${whl[@]}"; then
      echo "gpu-check: installed ${#whl[@]} wheels from $WHEELS into $SITE"
      export GPU_CHECK_WHEELS="$(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    else  # the checks still run (and the environment check fails with this reason)
      export GPU_CHECK_WHEELS_ERROR="the wheels in $WHEELS did not install offline (pip above)"
      echo "gpu-check: $GPU_CHECK_WHEELS_ERROR" >&2
    fi
  elif ! "$PY" -c 'import megatron.core' 2>/dev/null; then
    echo "gpu-check environment: FAIL megatron-core is not importable and $WHEELS holds no" \
         "wheels: run scripts/gpu_wheels.sh where the package index is reachable, and carry" \
         ".gpu-wheels with the checkout (docs/gpu.md)" >&2
    exit 1
  fi
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
"$PY" -m megatron_moe.gpucheck "$@"
