"""Every command-line tool answers --help (exit 0, usage printed). Start-up time is reported, not
asserted (shared CI machines): tools import torch / megatron-core only after parsing arguments,
so --help takes a fraction of a second."""

import glob
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tools():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tools", "*.py"))
                       + glob.glob(os.path.join(ROOT, "tools", "*", "*.py"))):
        with open(path, encoding="utf-8") as f:
            if "__main__" in f.read():
                out.append(os.path.relpath(path, ROOT))
    return out


TOOLS = _tools()


def test_the_tools_are_found():
    assert "tools/preprocess_data.py" in TOOLS and "tools/merge_datasets.py" in TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_help_exits_zero(tool):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, tool, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
    print(f"{tool} --help: {seconds:.2f} s")
