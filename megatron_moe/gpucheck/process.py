"""One bounded child process of the kit: a section or a performance row, in its own process group
so that a crash, a hang or a CUDA error stops only itself, and whatever it forked dies with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def run_bounded(cmd, log, limit_s: float, cwd: str, cpu: bool):
    """Run ``cmd`` with its output into ``log`` for at most ``limit_s`` seconds; returns
    (why: "ok" / "exit N" / "timed out after Ns", seconds taken)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1" if cpu else "8")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, limit_s))
        why = f"exit {rc}" if rc else "ok"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        why = f"timed out after {limit_s:.0f}s"
    else:  # anything the child left behind (a checkpoint writer, a generate.py child)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return why, time.monotonic() - t0
