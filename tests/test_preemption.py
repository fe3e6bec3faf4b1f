"""Preemption the Megatron way: a signal to ONE rank stops every rank at the same iteration.

--exit-signal-handler: the rank that receives SIGTERM only records it; at the next iteration
boundary all ranks all-reduce the flag, save a checkpoint at that iteration and exit 0. Without
the agreement the signalled rank leaves alone and its peer waits in the next collective forever
(the job below would then time out). --exit-duration-in-mins is agreed the same way.
"""

import os
import re
import signal

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import (TINY, differs, kill_group, log_text, run_pretrain_capture, start_torchrun,
                               wait_for, worker_pids)

COMMON = "--expert-model-parallel-size 2 --train-iters 1000 --lr-decay-style constant".split()


def _tracker(ckpt):
    path = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def _uninterrupted_then_resumed(rank, world_size, ref_argv, resume_argv):
    """The uninterrupted reference run, then the resume, in the same ranks (one process start)."""
    from megatron.core import parallel_state

    ref = run_pretrain_capture(rank, world_size, ref_argv)
    parallel_state.destroy_model_parallel()
    return ref, run_pretrain_capture(rank, world_size, resume_argv)


def test_sigterm_to_one_rank_saves_exits_zero_and_resumes_bit_exactly(tmp_path):
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "run.log")
    job = start_torchrun(2, TINY + COMMON + ["--save", ckpt, "--exit-signal-handler"],
                         log_path=log)
    try:
        wait_for(lambda: " iteration        2/" in log_text(log), 180, job, "iteration 2")
        ranks = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(worker_pids(job)), 10,
                         job, "the two workers")
        os.kill(ranks[1], signal.SIGTERM)          # the notice reaches one rank only
        rc = job.wait(timeout=90)                   # bound: a hang fails here
    finally:
        kill_group(job)
    text = log_text(log)
    assert rc == 0, text[-3000:]
    match = re.search(r"exiting program after receiving SIGTERM \(iteration (\d+)\)", text)
    assert match, text[-3000:]
    stop = int(match.group(1))
    assert _tracker(ckpt) == stop and os.path.isdir(os.path.join(ckpt, f"iter_{stop:07d}"))
    logged = [float(v) for v in re.findall(r"\| lm loss: (\S+) \|", text)]
    assert len(logged) == stop and stop < 1000

    # resume from the signal's checkpoint == the uninterrupted run, bit for bit; the resumed run
    # also carries --exit-duration-in-mins 1e-4 (6 ms): over as soon as its first iteration ends,
    # so every rank stops there together and saves
    ckpt2 = str(tmp_path / "ckpt2")
    runs = run_distributed(_uninterrupted_then_resumed, 2,
                           TINY + COMMON + ["--exit-interval", str(stop + 1)],
                           TINY + COMMON + ["--load", ckpt, "--save", ckpt2,
                                            "--exit-duration-in-mins", "1e-4"], timeout_s=400)
    ref = runs[0][0][0]
    resumed = [rank_runs[1] for rank_runs in runs]
    assert [f"{l:.6E}" for l in ref["lm_loss"][:stop]] == [f"{l:.6E}" for l in logged]
    for history, warnings, saves in resumed:
        assert differs(warnings) == []              # quiet saves (tests/test_quiet_saves.py)
        assert history["iteration"] == [stop + 1]
        assert saves == [stop + 1]
        assert history["lm_loss"] == ref["lm_loss"][stop:]
        assert history["grad_norm"] == ref["grad_norm"][stop:]
    assert _tracker(ckpt2) == stop + 1
