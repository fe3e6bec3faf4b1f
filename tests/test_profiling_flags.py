"""Megatron-LM's --profile with --use-pytorch-profiler on a tiny CPU run of 2 gloo ranks: the
trace of the one listed rank holds exactly the steps of iterations [start, end) (one profiler
step, its ops, no other iteration's marker); the other rank writes none; training is unchanged.
Mutations (run in the spawned ranks): the profiler never stepped, --profile-ranks ignored.
--record-memory-history on a CPU with torch's CUDA allocator calls replaced by recorders: recording
starts before the first step on the listed rank only, snapshots at Megatron's iterations and path;
mutation: a snapshot every step. --nvtx-ranges on a CPU with torch.cuda.nvtx's push/pop replaced by
recorders: megatron-core's ranges in the profiled iteration only, on the listed rank only;
mutation: megatron-core's switch never turned on. Parse-time refusals: bad window, no --tensorboard-dir, the
CUDA-only forms on a CPU."""

import gzip
import json
import os
import re

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _profiling_cases as cases
from tests.test_training import TINY

WINDOW = ["--profile-step-start", "2", "--profile-step-end", "3"]


def _trace_names(path):
    with gzip.open(path, "rt") as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"]]


def _check(tmp_path, mutate=None):
    tb = tmp_path / "tb"
    argv = TINY + ["--train-iters", "4", "--tensorboard-dir", str(tb), "--profile",
                   "--use-pytorch-profiler", "--profile-ranks", "1"] + WINDOW
    losses = run_distributed(cases.train_marking_iterations, 2, argv, timeout_s=300,
                             mutate=mutate)
    assert len(losses[1]) == 4 and losses[0] == losses[1]
    profile_dir = tmp_path / "torch_profile"   # Megatron's <--tensorboard-dir>/../torch_profile
    assert not os.path.exists(profile_dir / "rank-0.json.gz")   # rank 0 is not listed
    names = _trace_names(profile_dir / "rank-1.json.gz")
    steps = {n for n in names if n.startswith("ProfilerStep#")}
    marks = {n for n in names if n.startswith("megatron_moe_test_iteration_")}
    assert len(steps) == 1, steps                                 # end - start = 1 step
    assert marks == {"megatron_moe_test_iteration_2"}, marks     # iterations [2, 3), 1-based
    assert sum(bool(re.match(r"aten::(mm|bmm|addmm|matmul|_grouped_mm)$", n)) for n in names) > 4
    assert any(n.startswith("Optimizer.step") or "optimizer" in n.lower() for n in names)
    return losses[1]


def test_pytorch_profiler_window_on_listed_rank(tmp_path):
    profiled = _check(tmp_path)
    plain = run_distributed(cases.train_marking_iterations, 2, TINY + ["--train-iters", "4"],
                            timeout_s=300)[1]
    assert profiled == plain   # profiling changes no number


@pytest.mark.parametrize("mutate", ["never-stepped", "all-ranks"])
def test_pytorch_profiler_mutation_fails(tmp_path, mutate):
    with pytest.raises((AssertionError, FileNotFoundError)):
        _check(tmp_path, mutate)


@pytest.mark.parametrize("flags, message", [
    ("--profile --profile-step-start 3 --profile-step-end 3", "need 0 <= start < end"),
    ("--profile --use-pytorch-profiler", "--use-pytorch-profiler needs --tensorboard-dir"),
    ("--profile", "needs a GPU"),   # the nsys form (CUDA profiler API) on a CPU
])
def test_profile_refused_at_parse_time(flags, message, tmp_path, capsys):
    import torch

    from megatron_moe.arguments import parse_args

    if message == "needs a GPU" and torch.cuda.is_available():
        pytest.skip("the CUDA profiler API is there")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "4"] + flags.split(), world_size=1)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2, err   # usage + one line
    args = parse_args(TINY + ["--train-iters", "4", "--profile", "--use-pytorch-profiler",
                              "--tensorboard-dir", str(tmp_path)], world_size=1)
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [])


def _check_memory_history(tmp_path, mutate=None):
    snap = str(tmp_path / "mem" / "snap.pickle")
    argv = TINY + ["--train-iters", "5", "--log-interval", "2", "--record-memory-history",
                   "--memory-snapshot-path", snap, "--profile-ranks", "1"]
    calls = run_distributed(cases.train_recording_memory, 2, argv, timeout_s=300, mutate=mutate)
    assert calls[0] == []                                   # rank 0 is not listed
    want = str(tmp_path / "mem" / "snap_1.pickle")          # Megatron's _<rank> suffix
    # recording from before the first step; a snapshot at the first iteration and each log line
    assert calls[1] == [("record", {"max_entries": 100_000}), ("dump", want, 1),
                        ("dump", want, 2), ("dump", want, 4)], calls[1]


def test_record_memory_history_on_cpu_with_recorders(tmp_path):
    _check_memory_history(tmp_path)


def test_record_memory_history_mutation_fails(tmp_path):
    with pytest.raises(AssertionError):
        _check_memory_history(tmp_path, "dump-every-step")


def test_record_memory_history_refused_on_cpu(capsys):
    import torch

    from megatron_moe.arguments import parse_args

    if torch.cuda.is_available():
        pytest.skip("CUDA is there")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "4", "--record-memory-history"], world_size=1)
    err = capsys.readouterr().err
    assert "--record-memory-history" in err and "needs a GPU" in err, err


def _check_nvtx(tmp_path, mutate=None):
    """--nvtx-ranges with --profile-step-start 2 --profile-step-end 3 on rank 1 of 2: megatron-core's
    ranges (its transformer layer's self_attention / mlp, ...) are pushed and popped in iteration
    3 only (1-based; Megatron-LM switches them on at the top of the pass after --profile-step-start
    iterations, where it calls cudaProfilerStart, and off after --profile-step-end), none on
    rank 0."""
    argv = TINY + ["--train-iters", "4", "--tensorboard-dir", str(tmp_path / "tb"), "--profile",
                   "--use-pytorch-profiler", "--profile-ranks", "1", "--nvtx-ranges"] + WINDOW
    calls = run_distributed(cases.train_recording_nvtx, 2, argv, timeout_s=300, mutate=mutate)
    assert calls[0] == []                                   # rank 0 is not listed
    pushes = [(it, msg) for it, msg in calls[1] if msg != "pop"]
    assert {it for it, _ in calls[1]} == {3}, sorted({it for it, _ in calls[1]})
    assert len(pushes) == len(calls[1]) - len(pushes)       # balanced
    assert any(msg.endswith(".self_attention") for _, msg in pushes), pushes[:5]
    assert any(msg.endswith(".mlp") for _, msg in pushes), pushes[:5]


def test_nvtx_ranges_over_the_profiled_iterations(tmp_path):
    _check_nvtx(tmp_path)


def test_nvtx_ranges_mutation_fails(tmp_path):
    with pytest.raises(AssertionError):
        _check_nvtx(tmp_path, "never-enabled")


@pytest.mark.parametrize("flags, message", [
    ("--nvtx-ranges", "--nvtx-ranges needs --profile"),
    ("--nvtx-ranges --profile --use-pytorch-profiler --tensorboard-dir {tb}",
     "--nvtx-ranges needs CUDA"),
])
def test_nvtx_ranges_refused_at_parse_time(flags, message, tmp_path, capsys):
    import torch

    from megatron_moe.arguments import parse_args

    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("CUDA is there")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--train-iters", "4"] + flags.format(tb=tmp_path).split(),
                   world_size=1)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2, err   # usage + one line
