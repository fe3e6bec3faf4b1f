"""Behaviour of the Megatron-LM flags its MoE CI configs set (issue 39): each does what Megatron
does, checked against a hand computation or the state it must set; mutations make them fail."""

import os

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests._megatron_flags_cases import TINY, params_norm_rank


@pytest.mark.parametrize("mutate", [None, "expert_group"])
def test_params_norm_is_megatrons_and_weight_hash_check_sees_a_diverged_replica(mutate):
    results = run_distributed(params_norm_rank, 2, mutate=mutate, timeout_s=240)
    for ours, by_hand, same, differ in results:
        assert same is True and differ is False     # check_weight_hash: replicas, then one nudged
        if mutate is None:
            assert ours == pytest.approx(by_hand, rel=1e-6)
        else:
            assert ours != pytest.approx(by_hand, rel=1e-6)


def test_deterministic_mode_sets_torch_and_megatrons_environment(monkeypatch):
    from megatron_moe.runtime import determinism

    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}         # a caller's valid choice wins
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        determinism.apply(env)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring",
                   "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    with pytest.raises(ValueError, match="NCCL_ALGO='Tree' is not deterministic"):
        determinism.apply({"NCCL_ALGO": "Tree"})


def test_deterministic_mode_refuses_a_nondeterministic_environment_at_parse_time(monkeypatch, capsys):
    from megatron_moe.arguments import parse_args

    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--deterministic-mode"], world_size=2)
    err = capsys.readouterr().err
    assert "--deterministic-mode: NCCL_ALGO='Tree'" in err and "Traceback" not in err


def test_dist_ckpt_strictness_maps_to_megatron_cores_strict_handling():
    import argparse

    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_moe.compat import checkpoint_options

    for value in ("log_all", "raise_unexpected", "assume_ok_unexpected", "return_all"):
        kwargs = checkpoint_options.load_kwargs(argparse.Namespace(dist_ckpt_strictness=value))
        assert kwargs["strict"] is StrictHandling(value)
    assert checkpoint_options.loaded_state(({"a": 1}, set(), set())) == {"a": 1}


def test_per_token_loss_returns_megatrons_sum_and_token_count():
    import argparse

    import pretrain_gpt_moe
    from megatron_moe.runtime import global_vars

    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    global_vars.set_args(argparse.Namespace(calculate_per_token_loss=True))
    try:
        loss, tokens, report = pretrain_gpt_moe.loss_func(mask, losses)
        assert float(loss) == 7.0 and int(tokens) == 3
        assert report["lm loss"].tolist() == [7.0, 3.0]
        global_vars.set_args(argparse.Namespace(calculate_per_token_loss=False))
        loss, report = pretrain_gpt_moe.loss_func(mask, losses)
        assert float(loss) == pytest.approx(7.0 / 3)
    finally:
        global_vars.set_args(None)


@pytest.mark.parametrize("flag,message", [
    ("--overlap-moe-expert-parallel-comm", "--overlap-moe-expert-parallel-comm needs CUDA"),
    ("--fp8-format hybrid", "--fp8-format needs CUDA"),
    ("--cuda-graph-impl transformer_engine", "--cuda-graph-impl needs CUDA"),
    # (Muon's refusals, which depend on the megatron-core release: tests/test_muon.py)
    ("--optimizer soap", "--optimizer soap "),
    ("--ckpt-format torch_dcp", "--ckpt-format torch_dcp is refused"),
    ("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"),
    ("--num-distributed-optimizer-instances 2", "needs --use-distributed-optimizer"),
    ("--context-parallel-size 2 --attention-backend unfused",
     "--context-parallel-size 2 with --attention-backend unfused is not supported"),
])
def test_cpu_refusals_are_one_line_naming_the_flag(flag, message, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU refusals")
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + flag.split(), world_size=2)
    err = capsys.readouterr().err
    assert message in err and "invalid choice" not in err and len(err.strip().splitlines()) == 2


def _without_train_iters(argv):
    i = argv.index("--train-iters")
    return argv[:i] + argv[i + 2:]


class _Opt:
    """The part of a megatron-core optimizer OptimizerParamScheduler touches."""

    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _megatron_lr(step, warmup, decay, max_lr=1e-3, min_lr=1e-5):
    """Megatron's cosine schedule at ``step`` samples (optimizer_param_scheduler.get_lr)."""
    import math

    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


@pytest.mark.parametrize("mutate", [None, "iteration_steps"])
@pytest.mark.parametrize("schedule,warmup,decay", [
    ("--train-samples 101 --lr-warmup-samples 10 --lr-decay-samples 70", 10, 70),
    ("--train-samples 101 --lr-warmup-fraction 0.1", 10.1, 101),
    ("--train-iters 25 --lr-warmup-fraction 0.05", 0.05 * 100, 100),   # fraction of the samples
])
def test_sample_based_schedule_lr_equals_megatrons_formula(schedule, warmup, decay, mutate,
                                                           monkeypatch):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_moe import arguments

    argv = _without_train_iters(TINY)
    args = arguments.parse_args(argv + schedule.split() + [
        "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-5",
        "--lr-decay-style", "cosine"], world_size=2)
    assert args.train_iters == (101 // 4 if "samples" in schedule else 25)
    steps = arguments.lr_schedule_steps(args)
    if mutate == "iteration_steps":   # the pre-issue-39 rule: whole iterations x batch
        steps["lr_decay_steps"] = args.train_iters * 4
        steps["lr_warmup_steps"] = int(warmup / 4) * 4
    sched = OptimizerParamScheduler(
        _Opt(), init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style, start_wd=0.0, end_wd=0.0, wd_incr_style="constant",
        **steps)
    got, want = [], []
    for iteration in range(1, args.train_iters + 1):
        sched.step(increment=4)
        got.append(sched.get_lr(sched.optimizer.param_groups[0]))
        want.append(_megatron_lr(iteration * 4, warmup, decay))
    if mutate is None:
        assert got == pytest.approx(want, rel=1e-12)
    else:
        assert got != pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("flags,message", [
    ("--train-iters 4 --lr-decay-samples 8", "--lr-decay-samples needs sample-based training"),
    ("--train-samples 16 --lr-decay-iters 4", "--lr-decay-iters needs iteration-based training"),
    ("--train-samples 16 --lr-warmup-iters 1", "--lr-warmup-iters needs iteration-based"),
    ("--train-iters 4 --lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
])
def test_schedule_mixups_fail_at_parse_time_naming_the_flag(flags, message, capsys):
    from megatron_moe.arguments import parse_args

    argv = _without_train_iters(TINY)
    with pytest.raises(SystemExit):
        parse_args(argv + flags.split(), world_size=2)
    assert message in capsys.readouterr().err
