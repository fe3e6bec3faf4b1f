"""Training's helper processes outlast a step-wide SIGTERM and die with their rank (issue 26).

Slurm signals every process of a job step. These tests send SIGTERM to a helper from a third
process (``kill``, as slurmstepd would) and check it still serves the rank, and that the rank's
own shutdown still ends it. tests/test_slurm.py does the same through a real Slurm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from megatron_moe.runtime import helper_processes
from megatron_moe.runtime.dist_signal_handler import SIGNAL_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_notice_signals_are_exit_signal_choices():
    assert helper_processes.NOTICE_SIGNALS == SIGNAL_NAMES


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid, timeout=20):
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


# A rank in miniature: a DataLoader with one worker and the checkpoint writer's results queue.
# It prints the helpers' pids, lets the test signal them, uses both again, then exits normally
# (or is killed by the test).
RANK = textwrap.dedent("""
    import os, sys, time
    import torch
    from megatron_moe.runtime.helper_processes import shield_data_worker
    from megatron_moe.compat import checkpoint as ck

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 6
        def __getitem__(self, i):
            return torch.tensor([i, os.getpid()])

    shielded = sys.argv[1] == "1"
    loader = torch.utils.data.DataLoader(Data(), batch_size=1, num_workers=1,
                                         persistent_workers=True,
                                         worker_init_fn=shield_data_worker if shielded else None)
    it = iter(loader)
    worker = int(next(it)[0, 1])
    if shielded:
        ck.prestart_writer()
        queue = ck._filesystem_async()._results_queue
    else:   # megatron-core's own start of the queue
        fa = ck._filesystem_async()
        queue = (getattr(fa, "get_write_results_queue", None)
                 or getattr(fa, "_get_write_results_queue"))()
    ck.wait_writer_ready()
    manager = queue._manager._process.pid
    print("pids", worker, manager, flush=True)
    sys.stdin.readline()                       # the test signals the helpers now
    queue.put("after the signal")
    print("queue", queue.get(timeout=10), flush=True)
    print("batch", int(next(it)[0, 0]), flush=True)
    if sys.argv[2] == "wait":
        sys.stdin.readline()                   # the test kills this process now
""")


def _start(shielded: bool, mode: str = "exit"):
    proc = subprocess.Popen([sys.executable, "-c", RANK, "1" if shielded else "0", mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT,
                                                          OMP_NUM_THREADS="1"))
    line = proc.stdout.readline()
    assert line.startswith("pids"), line + proc.stderr.read()
    worker, manager = (int(v) for v in line.split()[1:])
    return proc, worker, manager


def _sigterm_from_elsewhere(*pids):
    # `kill` is a third process, neither the helper's parent nor the helper: what slurmstepd is
    subprocess.run(["kill", "-TERM", *map(str, pids)], check=True, timeout=10)


def test_helpers_survive_a_third_party_sigterm_and_stop_with_the_rank():
    proc, worker, manager = _start(True)
    try:
        _sigterm_from_elsewhere(worker, manager)
        time.sleep(0.5)
        assert _alive(worker) and _alive(manager)
        out, err = proc.communicate("\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "queue after the signal" in out and "batch 1" in out, out + err[-3000:]
    # the rank's normal exit ends both (the DataLoader's shutdown, the Manager's finalizer)
    assert _wait_gone(worker) and _wait_gone(manager)


def test_unshielded_helpers_die_of_it():
    """The mutation: megatron-core's own queue and a plain DataLoader worker die of the same
    signal, and the rank fails on its next use of them."""
    proc, worker, manager = _start(False)
    try:
        _sigterm_from_elsewhere(worker, manager)
        assert _wait_gone(worker) and _wait_gone(manager)
        out, err = proc.communicate("\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "queue after the signal" not in out


def test_helpers_die_with_a_sigkilled_rank():
    proc, worker, manager = _start(True, mode="wait")
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().startswith("queue")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # PR_SET_PDEATHSIG: the kernel kills them with their rank, however it died
        assert _wait_gone(worker) and _wait_gone(manager)
    finally:
        proc.kill()
