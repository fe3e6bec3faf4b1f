"""One bounded child process of the kit: a section, a performance row or the profile, in its own
process group so that a crash, a hang or a CUDA error stops only itself, and whatever it forked
dies with it.

On the GPU each child is a fresh interpreter (``python -m MODULE ...``, the profile
``python scripts/gpu_profile.py ...``). In ``--cpu`` mode (the suite runs it on both CI legs) each
child is a fork of the runner, which imported torch and megatron-core once: a fresh interpreter
spent ~4 s of a 2-core machine's time on those imports before its first line, most of a CPU
section's, row's or profile's time. The child is still a process of its own (own process group,
own output, killed on timeout), and nothing of a section, row or profile runs in the runner before
the fork, so each starts from the same state a fresh interpreter would reach after its imports.
The GPU keeps fresh interpreters: a CUDA context does not survive a fork, and each row's memory
figures must be its own.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import signal
import subprocess
import sys
import time


def _env(cpu):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1" if cpu else "8")
    return env


def run_bounded(cmd, log, limit_s: float, cwd: str, cpu: bool):
    """Run ``cmd`` with its output into ``log`` for at most ``limit_s`` seconds; returns
    (why: "ok" / "exit N" / "timed out after Ns", seconds taken)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=_env(cpu),
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


def module_command(module, args):
    """The command line of ``run_module``'s child (as the log shows it)."""
    return [sys.executable, "-m", module, *args]


def run_module(module, main, args, log, limit_s: float, cwd: str, cpu: bool):
    """``python -m module *args`` (``main`` is that module's ``main(argv)``) bounded as
    ``run_bounded``: a fresh interpreter on the GPU, a fork of this preloaded process that calls
    ``main(args)`` on the CPU (module docstring)."""
    if not cpu:
        return run_bounded(module_command(module, args), log, limit_s, cwd, cpu)
    return run_forked(module, main, args, log, limit_s, cwd)


def run_forked(name, main, args, log, limit_s: float, cwd: str):
    """``main(args)`` in a fork of this preloaded process (``sys.argv`` ``[name, *args]``), bounded
    and reported as ``run_bounded``: the CPU half of ``run_module``, also for a script's ``main``
    (``run.profile``)."""
    import multiprocessing

    _preload()
    t0 = time.monotonic()
    child = multiprocessing.get_context("fork").Process(
        target=_forked_main, args=(name, main, list(args), log.fileno(), cwd, _env(cpu=True)))
    child.start()
    child.join(max(1.0, limit_s))
    rc = child.exitcode
    why = f"timed out after {limit_s:.0f}s" if rc is None else f"exit {rc}" if rc else "ok"
    # the child's process group: anything it left behind (a checkpoint writer, a generate.py
    # child), or the child itself on timeout
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    if child.is_alive():  # killed before it made its own process group
        child.kill()
    child.join()
    return why, time.monotonic() - t0


@functools.cache
def _preload():
    """Imports every CPU child needs, once in the runner (the fork server's list of gloo test
    ranks, megatron_moe/compat/preload.py)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # read once, when torch loads its thread pool
    from megatron_moe.compat import preload

    preload.import_all()


def _forked_main(name, main, args, log_fd, cwd, env):
    os.setsid()   # as start_new_session=True: killing its group stops whatever it started
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    # stdout and stderr as a fresh interpreter's with PYTHONUNBUFFERED: over fds 1 and 2 (the
    # runner's sys.stdout may be another object, e.g. a caller's capture), written through
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, errors=errors)
        for fd, errors in ((1, "strict"), (2, "backslashreplace")))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [name, *args]
    sys.exit(main(args))
