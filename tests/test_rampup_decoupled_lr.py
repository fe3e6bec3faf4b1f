"""--rampup-batch-size and --decoupled-lr / --decoupled-min-lr (Megatron-LM's flags).

Ramp-up: each iteration runs the batch megatron-core's calculator gives for the samples consumed
so far (micro-batches run, consumed samples, the log line), a run stopped mid-ramp resumes
bit-identically, bad combinations are refused at parse time. Decoupled LR: the embedding and
output layer's param groups follow their own schedule, the others --lr's, across a resume.
Each case has a mutation (installed in the ranks, tests/_rampup_cases.py) that makes it fail.
"""

import re

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._rampup_cases import run_recorded

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear").split()

# start 2, +2 per increment up to 8: three increments over 12 samples (one per 4 samples)
RAMP = "--rampup-batch-size 2 2 12 --train-samples 40"


def megatron_rampup_batch(consumed, start=2, increment=2, samples=12, final=8):
    """Megatron-LM's ramp-up rule (its --rampup-batch-size help): from ``start``, one
    ``increment`` per samples/((final-start)/increment) consumed samples; ``final`` after."""
    if consumed > samples:
        return final
    return start + int(consumed / (samples / ((final - start) // increment))) * increment


def runs(world, argvs, mutations=None):
    return run_distributed(run_recorded, world, [TINY + a.split() for a in argvs],
                           mutations=mutations, timeout_s=400)


def megatron_ramp(train_samples, start, increment, samples, final):
    """(consumed before, batch) of each iteration of a --train-samples run: Megatron-LM's
    update_train_iters (ramp iterations, then whole batches; a partial last batch dropped)."""
    out, consumed = [], 0
    while consumed <= samples and consumed <= train_samples:
        batch = megatron_rampup_batch(consumed, start, increment, samples, final)
        out.append((consumed, batch))
        consumed += batch
    while consumed + final <= train_samples:
        out.append((consumed, final))
        consumed += final
    return out


@pytest.mark.parametrize("mutate", [None, "no_rampup"])
def test_rampup_batches_follow_the_calculator(mutate):
    """2 ranks (DP 2, micro-batch 2): ramp 4 -> 16 by 4 over 16 samples. Each iteration runs
    the batch Megatron's rule gives for the samples consumed before it: batch / (2 x 2)
    micro-batches on every rank, the log line's global batch size and consumed samples."""
    argv = "--global-batch-size 16 --rampup-batch-size 4 4 16 --train-samples 48"
    out = runs(2, [argv], [mutate])
    rank0 = out[0][0]
    assert rank0["error"] is None, rank0["error"]
    records = rank0["records"]
    expected = megatron_ramp(48, 4, 4, 16, 16)
    got = [(r["consumed_before"], r["microbatches"] * 2 * 2) for r in records]
    text = out[-1][0]["text"]   # the last rank prints the log line (Megatron's)
    logged = [int(v) for v in re.findall(r"global batch size: +(\d+)", text)]
    seen = [int(v) for v in re.findall(r"consumed samples: +(\d+)", text)]
    ok = got == expected and logged == [b for _, b in got] and seen == [c + b for c, b in got]
    if mutate:
        assert not ok, "the mutation went unnoticed"
        return
    assert ok, (got, expected, logged, seen)
    assert len({b for _, b in got}) >= 3   # the batch did grow, in more than one step
    # tokens per second counts the iteration's batch (x 32 tokens), not --global-batch-size
    for (_, batch), ms, rate in zip(got, re.findall(r"per iteration \(ms\): ([0-9.]+)", text),
                                    re.findall(r"tokens per second: ([0-9.]+)", text)):
        assert float(rate) * float(ms) / 1000 == pytest.approx(batch * 32, rel=0.02)
    # both ranks ran the same number of micro-batches (the batch is global)
    assert [r["microbatches"] for r in out[1][0]["records"]] == [r["microbatches"] for r in records]


def test_rampup_schedule_matches_megatron_core():
    """The batch per consumed sample, from megatron-core's calculator as this run builds it
    (0.16: RampupBatchsizeNumMicroBatchesCalculator; 0.19: the step schedule), equals Megatron's
    rule for uneven ramps too (samples not a multiple of the increments)."""
    import argparse

    from megatron.core import num_microbatches_calculator as nmc

    from megatron_moe.compat.batch_schedule import init_microbatch_calculator

    checked = 0
    for start, increment, samples, final in [(2, 2, 12, 8), (4, 4, 30, 32), (1, 3, 7, 10),
                                             (8, 8, 1000, 64), (2, 2, 3, 12)]:
        args = argparse.Namespace(rank=0, global_batch_size=final, micro_batch_size=1,
                                  data_parallel_size=1, rampup_batch_size=[start, increment, samples],
                                  decrease_batch_size_if_needed=False)
        init_microbatch_calculator(args)
        for consumed in range(samples + 3):
            nmc.update_num_microbatches(consumed, consistency_check=False)
            assert nmc.get_current_global_batch_size() == megatron_rampup_batch(
                consumed, start, increment, samples, final), (start, increment, samples, consumed)
            checked += 1
    nmc.destroy_num_microbatches_calculator()
    assert checked > 1000


def _losses(run):
    return [r["loss"]["lm loss"] for r in run["records"]]


@pytest.mark.parametrize("mutate", [None, "consumed_from_iteration"])
def test_rampup_exact_resume_mid_ramp(tmp_path, mutate):
    """Stopped at iteration 3 (batch 4 of the ramp 2 -> 8), resumed: the same batches, losses
    and LRs bit for bit as the uninterrupted run; Megatron-LM's save before each batch change."""
    ckpt = str(tmp_path / "ckpt")
    full, first, second = runs(1, [RAMP, f"{RAMP} --save {ckpt} --exit-interval 3",
                                   f"{RAMP} --save {ckpt} --load {ckpt}"],
                               [None, None, mutate])[0]
    assert full["error"] is None and first["error"] is None
    assert [r["consumed_before"] for r in first["records"]] == [0, 2, 4]
    resumed_ok = second["error"] is None and \
        _losses(first) + _losses(second) == _losses(full) and \
        first["history"]["lr"] + second["history"]["lr"] == full["history"]["lr"] and \
        [r["microbatches"] for r in first["records"] + second["records"]] == \
        [r["microbatches"] for r in full["records"]]
    if mutate:
        assert not resumed_ok, "the mutation went unnoticed"
        return
    assert resumed_ok, (second["error"], _losses(first) + _losses(second), _losses(full))
    import os

    # Megatron-LM saves before each batch change: before iteration 3 (2 -> 4) the first run
    # saved iteration 2, then 3 at --exit-interval; the resumed run saved 4 (before 6 -> 8) and
    # its last, 7
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == \
        ["iter_0000002", "iter_0000003", "iter_0000004", "iter_0000007"]
    assert [r["microbatches"] for r in full["records"]] == [1, 1, 2, 3, 4, 4, 4]


def _parse_error(argv, capsys, mutate=None, monkeypatch=None):
    from megatron_moe import arguments

    if mutate == "no_checks":   # the ramp counted without the refusals
        monkeypatch.setattr(arguments, "_validate_rampup", lambda args: None)
    with pytest.raises(SystemExit) as exc:
        world = 2 if "--pipeline-model-parallel-size 2" in argv else 1
        arguments.parse_args(TINY + argv.split(), world_size=world)
    assert exc.value.code == 2
    return [l for l in capsys.readouterr().err.splitlines() if l.strip()]


@pytest.mark.parametrize("argv,says", [
    ("--rampup-batch-size 2 2 12 --train-iters 10", "needs sample-based training"),
    ("--rampup-batch-size 3 1 12 --train-samples 40", "multiples of --micro-batch-size"),
    ("--rampup-batch-size 2 4 12 --train-samples 40", "positive multiple of the increment"),
    ("--rampup-batch-size 2 2 0 --train-samples 40", "must be >= 1"),
    ("--rampup-batch-size 2 2 12 --train-samples 40 --pipeline-model-parallel-size 2 "
     "--num-layers 4 --num-layers-per-virtual-pipeline-stage 1", "interleaved schedule"),
])
@pytest.mark.parametrize("mutate", [None, "no_checks"])
def test_rampup_refusals(argv, says, mutate, capsys, monkeypatch):
    if mutate:
        # without the checks the launch gets past the parser (or dies with a traceback)
        try:
            lines = _parse_error(argv, capsys, mutate, monkeypatch)
        except (AssertionError, ZeroDivisionError, pytest.fail.Exception):
            return
        assert not (len(lines) == 2 and "--rampup-batch-size" in lines[0] and says in lines[0]), lines
        return
    lines = _parse_error(argv, capsys)
    assert len(lines) == 2 and "--rampup-batch-size" in lines[0] and says in lines[0], lines


@pytest.mark.parametrize("mutate", [None, "no_decrease", "skipped_not_resumed"])
def test_decrease_batch_size_if_needed(tmp_path, mutate):
    """2 ranks (DP 2, micro-batch 2), --global-batch-size 10: each iteration runs 8 samples (2
    micro-batches per rank), the other 2 are Megatron's skipped samples, counted on across a
    resume; the log line's global batch size is the 8 run."""
    ckpt = str(tmp_path / "ckpt")
    common = "--global-batch-size 10 --decrease-batch-size-if-needed --train-iters 4"
    out = runs(2, [f"{common} --save {ckpt} --exit-interval 2", f"{common} --load {ckpt}"],
               [None, mutate])
    first, second = out[0][0], out[0][1]
    text = out[-1][0]["text"] + out[-1][1]["text"]   # the last rank's log lines, both runs
    assert first["error"] is None
    ok = second["error"] is None and \
        [r["microbatches"] for r in first["records"] + second["records"]] == [2, 2, 2, 2] and \
        [r["consumed_before"] for r in first["records"] + second["records"]] == [0, 8, 16, 24] and \
        re.findall(r"skipped samples: +(\d+)", text) == ["2", "4", "6", "8"] and \
        re.findall(r"global batch size: +(\d+)", text) == ["8"] * 4
    if mutate:
        assert not ok, "the mutation went unnoticed"
        return
    assert ok, (second["error"], re.findall(r"skipped samples: +(\d+)", text))


def test_decrease_batch_size_refusals(capsys):
    lines = _parse_error("--train-iters 4 --global-batch-size 9", capsys)
    assert "--global-batch-size (9)" in lines[0] and "--decrease-batch-size-if-needed" in lines[0]
    from megatron_moe.compat.versions import mcore_at_least

    if mcore_at_least("0.19"):   # its batch schedules refuse the rounding
        lines = _parse_error("--rampup-batch-size 2 2 12 --train-samples 40 "
                             "--decrease-batch-size-if-needed", capsys)
        assert len(lines) == 2 and "--decrease-batch-size-if-needed" in lines[0], lines


@pytest.mark.parametrize("mutate", [None, "no_decoupled_check"])
def test_decoupled_lr_change_on_resume_is_refused(tmp_path, mutate):
    """A resume with another --decoupled-lr (or without it) stops at the load with one line
    naming the flag (megatron-core 0.16 would train on with the checkpoint's, 0.19 fails to pair
    the param groups)."""
    ckpt = str(tmp_path / "ckpt")
    other = DECOUPLED.replace("--decoupled-lr 1e-2", "--decoupled-lr 2e-2")
    plain = DECOUPLED.replace("--decoupled-lr 1e-2 --decoupled-min-lr 1e-5", "")
    mutations = [None, mutate, mutate]
    first, changed, dropped = runs(1, [f"{DECOUPLED} --save {ckpt} --exit-interval 2",
                                       f"{other} --load {ckpt}", f"{plain} --load {ckpt}"],
                                   mutations)[0]
    assert first["error"] is None
    said = [r["text"].strip().splitlines()[-1] if r["text"].strip() else "" for r in (changed, dropped)]
    ok = changed["error"] is not None and dropped["error"] is not None and \
        "--decoupled-lr is 0.02 on this command line, 0.01 in the checkpoint" in said[0] and \
        "trained with --decoupled-lr" in said[1] and all(s.startswith("error: --load:") for s in said)
    if mutate:
        assert not ok, "the mutation went unnoticed"
        return
    assert ok, (said, changed["error"], dropped["error"])


def test_decoupled_min_lr_refusal(capsys):
    lines = _parse_error("--train-iters 4 --decoupled-lr 1e-4 --min-lr 1e-3", capsys)
    assert len(lines) == 2 and "--decoupled-min-lr" in lines[0] and "--decoupled-lr" in lines[0]


DECOUPLED = ("--train-iters 6 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 --lr-decay-style cosine "
             "--decoupled-lr 1e-2 --decoupled-min-lr 1e-5")


def _reference_lrs(iterations, max_lr, min_lr, batch=8):
    """megatron-core's OptimizerParamScheduler for one param group with these bounds (the
    run's schedule: warmup 2, cosine decay over 6 iterations of 8 samples)."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Opt:   # the scheduler reads and writes param_groups only
        param_groups = [{"max_lr": max_lr, "min_lr": min_lr, "params": [torch.zeros(1)]}]

    opt = _Opt()
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4,
                                    lr_warmup_steps=2 * batch, lr_decay_steps=6 * batch,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=6 * batch, wd_incr_style="constant")
    out = []
    for _ in range(iterations):
        sched.step(increment=batch)
        out.append(opt.param_groups[0]["lr"])
    return out


def _check_groups(records, iterations):
    """Every group is all embedding/output params or none; the first follow the decoupled
    schedule and are flagged is_decoupled_lr, the others --lr's; both kinds present."""
    decoupled, main = _reference_lrs(iterations, 1e-2, 1e-5), _reference_lrs(iterations, 3e-3, 3e-4)
    kinds = set()
    for i, r in enumerate(records):
        for any_marked, all_marked, lr, flagged in r["groups"]:
            if any_marked != all_marked or flagged != all_marked:
                return False
            kinds.add(all_marked)
            if lr != pytest.approx((decoupled if all_marked else main)[i], rel=1e-12):
                return False
    return kinds == {True, False}


@pytest.mark.parametrize("mutate", [None, "no_decoupled_lr"])
def test_decoupled_lr_param_groups(mutate):
    run = runs(1, [DECOUPLED], [mutate])[0][0]
    assert run["error"] is None, run["error"]
    ok = len(run["records"]) == 6 and _check_groups(run["records"], 6)
    if mutate:
        assert not ok, "the mutation went unnoticed"
        return
    assert ok, [r["groups"] for r in run["records"]]
    # the log line prints --lr's schedule (megatron-core's canonical LR), as Megatron-LM does
    logged = [float(v) for v in re.findall(r"learning rate: ([0-9.E+-]+)", run["text"])]
    assert logged == pytest.approx(_reference_lrs(6, 3e-3, 3e-4), rel=1e-6)


@pytest.mark.parametrize("mutate", [None, "loaded_bounds_to_all_groups",
                                    "unmarked_decoupled_groups"])
def test_decoupled_lr_resume(tmp_path, mutate):
    """6 iterations == 3, save, resume 3: the decoupled groups keep their schedule, losses are
    bit-identical. Unflagged groups (megatron-core's own): on 0.16.1 the resume fails in the
    optimizer's load (compat/optimizer.py mark_decoupled_lr_groups), on 0.19 the flag is missing."""
    ckpt = str(tmp_path / "ckpt")
    first_mutation = mutate if mutate == "unmarked_decoupled_groups" else None
    full, first, second = runs(1, [DECOUPLED, f"{DECOUPLED} --save {ckpt} --exit-interval 3",
                                   f"{DECOUPLED} --save {ckpt} --load {ckpt}"],
                               [None, first_mutation, mutate])[0]
    assert full["error"] is None and first["error"] is None
    ok = second["error"] is None and len(second["records"]) == 3 and \
        [r["groups"] for r in first["records"] + second["records"]] == \
        [r["groups"] for r in full["records"]] and \
        _losses(first) + _losses(second) == _losses(full) and \
        _check_groups(first["records"] + second["records"], 6)
    if mutate:
        assert not ok, "the mutation went unnoticed"
        return
    assert ok, (second["error"], [r["groups"] for r in second["records"]])
