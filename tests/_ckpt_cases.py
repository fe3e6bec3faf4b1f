"""Rank functions and launch helpers for the checkpoint / preemption / crash-safety tests."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear").split()


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_pretrain_capture(rank, world_size, argv, poison_after_first_save=False):
    """pretrain() with megatron-core's checkpoint warnings captured; (history, warnings, saves).

    ``poison_after_first_save``: from the second save on, the stored args carry a per-rank value
    (what a rank-dependent field would do), so the capture is shown to catch megatron-core's
    "common state dict differs" warning.
    """
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import checkpointing
    from megatron_moe.training.loop import pretrain

    capture = _Capture()
    logger = logging.getLogger("megatron.core.dist_checkpointing")
    logger.addHandler(capture)
    calls = []
    real_save = checkpointing.save_checkpoint

    def counting_save(iteration, *a, **k):
        calls.append(iteration)
        return real_save(iteration, *a, **k)

    checkpointing.save_checkpoint = counting_save
    real_portable = checkpointing._portable_args
    if poison_after_first_save:
        def poisoned(args):
            out = real_portable(args)
            if calls and len(calls) > 1:
                out.poison = rank
            return out

        checkpointing._portable_args = poisoned
    try:
        result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                          pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                          pretrain_gpt_moe.forward_step, argv=argv)
    finally:
        logger.removeHandler(capture)
        checkpointing.save_checkpoint = real_save
        checkpointing._portable_args = real_portable
    return result["history"], capture.messages, calls


def differs(warnings):
    """megatron-core's warning that a rank's common (rank-0-only) state differs from rank 0's."""
    return [w for w in warnings if "common state dict differs" in w]


# --- launching the real CLI under torchrun, in its own process group --------------------------
def start_torchrun(nproc, args, env=None, log_path=None):
    """Popen of torchrun + pretrain_gpt_moe.py in a new session (kill the group to kill all)."""
    from megatron_moe.runtime.local_ranks import free_port

    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), os.path.join(ROOT, "pretrain_gpt_moe.py"), *args]
    run_env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               **(env or {})}
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env,
                            start_new_session=True)


def kill_group(proc, sig=signal.SIGKILL):
    """Kill the whole job: torchrun starts each worker in its own session, so the launcher's
    process group and every worker's group (with what the worker forked: checkpoint writers,
    multiprocessing managers) are killed one by one."""
    groups = [proc.pid] + list(worker_pids(proc).values())
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_for(predicate, timeout, proc=None, what=""):
    """Poll until predicate() is truthy; fail (and kill the job) after timeout or if proc exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job exited (rc {proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    if proc is not None:
        kill_group(proc)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def worker_pids(proc) -> dict:
    """{rank: pid} of torchrun's workers (read from /proc: their RANK environment variable)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != proc.pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(pid)
    return out


def log_text(path):
    with open(path, errors="replace") as f:
        return f.read()


def run_pretrain_sequence(rank, world_size, argvs):
    """Several pretrain() runs one after the other in the same ranks (one process start for all;
    each run may have its own TP/PP/EP layout). Returns each run's history."""
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    from megatron.core import parallel_state

    out = []
    for argv in argvs:
        parallel_state.destroy_model_parallel()   # each run builds its own layout's groups
        result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                          pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                          pretrain_gpt_moe.forward_step, argv=argv)
        out.append(result["history"])
    return out


def run_pretrain_steps(rank, world_size, steps):
    """pretrain() runs one after the other in the same ranks, each step a dict: ``argv``;
    ``prepare``: a callable rank 0 runs first (damaging files, say), the other ranks waiting;
    ``mutate``: a callable run on every rank that installs a monkeypatch and returns its undo.
    Each run returns its printed text, exit code (0, the SystemExit's, or "raised ..." for an
    exception that left pretrain()) and history (pretrain()'s; None when it did not return)."""
    import contextlib
    import io

    import pretrain_gpt_moe
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    out = []
    for step in steps:
        if step.get("prepare") is not None:
            if rank == 0:
                step["prepare"]()
            dist.barrier()
        parallel_state.destroy_model_parallel()
        undo = step["mutate"]() if step.get("mutate") is not None else None
        buf, code, result = io.StringIO(), 0, None
        try:
            with contextlib.redirect_stdout(buf):
                result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                                  pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                                  pretrain_gpt_moe.forward_step, argv=step["argv"])
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:   # torch DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            code = f"raised {type(exc).__name__}: {str(exc)[:500]}"
        finally:
            if undo is not None:
                undo()
        out.append({"text": buf.getvalue(), "exit": code,
                    "history": result["history"] if result is not None else None})
    return out
