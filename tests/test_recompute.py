"""Megatron's activation-recomputation flags reach megatron-core and do not change the math."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, run_pretrain_sequence

BASE = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "3", "--hidden-dropout", "0",
               "--attention-dropout", "0"]


def _count_recompute(rank, world_size, argvs):
    """run_pretrain_sequence, counting megatron-core's checkpointed (recomputed) forwards."""
    from megatron.core.tensor_parallel import random as mrandom

    calls = {"n": 0}
    original = mrandom.CheckpointFunction.apply

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    mrandom.CheckpointFunction.apply = counting
    try:
        counts, histories = [], []
        for argv in argvs:
            before = calls["n"]
            histories += run_pretrain_sequence(rank, world_size, [argv])
            counts.append(calls["n"] - before)
        return histories, counts
    finally:
        mrandom.CheckpointFunction.apply = original


def test_full_recompute_same_losses_and_it_ran():
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    (plain, recomputed), counts = run_distributed(_count_recompute, 2, [BASE, BASE + full],
                                                  timeout_s=600)[0]
    assert counts[0] == 0 and counts[1] > 0          # recomputation really ran
    assert recomputed["lm_loss"] == plain["lm_loss"]  # and is exact on CPU fp32
    assert recomputed["grad_norm"] == plain["grad_norm"]


def test_recompute_flags_checked_at_parse_time(capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(BASE + ["--recompute-granularity", "full"], world_size=2)
    assert "--recompute-method" in capsys.readouterr().err
    args = parse_args(BASE + ["--recompute-activations"], world_size=2)
    assert args.recompute_granularity == "selective"
