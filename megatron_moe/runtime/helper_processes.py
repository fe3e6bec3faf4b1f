"""Helper processes of a training rank survive a scheduler's notice and die with their rank.

A preemption, time limit or ``scancel`` makes Slurm signal *every* process of the job step
(SIGTERM by default, or the ``--signal`` an sbatch names), helpers included: the checkpoint
writer's results-queue Manager (a spawned server megatron-core's writer talks to during every
save), DataLoader workers (``--num-workers``). A helper killed by that signal breaks the very
save the signal asked for (``ConnectionRefusedError`` from ``multiprocessing/managers.py``), or
makes torch's SIGCHLD handler raise in the rank while it saves.

``shield(parent_pid)`` is run first thing in such a helper:

* the scheduler-notice signals (``dist_signal_handler.SIGNAL_NAMES``: SIGTERM, SIGINT, SIGUSR1,
  SIGUSR2, SIGHUP, SIGQUIT) are ignored: the rank that owns the helper decides when to stop
  (``--exit-signal-handler``), and shuts its helpers down through their own channel (a
  Manager's shutdown message, the DataLoader's done event);
* ``PR_SET_PDEATHSIG`` = SIGKILL: the kernel kills the helper when its rank dies, however it dies
  (SIGKILL after KillWait included), so a helper never outlives its job, even one that Slurm's
  process tracking lost when it was re-parented;
* a helper whose rank is already gone exits at once.

Forked helpers (megatron-core's async-save writer, its per-bucket writer processes) inherit the
rank's own ``--exit-signal`` handler, which only records the signal, and need nothing here.

No torch import: the Manager's server is a bare interpreter that starts in ~0.1 s
(``compat/checkpoint.py:prestart_writer``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

# the signals --exit-signal accepts (dist_signal_handler.SIGNAL_NAMES, kept equal by a test)
NOTICE_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def _set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) through libc: the standard library has no binding (Linux only;
    False elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def shield(parent_pid: int):
    """Run in a helper process: ignore the notice signals, die with ``parent_pid``."""
    for name in NOTICE_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:   # the rank died before the line above took effect
        os._exit(0)


def shield_data_worker(worker_id: int):
    """DataLoader ``worker_init_fn``. torch's worker handler for SIGTERM ends the worker unless
    the signal came from its parent; here only the parent's SIGTERM (the DataLoader's and
    multiprocessing's shutdown: ``terminate()``, then ``join()``) ends it, and a SIGTERM from
    anyone else (Slurm signalling the whole step) is dropped. A worker that ignored its parent's
    SIGTERM would hang the rank's exit in that ``join()``. The other notice signals are ignored
    and the worker dies with its rank, as in ``shield``.

    SIGTERM is blocked in this (the worker's only) thread, and threads started later inherit the
    mask; a daemon thread takes each one with ``sigwaitinfo``, which names the sender."""
    parent = os.getppid()
    for name in NOTICE_SIGNALS:
        if name != "SIGTERM":
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take_sigterm():
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=take_sigterm, name="sigterm-from-parent", daemon=True).start()
