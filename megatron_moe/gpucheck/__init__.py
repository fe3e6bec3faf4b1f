"""The GPU kit (issue 27, docs/gpu.md): ``scripts/gpu_wheels.sh`` (wheels.py) fetches what an
offline GPU machine lacks; ``scripts/gpu_check.sh [--cpu] OUTDIR`` (run.py, checks.py) proves the
CUDA path in one command and writes the report."""
