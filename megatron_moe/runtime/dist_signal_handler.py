"""Stopping a run the Megatron-LM way: every rank stops at the same iteration, saves, exits 0.

A scheduler's preemption notice (SIGTERM, or the signal named by ``--exit-signal``) reaches the
ranks of a job at slightly different moments, often only some of them. A rank that stopped on its
own would leave the others waiting in the next collective forever. So the handler only records
the signal, and at every iteration boundary the ranks agree with one all-reduce (MAX) of a
two-int flag tensor: [a signal arrived here, ``--exit-duration-in-mins`` is exceeded here]. The
tensor lives on the data's device (NCCL moves device memory only). Megatron-LM's
``dist_signal_handler.DistributedSignalHandler`` all-gathers the same flag; its duration check is
a second all-reduce, merged here into the same collective.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

# --exit-signal's choices: Megatron-LM's names (signal.Signals members)
SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def add_arguments(parser):
    """Megatron-LM's flags (its ``--exit-signal-handler`` is in arguments.py)."""
    g = parser.add_argument_group("exit conditions")
    g.add_argument("--exit-signal", default="SIGTERM", choices=SIGNAL_NAMES,
                   help="The signal --exit-signal-handler catches (default SIGTERM).")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Save and exit after this many minutes of wall time (agreed by all ranks).")


def _data_device():
    # the device the data lives on; the CPU shims answer torch.device("cpu") on a CPU build
    return torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")


class ExitConditions:
    """Installs the signal handler (``--exit-signal-handler``) and answers, at an iteration
    boundary and identically on every rank, whether the run must stop and why."""

    def __init__(self, args, start_time: float | None = None):
        self.args = args
        self.start_time = time.time() if start_time is None else start_time
        # getattr: tools (evaluate, generate) build a Trainer from parsers without these flags
        self.signal = (signal.Signals[getattr(args, "exit_signal", "SIGTERM")]
                       if getattr(args, "exit_signal_handler", False) else None)
        minutes = getattr(args, "exit_duration_in_mins", None)
        self.duration_s = minutes * 60.0 if minutes is not None else None
        self.received = False
        self.checks = 0            # collectives issued (tests: proves the agreement ran)
        self._previous = None
        if self.signal is not None:
            self._previous = signal.signal(self.signal, self._handler)
            # restart system calls the signal interrupts inside C libraries (gloo's sockets)
            signal.siginterrupt(self.signal, False)

    def _handler(self, signum, frame):
        self.received = True       # only a flag: the next iteration boundary acts on it

    @property
    def active(self) -> bool:
        return self.signal is not None or self.duration_s is not None

    def check(self) -> str | None:
        """None to go on, else the reason to save and exit (the same on every rank)."""
        if not self.active:
            return None
        over_time = self.duration_s is not None and time.time() - self.start_time > self.duration_s
        flags = torch.tensor([int(self.received), int(over_time)], dtype=torch.int32,
                             device=_data_device())
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.checks += 1
        got_signal, timed_out = (int(v) for v in flags.cpu().tolist())
        if got_signal:
            return f"exiting program after receiving {self.signal.name}"
        if timed_out:
            return (f"exiting program after {(time.time() - self.start_time) / 60.0:.2f} minutes "
                    f"(--exit-duration-in-mins {self.duration_s / 60.0:g})")
        return None

    def close(self):
        if self.signal is not None and self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None


def validate_args(args):
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ValueError(f"--exit-duration-in-mins must be > 0 (got {args.exit_duration_in_mins})")
