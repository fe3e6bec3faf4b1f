"""Run a function on N local processes over gloo, with a hard timeout (tests, benchmarks).

A hang (a collective waiting forever, a forked checkpoint writer) must fail the caller, not hang
it: every rank runs in its own process group, and on timeout or failure the whole group is
killed, including anything the ranks forked.

Ranks are forked from a fork server that has imported torch and megatron-core once per test
session (megatron_moe/compat/preload.py): a spawned rank re-imported them every time, ~5
CPU-seconds a rank, which was most of the CPU time of a short gloo test. Each rank still starts
from that clean server, never from the caller's process, and gets the caller's current environment
(a fork server keeps the one it started with), so a rank sees what a spawned one saw.

Every rank runs in strict device mode (``MEGATRON_MOE_STRICT_DEVICES=1``, megatron_moe/comm/strict.py):
each collective is checked as NCCL would need it, so the suite proves NCCL-readiness on gloo.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import signal
import socket
import time
import traceback

import torch.multiprocessing as mp

from megatron_moe.compat import preload


STRICT_DEVICES_ENV = "MEGATRON_MOE_STRICT_DEVICES"   # = megatron_moe.comm.strict.ENV


class DistributedRunError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ctx = None


def _context():
    """The fork-server context, its preload list set before the server starts (once a process)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(list(preload.MODULES))
        atexit.register(_stop_server)
    return _ctx


def _stop_server():
    """At exit: stop the fork server and reap it, so that it does not outlive the caller and its
    ranks' CPU time counts as the caller's (``time``, rusage); the stop is multiprocessing's own
    (private, hence the guard)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        try:
            stop()
        except OSError:
            pass


class _CallerStdio:
    """The caller's fds 1 and 2 as they are when a rank starts (pytest's capfd swaps them per
    test): a spawned rank inherited them, a fork-server child would write to the server's. Pickled
    while the rank starts, it becomes the fds themselves, sent to the child (``_Stdio``)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _Stdio, (reduction.DupFd(1), reduction.DupFd(2))


class _Stdio:
    def __init__(self, out, err):
        self.out, self.err = out, err

    def attach(self):
        for target, dup in ((1, self.out), (2, self.err)):
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _worker(rank, world_size, port, fn, args, kwargs, results, collective_timeout_s, env, stdio):
    stdio.attach()  # print where a spawned rank printed
    os.setpgrp()  # so the parent can kill this rank and everything it forks
    os.environ.clear()  # the caller's environment, as a spawned rank would have inherited it
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # a rank forked from the fork server inherits "forkserver" as its start method; under torchrun
    # a rank's is Linux's default, fork. DataLoader workers (--num-workers) start the rank's way:
    # through a fork server of their own they re-import torch each (~8 s for 8 workers here)
    mp.set_start_method("fork", force=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        from megatron_moe.compat import apply_cpu_shims

        apply_cpu_shims()
        from megatron_moe.comm import strict

        strict.enable_from_env()  # every collective checked as NCCL needs it
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", out))
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        dist.destroy_process_group()
    except BaseException:  # report every failure, including SystemExit from arg checks
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout_s: float = 240.0,
                    collective_timeout_s: float = 120.0, env: dict | None = None, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable (module level). Returns the per-rank return values (picklable).
    Raises DistributedRunError with the failing rank's traceback, or on timeout.
    """
    ctx = _context()
    # NCCL-readiness on gloo: every collective's devices checked (megatron_moe/comm/strict.py);
    # a caller may pass env={STRICT_DEVICES_ENV: "0"} to run without it
    env = {**os.environ, STRICT_DEVICES_ENV: os.environ.get(STRICT_DEVICES_ENV, "1"), **(env or {})}
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results,
                                          collective_timeout_s, dict(env or {}), _CallerStdio()),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(
                    f"timed out after {timeout_s:.0f}s; ranks finished: {sorted(outputs)}, "
                    f"failed: {sorted(errors)}" + _format_errors(errors))
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outputs and r not in errors]
                if dead:
                    # a rank died without reporting (segfault, OOM kill)
                    errors.update({r: f"exited with code {procs[r].exitcode}" for r in dead})
                continue
            (outputs if status == "ok" else errors)[rank] = value
            if errors:
                # one rank failed: give peers a moment to report, then stop everyone
                time.sleep(0.5)
                while True:
                    try:
                        rank, status, value = results.get_nowait()
                        (outputs if status == "ok" else errors)[rank] = value
                    except queue.Empty:
                        break
                raise DistributedRunError("rank(s) failed" + _format_errors(errors))
        if errors:
            raise DistributedRunError("rank(s) failed" + _format_errors(errors))
        for p in procs:
            p.join(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        _kill(procs)
    return [outputs[r] for r in range(world_size)]


def _format_errors(errors):
    return "".join(f"\n--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))


def _kill(procs):
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.is_alive():  # not yet in its own process group (killed during start-up on a busy host)
            p.kill()
        p.join(timeout=5)


def run_script(path: str, args, env: dict | None = None, timeout_s: float = 120.0):
    """``python path *args`` with environment ``env``, in a process forked from the fork server
    (torch and megatron-core already imported; a fresh interpreter paid ~4 CPU-s for that before a
    script's first line ran). The script runs as ``__main__`` with that ``sys.argv``; its exit status
    and what it printed come back as ``subprocess.run(..., capture_output=True, text=True)`` would
    return them: SystemExit's code, or 1 and the traceback on stderr for an uncaught exception.
    For command lines that end early (argument errors); a training run uses run_distributed."""
    import subprocess
    import tempfile

    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")]
        p = ctx.Process(target=_script_main, args=(os.path.abspath(path), list(args),
                                                    dict(os.environ if env is None else env), outs))
        p.start()
        try:
            p.join(timeout_s)
            if p.exitcode is None:
                raise subprocess.TimeoutExpired([path, *args], timeout_s)
        finally:
            _kill([p])
        stdout, stderr = (open(o, encoding="utf-8", errors="replace").read() for o in outs)
    return subprocess.CompletedProcess([path, *args], p.exitcode, stdout, stderr)


def _script_main(path, argv, env, outs):
    import runpy
    import sys

    os.setpgrp()
    os.environ.clear()
    os.environ.update(env)
    for target, name in zip((1, 2), outs):
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    sys.argv = [path, *argv]
    sys.path[0:0] = [os.path.dirname(path)]   # as `python path` puts the script's folder first
    runpy.run_path(path, run_name="__main__")
