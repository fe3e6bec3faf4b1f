"""The LR schedule on resume: --override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler,
and neither (Megatron-LM's meanings). The learning rate checked is the one the training log line
prints after the resume, against the schedule computed here by hand."""

import math
import re

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, run_pretrain_steps

BASE = TINY + ["--expert-model-parallel-size", "2"]
SAVED = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", "8"]
NEW = ["--lr", "5e-4", "--min-lr", "5e-5", "--lr-decay-style", "linear", "--lr-decay-iters", "6",
       "--lr-warmup-iters", "1"]


def _lr(it, lr, min_lr, style, decay, warmup=0):
    """Megatron's schedule in iterations (the scheduler counts samples: the batch cancels)."""
    if warmup and it <= warmup:
        return lr * it / warmup
    ratio = (it - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (lr - min_lr)


def _keep_checkpoint_bounds():
    """Mutation: the fix left out: the param groups keep the bounds the optimizer state loads
    (and megatron-core 0.19 pairs loaded groups by them)."""
    from megatron_moe.compat import checkpoint as compat_checkpoint
    from megatron_moe.training import checkpointing

    real = (checkpointing._schedule_bounds_to_param_groups,
            compat_checkpoint.align_loaded_param_group_bounds)
    checkpointing._schedule_bounds_to_param_groups = lambda optimizer, scheduler: None
    compat_checkpoint.align_loaded_param_group_bounds = lambda state, max_lr, min_lr: None

    def undo():
        (checkpointing._schedule_bounds_to_param_groups,
         compat_checkpoint.align_loaded_param_group_bounds) = real
    return undo


def _printed_lr(text):
    return {int(i): float(lr) for i, lr in
            re.findall(r" iteration +(\d+)/ *\d+ \|.*?\| learning rate: (\S+) \|", text)}


def test_resume_schedule_flags(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    resume = BASE + ["--load", ckpt, "--train-iters", "4"]
    steps = [
        dict(argv=BASE + SAVED + ["--train-iters", "2", "--save", ckpt, "--save-interval", "2"]),
        dict(argv=resume + NEW + ["--override-opt_param-scheduler"]),
        dict(argv=resume + NEW + ["--override-opt_param-scheduler"], mutate=_keep_checkpoint_bounds),
        dict(argv=resume + NEW + ["--use-checkpoint-opt_param-scheduler"]),
        dict(argv=resume + NEW),
    ]
    out = run_distributed(run_pretrain_steps, 2, steps, timeout_s=600)
    last = out[1]            # the log line is printed by the last rank
    first = out[0]           # errors by rank 0
    saved = _printed_lr(last[0]["text"])
    assert saved[2] == pytest.approx(_lr(2, 1e-3, 1e-4, "cosine", 8), rel=1e-5)

    # --override-opt_param-scheduler: every value from the command line (lr, min-lr, style,
    # decay and warmup iterations), at the checkpoint's iteration
    override = _printed_lr(last[1]["text"])
    assert sorted(override) == [3, 4], (first[1], last[1])
    for it in (3, 4):
        assert override[it] == pytest.approx(_lr(it, 5e-4, 5e-5, "linear", 6, warmup=1), rel=1e-5)
    # mutation: the loaded optimizer's param groups keep the checkpoint's max_lr/min_lr (the bug:
    # 1e-3 with the new decay style; on megatron-core 0.19 the optimizer state does not load)
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if "max_lr" in mcore_optimizer.param_group_identifier_keys:   # 0.19: the load fails
        assert "Could not find parameter group" in str(last[2]["exit"]), last[2]
    else:
        mutated = _printed_lr(last[2]["text"])
        assert mutated[3] == pytest.approx(_lr(3, 1e-3, 1e-4, "linear", 6, warmup=1), rel=1e-5)
        assert mutated[3] != pytest.approx(override[3], rel=1e-3)

    # --use-checkpoint-opt_param-scheduler: the checkpoint's schedule, the command line ignored
    kept = _printed_lr(last[3]["text"])
    for it in (3, 4):
        assert kept[it] == pytest.approx(_lr(it, 1e-3, 1e-4, "cosine", 8), rel=1e-5)

    # neither: Megatron's check that the command line's schedule equals the checkpoint's
    assert first[4]["exit"] == 1
    error = [line for line in first[4]["text"].splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "--lr is 0.0005 on this command line, 0.001 in the checkpoint" \
        in error[0] and "--override-opt_param-scheduler" in error[0], first[4]["text"][-2000:]


def test_override_and_use_checkpoint_exclude_each_other(capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(BASE + ["--train-iters", "2", "--override-opt_param-scheduler",
                           "--use-checkpoint-opt_param-scheduler"], world_size=2)
    err = capsys.readouterr().err
    assert "--override-opt_param-scheduler" in err and "exclude each other" in err
