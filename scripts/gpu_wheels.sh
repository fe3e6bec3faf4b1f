#!/usr/bin/env bash
# Where the package index is reachable: download into .gpu-wheels/ (git-ignored) exactly the wheels
# the GPU machine lacks (CPython 3.12 manylinux x86-64; megatron-core at the newest release in
# pyproject's range, and the project's other run-time dependencies not on that machine), print
# their total size, refuse past 48 MiB. Then on the GPU machine: bash scripts/gpu_check.sh OUTDIR
# (docs/gpu.md).   PYTHON= the interpreter whose pip downloads (default python3; any version).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exec "${PYTHON:-python3}" -m megatron_moe.gpucheck.wheels "$@"
