"""bf16 and fp16 (dynamic loss scaling) GPT-MoE training on CPU, against fp32; collective timeouts.

Tolerances (4 iterations, EP=2, dropout off, the same data and initial weights): per-iteration
lm loss within 2e-3 relative of fp32 for bf16 (8-bit mantissa) and 5e-4 for fp16 (11-bit), grad
norm within 2e-2 relative. The grad norm is the proof that fp16 loss scaling ran end to end: the
loss is multiplied by the scale before backward and the optimizer divides it out; without the
multiplication the reported norm is 1/scale of fp32's (it was, before config.grad_scale_func was
set). The bf16 checkpoint stores bf16 weights (read with tools/checkpoint_info.py).
"""

import os
import re
import signal

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import (TINY, kill_group, log_text, run_pretrain_sequence, start_torchrun,
                               wait_for, worker_pids)

BASE = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "4", "--hidden-dropout",
               "0", "--attention-dropout", "0"]


def test_bf16_and_fp16_losses_close_to_fp32(tmp_path):
    ckpt = str(tmp_path / "bf16")
    runs = run_distributed(run_pretrain_sequence, 2, [
        BASE, BASE + ["--bf16", "--save", ckpt], BASE + ["--fp16", "--initial-loss-scale", "4096"],
    ], timeout_s=600)[0]
    fp32, bf16, fp16 = runs
    for history, loss_tol in ((bf16, 2e-3), (fp16, 5e-4)):
        assert history["iteration"] == [1, 2, 3, 4]
        assert history["lm_loss"] == pytest.approx(fp32["lm_loss"], rel=loss_tol)
        assert history["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=2e-2)
        assert history["lm_loss"] != fp32["lm_loss"]      # another precision really ran
    assert fp32["lm_loss"][-1] < fp32["lm_loss"][0]

    from tools.checkpoint_info import inspect

    tensors = {t["name"]: t["dtype"] for t in inspect(os.path.join(ckpt, "iter_0000004"))["tensors"]}
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == "bfloat16"
    # fp32 main params and Adam moments of the mixed-precision optimizer
    assert tensors["optimizer.state.fp32_param.decoder.layers.mlp.router.weight"] == "float32"


def test_stuck_rank_ends_in_a_timeout_error_naming_the_flag(tmp_path):
    """Rank 1 is frozen (SIGSTOP: a hung node); rank 0's next collective fails after
    --distributed-timeout-minutes (0.05 = 3 s) with an error naming the flag, instead of a hang."""
    log = str(tmp_path / "run.log")
    job = start_torchrun(2, TINY + ["--expert-model-parallel-size", "2", "--train-iters", "1000",
                                    "--distributed-timeout-minutes", "0.05"], log_path=log)
    try:
        wait_for(lambda: " iteration        2/" in log_text(log), 240, job, "iteration 2")
        ranks = worker_pids(job)
        os.kill(ranks[1], signal.SIGSTOP)
        wait_for(lambda: "error: rank 0: a collective timed out" in log_text(log), 120, job,
                 "rank 0's timeout error")
        # rank 0 has failed on its own and the launcher stops the other ranks with SIGTERM,
        # which a stopped process receives only once continued (else torchrun waits 30 s
        # before its SIGKILL)
        wait_for(lambda: f"Sending process {ranks[1]} closing signal SIGTERM" in log_text(log),
                 120, job, "the launcher's SIGTERM to rank 1")
        os.kill(ranks[1], signal.SIGCONT)
        rc = wait_for(lambda: job.poll() if job.poll() is not None else None, 60, None,
                      "the launcher to exit")
    finally:
        kill_group(job)
    text = log_text(log)
    assert re.search(r"error: rank 0: a collective timed out after --distributed-timeout-minutes "
                     r"0\.05: another rank is stuck or dead \(.+\)", text), text[-2000:]
    assert rc != 0
    # the launcher's first observed failure is rank 0 (its timeout), not the continued rank 1
    assert re.search(r"Root Cause \(first observed failure\):\n\[0\]:.*?\n\s+rank\s*:\s*0 ",
                     text, re.S), text[-2000:]


def _loss_scales(rank, world, runs):
    """Per run: the optimizer's loss scale after each iteration (read by the test, not the loop)."""
    from tests._train_cases import pretrain_recording

    return [pretrain_recording(argv, lambda trainer: float(trainer.optimizer.get_loss_scale()))
            for argv in runs]


def test_fp16_loss_scale_flags_drive_megatron_cores_scaler():
    """--loss-scale-window (growth), --hysteresis and --min-loss-scale (backoff) reach megatron-core's
    DynamicGradScaler: a 2-iteration window doubles the scale every 2 clean iterations where the
    default (1000) keeps it; from 2**32 every fp16 step overflows, and with --hysteresis 1 the scale
    halves from the first step down to --min-loss-scale and stays there, where the default
    hysteresis (2) lets the first overflow pass (megatron-core resets its count only on growth)."""
    fp16 = TINY + ["--fp16", "--train-iters", "6", "--hidden-dropout", "0"]
    window, default, floor, halving = run_distributed(_loss_scales, 1, [
        fp16 + ["--initial-loss-scale", "1024", "--loss-scale-window", "2"],
        fp16 + ["--initial-loss-scale", "1024"],
        fp16 + ["--hysteresis", "1", "--min-loss-scale", str(2.0 ** 29)],
        fp16,
    ], timeout_s=300)[0]
    assert window == [1024, 2048, 2048, 4096, 4096, 8192], window
    assert default == [1024] * 6, default
    assert floor == [2.0 ** 31, 2.0 ** 30, 2.0 ** 29, 2.0 ** 29, 2.0 ** 29, 2.0 ** 29], floor
    assert halving == [2.0 ** 32, 2.0 ** 31, 2.0 ** 30, 2.0 ** 29, 2.0 ** 28, 2.0 ** 27], halving
